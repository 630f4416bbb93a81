"""Load, fault and by-id accounting: the fault-injection suite
(tests/faults) and the reliability benchmarks (benchmarks/faults.py,
benchmarks/soak.py) share it.

A `FaultStack` is a real `lemix up` stack (`lemix.stack.launcher.Stack`: every
service its own process, an embedded redis-server with AOF, real gRPC),
tuned so faults are noticed in seconds: heartbeats every 0.2 s with a 1.5 s
TTL, stream leases of 3 s. `Load` drives it the way a client would and
remembers every task id it caused; `account` then reads each id's final
state through the gateway (WatchTasks/GetTask) and reports, per id, what
was lost. Nothing here counts: every claim is a set of ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio

from lemix._proto.lemix.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from lemix.infra.rpc.client import channel
from lemix.stack.launcher import Stack, StackConfig

# Fast fault detection (seconds, not the production defaults).
FAST_ENV = {
    "LEMIX_HEARTBEAT_S": "0.2",
    "LEMIX_NODE_TTL_S": "1.5",
    "LEMIX_NODE_POLL_S": "0.2",
    "LEMIX_REDIS_OUTAGE_GRACE_S": "3",
    "LEMIX_STREAM_LEASE_TTL_S": "3",
    "LEMIX_LEASE_CHECK_S": "0.5",
    "LEMIX_MAX_DEFER_S": "1",
    "LEMIX_DISPATCH_RETRY_S": "1",
}
FINAL_STATES = {
    gateway_pb2.TASK_STATE_COMPLETED,
    gateway_pb2.TASK_STATE_FAILED,
    gateway_pb2.TASK_STATE_REJECTED,
    gateway_pb2.TASK_STATE_CANCELLED,
}
STATUS_PREFIXES = (
    "INVALID_ARGUMENT:",
    "RESOURCE_EXHAUSTED:",
    "UNAVAILABLE:",
    "CANCELLED:",
    "DEADLINE_EXCEEDED:",
    "INTERNAL:",
    "FAILED_PRECONDITION:",
    "NOT_FOUND:",
)
_TOKEN_ID = 100
_RETRY_PAUSE_S = 0.2
_WATCH_BATCH = 5000  # WatchTasks takes at most 10,000 ids a call


@contextlib.asynccontextmanager
async def fault_stack(
    tmp_path: Path,
    *,
    num_nodes: int = 2,
    time_scale: float = 0.2,
    extra_env: dict[str, str] | None = None,
    is_fast: bool = True,
) -> AsyncIterator[tuple[Stack, gateway_pb2_grpc.GatewayStub]]:
    """A supervised stack and a gateway stub on its fixed address.

    `is_fast`: the seconds-scale detection settings of `FAST_ENV`; False
    keeps the production defaults (5 s heartbeat TTL, 15 s stream leases).
    """
    env = {**(FAST_ENV if is_fast else {}), **(extra_env or {})}
    config = StackConfig(
        num_nodes=num_nodes,
        gateway_port=0,
        time_scale=time_scale,
        log_dir=tmp_path / "logs",
        redis_dir=tmp_path / "redis",
        namespace=f"faults{os.getpid()}",
        extra_env=env,
    )
    async with (
        Stack(config, report=lambda line: None) as stack,
        channel(stack.gateway_address) as chan,
    ):
        yield stack, gateway_pb2_grpc.GatewayStub(chan)


@dataclass
class Seen:
    """What the client saw of one inference request."""

    is_completed: bool = False
    code: str = ""  # the status name of the error that ended the call, if any
    details: str = ""
    num_tokens: int = 0


@dataclass
class Load:
    """A client: inference streams and Train calls, every task id remembered."""

    stub: gateway_pb2_grpc.GatewayStub
    run_id: str = field(default_factory=lambda: os.urandom(4).hex())
    prompt_tokens: int = 48
    max_tokens: int = 32
    seen: dict[str, Seen] = field(default_factory=dict)
    training_ids: set[str] = field(default_factory=set)  # acknowledged by Train
    _streams: list[asyncio.Task[None]] = field(default_factory=list)
    _seq: itertools.count[int] = field(default_factory=itertools.count)
    _sample_seq: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def inference_ids(self) -> set[str]:
        return set(self.seen)

    def generate(self, max_tokens: int | None = None) -> str:
        """Start one Generate stream in the background; its request (= task) id."""
        task_id = f"{self.run_id}-inf-{next(self._seq)}"
        seen = self.seen[task_id] = Seen()
        request = gateway_pb2.GenerateRequest(
            request_id=task_id,
            prompt_token_ids=[_TOKEN_ID] * self.prompt_tokens,
            max_tokens=max_tokens or self.max_tokens,
            sampling=common_pb2.SamplingParams(ignore_eos=True),
        )
        self._streams.append(asyncio.create_task(self._stream(request, seen)))
        return task_id

    async def _stream(self, request: gateway_pb2.GenerateRequest, seen: Seen) -> None:
        try:
            async for message in self.stub.Generate(request, timeout=120):
                seen.num_tokens = message.num_output_tokens
                if message.is_finished:
                    seen.is_completed = True
        except grpc.aio.AioRpcError as err:
            seen.code, seen.details = err.code().name, err.details() or ""

    async def generate_paced(self, num_requests: int, interval_s: float) -> None:
        for _ in range(num_requests):
            self.generate()
            await asyncio.sleep(interval_s)

    async def train(
        self, num_samples: int, *, per_call: int = 20, deadline_s: float = 60.0
    ) -> None:
        """Train in calls of `per_call` samples; a call refused UNAVAILABLE is
        retried with the same sample ids (idempotent: the same task ids), as a
        client that wants its samples trained would."""
        for start in range(0, num_samples, per_call):
            samples = [
                gateway_pb2.TrainSample(
                    sample_id=f"{self.run_id}-s{next(self._sample_seq)}",
                    token_ids=[_TOKEN_ID] * self.prompt_tokens,
                    num_reference_tokens=8,
                )
                for _ in range(min(per_call, num_samples - start))
            ]
            self.training_ids.update(await self._train_call(samples, deadline_s))

    async def _train_call(
        self, samples: list[gateway_pb2.TrainSample], deadline_s: float
    ) -> list[str]:
        give_up_s = time.monotonic() + deadline_s
        while True:
            try:
                reply = await self.stub.Train(gateway_pb2.TrainRequest(samples=samples), timeout=30)
                return list(reply.task_ids)
            except grpc.aio.AioRpcError as err:
                if (
                    err.code()
                    not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                    or time.monotonic() > give_up_s
                ):
                    raise
                await asyncio.sleep(_RETRY_PAUSE_S)

    async def finish_streams(self, timeout_s: float = 120.0) -> None:
        if self._streams:
            await asyncio.wait_for(asyncio.gather(*self._streams), timeout_s)


async def wait_ready(stub: gateway_pb2_grpc.GatewayStub, timeout_s: float = 60.0) -> None:
    """Until a Generate completes (every executor heartbeats, the scheduler serves)."""
    give_up_s = time.monotonic() + timeout_s
    while True:
        try:
            request = gateway_pb2.GenerateRequest(prompt_token_ids=[_TOKEN_ID] * 8, max_tokens=2)
            async for message in stub.Generate(request, timeout=10):
                if message.is_finished:
                    return
        except grpc.aio.AioRpcError:
            if time.monotonic() > give_up_s:
                raise
        await asyncio.sleep(_RETRY_PAUSE_S)


async def get_task(
    stub: gateway_pb2_grpc.GatewayStub, task_id: str, timeout_s: float = 30.0
) -> gateway_pb2.TaskInfo | None:
    """The task's state, or None for NOT_FOUND; rides over a gateway restart."""
    give_up_s = time.monotonic() + timeout_s
    while True:
        try:
            return await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), timeout=5)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            if time.monotonic() > give_up_s:
                raise
            await asyncio.sleep(_RETRY_PAUSE_S)


