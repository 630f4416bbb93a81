"""Per-task truth: GetTask, WatchTasks, AuditTasks and GET /v1/lemix/tasks/{id}.

Task states are written by the services' own writers (the scheduler's
Submit path and `RedisResultWriter`, the executor's `RedisOutcomeSink`) into
a real Redis, and read through a real gateway over gRPC and HTTP. The last
tests run a whole stack in-process (scheduler, emulated executors, gateway).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import grpc.aio
import pytest
from gateway_fakes import FakeScheduler
from task_stack import TaskStack, eventually, start_stack

from gateway.service import GatewayService
from gateway.tasks import IN_INTAKE_REASON, MAX_WATCH_TASKS
from lemix._proto.lemix.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from lemix.engine import Failed, Finished, FirstToken
from lemix.infra.rpc.client import channel
from lemix.infra.store.server import EmbeddedRedis
from lemix.infra.store.store import Store
from lemix.infra.store.task_fields import task_to_fields
from lemix.types import Task, TaskKind, TaskPayload
from services.executor.sink import RedisOutcomeSink
from services.scheduler.adapters import RedisResultWriter
from services.scheduler.core import StateWrite

S = gateway_pb2  # state names: S.TASK_STATE_...
NODE = 3


def _task(task_id: str, kind: TaskKind = TaskKind.INFERENCE) -> Task:
    return Task(
        task_id=task_id,
        kind=kind,
        arrival_s=0.0,
        num_prompt_tokens=8,
        max_output_tokens=0 if kind is TaskKind.TRAINING else 4,
    )


@pytest.fixture(autouse=True)
async def _no_fake_intake_reader(fake_scheduler: FakeScheduler) -> None:
    """These tests play the scheduler's part on the intake themselves."""
    await fake_scheduler.stop_reading()


async def _submit(
    store: Store, task_id: str, kind: TaskKind = TaskKind.INFERENCE, submit_t: float | None = None
) -> None:
    """What scheduler Submit stores: the task in the intake (acknowledged)."""
    assert await store.submit_task(
        task_to_fields(_task(task_id, kind), TaskPayload(), submit_t=submit_t)
    )


async def _take(
    store: Store, task_id: str, kind: TaskKind = TaskKind.INFERENCE, submit_t: float | None = None
) -> None:
    """Submitted, then taken from the intake by the scheduler (queued in its hash)."""
    fields = task_to_fields(_task(task_id, kind), TaskPayload(), submit_t=submit_t)
    assert await store.submit_task(fields)
    await store.set_task_states(
        [(task_id, {**fields, "status": "queued", "queued_t": time.time()})]
    )
    entries = await store.read_intake_entries()
    await store.ack_intake([entry_id for entry_id, f in entries if f["task_id"] == task_id])


class _FirstAttempts:
    """A node's ledger for tasks placed once: each runs its first attempt,
    the number the submit writes (an unbound sink writes as attempt 0, which
    the task's hash fences)."""

    def attempt_of(self, task_id: str) -> int:
        return 1

    def on_fenced(self, task_id: str) -> None:
        raise AssertionError(f"{task_id} fenced")


def _first_attempt_sink(store: Store) -> RedisOutcomeSink:
    sink = RedisOutcomeSink(store, NODE)
    sink.bind(_FirstAttempts())
    return sink


async def _place(store: Store, task_id: str) -> None:
    await RedisResultWriter(store).write_states([StateWrite(task_id, "placed", node_id=NODE)])


async def _get(stub: gateway_pb2_grpc.GatewayStub, task_id: str) -> gateway_pb2.TaskInfo:
    return await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), timeout=5)


async def _code_of(call: object) -> grpc.StatusCode:
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:  # type: ignore[attr-defined]
                pass
        else:
            await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as err:
        return err.code()
    raise AssertionError("the call succeeded")


# ------------------------------------------------------------------ GetTask


