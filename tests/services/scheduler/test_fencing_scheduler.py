"""Fencing on the scheduler side, against a real Redis.

* `SchedulerCore` with the real Redis ledger (`RedisResultWriter`) and an
  in-memory dispatcher: attempts are numbered before each Dispatch, fenced
  when a task is taken away, and a completion of an old attempt is stale
  even from the node the task is placed on again.
* End to end, SIGSTOP-like: a real scheduler and two real executors; node 0
  goes silent (heartbeat stopped, its writes held back) holding an inference
  request and a training task, which move to node 1; then node 0 resumes.
  Only node 1's attempt reaches the streams; each task ends once, completed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from factories import make_planner, make_profile, make_request
from output_messages import token_numbers
from test_scheduler_service import PROFILE, end_message, inference, submit, training, wait_until

from lemix._proto.lemix.v1 import scheduler_pb2_grpc
from lemix.engine import Outcome
from lemix.infra.rpc.client import channel
from lemix.infra.store.fencing import FinishOutcome
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.server import EmbeddedRedis
from lemix.infra.store.store import Store
from lemix.infra.store.task_hash import ATTEMPT_FIELD
from lemix.planner.recording import RecordingPlanner
from lemix.profile import save_profile
from lemix.types import Placement, Task
from services.executor.config import ExecutorConfig
from services.executor.service import ExecutorService
from services.scheduler.adapters import RedisResultWriter
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import DispatchError, SchedulerCore, TaskProgress
from services.scheduler.service import SchedulerService


@pytest.fixture
def store(redis_client: aioredis.Redis) -> Store:
    return Store(redis_client, RedisKeys(f"fencecore-{uuid.uuid4().hex[:8]}"))


class Executors:
    """The Dispatcher port in memory: records (task id, node, attempt sent)."""

    def __init__(self) -> None:
        self.core: SchedulerCore | None = None
        self.dispatched: list[tuple[str, int, int]] = []
        self.hung: set[int] = set()  # Dispatch times out: maybe taken

    async def dispatch(self, placement: Placement, task: Task) -> None:
        if placement.node_id in self.hung:
            raise DispatchError("DEADLINE_EXCEEDED", is_maybe_taken=True)
        assert self.core is not None
        self.dispatched.append(
            (task.task_id, placement.node_id, self.core.attempt_of(task.task_id))
        )

    async def sync_weights(self, sync: Any) -> None:
        pass


class FlakyLedger:
    """The Redis ledger, failing its next `num_failures` begin_attempts calls."""

    def __init__(self, inner: RedisResultWriter) -> None:
        self.inner = inner
        self.num_failures = 0

    async def begin_attempts(
        self, task_ids: Sequence[str], check_cancelled: Sequence[str]
    ) -> tuple[list[int], list[bool]]:
        if self.num_failures > 0:
            self.num_failures -= 1
            raise ConnectionError("Redis is restarting")
        return await self.inner.begin_attempts(task_ids, check_cancelled)

    async def fence(self, taken: Sequence[tuple[str, int]]) -> list[TaskProgress]:
        return await self.inner.fence(taken)


def make_core(store: Store, ledger: Any = None) -> tuple[SchedulerCore, Executors]:
    executors = Executors()
    writer = RedisResultWriter(store)
    clock = iter(float(i) for i in range(10_000))
    core = SchedulerCore(
        RecordingPlanner(make_planner("mix-rr", num_nodes=2), lambda _: None),
        executors,
        writer,
        lambda: next(clock),
        ledger=ledger or writer,
    )
    executors.core = core
    return core, executors


async def attempt_in_redis(store: Store, task_id: str) -> str:
    return (await store.get_task_state(task_id)).get(ATTEMPT_FIELD, "")


# ------------------------------------------------------------------ core


async def test_each_placement_is_numbered_and_a_stale_completion_is_ignored(store: Store) -> None:
    core, executors = make_core(store)
    await core.on_task(make_request("a"))  # round robin: node 0
    assert executors.dispatched == [("a", 0, 1)] and await attempt_in_redis(store, "a") == "1"
    await core.on_node_down(0)  # lost: fenced (2), placed again on node 1 (3)
    assert executors.dispatched[-1] == ("a", 1, 3) and core.revoked == {0: {"a": 1}}
    assert await store.finish_task_fenced("a", 1, "failed", "CANCELLED") is FinishOutcome.FENCED
    await core.on_node_health(0, True)
    await core.on_node_down(1)  # and back to node 0 (5)
    assert executors.dispatched[-1] == ("a", 0, 5)
    # Node 0's completion of its first attempt names the right node, the wrong attempt.
    assert not await core.on_finished("a", is_success=True, node_id=0, attempt=1)
    assert core.knows("a")
    assert await core.on_finished("a", is_success=True, node_id=0, attempt=5)
    assert not core.knows("a") and core.attempt_of("a") == 0


async def test_a_first_placement_numbered_at_intake_takes_no_round_trip(store: Store) -> None:
    ledger = FlakyLedger(RedisResultWriter(store))
    ledger.num_failures = 1  # a numbering call would fail (and defer the placement)
    core, executors = make_core(store, ledger)
    (check,) = await store.accept_intake([("i", {"status": "queued"})])
    await core.on_tasks([make_request("i")], {"i": check.attempt})
    assert executors.dispatched == [("i", 0, 1)] and ledger.num_failures == 1  # not called
    assert await attempt_in_redis(store, "i") == "1"
    ledger.num_failures = 0
    await core.on_node_down(0)  # a second placement is numbered by the ledger: 2 fenced, 3
    assert executors.dispatched[-1] == ("i", 1, 3) and core.revoked == {0: {"i": 1}}


async def test_a_maybe_taken_dispatch_is_fenced_at_once(store: Store) -> None:
    core, executors = make_core(store)
    executors.hung.add(0)
    await core.on_task(make_request("h"))  # node 0 times out; goes to node 1
    assert executors.dispatched == [("h", 1, 3)] and core.revoked == {0: {"h": 1}}
    assert await store.append_outputs_fenced([("h", 1, {"n": 1})]) == [None]
    await core.fence_revoked(0)  # again before the Cancel: attempt 3 is kept
    assert await attempt_in_redis(store, "h") == "3"


async def test_a_revoked_attempt_is_fenced_before_its_node_is_told_to_cancel(store: Store) -> None:
    core, executors = make_core(store)
    await core.on_task(make_request("u"))
    assert executors.dispatched == [("u", 0, 1)]
    # After a restart: placed in the log, never confirmed; back to the queue.
    assert core.requeue_unconfirmed(["u"]) == ["u"] and core.revoked == {0: {"u": 1}}
    await core.fence_revoked(0)  # what the supervisor does before the Cancel
    assert (
        await store.finish_task_fenced("u", 1, "failed", "CANCELLED: moved") is FinishOutcome.FENCED
    )
    assert (await store.get_task_state("u")).get("is_final") is None


async def test_nothing_is_dispatched_unnumbered_when_redis_fails(store: Store) -> None:
    ledger = FlakyLedger(RedisResultWriter(store))
    core, executors = make_core(store, ledger)
    ledger.num_failures = 1
    await core.on_task(make_request("n"))
    assert executors.dispatched == [] and core.knows("n") and core.node_of("n") is None
    await core.retry_writes()  # the nodes loop's next tick: placed, numbered
    assert executors.dispatched == [("n", 1, 1)] or executors.dispatched == [("n", 0, 1)]
    assert core.node_of("n") == executors.dispatched[0][1]


# ------------------------------------------------------------------ end to end

FAST = {
    "policy": "mix-rr",
    "node_poll_s": 0.05,
    "redis_outage_grace_s": 0.2,
    "node_lost_after_s": 0.3,
    "dispatch_deadline_s": 1.0,
    "dispatch_retry_s": 0.3,
    "read_block_s": 0.1,
    "shutdown_grace_s": 0.5,
    "slo_ttft_s": 1.0,
    "slo_tbt_s": 0.5,
    "consumer": "fencing-scheduler",
}


class Paused:
    """SIGSTOP, in process: the executor's heartbeats stop and its writes wait."""

    def __init__(self, service: ExecutorService) -> None:
        assert service.node is not None
        self.service = service
        self.gate = asyncio.Event()
        sink = service.node.sink
        write = sink.write

        async def held_back(batch: list[tuple[float, Outcome]]) -> None:
            await self.gate.wait()
            await write(batch)

        sink.write = held_back  # type: ignore[method-assign]

    async def stop_heartbeats(self) -> None:
        service = self.service
        service._heartbeat_stop.set()
        assert service._heartbeat is not None
        await service._heartbeat

    def resume(self) -> None:
        service = self.service
        self.gate.set()
        service._heartbeat_stop.clear()
        service._heartbeat = asyncio.create_task(service._heartbeat_loop())