async def final_states(
    stub: gateway_pb2_grpc.GatewayStub, task_ids: set[str], timeout_s: float
) -> dict[str, gateway_pb2.TaskInfo | None]:
    """Each id's state once all are final or `timeout_s` passed (None: NOT_FOUND)."""
    give_up_s = time.monotonic() + timeout_s
    states: dict[str, gateway_pb2.TaskInfo | None] = {}
    pending = set(task_ids)
    while True:
        for task_id in sorted(pending):
            states[task_id] = await get_task(stub, task_id)
        pending = {
            i for i, info in states.items() if info is not None and info.state not in FINAL_STATES
        }
        if not pending or time.monotonic() > give_up_s:
            return states
        await asyncio.sleep(0.5)


@dataclass
class Accounting:
    """Per task id: what ended how, and what did not end (the lost)."""

    states: dict[str, gateway_pb2.TaskInfo | None]
    lost: list[str]  # acknowledged, not final
    missing_training: list[str]  # Train acknowledged them, the stack does not know them
    no_reason: list[str]  # ended other than completed without a "STATUS: ..." reason
    inconsistent: list[str]  # the client saw completion, the record says otherwise

    def by_state(self) -> dict[str, int]:
        names: dict[str, int] = {}
        for info in self.states.values():
            name = "NOT_FOUND" if info is None else gateway_pb2.TaskState.Name(info.state)
            names[name] = names.get(name, 0) + 1
        return names

    def assert_nothing_lost(self) -> None:
        problems = {
            "lost (acknowledged, not final)": self.lost,
            "training acknowledged but unknown": self.missing_training,
            "ended without a reason": self.no_reason,
            "client saw completion, record disagrees": self.inconsistent,
        }
        bad = {what: ids[:10] for what, ids in problems.items() if ids}
        assert not bad, f"{bad}; states: {self.by_state()}"


