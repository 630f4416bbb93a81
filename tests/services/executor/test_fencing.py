"""Fencing on the executor side: real executors (gRPC, emulated backend at 50x),
real Redis. The scheduler's part is played by the Store calls it makes: it
numbers a placement (`Store.begin_attempts`) before the Dispatch, so bumping
a task's attempt is exactly what "the scheduler moved it" looks like to an
executor still holding the old attempt."""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from factories import make_profile, make_request, make_training
from output_messages import token_numbers
from prometheus_client import REGISTRY
from redis_pool import TEST_POOL_SIZE
from waiting import wait_until

from lemix._proto.lemix.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from lemix.engine import Outcome
from lemix.infra.rpc.client import DEFAULT_DEADLINE_S, channel
from lemix.infra.rpc.convert import task_to_proto
from lemix.infra.store.codec import Entry, Fields
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.server import EmbeddedRedis
from lemix.infra.store.store import Store
from lemix.infra.store.task_hash import ATTEMPT_FIELD
from lemix.profile import save_profile
from lemix.types import Task
from services.executor.config import ExecutorConfig
from services.executor.service import ExecutorService

OLD, NEW = 3, 4  # node ids: the one the task is taken from, the one it goes to


class Node:
    """One started executor and a stub to it."""

    def __init__(
        self, service: ExecutorService, ch: object, stub: executor_pb2_grpc.ExecutorStub
    ) -> None:
        self.service = service
        self.channel = ch
        self.stub = stub
        self.gates: list[asyncio.Event] = []  # writes held back (`hold_back_writes`)

    async def dispatch(self, task: Task, attempt: int = 0) -> None:
        reply = await self.stub.Dispatch(
            executor_pb2.DispatchRequest(task=task_to_proto(task), attempt=attempt),
            timeout=DEFAULT_DEADLINE_S,
        )
        assert reply.is_accepted

    def holds(self, task_id: str) -> bool:
        assert self.service.node is not None
        return self.service.node.held_task(task_id) is not None