@pytest.fixture
async def cluster(
    redis_server: EmbeddedRedis, redis_client: aioredis.Redis, tmp_path: Path
) -> AsyncIterator[dict[str, Any]]:
    namespace = f"fence-e2e-{uuid.uuid4().hex[:8]}"
    profile_path = tmp_path / "profile.json"
    save_profile(
        make_profile(capacity_bytes=10**9, weight_bytes=10**6, name="fence-e2e"), profile_path
    )
    made: dict[str, Any] = {
        "store": Store(redis_client, RedisKeys(namespace)),
        "executors": [],
        "schedulers": [],
        "channels": [],
        "paused": [],
    }

    def executor_config(node_id: int) -> ExecutorConfig:
        return ExecutorConfig(
            node_id=node_id,
            redis_url=redis_server.url,
            namespace=namespace,
            profile_path=profile_path,
            time_scale=0.02,
            heartbeat_s=0.05,
            node_ttl_s=0.3,
            shutdown_grace_s=0.5,
            weight_sync_dir=str(tmp_path / "w"),
        )

    made["executor_config"] = executor_config
    made["scheduler_config"] = SchedulerConfig(
        redis_url=redis_server.url, namespace=namespace, num_nodes=2, **FAST
    )  # type: ignore[arg-type]
    try:
        yield made
    finally:
        for paused in made["paused"]:
            paused.gate.set()  # a held-back write must not hang the executor's stop
        for ch in made["channels"]:
            await ch.close()
        for scheduler in made["schedulers"]:
            await scheduler.stop(grace_s=0.1)
        for executor in made["executors"]:
            await executor.stop(grace_s=0.1)