async def account(
    stub: gateway_pb2_grpc.GatewayStub,
    load: Load,
    timeout_s: float = 90.0,
    recorded: dict[str, gateway_pb2.TaskInfo] | None = None,
) -> Accounting:
    """Read every task id's final state and judge it. `recorded`: final states
    a watcher already took while the run went on (`FinalWatcher`); those ids
    are not read again (their records may have expired since)."""
    recorded = recorded or {}
    unread = (load.inference_ids | load.training_ids) - recorded.keys()
    states: dict[str, gateway_pb2.TaskInfo | None] = {
        **recorded,
        **await final_states(stub, unread, timeout_s),
    }
    lost = sorted(
        i for i, info in states.items() if info is not None and info.state not in FINAL_STATES
    )
    missing = sorted(i for i in load.training_ids if states[i] is None)
    no_reason = sorted(
        i
        for i, info in states.items()
        if info is not None
        and info.state in FINAL_STATES
        and info.state != gateway_pb2.TASK_STATE_COMPLETED
        and not info.reason.startswith(STATUS_PREFIXES)
    )
    inconsistent = sorted(
        i
        for i, seen in load.seen.items()
        if seen.is_completed and _state_of(states[i]) != gateway_pb2.TASK_STATE_COMPLETED
    )
    return Accounting(states, lost, missing, no_reason, inconsistent)


@dataclass
class FinalWatcher:
    """Takes each task id's final state while a long run goes on (WatchTasks
    over the ids not yet final, every `sweep_s`), so the stack may expire
    finished records (a short `finished_task_ttl_s`, bounded Redis memory)
    without the end-of-run accounting reading them as unknown. `sweep_s`
    must be well under that TTL; `expired` lists ids the watcher saw known
    and then not found, never final: lost."""

    stub: gateway_pb2_grpc.GatewayStub
    load: Load
    sweep_s: float = 10.0
    final: dict[str, gateway_pb2.TaskInfo] = field(default_factory=dict)
    known: set[str] = field(default_factory=set)  # seen in a state other than UNKNOWN
    expired: set[str] = field(default_factory=set)

    async def run(self, until_s: float) -> None:
        while time.monotonic() < until_s:
            await self.sweep()
            await asyncio.sleep(self.sweep_s)

    async def sweep(self) -> None:
        pending = sorted((self.load.inference_ids | self.load.training_ids) - self.final.keys())
        for start in range(0, len(pending), _WATCH_BATCH):
            batch = pending[start : start + _WATCH_BATCH]
            request = gateway_pb2.WatchTasksRequest(task_ids=batch, timeout_s=1.0)
            latest: dict[str, gateway_pb2.TaskInfo] = {}
            try:
                async for info in self.stub.WatchTasks(request, timeout=30):
                    latest[info.task_id] = info
            except grpc.aio.AioRpcError:
                continue  # mid-fault; the next sweep takes these ids again
            for task_id, info in latest.items():
                if info.state in FINAL_STATES:
                    self.final[task_id] = info
                elif info.state != gateway_pb2.TASK_STATE_UNKNOWN:
                    self.known.add(task_id)
                elif task_id in self.known:
                    self.expired.add(task_id)


def _state_of(info: gateway_pb2.TaskInfo | None) -> int | None:
    return None if info is None else info.state


async def audit_clean(stub: gateway_pb2_grpc.GatewayStub) -> list[str]:
    """Ids of non-final tasks the stack itself reports (AuditTasks): ghosts."""
    reply = await stub.AuditTasks(gateway_pb2.AuditRequest(min_age_s=0.0), timeout=30)
    return [task.task_id for task in reply.tasks]


async def held_on_node(stub: gateway_pb2_grpc.GatewayStub, node_id: int) -> list[str]:
    """Non-final tasks placed on `node_id` right now (proof a fault will bite)."""
    reply = await stub.AuditTasks(gateway_pb2.AuditRequest(min_age_s=0.0), timeout=30)
    return [t.task_id for t in reply.tasks if t.HasField("node_id") and t.node_id == node_id]


async def wait_until_held(
    stub: gateway_pb2_grpc.GatewayStub, node_id: int, timeout_s: float = 30.0
) -> list[str]:
    give_up_s = time.monotonic() + timeout_s
    while True:
        held = await held_on_node(stub, node_id)
        if held or time.monotonic() > give_up_s:
            return held
        await asyncio.sleep(0.1)


async def wait_until_placed(
    stub: gateway_pb2_grpc.GatewayStub, task_ids: set[str], timeout_s: float = 30.0
) -> set[str]:
    """Until every id in `task_ids` is running on some node; the ids not yet placed.

    A fault injected before that bites requests still inside the gateway,
    which the stack never acknowledged (their clients see UNAVAILABLE and the
    store never knew them): a different test from one about held work."""
    give_up_s = time.monotonic() + timeout_s
    while True:
        reply = await stub.AuditTasks(gateway_pb2.AuditRequest(min_age_s=0.0), timeout=30)
        placed = {t.task_id for t in reply.tasks if t.HasField("node_id")}
        missing = task_ids - placed
        if not missing or time.monotonic() > give_up_s:
            return missing
        await asyncio.sleep(0.1)
