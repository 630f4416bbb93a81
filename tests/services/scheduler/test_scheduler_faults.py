"""The scheduler under faults, against a real Redis and real gRPC (issue 12).

Executors are in-test gRPC servers (`FakeExecutor` from
test_scheduler_service, plus variants that refuse or hang) that heartbeat in
Redis as a real executor does. Every outcome is checked per task id in its
Redis state hash, never by counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import uuid
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from test_scheduler_service import (
    PROFILE,
    FakeExecutor,
    Stack,
    end_message,
    inference,
    submit,
    training,
    wait_until,
)

from lemix._proto.lemix.v1 import executor_pb2, executor_pb2_grpc
from lemix.infra.rpc import EXECUTOR_SERVICE
from lemix.infra.rpc.server import start_server
from lemix.infra.store.client import RedisClientConfig, connect
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.server import EmbeddedRedis, find_free_port
from lemix.infra.store.store import Store
from lemix.infra.store.task_fields import task_to_fields
from lemix.infra.store.task_hash import gateways_of
from lemix.types import Task, TaskKind, TaskPayload
from services.scheduler.service import GATEWAY_GONE, SchedulerService, describe_redis_error

# Fast failure detection for tests: heartbeats live 0.6 s, polled every 50 ms.
HEARTBEAT_TTL_S = 0.6
FAST = {
    "policy": "mix-rr",
    "node_poll_s": 0.05,
    "redis_outage_grace_s": 0.2,
    "node_lost_after_s": 0.3,
    "dispatch_deadline_s": 0.5,
    "dispatch_retry_s": 0.3,
}


@pytest.fixture
async def stack(redis_server: EmbeddedRedis, redis_client: aioredis.Redis) -> AsyncIterator[Stack]:
    namespace = f"faults-{uuid.uuid4().hex[:8]}"
    s = Stack(redis_server.url, Store(redis_client, RedisKeys(namespace)), namespace)
    try:
        yield s
    finally:
        await s.close()


class PickyExecutor(FakeExecutor):
    """Refuses tasks whose id starts with "bad" as a real executor refuses a
    prompt with an out-of-vocabulary token id."""

    async def Dispatch(
        self, request: executor_pb2.DispatchRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.DispatchResponse:
        if request.task.task_id.startswith("bad"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"task {request.task.task_id!r}: token id out of the vocabulary",
            )
        return await super().Dispatch(request, context)


class HungExecutor(FakeExecutor):
    """Answers Dispatch only after `hang_s` (SIGSTOPped, swapping, wedged)."""

    def __init__(self, hang_s: float) -> None:
        super().__init__()
        self.hang_s = hang_s

    async def Dispatch(
        self, request: executor_pb2.DispatchRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.DispatchResponse:
        await asyncio.sleep(self.hang_s)
        return await super().Dispatch(request, context)


async def serve(stack: Stack, fake: FakeExecutor) -> str:
    server, port, health = await start_server(
        [(executor_pb2_grpc.add_ExecutorServicer_to_server, fake)],
        "127.0.0.1",
        0,
        service_names=[EXECUTOR_SERVICE],
    )
    stack.servers.append((server, health))
    return f"127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def beating(
    store: Store, node_id: int, address: str, period_s: float = 0.1
) -> AsyncIterator[None]:
    """Heartbeat (TTL HEARTBEAT_TTL_S) while inside; a Redis outage is ridden out."""

    async def beat() -> None:
        while True:
            with contextlib.suppress(Exception):
                await store.put_node_state(
                    node_id,
                    {"node_id": node_id, "address": address, "is_healthy": True, "num_stages": 2},
                    ttl_s=HEARTBEAT_TTL_S,
                )
            await asyncio.sleep(period_s)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def state_of(store: Store, task_id: str) -> dict[str, str]:
    return await store.get_task_state(task_id)


async def placed_on(store: Store, task_id: str, node_id: int) -> bool:
    fields = await store.get_task_state(task_id)
    return fields.get("status") == "placed" and fields.get("node_id") == str(node_id)


# ------------------------------------------------------------------ refusal vs node failure


async def test_an_executor_refusal_fails_only_that_task_and_the_node_stays_up(stack: Stack) -> None:
    fake = PickyExecutor()
    await stack.heartbeat(0, await serve(stack, fake))
    service = await stack.start_service(num_nodes=1, **FAST)
    stub = stack.stub(service)
    await submit(stub, inference("bad-1"))
    end = await end_message(stack.store, "bad-1")
    assert end["status"] == "rejected"
    assert end["reason"] == (
        "INVALID_ARGUMENT: node 0 refused the task: task 'bad-1': token id out of the vocabulary"
    )
    assert service.live_node_ids == [0] and service.core.dispatch_failed_s == {}
    await submit(stub, inference("good-1"))
    await wait_until(lambda: placed_on(stack.store, "good-1", 0), what="good-1 placed on 0")


async def test_a_hung_node_s_task_goes_elsewhere_and_is_cancelled_there_on_return(
    stack: Stack,
) -> None:
    hung = HungExecutor(hang_s=1.0)  # past the 0.5 s dispatch deadline
    await stack.heartbeat(0, await serve(stack, hung))
    await stack.start_executor(1)
    service = await stack.start_service(**FAST)
    await wait_until(lambda: service.live_node_ids == [0, 1], what="both nodes up")
    await submit(stack.stub(service), inference("h"))  # round robin: node 0 first
    await wait_until(lambda: placed_on(stack.store, "h", 1), what="h moved to node 1")
    assert stack.executors[1].dispatched_ids == ["h"]
    # Node 0 still heartbeats: after the pause it is re-admitted, but first
    # told to drop "h", which it may have taken after all.
    await wait_until(lambda: service.live_node_ids == [0, 1], what="node 0 re-admitted")
    assert [c.task_id for c in hung.cancelled] == ["h"]
    assert service.core.revoked == {}


# ------------------------------------------------------------------ dead nodes


async def test_a_dead_node_s_tasks_are_requeued_or_failed_by_task_id(stack: Stack) -> None:
    store = stack.store
    fake0 = FakeExecutor()
    address0 = await serve(stack, fake0)
    service = await stack.start_service(**FAST)
    stub = stack.stub(service)
    async with beating(store, 0, address0):
        await wait_until(lambda: service.live_node_ids == [0], what="node 0 up")
        for i, task in enumerate(
            [training("t", seq=0), inference("fresh", seq=1), inference("streaming", seq=2)]
        ):
            await submit(stub, task)
            await wait_until(lambda i=i: len(fake0.dispatched_ids) == i + 1, what="dispatch")
        # "streaming" has sent its first token; "fresh" has not started.
        await store.append_output("streaming", {"type": "token", "n": 1, "node": "0"})
        fake1 = await stack.start_executor(1)
        await wait_until(lambda: service.live_node_ids == [0, 1], what="node 1 up")
    # Node 0 stops heartbeating (killed): within TTL + a poll its tasks move.
    for task_id in ("t", "fresh"):
        await wait_until(
            lambda t=task_id: placed_on(store, t, 1),
            what=f"{task_id} on node 1",
            timeout_s=HEARTBEAT_TTL_S + 3.0,
        )
    assert sorted(fake1.dispatched_ids) == ["fresh", "t"]
    assert list(fake1.dispatched[fake1.dispatched_ids.index("t")].task.reference_token_ids) == [
        1,
        2,
        3,
    ]  # its payload went along
    end = await end_message(store, "streaming")
    assert end["status"] == "failed"
    assert end["reason"] == "UNAVAILABLE: executor of node 0 went down while streaming; retry"
    assert service.live_node_ids == [1]
    # The old node's late completion is stale; the new node's counts.
    await store.append_completion({"task_id": "t", "node_id": 0, "status": "completed"})
    await store.append_completion({"task_id": "t", "node_id": 1, "status": "completed"})
    await wait_until(lambda: not service.core.knows("t"), what="t finished on node 1")
    # Node 0 comes back (SIGCONT): it is told to drop all three before new work.
    async with beating(store, 0, address0):
        await wait_until(lambda: 0 in service.live_node_ids, what="node 0 back")
        assert sorted(c.task_id for c in fake0.cancelled) == ["fresh", "streaming", "t"]


async def test_a_late_heartbeat_costs_no_task(stack: Stack) -> None:
    store = stack.store
    fake0 = FakeExecutor()
    address0 = await serve(stack, fake0)
    await stack.start_executor(1)
    service = await stack.start_service(**{**FAST, "node_lost_after_s": 5.0})
    async with beating(store, 0, address0):
        await wait_until(lambda: service.live_node_ids == [0, 1], what="both nodes up")
        await submit(stack.stub(service), training("slow"))  # round robin: node 0
        await wait_until(lambda: placed_on(store, "slow", 0), what="slow on node 0")
    # Silent past its TTL (CPU-starved), then back well before it counts as lost.
    await wait_until(lambda: service.live_node_ids == [1], what="node 0 down")
    async with beating(store, 0, address0):
        await wait_until(lambda: service.live_node_ids == [0, 1], what="node 0 back")
    assert service.core.node_of("slow") == 0 and await placed_on(store, "slow", 0)
    assert fake0.cancelled == [] and stack.executors[1].dispatched_ids == []


async def test_an_executor_that_restarted_loses_its_tasks_to_the_queue(stack: Stack) -> None:
    fake0 = await stack.start_executor(0)
    await stack.start_executor(1)
    service = await stack.start_service(**FAST)
    await wait_until(lambda: service.live_node_ids == [0, 1], what="both nodes up")
    address0 = service.dispatcher.address_of(0)
    assert address0 is not None

    async def beat(now_s: float) -> None:
        await stack.store.put_node_state(0, {"address": address0, "now_s": now_s}, ttl_s=30.0)

    await beat(100.0)
    await wait_until(lambda: service.nodes._engine_now_s.get(0) == 100.0, what="seen")
    await submit(stack.stub(service), training("tr"))  # round robin: node 0
    await wait_until(lambda: placed_on(stack.store, "tr", 0), what="tr on node 0")
    await beat(0.5)  # a new process under the same address: its clock restarted
    await wait_until(lambda: placed_on(stack.store, "tr", 1), what="tr moved to node 1")
    assert fake0.dispatched_ids == ["tr"]


# ------------------------------------------------------------------ burst


async def test_a_burst_of_training_is_placed_whole_with_a_small_pool(stack: Stack) -> None:
    await stack.start_executor(0)
    await stack.start_executor(1)
    # Pool of 5 + 1 connections, 4 dispatches at once: the 10,000-sample
    # Train of the issue in miniature; every task must end up placed.
    service = await stack.start_service(max_rpc_redis_calls=1, max_concurrent_dispatches=4, **FAST)
    await wait_until(lambda: service.live_node_ids == [0, 1], what="both nodes up")
    ids = [f"b{i}" for i in range(400)]
    for i, task_id in enumerate(ids):
        await stack.store.submit_task(
            task_to_fields(Task(task_id, TaskKind.TRAINING, 0.0, 20, seq=i), TaskPayload())
        )

    async def all_placed() -> bool:
        return all(
            [s.get("status") == "placed" for s in [await state_of(stack.store, t) for t in ids]]
        )

    await wait_until(all_placed, timeout_s=20.0, what="every task placed")
    dispatched = stack.executors[0].dispatched_ids + stack.executors[1].dispatched_ids
    assert sorted(dispatched) == sorted(ids)  # each exactly once
    assert service.core.num_unwritten == 0


# ------------------------------------------------------------------ Redis outage


async def test_silent_nodes_get_a_grace_after_redis_restarts(stack: Stack) -> None:
    port = find_free_port()
    with tempfile.TemporaryDirectory() as data_dir:
        own = EmbeddedRedis(port=port, dir=data_dir, appendonly=True).start()
        client = connect(RedisClientConfig(own.url, max_connections=4, socket_timeout_s=5.0))
        store = Store(client, RedisKeys(stack.namespace))
        try:
            fake = FakeExecutor()
            address = await serve(stack, fake)
            async with beating(store, 0, address):
                service = SchedulerService(
                    stack.config(
                        num_nodes=1, redis_url=own.url, **{**FAST, "redis_outage_grace_s": 1.5}
                    ),
                    profile=PROFILE,
                )
                stack.services.append(service)
                await service.start()
                await wait_until(lambda: service.live_node_ids == [0], what="node 0 up")
                await submit(stack.stub(service), training("t"))
                await wait_until(lambda: service.core.node_of("t") == 0, what="t placed")
            # Redis dies; the heartbeat lapses during the outage (AOF keeps the rest).
            await asyncio.to_thread(own.stop)
            await asyncio.sleep(HEARTBEAT_TTL_S + 0.2)  # make the outage outlive the TTL
            own = EmbeddedRedis(port=port, dir=data_dir, appendonly=True)
            await asyncio.to_thread(own.start)
            assert not await store.client.exists(store.keys.node_heartbeat(0))
            # Within the grace the node stays up with its task, though silent.
            loop = asyncio.get_running_loop()
            until = loop.time() + 1.0
            while loop.time() < until:
                assert service.live_node_ids == [0] and service.core.node_of("t") == 0
                await asyncio.sleep(0.05)
            async with beating(store, 0, address):  # the executor reconnects in time
                await wait_until(lambda: service.nodes.is_in_grace is False, what="grace over")
                assert service.live_node_ids == [0] and fake.dispatched_ids == ["t"]
            # Silent for good, outside any grace: down, and its training leaves.
            end = await end_message(store, "t")  # one node: nowhere to go but an end
            assert end["reason"].startswith("UNAVAILABLE")
            assert service.live_node_ids == []
        finally:
            await client.aclose()
            for service in stack.services:
                await service.stop(grace_s=0.1)
            stack.services.clear()
            own.stop()


# ------------------------------------------------------------------ orphaned streams


async def test_a_lapsed_gateway_lease_cancels_its_requests_and_only_them(stack: Stack) -> None:
    fake = await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1, lease_check_s=0.05, **FAST)
    stub = stack.stub(service)
    store = stack.store
    # A gateway's lease is live before its Submits; "direct" names no
    # gateway; "retried" came through gw-a, then again through gw-b.
    await store.renew_gateway_lease("gw-a", ttl_s=0.4)
    await store.renew_gateway_lease("gw-b", ttl_s=0.4)
    for i, (task_id, gateway_id) in enumerate(
        [("orphan", "gw-a"), ("kept", "gw-b"), ("direct", ""), ("retried", "gw-a")]
    ):
        await submit(stub, inference(task_id, seq=i), gateway_id=gateway_id)
    await wait_until(lambda: len(fake.dispatched_ids) == 4, what="all dispatched")
    reply = await submit(stub, inference("retried", seq=3), gateway_id="gw-b")
    assert reply.is_duplicate

    async def renewing() -> None:
        while True:
            await store.renew_gateway_lease("gw-b", ttl_s=0.4)
            await asyncio.sleep(0.1)

    renewer = asyncio.create_task(renewing())
    try:
        await wait_until(
            lambda: [c.task_id for c in fake.cancelled] == ["orphan"], what="orphan cancelled"
        )
        assert fake.cancelled[0].reason == GATEWAY_GONE
        # Several more checks pass: only the orphan was cancelled.
        await store.renew_gateway_lease("gw-c", ttl_s=0.3)
        await submit(stub, inference("late", seq=4), gateway_id="gw-c")
        await wait_until(
            lambda: [c.task_id for c in fake.cancelled] == ["orphan", "late"], what="late cancelled"
        )
        # "kept" and "retried" (gw-b reads it too) stay watched; "direct" never
        # was; a cancelled task leaves the watch once its cancel has gone
        # through (asynchronously). gw-b's lease is still being renewed here:
        # once it lapses (0.4 s) those two are orphans too.
        await wait_until(lambda: service.leases.num_watched == 2, what="'kept', 'retried' watched")
    finally:
        renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewer
    assert (await store.get_task_state("orphan"))["gateway_id"] == "gw-a"
    # A restarted scheduler knows both gateways of "retried" (from its hash):
    # gw-a's lease lapsed, gw-b's is renewed, so it stays watched.
    assert gateways_of(await store.get_task_state("retried")) == ["gw-a", "gw-b"]
    await service.stop(grace_s=0.1)
    await store.renew_gateway_lease("gw-b", ttl_s=5.0)
    restarted = await stack.start_service(num_nodes=1, lease_check_s=0.05, **FAST)
    assert restarted.leases.gateways_watching("retried") == {"gw-b"}


# ------------------------------------------------------------------ error causes


async def test_an_exhausted_pool_is_named_as_such_not_as_an_unreachable_redis(
    redis_server: EmbeddedRedis,
) -> None:
    client = connect(
        RedisClientConfig(
            redis_server.url, max_connections=1, socket_timeout_s=5.0, pool_timeout_s=0.1
        )
    )
    try:
        blocked = asyncio.create_task(client.xread({"nothing-here": "$"}, block=500))
        await asyncio.sleep(0.05)  # let it take the only connection
        with pytest.raises(RedisConnectionError) as info:
            await client.ping()
        assert "busy past the pool's wait" in describe_redis_error(info.value)
        await blocked
    finally:
        await client.aclose()
    nobody = connect(
        RedisClientConfig(
            f"redis://127.0.0.1:{find_free_port()}/0", max_connections=1, socket_timeout_s=1.0
        )
    )
    try:
        with pytest.raises(RedisConnectionError) as info:
            await nobody.ping()
    finally:
        await nobody.aclose()
    assert describe_redis_error(info.value).startswith("Redis is unreachable (ConnectionError")