async def test_a_paused_node_s_tasks_move_and_its_resumed_writes_are_fenced(
    cluster: dict[str, Any],
) -> None:
    store: Store = cluster["store"]
    node0 = ExecutorService(cluster["executor_config"](0))
    cluster["executors"].append(node0)
    await node0.start()
    paused = Paused(node0)  # nothing node 0 produces reaches Redis until it resumes
    cluster["paused"].append(paused)
    scheduler = SchedulerService(cluster["scheduler_config"], profile=PROFILE)
    cluster["schedulers"].append(scheduler)
    await scheduler.start()
    ch = channel(scheduler.address)
    cluster["channels"].append(ch)
    stub = scheduler_pb2_grpc.SchedulerStub(ch)
    await wait_until(lambda: scheduler.live_node_ids == [0], what="node 0 up")
    await submit(stub, inference("req", output=30))
    await submit(stub, training("trn", seq=1))
    await wait_until(
        lambda: scheduler.core.node_of("req") == scheduler.core.node_of("trn") == 0,
        what="both placed on node 0",
    )
    node1 = ExecutorService(cluster["executor_config"](1))
    cluster["executors"].append(node1)
    await node1.start()
    await wait_until(lambda: scheduler.live_node_ids == [0, 1], what="node 1 up")

    await paused.stop_heartbeats()  # node 0 is declared dead; both tasks go to node 1
    req_end = await end_message(store, "req")
    trn_end = await end_message(store, "trn")
    assert (req_end["status"], req_end["node"]) == ("completed", "1")
    assert (trn_end["status"], trn_end["node"]) == ("completed", "1")
    attempts = {t: await store.get_task_state(t) for t in ("req", "trn")}

    paused.resume()  # SIGCONT: node 0 flushes what it held back, and heartbeats
    node = node0.node
    assert node is not None
    await wait_until(
        lambda: not node.held_task("req") and not node.held_task("trn"), what="node 0 let both go"
    )
    await wait_until(
        lambda: scheduler.live_node_ids == [0, 1] and not scheduler.core.revoked,
        what="node 0 back, told to cancel what it lost",
    )
    messages = [f for _, f in await store.read_output("req")]
    assert {m["node"] for m in messages} == {"1"}  # node 0's tokens never landed
    assert token_numbers(messages) == list(range(1, 31))
    for task_id in ("req", "trn"):
        ends = [f for _, f in await store.read_output(task_id) if f["type"] == "end"]
        assert [(e["status"], e["node"]) for e in ends] == [("completed", "1")]
        state = await store.get_task_state(task_id)
        assert (state["status"], state["node_id"]) == ("completed", "1")
        assert state[ATTEMPT_FIELD] == attempts[task_id][ATTEMPT_FIELD]  # nothing moved since
        assert not scheduler.core.knows(task_id)