async def test_get_task_reads_each_state_as_the_services_write_it(
    store: Store, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    sink = _first_attempt_sink(store)
    writer = RedisResultWriter(store)
    before_s = time.time()

    await _submit(store, "t-intake", TaskKind.TRAINING)
    info = await _get(stub, "t-intake")
    # The submit wrote its hash, queued, with the intake entry.
    assert info.state == S.TASK_STATE_QUEUED and not info.is_final
    assert info.kind == common_pb2.TASK_KIND_TRAINING and info.queued_at_s >= before_s
    # A marker without a hash (an entry of an older writer) reads "in the intake".
    await store.client.set(store.keys.dedupe("t-legacy"), "0-1")
    info = await _get(stub, "t-legacy")
    assert info.state == S.TASK_STATE_QUEUED and info.reason == IN_INTAKE_REASON

    await _take(store, "t-queued", TaskKind.TRAINING)
    info = await _get(stub, "t-queued")
    assert (info.state, info.kind) == (S.TASK_STATE_QUEUED, common_pb2.TASK_KIND_TRAINING)
    assert before_s <= info.submitted_at_s <= info.queued_at_s <= time.time()
    assert not info.HasField("node_id") and info.placed_at_s == 0

    await _take(store, "t-run")
    await _place(store, "t-run")
    info = await _get(stub, "t-run")
    assert (info.state, info.node_id) == (S.TASK_STATE_PLACED, NODE)
    assert info.queued_at_s <= info.placed_at_s <= time.time()
    await sink.write([(0.0, FirstToken("t-run", weight_updates=5))])
    assert (await _get(stub, "t-run")).state == S.TASK_STATE_RUNNING
    await sink.write([(0.0, Finished("t-run", num_output_tokens=4))])
    info = await _get(stub, "t-run")
    assert (info.state, info.is_final, info.reason) == (S.TASK_STATE_COMPLETED, True, "")
    assert (info.num_output_tokens, info.weight_version, info.node_id) == (4, 5, NODE)
    assert info.placed_at_s <= info.finished_at_s <= time.time()
    assert info.kind == common_pb2.TASK_KIND_INFERENCE

    await _take(store, "t-never-fits")
    await writer.end_task("t-never-fits", "rejected", "RESOURCE_EXHAUSTED: needs 9 GB")
    info = await _get(stub, "t-never-fits")
    assert (info.state, info.reason) == (S.TASK_STATE_REJECTED, "RESOURCE_EXHAUSTED: needs 9 GB")

    await _take(store, "t-node-died")
    await _place(store, "t-node-died")
    await sink.write([(0.0, Failed("t-node-died", "INTERNAL: stage 1 failed"))])
    info = await _get(stub, "t-node-died")
    assert (info.state, info.reason) == (S.TASK_STATE_FAILED, "INTERNAL: stage 1 failed")
    assert info.is_final and info.node_id == NODE

    await _take(store, "t-cancelled")
    await writer.end_task("t-cancelled", "failed", "CANCELLED: the client cancelled the call")
    info = await _get(stub, "t-cancelled")
    assert info.state == S.TASK_STATE_CANCELLED and info.is_final
    assert info.reason.startswith("CANCELLED:")

    # Taken back from a node that went down: queued again, no node.
    await _take(store, "t-requeued", TaskKind.TRAINING)
    await _place(store, "t-requeued")
    await writer.write_states([StateWrite("t-requeued", "queued")])
    info = await _get(stub, "t-requeued")
    assert info.state == S.TASK_STATE_QUEUED and not info.HasField("node_id")


async def test_get_task_unknown_and_malformed_ids(stub: gateway_pb2_grpc.GatewayStub) -> None:
    assert await _code_of(_get(stub, "never-submitted")) == grpc.StatusCode.NOT_FOUND
    assert await _code_of(_get(stub, "")) == grpc.StatusCode.INVALID_ARGUMENT
    assert await _code_of(_get(stub, "has space")) == grpc.StatusCode.INVALID_ARGUMENT
    assert await _code_of(_get(stub, "x" * 1000)) == grpc.StatusCode.INVALID_ARGUMENT


# --------------------------------------------------------------- WatchTasks


async def test_watch_tasks_sends_changes_and_ends_when_all_are_final(
    store: Store, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    await _submit(store, "w-a")
    await _take(store, "w-b", TaskKind.TRAINING)
    await _place(store, "w-b")
    seen: list[tuple[str, int]] = []
    first_round = asyncio.Event()

    async def watch() -> None:
        request = gateway_pb2.WatchTasksRequest(task_ids=["w-a", "w-b"], poll_interval_s=0.05)
        async for info in stub.WatchTasks(request, timeout=20):
            seen.append((info.task_id, info.state))
            if len(seen) == 2:
                first_round.set()

    watching = asyncio.create_task(watch())
    await asyncio.wait_for(first_round.wait(), 5)
    assert sorted(seen) == [("w-a", S.TASK_STATE_QUEUED), ("w-b", S.TASK_STATE_PLACED)]
    sink = _first_attempt_sink(store)
    await sink.write([(0.0, Finished("w-b", num_output_tokens=0))])
    await eventually(lambda: ("w-b", S.TASK_STATE_COMPLETED) in seen, what="w-b completed")
    assert not watching.done()  # w-a is not final yet
    await RedisResultWriter(store).end_task("w-a", "rejected", "UNAVAILABLE: no node")
    await asyncio.wait_for(watching, 5)  # ends by itself, well before its deadline
    assert [s for t, s in seen if t == "w-a"] == [S.TASK_STATE_QUEUED, S.TASK_STATE_REJECTED]
    assert [s for t, s in seen if t == "w-b"] == [S.TASK_STATE_PLACED, S.TASK_STATE_COMPLETED]


async def test_watch_tasks_timeout_and_unknown_ids(
    store: Store, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    await _submit(store, "w-stuck")
    request = gateway_pb2.WatchTasksRequest(
        task_ids=["w-stuck", "w-nobody"], timeout_s=0.3, poll_interval_s=0.05
    )
    started_s = time.monotonic()
    infos = [info async for info in stub.WatchTasks(request, timeout=10)]
    assert time.monotonic() - started_s < 5
    # Each state once: nothing changed after the first poll.
    assert [(i.task_id, i.state) for i in infos] == [
        ("w-stuck", S.TASK_STATE_QUEUED),
        ("w-nobody", S.TASK_STATE_UNKNOWN),
    ]


@pytest.mark.parametrize(
    "task_ids",
    [[], ["a", "a"], ["ok", "bad id"], [f"t{i}" for i in range(MAX_WATCH_TASKS + 1)]],
    ids=["none", "repeat", "malformed", "too-many"],
)
async def test_watch_tasks_refuses_bad_requests(
    stub: gateway_pb2_grpc.GatewayStub, task_ids: list[str]
) -> None:
    call = stub.WatchTasks(gateway_pb2.WatchTasksRequest(task_ids=task_ids), timeout=10)
    assert await _code_of(call) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.slow
async def test_watch_tasks_takes_the_maximum(
    store: Store, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    task_ids = [f"m{i}" for i in range(MAX_WATCH_TASKS)]
    request = gateway_pb2.WatchTasksRequest(task_ids=task_ids, timeout_s=0.01)
    infos = [info async for info in stub.WatchTasks(request, timeout=30)]
    assert [i.task_id for i in infos] == task_ids
    assert {i.state for i in infos} == {S.TASK_STATE_UNKNOWN}


# -------------------------------------------------------------- AuditTasks


async def test_audit_lists_old_non_final_tasks_oldest_first(
    store: Store, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    now_s = time.time()
    await _take(store, "a-placed", submit_t=now_s - 300)
    await _place(store, "a-placed")
    await _submit(store, "a-intake", TaskKind.TRAINING, submit_t=now_s - 600)
    await _take(store, "a-young", submit_t=now_s)
    await _take(store, "a-done", submit_t=now_s - 900)
    await RedisResultWriter(store).end_task("a-done", "rejected", "UNAVAILABLE: no node")
    # Ended while its intake entry waits for the scheduler's (shared) ack.
    await _submit(store, "a-ended", submit_t=now_s - 700)
    await RedisResultWriter(store).end_task("a-ended", "failed", "CANCELLED: by the client")

    reply = await stub.AuditTasks(gateway_pb2.AuditRequest(min_age_s=60), timeout=10)
    assert [(t.task_id, t.state) for t in reply.tasks] == [
        ("a-intake", S.TASK_STATE_QUEUED),
        ("a-placed", S.TASK_STATE_PLACED),
    ]
    assert reply.tasks[0].kind == common_pb2.TASK_KIND_TRAINING and reply.tasks[1].node_id == NODE
    assert not reply.is_truncated and reply.num_scanned >= 4

    reply = await stub.AuditTasks(gateway_pb2.AuditRequest(min_age_s=0), timeout=10)
    assert [t.task_id for t in reply.tasks] == ["a-intake", "a-placed", "a-young"]
    reply = await stub.AuditTasks(gateway_pb2.AuditRequest(min_age_s=0, limit=1), timeout=10)
    assert [t.task_id for t in reply.tasks] == ["a-intake"] and reply.is_truncated
    reply = await stub.AuditTasks(gateway_pb2.AuditRequest(min_age_s=3600), timeout=10)
    assert list(reply.tasks) == []
    bad = stub.AuditTasks(gateway_pb2.AuditRequest(min_age_s=-1), timeout=10)
    assert await _code_of(bad) == grpc.StatusCode.INVALID_ARGUMENT


# -------------------------------------------------------------------- HTTP


async def _http_get(gateway: GatewayService, path: str) -> tuple[int, dict]:
    url = f"http://{gateway.http_address}{path}"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.json()


async def test_http_task_route(store: Store, gateway: GatewayService) -> None:
    await _take(store, "h-1", TaskKind.TRAINING)
    await _place(store, "h-1")
    await _first_attempt_sink(store).write([(0.0, Finished("h-1", num_output_tokens=0))])
    status, body = await _http_get(gateway, "/v1/lemix/tasks/h-1")
    assert status == 200
    assert body["object"] == "lemix.task" and body["task_id"] == "h-1"
    assert (body["state"], body["kind"], body["node_id"]) == ("completed", "training", NODE)
    assert body["is_final"] is True and body["finished_at_s"] >= body["placed_at_s"] > 0
    assert body["training_loss"] is None  # the emulated backend computes no loss

    status, body = await _http_get(gateway, "/v1/lemix/tasks/nobody")
    assert status == 404 and "unknown" in body["error"]["message"]
    status, body = await _http_get(gateway, "/v1/lemix/tasks/bad%20id")
    assert status == 400 and "whitespace" in body["error"]["message"]


# -------------------------------------------------------- a whole stack


@pytest.fixture
async def stack(
    redis_server: EmbeddedRedis, namespace: str, tmp_path: Path
) -> AsyncIterator[TaskStack]:
    s = await start_stack(redis_server.url, namespace, tmp_path)
    try:
        yield s
    finally:
        await s.close()


async def test_live_stack_tasks_end_final_and_are_watched_to_the_end(stack: TaskStack) -> None:
    gateway = stack.gateways[0]
    async with channel(gateway.address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        request = gateway_pb2.GenerateRequest(
            request_id="live-inf", prompt_token_ids=[5] * 8, max_tokens=6
        )
        messages = [m async for m in stub.Generate(request, timeout=30)]
        assert messages[-1].is_finished
        info = await _get(stub, "live-inf")
        assert (info.state, info.num_output_tokens, info.node_id) == (S.TASK_STATE_COMPLETED, 6, 0)
        assert info.HasField("weight_version")
        assert 0 < info.submitted_at_s <= info.queued_at_s <= info.finished_at_s <= time.time()
        # The executor records when it took the task (on the end itself when
        # the task ended in the node's first write for it).
        assert info.queued_at_s <= info.placed_at_s <= info.finished_at_s

        samples = [
            gateway_pb2.TrainSample(sample_id=f"live-s{i}", token_ids=[7] * 16) for i in range(6)
        ]
        reply = await stub.Train(
            gateway_pb2.TrainRequest(samples=samples, batch_size=2), timeout=10
        )
        assert len(reply.task_ids) == 3
        watch = gateway_pb2.WatchTasksRequest(task_ids=reply.task_ids, poll_interval_s=0.05)
        last: dict[str, gateway_pb2.TaskInfo] = {}
        async for info in stub.WatchTasks(watch, timeout=30):  # ends when all are final
            assert info.task_id not in last or not last[info.task_id].is_final
            last[info.task_id] = info
        assert sorted(last) == sorted(reply.task_ids)
        assert {i.state for i in last.values()} == {S.TASK_STATE_COMPLETED}


@pytest.fixture
async def slow_stack(
    redis_server: EmbeddedRedis, namespace: str, tmp_path: Path
) -> AsyncIterator[TaskStack]:
    """One node 1,000x slower than `stack`'s: a training task stays on it a while."""
    s = await start_stack(redis_server.url, namespace, tmp_path, time_scale=100.0)
    try:
        yield s
    finally:
        await s.close()


async def test_live_stack_training_shows_placed_while_its_node_works(slow_stack: TaskStack) -> None:
    stack = slow_stack
    gateway = stack.gateways[0]
    async with channel(gateway.address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        sample = gateway_pb2.TrainSample(sample_id="slow-0", token_ids=[7] * 200)
        reply = await stub.Train(gateway_pb2.TrainRequest(samples=[sample]), timeout=10)
        (task_id,) = reply.task_ids

        async def is_placed() -> bool:
            return (await _get(stub, task_id)).state == S.TASK_STATE_PLACED

        await eventually(is_placed, what=f"{task_id} placed")
        info = await _get(stub, task_id)
        assert info.node_id == 0 and not info.is_final and info.placed_at_s > 0
        audit = await stub.AuditTasks(gateway_pb2.AuditRequest(min_age_s=0), timeout=10)
        assert [t.task_id for t in audit.tasks] == [task_id]