@pytest.fixture
async def nodes(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> AsyncIterator[tuple[Node, Node, Store]]:
    profile_path = tmp_path / "profile.json"
    save_profile(
        make_profile(capacity_bytes=10**9, weight_bytes=10**6, name="fencing"), profile_path
    )
    namespace = f"fence-{uuid.uuid4().hex[:8]}"
    started: list[Node] = []
    client = aioredis.Redis.from_url(
        redis_server.url, decode_responses=True, max_connections=TEST_POOL_SIZE
    )
    try:
        for node_id in (OLD, NEW):
            service = ExecutorService(
                ExecutorConfig(
                    node_id=node_id,
                    redis_url=redis_server.url,
                    namespace=namespace,
                    profile_path=profile_path,
                    time_scale=0.02,
                    heartbeat_s=0.05,
                    node_ttl_s=0.5,
                    shutdown_grace_s=0.5,
                    weight_sync_dir=str(tmp_path / "w"),
                )
            )
            await service.start()
            ch = channel(service.address)
            started.append(Node(service, ch, executor_pb2_grpc.ExecutorStub(ch)))
        yield started[0], started[1], Store(client, RedisKeys(namespace))
    finally:
        for node in started:
            for gate in node.gates:
                gate.set()  # a held-back write must not hang the stop
            await node.channel.close()  # type: ignore[attr-defined]
            await node.service.stop(grace_s=0.1)
        await client.aclose()


async def place(store: Store, task_id: str) -> int:
    """What the scheduler does before each Dispatch: number the placement."""
    [attempt], _ = await store.begin_attempts([task_id])
    return attempt


async def outputs(store: Store, task_id: str) -> list[Fields]:
    return [fields for _, fields in await store.read_output(task_id)]


async def read_until_end(store: Store, task_id: str) -> list[Fields]:
    async def has_end() -> bool:
        return any(m.get("type") == "end" for m in await outputs(store, task_id))

    await wait_until(has_end, what=f"{task_id}'s end")
    return await outputs(store, task_id)


async def completions_of(store: Store, task_id: str) -> list[Fields]:
    entries: list[Entry] = await store.read_completions("0-0")
    return [fields for _, fields in entries if fields["task_id"] == task_id]


def fenced_writes(node_id: int, what: str) -> float:
    value = REGISTRY.get_sample_value(
        "lemix_executor_fenced_writes_total", {"node": str(node_id), "what": what}
    )
    return value or 0.0


# ------------------------------------------------------------------ tests


async def test_a_moved_request_gets_no_token_and_no_end_from_its_old_executor(
    nodes: tuple[Node, Node, Store],
) -> None:
    old, new, store = nodes
    fenced_before = fenced_writes(OLD, "token")
    await old.dispatch(make_request("r", 0.0, 50, 100_000), await place(store, "r"))
    await wait_until(lambda: _has_output(store, "r"), what="r streaming on the old node")
    attempt = await place(store, "r")  # the scheduler moved it: from here on old is fenced
    num_before = len(await outputs(store, "r"))
    # The old node finds out at its next write, lets the task go and frees its KV.
    await wait_until(lambda: not old.holds("r"), what="the old node let r go")
    [completion] = await completions_of(store, "r")
    assert (completion["node_id"], completion[ATTEMPT_FIELD]) == (str(OLD), "1")
    assert len(await outputs(store, "r")) == num_before  # nothing after the fence
    assert (await store.get_task_state("r")).get("is_final") is None  # no end either
    assert fenced_writes(OLD, "token") > fenced_before
    state = await old.stub.GetNodeState(
        executor_pb2.GetNodeStateRequest(), timeout=DEFAULT_DEADLINE_S
    )
    assert state.num_running == 0 and state.kv_used_bytes == 0
    # The new placement streams and ends.
    await new.dispatch(make_request("r", 0.0, 50, 8), attempt)
    messages = (await read_until_end(store, "r"))[num_before:]
    assert {m["node"] for m in messages} == {str(NEW)}
    assert token_numbers(messages) == list(range(1, 9))
    assert (messages[-1]["status"], messages[-1]["n"]) == ("completed", "8")
    final = await store.get_task_state("r")
    assert (final["status"], final["node_id"], final[ATTEMPT_FIELD]) == ("completed", str(NEW), "2")


async def _has_output(store: Store, task_id: str) -> bool:
    return bool(await outputs(store, task_id))


async def test_a_cancel_on_the_old_node_writes_no_cancelled_end(
    nodes: tuple[Node, Node, Store],
) -> None:
    old, _, store = nodes
    await old.dispatch(make_request("c", 0.0, 50, 100_000), await place(store, "c"))
    await wait_until(lambda: _has_output(store, "c"), what="c streaming")
    await place(store, "c")  # moved (the node was declared dead), then told to cancel
    await old.stub.Cancel(
        common_pb2.CancelRequest(task_id="c", reason="moved off node 3"), timeout=DEFAULT_DEADLINE_S
    )
    await wait_until(lambda: not old.holds("c"), what="the old node let c go")
    await wait_until(lambda: _completed_by(store, "c", OLD), what="the old node's completion")
    assert [m for m in await outputs(store, "c") if m["type"] == "end"] == []
    assert (await store.get_task_state("c")).get("is_final") is None


async def _completed_by(store: Store, task_id: str, node_id: int) -> bool:
    return any(c["node_id"] == str(node_id) for c in await completions_of(store, task_id))


async def test_two_executors_on_one_task_only_the_current_attempt_lands(
    nodes: tuple[Node, Node, Store],
) -> None:
    old, new, store = nodes
    first = await place(store, "d")
    second = await place(store, "d")
    # Both run it at once (a resumed executor and its replacement); only the
    # current attempt may write.
    await asyncio.gather(
        old.dispatch(make_request("d", 0.0, 50, 8), first),
        new.dispatch(make_request("d", 0.0, 50, 8), second),
    )
    await wait_until(lambda: not old.holds("d") and not new.holds("d"), what="both done with d")
    messages = await read_until_end(store, "d")
    assert {m["node"] for m in messages} == {str(NEW)}
    assert token_numbers(messages) == list(range(1, 9))
    assert [m["status"] for m in messages if m["type"] == "end"] == ["completed"]
    final = await store.get_task_state("d")
    assert (final["status"], final["node_id"]) == ("completed", str(NEW))
    by_node = {c["node_id"]: c[ATTEMPT_FIELD] for c in await completions_of(store, "d")}
    assert by_node == {str(OLD): "1", str(NEW): "2"}  # the scheduler tells them apart


async def test_training_moved_away_ends_once_by_its_new_node(
    nodes: tuple[Node, Node, Store],
) -> None:
    old, new, store = nodes
    fenced_before = fenced_writes(OLD, "end")
    stale = await place(store, "t")
    current = await place(store, "t")  # moved before the old node finished it
    await old.dispatch(make_training("t", 0.0, 50), stale)
    await wait_until(lambda: _completed_by(store, "t", OLD), what="the stale run ended")
    assert await outputs(store, "t") == []  # its end did not land...
    assert (await store.get_task_state("t")).get("is_final") is None
    assert fenced_writes(OLD, "end") == fenced_before + 1
    await new.dispatch(make_training("t", 0.0, 50), current)  # ...the current one's does
    ends = await read_until_end(store, "t")
    assert [(m["status"], m["node"]) for m in ends] == [("completed", str(NEW))]


async def test_a_task_moved_away_and_back_runs_again_on_the_same_node(
    nodes: tuple[Node, Node, Store],
) -> None:
    old, _, store = nodes
    await old.dispatch(make_request("b", 0.0, 50, 100_000), await place(store, "b"))
    await wait_until(lambda: _has_output(store, "b"), what="b streaming")
    gate = hold_back_writes(old)  # so the node cannot find out by itself it was fenced
    await place(store, "b")  # moved to another node...
    attempt = await place(store, "b")  # ...and back, while the old attempt still runs here
    num_before = len(await outputs(store, "b"))
    back = asyncio.create_task(old.dispatch(make_request("b", 0.0, 50, 6), attempt))
    assert old.service.node is not None
    releasing = old.service.node._releasing  # the Dispatch waits for the old one to leave
    await wait_until(lambda: "b" in releasing, what="the old attempt cancelled")
    gate.set()  # its (fenced) end goes out; then the new attempt starts
    await back
    await old.dispatch(make_request("b", 0.0, 50, 6), attempt)  # redelivered: runs once
    await old.dispatch(make_request("b", 0.0, 50, 6), 1)  # a stale one: not run again
    messages = (await read_until_end(store, "b"))[num_before:]
    assert {m["node"] for m in messages} == {str(OLD)}
    assert token_numbers(messages) == list(range(1, 7))
    assert [m["status"] for m in messages if m["type"] == "end"] == ["completed"]
    assert (await store.get_task_state("b"))[ATTEMPT_FIELD] == "3"


def hold_back_writes(node: Node) -> asyncio.Event:
    """The node's outcome writes wait until the returned event is set."""
    assert node.service.node is not None
    sink = node.service.node.sink
    write = sink.write
    gate = asyncio.Event()

    async def held_back(batch: list[tuple[float, Outcome]]) -> None:
        await gate.wait()
        await write(batch)

    sink.write = held_back  # type: ignore[method-assign]
    node.gates.append(gate)
    return gate


async def test_a_dispatch_without_an_attempt_still_runs(nodes: tuple[Node, Node, Store]) -> None:
    old, _, store = nodes
    await store.set_task_state("plain", {"status": "placed"})  # a hash, no attempt field
    await old.dispatch(make_request("plain", 0.0, 50, 4))
    await old.dispatch(make_request("direct", 0.0, 50, 4))  # no hash at all
    for task_id in ("plain", "direct"):
        messages = await read_until_end(store, task_id)
        assert token_numbers(messages) == [1, 2, 3, 4]
        assert messages[-1]["status"] == "completed"
        await wait_until(functools.partial(_completed_by, store, task_id, OLD), what="completion")
        [completion] = await completions_of(store, task_id)
        assert completion[ATTEMPT_FIELD] == "0"


async def test_the_executor_records_each_placement_itself_and_says_so(
    nodes: tuple[Node, Node, Store],
) -> None:
    old, _, store = nodes
    long_running = make_request("long", 0.0, 50, 100_000)
    reply = await old.stub.Dispatch(
        executor_pb2.DispatchRequest(
            task=task_to_proto(long_running), attempt=await place(store, "long")
        ),
        timeout=DEFAULT_DEADLINE_S,
    )
    assert reply.is_accepted and reply.is_placement_recorded  # the scheduler writes none

    async def placed() -> bool:
        return (await store.get_task_state("long")).get("status") == "placed"

    await wait_until(placed, what="long's placed state")
    state = await store.get_task_state("long")
    assert state["node_id"] == str(OLD) and float(state["placed_t"]) > 0
    # A task that ends in the node's first write for it gets the time it was
    # taken on its final state (one write).
    await old.dispatch(make_request("short", 0.0, 50, 1), await place(store, "short"))
    await read_until_end(store, "short")
    final = await store.get_task_state("short")
    assert (final["status"], final["node_id"]) == ("completed", str(OLD))
    assert 0 < float(final["placed_t"]) <= float(final["finish_t"])
