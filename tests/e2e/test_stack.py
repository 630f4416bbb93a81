"""End to end: real Redis, real service processes on free ports, real gRPC.

`lemix.stack.launcher.Stack` starts an embedded redis-server, two emulated executors,
the scheduler and the gateway as subprocesses; `lemix.harness.replay` fires a few
hundred mixed requests and training samples at the gateway. Every task must be
accounted for, and the gateway's counters must agree with the client's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from redis_pool import TEST_POOL_SIZE

from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc
from lemix.harness.replay import ReplayConfig, run_replay
from lemix.infra.rpc.client import channel
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.store import Store
from lemix.memory import MemoryConfig
from lemix.planner.base import PlannerConfig
from lemix.planner.recording import decision_key, recorded_decision_keys, replay
from lemix.planner.registry import build_planner
from lemix.profile import default_profile_path, load_profile
from lemix.stack.launcher import Stack, StackConfig
from lemix.workload import WorkloadConfig, build_workload
from services.scheduler.codec import events_from_entries
from services.scheduler.recovery import START_MARKER

TIME_SCALE = 0.05  # 20x faster than the A100 profile, so the test stays short


async def test_mixed_load_every_task_accounted_for(tmp_path: Path) -> None:
    workload = build_workload(
        WorkloadConfig(
            request_rate=20.0, train_rate=0.2, duration_s=12.0, seed=3, max_total_tokens=2048
        )
    )
    tasks = list(workload.tasks)
    assert len(tasks) >= 250
    config = StackConfig(
        num_nodes=2,
        gateway_port=0,
        time_scale=TIME_SCALE,
        log_dir=tmp_path / "logs",
        namespace="e2e",
    )
    async with Stack(config) as stack:
        metrics = await run_replay(
            ReplayConfig(target=stack.gateway_address, drain_timeout_s=60.0, show_progress=False),
            tasks,
            request_rate=20.0,
            train_rate=0.2,
            duration_s=workload.duration_s,
            seed=3,
        )
        async with channel(stack.gateway_address) as chan:
            stub = gateway_pb2_grpc.GatewayStub(chan)
            # The executors' counters reach Redis with their heartbeats (0.5 s):
            # GetStats catches up with the per-task truth within a few.
            for _ in range(50):
                stats = await stub.GetStats(gateway_pb2.GetStatsRequest(), timeout=10)
                if (stats.num_completed_inference, stats.num_completed_training) == (
                    metrics["num_completed_inference"],
                    metrics["num_completed_training"],
                ):
                    break
                await asyncio.sleep(0.1)
        assert stack.failed_child() is None
        assert stack.redis is not None
        events = await _read_events(stack.redis.url, "e2e")
    assert metrics["num_lost"] == 0
    assert metrics["num_inference"] + metrics["num_training"] == len(tasks)
    ended = metrics["num_completed"] + metrics["num_rejected"] + metrics["num_failed"]
    assert ended == len(tasks)
    # Nothing overloads this cluster: everything completes.
    assert metrics["num_completed_inference"] == metrics["num_inference"]
    assert metrics["num_completed_training"] == metrics["num_training"]
    assert stats.num_completed_inference == metrics["num_completed_inference"]
    assert stats.num_completed_training == metrics["num_completed_training"]
    # Parity: the live scheduler's recorded inputs, replayed offline through a
    # fresh planner built from the recorded config, give the same decisions.
    marker = next(e[START_MARKER] for e in events if START_MARKER in e)
    planner = build_planner(
        marker["policy"],
        PlannerConfig(**marker["planner_config"]),
        load_profile(default_profile_path()),
        MemoryConfig(),
    )
    live = recorded_decision_keys(events)
    assert sum(k[0] == "Placement" for k in live) >= len(tasks)
    assert [decision_key(d) for d in replay(events, planner)] == live


async def _read_events(redis_url: str, namespace: str) -> list[dict]:
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url, decode_responses=True, max_connections=TEST_POOL_SIZE)
    try:
        store = Store(client, RedisKeys(namespace))
        return events_from_entries(await store.read_events())
    finally:
        await client.aclose()


async def test_bad_request_gets_invalid_argument_and_the_stack_keeps_serving(
    tmp_path: Path,
) -> None:
    config = StackConfig(
        num_nodes=1,
        gateway_port=0,
        time_scale=TIME_SCALE,
        log_dir=tmp_path / "logs",
        namespace="e2e-bad",
    )
    async with Stack(config) as stack, channel(stack.gateway_address) as chan:
        stub = gateway_pb2_grpc.GatewayStub(chan)
        try:
            async for _ in stub.Generate(gateway_pb2.GenerateRequest(max_tokens=5), timeout=10):
                pass
            raise AssertionError("an empty prompt must be refused")
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        messages = [
            m
            async for m in stub.Generate(
                gateway_pb2.GenerateRequest(prompt_token_ids=[1] * 20, max_tokens=4), timeout=30
            )
        ]
        assert messages[-1].is_finished and messages[-1].num_output_tokens == 4
