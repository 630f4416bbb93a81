"""SchedulerCore: no ghost placements and dead-node evacuation, with in-memory ports.

Every test checks each task by id: where the planner has it, what state the
core asked to store, what it ended with. Redis and gRPC versions of the same
faults are in test_scheduler_faults.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import grpc.aio
import pytest
from factories import make_planner, make_request, make_training

from gateway.convert import status_for_reason
from lemix.planner.recording import RecordingPlanner, decision_key, recorded_decision_keys, replay
from lemix.types import Placement, Task, WeightSync
from services.scheduler.adapters import dispatch_error
from services.scheduler.core import (
    DispatchError,
    SchedulerCore,
    StateWrite,
    TaskProgress,
    TaskRefused,
)

IDLE = TaskProgress(is_final=False, status="", has_output=False)


class Ports:
    """Dispatcher + ResultWriter in memory, each fault switchable per test."""

    def __init__(self) -> None:
        self.dispatched: list[tuple[str, int]] = []
        self.states: dict[str, StateWrite] = {}
        self.down: set[int] = set()  # dispatch raises DispatchError
        self.refuse: dict[str, TaskRefused] = {}  # by task id
        # By task id: the executor answers Dispatch with this status (as gRPC
        # would, through the adapter's `dispatch_error`).
        self.rpc_error: dict[str, tuple[grpc.StatusCode, str]] = {}
        self.crash: dict[str, int] = {}  # task id -> raise RuntimeError this many times
        self.num_write_failures = 0  # the next N write_states raise
        self.num_progress_failures = 0
        self.progress_of: dict[str, TaskProgress] = {}
        self.in_flight = 0
        self.max_in_flight = 0

    async def dispatch(self, placement: Placement, task: Task) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)  # let the others start: concurrency is observable
            if placement.node_id in self.down:
                raise DispatchError("UNAVAILABLE: connection refused")
            if task.task_id in self.refuse:
                raise self.refuse[task.task_id]
            if task.task_id in self.rpc_error:
                code, details = self.rpc_error[task.task_id]
                empty = grpc.aio.Metadata()
                raise dispatch_error(
                    placement.node_id, grpc.aio.AioRpcError(code, empty, empty, details=details)
                )
            if self.crash.get(task.task_id, 0) > 0:
                self.crash[task.task_id] -= 1
                raise RuntimeError("redis.exceptions.ConnectionError: pool exhausted")
            self.dispatched.append((task.task_id, placement.node_id))
        finally:
            self.in_flight -= 1

    async def sync_weights(self, sync: WeightSync) -> None:
        pass

    async def write_states(self, writes: Sequence[StateWrite]) -> None:
        if self.num_write_failures > 0:
            self.num_write_failures -= 1
            raise ConnectionError("Redis is restarting")
        for write in writes:
            if write.task_id in self.states and self.states[write.task_id].is_final:
                continue  # as Store: a final state is never overwritten
            self.states[write.task_id] = write

    async def progress(self, task_ids: Sequence[str]) -> list[TaskProgress]:
        if self.num_progress_failures > 0:
            self.num_progress_failures -= 1
            raise ConnectionError("Redis is restarting")
        return [self.progress_of.get(t, IDLE) for t in task_ids]


def make_core(policy: str = "mix-rr", num_nodes: int = 2, **kw: int):
    events: list[dict] = []
    ports = Ports()
    clock = iter(float(i) for i in range(100_000))
    core = SchedulerCore(
        RecordingPlanner(make_planner(policy, num_nodes=num_nodes), events.append),
        ports,
        ports,
        lambda: next(clock),
        **kw,
    )  # type: ignore[arg-type]
    return core, ports, events


def assert_replays(events: list[dict], policy: str = "mix-rr", num_nodes: int = 2) -> None:
    replayed = [decision_key(d) for d in replay(events, make_planner(policy, num_nodes=num_nodes))]
    assert replayed == recorded_decision_keys(events)


def state(ports: Ports, task_id: str) -> tuple[str, int | None, str]:
    write = ports.states[task_id]
    return write.status, write.node_id, write.reason


# ------------------------------------------------------------------ dispatch faults


async def test_a_dispatch_raising_anything_is_placed_again_not_lost() -> None:
    core, ports, events = make_core()
    ports.crash["a"] = 1  # e.g. a pool error inside the dispatcher
    await core.on_task(make_request("a"))
    assert ports.dispatched == [("a", 1)]  # rolled back on 0, placed again: 1 (round robin)
    assert core.node_of("a") == 1 and state(ports, "a") == ("placed", 1, "")
    assert core.down_nodes == set()  # not the node's fault
    assert_replays(events)


async def test_a_task_that_keeps_failing_ends_with_the_reason_after_the_move_cap() -> None:
    core, ports, _ = make_core(max_task_moves=2)
    ports.crash["a"] = 100
    await core.on_task(make_request("a"))
    status, _, reason = state(ports, "a")
    assert status == "failed" and reason.startswith("UNAVAILABLE: dispatching to node")
    assert "RuntimeError: redis.exceptions.ConnectionError: pool exhausted" in reason
    assert "gave up after placing it 3 times" in reason
    assert not core.knows("a") and core.node_of("a") is None


async def test_an_executor_refusal_ends_only_that_task_and_the_node_stays_up() -> None:
    core, ports, events = make_core(num_nodes=1)
    ports.refuse["bad"] = TaskRefused("INVALID_ARGUMENT", "token id 99999 out of vocab")
    await core.on_tasks([make_request("bad"), make_request("good", seq=1)])
    assert state(ports, "bad") == (
        "rejected",
        None,
        "INVALID_ARGUMENT: token id 99999 out of vocab",
    )
    assert state(ports, "good") == ("placed", 0, "")
    assert core.down_nodes == set() and core.num_refused == 1
    await core.on_task(make_request("next", seq=2))
    assert ("next", 0) in ports.dispatched
    assert_replays(events, num_nodes=1)


async def test_executor_validation_failures_never_take_a_node_out_of_rotation() -> None:
    # Issue 11: two bad requests on a 2-node stack (one per node, round robin)
    # used to make the next valid one fail with 503.
    core, ports, events = make_core(num_nodes=2)
    ports.rpc_error["vocab"] = (
        grpc.StatusCode.INVALID_ARGUMENT,
        "task 'vocab': token id out of the model's vocabulary of 32000",
    )
    ports.rpc_error["long"] = (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "task 'long': prompt + max_tokens exceed the model's 2048 positions",
    )
    await core.on_task(make_request("vocab"))
    await core.on_task(make_request("long", seq=1))
    assert state(ports, "vocab") == (
        "rejected",
        None,
        "INVALID_ARGUMENT: node 0 refused the task: "
        "task 'vocab': token id out of the model's vocabulary of 32000",
    )
    status, _, reason = state(ports, "long")
    assert status == "rejected" and reason.startswith("RESOURCE_EXHAUSTED: node 1 refused")
    # The client gets the executor's status (HTTP 400 / 429), not UNAVAILABLE.
    assert status_for_reason(state(ports, "vocab")[2])[0] is grpc.StatusCode.INVALID_ARGUMENT
    assert status_for_reason(reason)[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert core.down_nodes == set() and core.dispatch_failed_s == {}
    assert core.num_refused == 2 and core.num_dispatch_failures == 0

    for i in range(4):  # valid requests run, on every node
        await core.on_task(make_request(f"ok{i}", seq=2 + i))
        assert state(ports, f"ok{i}")[0] == "placed"
    assert {node for task_id, node in ports.dispatched if task_id.startswith("ok")} == {0, 1}
    assert_replays(events, num_nodes=2)


@pytest.mark.parametrize(
    ("code", "is_refusal"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, True),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, True),
        (grpc.StatusCode.FAILED_PRECONDITION, True),
        (grpc.StatusCode.INTERNAL, True),
        (grpc.StatusCode.UNAVAILABLE, False),
        (grpc.StatusCode.DEADLINE_EXCEEDED, False),
    ],
)
def test_dispatch_status_is_a_task_refusal_or_a_node_fault(
    code: grpc.StatusCode, is_refusal: bool
) -> None:
    empty = grpc.aio.Metadata()
    error = dispatch_error(3, grpc.aio.AioRpcError(code, empty, empty, details="why"))
    assert isinstance(error, TaskRefused) is is_refusal
    if is_refusal:
        assert isinstance(error, TaskRefused)
        assert error.reason == f"{code.name}: node 3 refused the task: why"


async def test_a_failed_state_write_keeps_the_placement_and_is_retried() -> None:
    core, ports, _ = make_core()
    ports.num_write_failures = 1
    await core.on_task(make_training("t", 0.0, 50))
    assert ports.dispatched == [("t", 0)] and core.node_of("t") == 0  # it stands
    assert "t" not in ports.states and core.num_unwritten == 1
    await core.retry_writes()
    assert state(ports, "t") == ("placed", 0, "") and core.num_unwritten == 0
    assert ports.dispatched == [("t", 0)]  # never dispatched twice


async def test_dispatches_are_bounded_and_every_placement_resolves() -> None:
    core, ports, events = make_core(max_concurrent_dispatches=4)
    ports.down = {1}  # half of them fail over to node 0
    tasks = [make_training(f"t{i}", 0.0, 20, seq=i) for i in range(200)]
    await core.on_tasks(tasks)
    assert 1 <= ports.max_in_flight <= 4
    for task in tasks:  # by id: placed on the live node, stored as placed
        assert core.node_of(task.task_id) == 0, task.task_id
        assert state(ports, task.task_id) == ("placed", 0, ""), task.task_id
    assert sorted(t for t, _ in ports.dispatched) == sorted(t.task_id for t in tasks)
    assert_replays(events)


def test_core_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_concurrent_dispatches"):
        make_core(max_concurrent_dispatches=0)
    with pytest.raises(ValueError, match="max_task_moves"):
        make_core(max_task_moves=-1)


# ------------------------------------------------------------------ dead nodes


async def _four_tasks_on_node_0(core: SchedulerCore, ports: Ports) -> None:
    await core.mark_down([1])
    await core.on_node_health(0, True)
    await core.on_tasks(
        [
            make_training("t", 0.0, 50),
            make_request("fresh", seq=1),
            make_request("streaming", seq=2),
            make_request("done", seq=3),
        ]
    )
    assert {core.node_of(t) for t in ("t", "fresh", "streaming", "done")} == {0}
    await core.on_node_health(1, True)
    ports.progress_of["streaming"] = TaskProgress(is_final=False, status="", has_output=True)
    ports.progress_of["done"] = TaskProgress(is_final=True, status="completed", has_output=True)


async def test_a_dead_node_s_tasks_are_requeued_failed_or_released_by_progress() -> None:
    core, ports, events = make_core()
    await _four_tasks_on_node_0(core, ports)
    await core.on_node_down(0)
    assert core.down_nodes == {0}
    # Training and not-started inference: on node 1 now, stored as placed there.
    assert core.node_of("t") == 1 and state(ports, "t") == ("placed", 1, "")
    assert core.node_of("fresh") == 1 and state(ports, "fresh") == ("placed", 1, "")
    # Mid-stream inference: failed with a reason the client can act on.
    status, _, reason = state(ports, "streaming")
    assert status == "failed" and not core.knows("streaming")
    assert reason == "UNAVAILABLE: executor of node 0 went down while streaming; retry"
    # Already finished there: only released (its result stands).
    assert not core.knows("done") and state(ports, "done") == ("placed", 0, "")
    assert list(core.revoked[0]) == ["t", "fresh", "streaming"]
    # The old node's late reports are stale; node 1's are not.
    assert not await core.on_finished("t", is_success=True, node_id=0)
    assert await core.on_finished("t", is_success=True, node_id=1)
    assert_replays(events)


async def test_evacuation_waits_for_redis_and_is_retried() -> None:
    core, ports, _ = make_core()
    await _four_tasks_on_node_0(core, ports)
    ports.num_progress_failures = 1
    await core.on_node_down(0)
    assert core.down_nodes == {0} and core.node_of("t") == 0  # down, tasks not moved yet
    await core.on_node_down(0)  # the next poll
    assert core.node_of("t") == 1 and core.node_of("fresh") == 1


async def test_a_node_that_keeps_dying_does_not_move_a_task_forever() -> None:
    core, ports, _ = make_core(max_task_moves=1)
    await core.on_task(make_training("t", 0.0, 50))
    first = core.node_of("t")
    assert first is not None
    await core.on_node_down(first)
    second = core.node_of("t")
    assert second is not None and second != first
    await core.on_node_health(first, True)
    await core.on_node_down(second)
    status, _, reason = state(ports, "t")
    assert status == "failed" and reason.startswith(f"UNAVAILABLE: executor of node {second}")
    assert "gave up after placing it 2 times" in reason and not core.knows("t")


async def test_unconfirmed_placements_after_a_restart_are_requeued_and_revoked() -> None:
    core, ports, events = make_core()
    await core.on_task(make_training("t", 0.0, 50))
    assert core.node_of("t") == 0
    assert core.requeue_unconfirmed(["t", "unknown"]) == ["t"]
    assert core.node_of("t") is None and list(core.revoked[0]) == ["t"]
    await core.on_timer()
    assert core.node_of("t") is not None and ports.dispatched[-1][0] == "t"
    assert_replays(events)


async def test_a_failing_node_is_tried_once_per_wave_not_once_per_task() -> None:
    core, ports, _ = make_core(max_concurrent_dispatches=2)
    await core.mark_down([1])
    await core.on_node_health(0, True)
    await core.on_node_health(1, True)
    attempts: list[int] = []
    dispatch = ports.dispatch

    async def counting(placement: Placement, task: Task) -> None:
        attempts.append(placement.node_id)
        await dispatch(placement, task)

    ports.dispatch = counting  # type: ignore[method-assign]
    ports.down = {0}
    await core.on_tasks([make_training(f"t{i}", 0.0, 20, seq=i) for i in range(40)])
    assert attempts.count(0) <= 2  # the first wave; the rest skip it
    assert all(core.node_of(f"t{i}") == 1 for i in range(40))
