"""A whole stack in the test's process and event loop, for the per-task truth
tests (GetTask/WatchTasks/AuditTasks, `lemix replay`, `lemix audit`).

Real parts on free ports: the session's redis-server, the scheduler, emulated
executors (timing from a small test profile, sped up) and a gateway, all in
one namespace. Executors can be started late or stopped, so a test can leave
work with no node to run it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from factories import make_profile
from waiting import wait_until

from gateway.config import GatewayConfig
from gateway.service import GatewayService
from lemix.profile import Profile, save_profile
from services.executor.config import ExecutorConfig
from services.executor.service import ExecutorService
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService

TIME_SCALE = 0.1  # a decode step of the test profile (2 stages x 10 ms) takes 2 ms


def test_profile() -> Profile:
    return make_profile(capacity_bytes=10**9, weight_bytes=10**6, name="tasks-test")


@dataclass
class TaskStack:
    redis_url: str
    namespace: str
    profile_path: Path
    scheduler: SchedulerService | None = None
    executors: list[ExecutorService] = field(default_factory=list)
    gateways: list[GatewayService] = field(default_factory=list)

    async def start_scheduler(self, profile: Profile) -> SchedulerService:
        self.scheduler = SchedulerService(
            SchedulerConfig(
                redis_url=self.redis_url,
                namespace=self.namespace,
                num_nodes=1,
                slo_ttft_s=1.0,
                slo_tbt_s=0.5,
                node_poll_s=0.05,
                read_block_s=0.1,
                shutdown_grace_s=0.5,
                # Deferred training is released within 1 s (default 30 s): short tests.
                max_defer_s=1.0,
                consumer=f"{self.namespace}-scheduler",
            ),
            profile=profile,
        )
        await self.scheduler.start()
        return self.scheduler

    async def start_executor(self, node_id: int = 0, **overrides: Any) -> ExecutorService:
        values: dict[str, Any] = {
            "node_id": node_id,
            "redis_url": self.redis_url,
            "namespace": self.namespace,
            "profile_path": self.profile_path,
            "time_scale": TIME_SCALE,
            "heartbeat_s": 0.05,
            # Not 3 x 0.05 s: every service shares the test's event loop, and a
            # 150 ms stall on a busy 2-core machine would read as a dead node.
            "node_ttl_s": 2.0,
            "shutdown_grace_s": 0.5,
            **overrides,
        }
        executor = ExecutorService(ExecutorConfig(**values))
        await executor.start()
        self.executors.append(executor)
        return executor

    async def start_gateway(self, **overrides: Any) -> GatewayService:
        assert self.scheduler is not None, "start the scheduler first"
        values: dict[str, Any] = {
            "port": 0,
            "http_port": 0,
            "scheduler_address": self.scheduler.address,
            "redis_url": self.redis_url,
            "namespace": self.namespace,
            "node_check_s": 0.0,
            "stream_idle_timeout_s": 10.0,
            "shutdown_grace_s": 0.5,
            **overrides,
        }
        gateway = GatewayService(GatewayConfig(**values))
        await gateway.start()
        self.gateways.append(gateway)
        return gateway

    async def close(self) -> None:
        for gateway in self.gateways:
            await gateway.stop()
        if self.scheduler is not None:
            await self.scheduler.stop(grace_s=0.2)
        for executor in self.executors:
            await executor.stop(grace_s=0.2)


async def start_stack(
    redis_url: str,
    namespace: str,
    tmp_path: Path,
    *,
    num_executors: int = 1,
    **executor_overrides: Any,
) -> TaskStack:
    """Scheduler, `num_executors` executors (`ExecutorConfig` overrides) and
    one gateway, started."""
    profile = test_profile()
    save_profile(profile, tmp_path / "profile.json")
    stack = TaskStack(redis_url, namespace, tmp_path / "profile.json")
    try:
        for node_id in range(num_executors):
            await stack.start_executor(node_id, **executor_overrides)
        await stack.start_scheduler(profile)
        await stack.start_gateway()
    except BaseException:
        await stack.close()
        raise
    return stack


async def eventually(
    predicate: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition"
) -> None:
    """Poll `predicate` (sync, or returning an awaitable) until truthy, or fail."""
    await wait_until(predicate, timeout_s=timeout_s, what=what, poll_s=0.02)
