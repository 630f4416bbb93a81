"""SchedulerCore sequencing, with in-memory ports (Redis and gRPC are tested elsewhere)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from factories import make_planner, make_request, make_training

from lemix.planner.recording import RecordingPlanner, decision_key, recorded_decision_keys, replay
from lemix.types import Placement, Task, WeightSync
from services.scheduler.core import DispatchError, SchedulerCore, StateWrite, TaskProgress


class Ports:
    def __init__(self, down: set[int] | None = None) -> None:
        self.dispatched: list[tuple[str, int]] = []
        self.ended: dict[str, tuple[str, str]] = {}
        self.states: dict[str, StateWrite] = {}
        self.syncs: list[WeightSync] = []
        self.down = down or set()
        self.is_placement_recorded = False  # what the executors' replies say

    async def dispatch(self, placement: Placement, task: Task) -> bool:
        if placement.node_id in self.down:
            raise DispatchError("connection refused")
        self.dispatched.append((task.task_id, placement.node_id))
        return self.is_placement_recorded

    async def sync_weights(self, sync: WeightSync) -> None:
        self.syncs.append(sync)

    async def write_states(self, writes: Sequence[StateWrite]) -> None:
        for write in writes:
            self.states[write.task_id] = write
            if write.is_final:
                self.ended[write.task_id] = (write.status, write.reason)

    async def progress(self, task_ids: Sequence[str]) -> list[TaskProgress]:
        return [TaskProgress(is_final=False, status="", has_output=False) for _ in task_ids]


def make_core(policy: str = "mix-rr", down: set[int] | None = None, **kw: object):
    events: list[dict] = []
    ports = Ports(down)
    clock = iter(float(i) for i in range(10_000))
    core = SchedulerCore(
        RecordingPlanner(make_planner(policy, num_nodes=2, **kw), events.append),
        ports,
        ports,
        lambda: next(clock),
    )
    return core, ports, events


async def test_redelivered_task_is_placed_once() -> None:
    core, ports, _ = make_core()
    await core.on_task(make_request("a"))
    await core.on_task(make_request("a"))
    assert ports.dispatched == [("a", 0)]


async def test_unreachable_executor_moves_the_task_to_another_node() -> None:
    core, ports, _ = make_core(down={0})
    await core.on_task(make_request("a"))  # round-robin picks node 0, which is down
    assert ports.dispatched == [("a", 1)] and "a" not in ports.ended  # not started: moved
    assert ports.states["a"] == StateWrite("a", "placed", node_id=1)
    assert core.down_nodes == {0}
    await core.on_task(make_training("t", 0.0, 50))  # node 0 is now known down
    assert ("t", 1) in ports.dispatched
    await core.on_task(make_request("b"))
    assert ("b", 1) in ports.dispatched


async def test_the_placed_state_is_written_only_for_executors_that_do_not_record_it() -> None:
    core, ports, _ = make_core()
    await core.on_task(make_request("older"))  # an executor that does not record it
    assert ports.states["older"] == StateWrite("older", "placed", node_id=0)
    ports.is_placement_recorded = True
    await core.on_task(make_request("newer"))
    assert ports.dispatched[-1] == ("newer", 1) and "newer" not in ports.states
    assert core.num_unwritten == 0


async def test_training_given_back_is_placed_again_not_lost() -> None:
    core, ports, _ = make_core()
    await core.on_task(make_training("t", 0.0, 50))
    await core.on_finished("t", is_success=False, is_requeue=True)
    assert [d for d in ports.dispatched if d[0] == "t"] == [("t", 0), ("t", 1)]
    assert "t" not in ports.ended


async def test_separate_weight_sync_goes_to_the_dispatcher() -> None:
    core, ports, _ = make_core("separate", sync_every_tasks=1, train_rate=0.5)
    await core.on_task(make_training("t", 0.0, 50))
    await core.on_finished("t", is_success=True)
    assert len(ports.syncs) == 1 and ports.syncs[0].target_node_ids == (0,)


async def test_event_log_replays_to_the_same_decisions() -> None:
    core, ports, events = make_core("lemix")
    for i in range(6):
        await core.on_task(make_request(f"r{i}", 0.0, 30 + 40 * i, 8, seq=i))
    await core.on_finished("r1", is_success=True)
    await core.on_task(make_training("t", 0.0, 60, seq=9))
    replayed = [decision_key(d) for d in replay(events, make_planner("lemix", num_nodes=2))]
    assert replayed == recorded_decision_keys(events)


async def test_an_intake_batch_is_planned_once_and_dispatched_together() -> None:
    core, ports, events = make_core()
    batch = [make_request(f"b{i}", 0.0, seq=i) for i in range(4)]
    await core.on_tasks(batch + [make_request("b0")])  # a redelivered id inside the batch
    assert sorted(ports.dispatched) == [("b0", 0), ("b1", 1), ("b2", 0), ("b3", 1)]
    assert sum(1 for e in events if e.get("input") == "plan") == 1
    await core.on_tasks([make_request("b1")])  # known: nothing new, no plan
    assert sum(1 for e in events if e.get("input") == "plan") == 1


async def test_a_placement_records_how_long_the_task_queued() -> None:
    from prometheus_client import REGISTRY

    def observed() -> tuple[float, float]:
        labels = {"kind": "inference"}
        count = REGISTRY.get_sample_value("lemix_scheduler_queue_seconds_count", labels) or 0.0
        total = REGISTRY.get_sample_value("lemix_scheduler_queue_seconds_sum", labels) or 0.0
        return count, total

    count_before, sum_before = observed()
    ports = Ports()
    planner = RecordingPlanner(make_planner("mix-rr", num_nodes=2), lambda event: None)
    core = SchedulerCore(planner, ports, ports, lambda: 5.0)  # the clock reads 5 s
    await core.on_task(make_request("q", 2.0))  # taken in at 2 s
    assert ports.dispatched == [("q", 0)]
    count, total = observed()
    assert count == count_before + 1
    assert total - sum_before == 3.0


async def test_a_task_cancelled_before_the_core_took_it_is_ended_not_planned() -> None:
    # A Cancel can land after the intake read the task's entry (before its
    # cancel marker was written) and before the batch reaches the core.
    core, ports, _ = make_core()
    core.cancel_on_take("a", "CANCELLED: client went away")
    await core.on_tasks([make_request("a"), make_request("b")])
    assert ports.dispatched == [("b", 0)]
    assert ports.ended["a"] == ("failed", "CANCELLED: client went away")
    assert not core.knows("a")
    # Alone in its batch: ended (and written) as well.
    core.cancel_on_take("c", "CANCELLED: by the client")
    await core.on_tasks([make_request("c")])
    assert ports.ended["c"] == ("failed", "CANCELLED: by the client")
    # A task the core holds already is cancelled on its node, not here.
    core.cancel_on_take("b", "CANCELLED: late")
    await core.on_tasks([make_request("b")])
    assert "b" not in ports.ended and ports.dispatched == [("b", 0)]


@pytest.mark.parametrize("max_runs", [1, 10**9])
async def test_training_past_a_plans_cap_lets_a_waiting_request_go_first(max_runs: int) -> None:
    """A plan that stops at its training cap (`Planner.is_release_pending`)
    is followed by another once the core's lock has served what waited for
    it: a request submitted meanwhile is placed before the rest of the burst.
    Without a cap (10**9 runs) the burst goes out first, in one plan."""
    core, ports, _ = make_core("lemix", max_training_runs_per_plan=max_runs)
    burst = [make_training(f"t{i}", 0.0, 20, seq=i) for i in range(6)]
    flood = asyncio.ensure_future(core.on_tasks(burst))
    request = asyncio.ensure_future(core.on_task(make_request("r")))
    await asyncio.gather(flood, request)
    order = [task_id for task_id, _ in ports.dispatched]
    assert sorted(order) == sorted(["r", *(t.task_id for t in burst)])  # all of it placed
    if max_runs == 1:
        assert order.index("r") < len(burst)
    else:
        assert order.index("r") == len(burst)