class HeldExecutors(Executors):
    """Dispatches to `held` nodes wait until `release` is set (a slow executor)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: set[int] = set()
        self.release = asyncio.Event()
        self.is_waiting = asyncio.Event()
        self.fail_held = False

    async def dispatch(self, placement: Placement, task: Task) -> None:
        if placement.node_id in self.held:
            self.is_waiting.set()
            await self.release.wait()
            if self.fail_held:
                raise DispatchError("DEADLINE_EXCEEDED", is_maybe_taken=True)
        await super().dispatch(placement, task)


def make_held_core(store: Store) -> tuple[SchedulerCore, HeldExecutors]:
    core, _ = make_core(store)
    executors = HeldExecutors()
    executors.core = core
    core.dispatcher = executors
    return core, executors


async def test_a_slow_dispatch_does_not_hold_up_other_inputs(store: Store) -> None:
    # The planner lock is not held across a Dispatch round trip (issue 15):
    # while node 0's Dispatch hangs, node 1 gets its task and a completion
    # is applied.
    core, executors = make_held_core(store)
    executors.held.add(0)
    slow = asyncio.create_task(core.on_task(make_request("s")))  # round robin: node 0
    await asyncio.wait_for(executors.is_waiting.wait(), 5.0)
    await asyncio.wait_for(core.on_task(make_request("f")), 5.0)  # node 1, not waiting
    assert executors.dispatched == [("f", 1, 1)]
    assert await asyncio.wait_for(core.on_finished("f", True, node_id=1, attempt=1), 5.0)
    assert not slow.done()
    executors.release.set()
    await slow
    assert executors.dispatched[-1] == ("s", 0, 1)
    assert (await store.get_task_state("s"))["status"] == "placed"


async def test_a_completion_that_beats_its_dispatch_reply_stands(store: Store) -> None:
    core, executors = make_held_core(store)
    executors.held.add(0)
    slow = asyncio.create_task(core.on_task(make_request("c")))
    await asyncio.wait_for(executors.is_waiting.wait(), 5.0)
    # The executor ran it and reported before its Dispatch reply came back.
    assert await store.finish_task_fenced("c", 1, "completed", "") is FinishOutcome.ENDED
    assert await core.on_finished("c", True, node_id=0, attempt=1)
    executors.release.set()
    await slow
    assert not core.knows("c") and core.num_placed == 1
    state = await store.get_task_state("c")
    assert (state["status"], state["is_final"]) == ("completed", "1")


async def test_a_dispatch_failing_after_its_node_was_evacuated_moves_nothing_twice(
    store: Store,
) -> None:
    core, executors = make_held_core(store)
    executors.held.add(0)
    executors.fail_held = True
    slow = asyncio.create_task(core.on_task(make_request("e")))
    await asyncio.wait_for(executors.is_waiting.wait(), 5.0)
    await core.on_node_down(0)  # fenced (2), placed again on node 1 (3)
    assert executors.dispatched == [("e", 1, 3)]
    executors.release.set()
    await slow  # node 0's late failure is about attempt 1: stale, no second move
    assert executors.dispatched == [("e", 1, 3)] and core.node_of("e") == 1
    assert core.num_moved == 1 and await attempt_in_redis(store, "e") == "3"


async def test_completions_during_a_dispatch_gather_into_one_plan_after_it(store: Store) -> None:
    core, executors = make_held_core(store)
    for task_id in ("p", "q"):  # placed on nodes 0 and 1
        await core.on_task(make_request(task_id))
    executors.held.add(0)
    slow = asyncio.create_task(core.on_task(make_request("r")))  # round robin: node 0
    await asyncio.wait_for(executors.is_waiting.wait(), 5.0)
    plans = 0
    plan = core.planner.plan

    def counting_plan(now_s: float) -> Any:
        nonlocal plans
        plans += 1
        return plan(now_s)

    core.planner.plan = counting_plan  # type: ignore[method-assign]
    assert await core.on_finished("p", True, node_id=0, attempt=1)
    assert await core.on_finished("q", True, node_id=1, attempt=1)
    assert plans == 0  # put off while node 0's Dispatch is out
    executors.release.set()
    await slow
    assert plans == 1 and core.node_of("r") == 0
