"""What the scheduler keeps in Redis, and what a restart makes of it (issue 12).

Real Redis, real gRPC, fake executors (test_scheduler_service's `FakeExecutor`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc.aio
import pytest
import redis.asyncio as aioredis
from test_scheduler_service import (
    FakeExecutor,
    Stack,
    end_message,
    inference,
    submit,
    training,
    wait_until,
)

from lemix._proto.lemix.v1 import common_pb2, executor_pb2
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.server import EmbeddedRedis
from lemix.infra.store.store import Store

TTL_S = 3600.0
OUTPUT_TTL_S = 120.0


@pytest.fixture
async def stack(redis_server: EmbeddedRedis, redis_client: aioredis.Redis) -> AsyncIterator[Stack]:
    namespace = f"keep-{uuid.uuid4().hex[:8]}"
    s = Stack(redis_server.url, Store(redis_client, RedisKeys(namespace)), namespace)
    try:
        yield s
    finally:
        await s.close()


async def _pttl_ms(store: Store, key: str) -> int:
    return int(await store.client.pttl(key))


async def _has_ttl(store: Store, key: str) -> bool:
    # PTTL is -1 for a key without a TTL and -2 for no key: both truthy.
    return await _pttl_ms(store, key) > 0


async def test_finished_tasks_expire_and_applied_completions_are_trimmed(stack: Stack) -> None:
    store = stack.store
    fake = await stack.start_executor(0)
    service = await stack.start_service(
        num_nodes=1, finished_task_ttl_s=TTL_S, output_retain_s=OUTPUT_TTL_S
    )
    stub = stack.stub(service)
    cursors = []
    for task_id in ("r1", "r2"):
        await submit(stub, inference(task_id))
        await wait_until(lambda t=task_id: t in fake.dispatched_ids, what=f"{task_id} dispatch")
        # The executor ends it as the real one does: no TTL of its own.
        await store.finish_task(task_id, "completed", "", {"type": "end", "n": 8})
        cursors.append(
            await store.append_completion(
                {"task_id": task_id, "node_id": 0, "status": "completed", "reason": ""}
            )
        )
        await wait_until(lambda t=task_id: not service.core.knows(t), what=f"{task_id} applied")
        await wait_until(
            lambda t=task_id: _has_ttl(store, store.keys.task(t)), what=f"{task_id} expires"
        )
        # The state is kept for the audit and GetTask; the output (tokens)
        # only as long as a retry may replay it.
        assert await _pttl_ms(store, store.keys.task(task_id)) > OUTPUT_TTL_S * 1000
        assert await _pttl_ms(store, store.keys.task(task_id)) <= TTL_S * 1000
        assert 0 < await _pttl_ms(store, store.keys.output(task_id)) <= OUTPUT_TTL_S * 1000
    # Only the last applied entry is left (the cursor); the rest is in the log.
    await wait_until(lambda: _completion_ids_are(store, cursors[-1:]), what="trimmed")
    assert await store.get_completions_cursor() == cursors[-1]
    # A task the scheduler itself ends expires too.
    await submit(stub, inference("huge", prompt=5_000))
    assert (await end_message(store, "huge"))["status"] == "rejected"
    assert OUTPUT_TTL_S * 1000 < await _pttl_ms(store, store.keys.task("huge")) <= TTL_S * 1000
    assert 0 < await _pttl_ms(store, store.keys.output("huge")) <= OUTPUT_TTL_S * 1000


async def _completion_ids_are(store: Store, ids: list[str]) -> bool:
    entries = await store.client.xrange(store.keys.completions_stream)
    return [entry_id for entry_id, _ in entries] == ids


async def test_no_ttl_when_retention_is_off(stack: Stack) -> None:
    await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1, finished_task_ttl_s=0.0, output_retain_s=0.0)
    await submit(stack.stub(service), inference("huge", prompt=5_000))
    await end_message(stack.store, "huge")
    for key in (stack.store.keys.task("huge"), stack.store.keys.output("huge")):
        assert await _pttl_ms(stack.store, key) == -1  # no expiry
    # Cancelled before it was taken in: the marker's own TTL goes with the end.
    await stack.store.mark_cancelled("early", ttl_s=60.0)
    await submit(stack.stub(service), inference("early"))
    assert (await end_message(stack.store, "early"))["reason"].startswith("CANCELLED")
    assert await _pttl_ms(stack.store, stack.store.keys.task("early")) == -1


class OrderedExecutor(FakeExecutor):
    """Also records Dispatch and Cancel in one ordered log."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    async def Dispatch(
        self, request: executor_pb2.DispatchRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.DispatchResponse:
        self.calls.append(("dispatch", request.task.task_id))
        return await super().Dispatch(request, context)

    async def Cancel(
        self, request: common_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.CancelResponse:
        self.calls.append(("cancel", request.task_id))
        return await super().Cancel(request, context)


async def test_a_placement_no_executor_confirmed_is_placed_again_after_a_restart(
    stack: Stack,
) -> None:
    from test_scheduler_faults import serve

    fake = OrderedExecutor()
    await stack.heartbeat(0, await serve(stack, fake))
    old = await stack.start_service(num_nodes=1)
    await submit(stack.stub(old), training("u"))
    await wait_until(lambda: _status_is(stack.store, "u", "placed"), what="u placed")
    await old.stop()
    # As if the old scheduler died between Dispatch and the "placed" write.
    await stack.store.client.hset(stack.store.keys.task("u"), "status", "queued")
    new = await stack.start_service(num_nodes=1)
    await wait_until(lambda: _status_is(stack.store, "u", "placed"), what="u placed again")
    # The node is told to drop its copy before it gets the task again.
    assert fake.calls == [("dispatch", "u"), ("cancel", "u"), ("dispatch", "u")]
    assert new.core.node_of("u") == 0 and new.core.revoked == {}


async def _status_is(store: Store, task_id: str, status: str) -> bool:
    return (await store.get_task_state(task_id)).get("status") == status
