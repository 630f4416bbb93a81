"""The scheduler's loop logic, apart from Redis and gRPC plumbing.

`SchedulerCore` turns inputs (a task from the intake, a completion from an
executor, a node going up or down, a timer) into planner calls and applies the
planner's decisions through two narrow ports: a `Dispatcher` (gRPC to the
executors) and a `ResultWriter` (Redis: final states for rejected tasks, the
event log). All scheduling logic lives in the planner; this module only
sequences it, one input at a time under a lock, so the recorded event log is
exactly what the planner saw.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

import structlog

from lemix import telemetry
from lemix.planner.recording import RecordingPlanner
from lemix.types import Decision, Deferral, Placement, Rejection, Task, WeightSync

log = structlog.get_logger(__name__)


# Status names a failure reason may start with (services/PROTOCOL.md).
STATUS_PREFIXES = ("INVALID_ARGUMENT:", "RESOURCE_EXHAUSTED:", "UNAVAILABLE:", "CANCELLED:",
                   "DEADLINE_EXCEEDED:")


def rejection_reason(reason: str) -> str:
    """A planner rejection's reason as the client sees it, status name first.

    The planner rejects for two causes: no live node (already "UNAVAILABLE:
    ...") and "can never fit", which the protocol names RESOURCE_EXHAUSTED; a
    reason without a prefix would otherwise reach the client as INTERNAL.
    """
    if reason.startswith(STATUS_PREFIXES):
        return reason
    return f"RESOURCE_EXHAUSTED: {reason}"


class DispatchError(Exception):
    """An executor could not take a placed task (unreachable, or it refused)."""


class Dispatcher(Protocol):
    async def dispatch(self, placement: Placement, task: Task) -> None:
        """Hand `task` to its node's executor; raise DispatchError on failure."""
        ...

    async def sync_weights(self, sync: WeightSync) -> None: ...


class ResultWriter(Protocol):
    async def end_task(self, task_id: str, status: str, reason: str) -> None:
        """Write a task's final state (and its client's final message)."""
        ...

    async def mark_placed(self, task_id: str, node_id: int) -> None: ...


class SchedulerCore:
    """Sequences planner inputs and applies decisions through the ports.

    `on_forget(task_id)` is called whenever a task leaves the core (finished,
    rejected, failed to dispatch, cancelled), so the service can drop what it
    keeps beside the task (its payload). `is_cancelled(task_id)` is asked
    before a deferred training task is dispatched: one cancelled while it
    waited is dropped instead (its end message was written by the canceller).
    `policy` labels the Prometheus counters (`lemix.telemetry`).
    """

    def __init__(self, planner: RecordingPlanner, dispatcher: Dispatcher, writer: ResultWriter,
                 clock: Callable[[], float], *,
                 on_forget: Callable[[str], None] | None = None,
                 is_cancelled: Callable[[str], Awaitable[bool]] | None = None,
                 policy: str = "") -> None:
        self.planner = planner
        self.policy = policy
        self.dispatcher = dispatcher
        self.writer = writer
        self.clock = clock
        self._lock = asyncio.Lock()
        self._tasks: dict[str, Task] = {}  # placed or deferred, not finished
        self.num_placed = 0
        self.num_rejected = 0
        self.num_dispatch_failures = 0
        # Nodes the planner has down, and when (planner time) a failed dispatch
        # took one down: the service re-admits it only after a pause.
        self.down_nodes: set[int] = set()
        self.dispatch_failed_s: dict[int, float] = {}
        self.wakeup = asyncio.Event()  # set when the next timer may have changed
        self._on_forget = on_forget
        self._is_cancelled = is_cancelled

    def knows(self, task_id: str) -> bool:
        return task_id in self._tasks

    def node_of(self, task_id: str) -> int | None:
        """The node a task is placed on, or None (queued, deferred or unknown)."""
        return self.planner.planner.node_of(task_id)

    @property
    def num_tasks(self) -> int:
        return len(self._tasks)

    def restore(self, tasks: Iterable[Task], num_placed: int = 0, num_rejected: int = 0) -> None:
        """After a restart: the tasks the replayed planner still holds, and counters."""
        self._tasks = {task.task_id: task for task in tasks}
        self.num_placed = num_placed
        self.num_rejected = num_rejected

    def _forget(self, task_id: str) -> None:
        if self._tasks.pop(task_id, None) is not None and self._on_forget is not None:
            self._on_forget(task_id)

    async def on_task(self, task: Task) -> None:
        """A new task from the intake (idempotent: a redelivered id is ignored)."""
        async with self._lock:
            if task.task_id in self._tasks:
                return
            self._tasks[task.task_id] = task
            now_s = self.clock()
            self.planner.submit(task, now_s)
            await self._apply(self._plan(now_s))

    async def on_tasks(self, tasks: Iterable[Task]) -> None:
        """An intake batch: submit every new task, plan once, dispatch in parallel."""
        async with self._lock:
            now_s = self.clock()
            is_new = False
            for task in tasks:
                if task.task_id in self._tasks:
                    continue  # redelivered; the planner has it
                self._tasks[task.task_id] = task
                self.planner.submit(task, now_s)
                is_new = True
            if is_new:
                await self._apply(self._plan(now_s))

    async def on_finished(self, task_id: str, is_success: bool, is_requeue: bool = False,
                          node_id: int | None = None) -> bool:
        """An executor finished (or gave back) a task; False if ignored as stale.

        With `node_id` (the reporting node) a report for a task not placed on
        that node is stale (a redelivered completion, or one for a placement
        the scheduler already gave up on) and changes nothing.
        """
        async with self._lock:
            if node_id is not None and self.node_of(task_id) != node_id:
                log.debug("stale_completion", task_id=task_id, node_id=node_id)
                return False
            now_s = self.clock()
            task = self._tasks.get(task_id)
            decisions = self.planner.on_task_finished(task_id, now_s, is_success)
            if is_requeue and task is not None:
                self.planner.submit(task, now_s)  # training goes back, never lost
            else:
                self._forget(task_id)
            decisions += self._plan(now_s)
            await self._apply(decisions)
            return True

    async def on_node_health(self, node_id: int, is_healthy: bool) -> None:
        async with self._lock:
            now_s = self.clock()
            self._set_health(node_id, is_healthy, now_s)
            await self._apply(self._plan(now_s))

    def _set_health(self, node_id: int, is_healthy: bool, now_s: float) -> None:
        self.planner.on_node_health(node_id, is_healthy, now_s)
        telemetry.set_node_health(node_id, is_healthy)
        if is_healthy:
            self.down_nodes.discard(node_id)
            self.dispatch_failed_s.pop(node_id, None)
        else:
            self.down_nodes.add(node_id)

    async def mark_down(self, node_ids: Iterable[int]) -> None:
        """Record nodes as down without planning (at start: every node is down
        until its first heartbeat, and planning then would reject deferred
        training that only waits for that heartbeat)."""
        async with self._lock:
            now_s = self.clock()
            for node_id in node_ids:
                self._set_health(node_id, False, now_s)

    async def on_timer(self) -> None:
        async with self._lock:
            await self._apply(self._plan(self.clock()))

    def next_wakeup_s(self) -> float | None:
        return self.planner.planner.next_wakeup_s()

    def _plan(self, now_s: float) -> list[Decision]:
        """The planner's decisions now; its wall time is the decision latency."""
        start_s = time.perf_counter()
        decisions = self.planner.plan(now_s)
        telemetry.observe_decision(time.perf_counter() - start_s)
        return decisions

    async def _apply(self, decisions: list[Decision]) -> None:
        placements: list[Placement] = []
        for decision in decisions:
            if isinstance(decision, Placement):
                placements.append(decision)
            elif isinstance(decision, Rejection):
                self.num_rejected += 1
                rejected = self._tasks.get(decision.task_id)
                telemetry.observe_rejected(self.policy, rejected.kind.value if rejected else "")
                self._forget(decision.task_id)
                await self.writer.end_task(decision.task_id, "rejected",
                                           rejection_reason(decision.reason))
            elif isinstance(decision, WeightSync):
                try:
                    await self.dispatcher.sync_weights(decision)
                except DispatchError as exc:
                    log.warning("weight_sync_failed", error=str(exc))
            elif isinstance(decision, Deferral):
                log.debug("deferred", task_id=decision.task_id)
        # Dispatch RPCs go out together (each has its deadline); a failure's
        # planner inputs are still recorded in the order they happen.
        if len(placements) == 1:
            await self._dispatch(placements[0])
        elif placements:
            await asyncio.gather(*(self._dispatch(p) for p in placements))
        self.wakeup.set()

    async def _dispatch(self, placement: Placement) -> None:
        task = self._tasks[placement.task_id]
        # Only training waits in the planner long enough to be cancelled
        # before placement; inference is checked at intake, just before.
        if (task.is_training and self._is_cancelled is not None
                and await self._is_cancelled(task.task_id)):
            self.planner.on_task_finished(task.task_id, self.clock(), is_success=False)
            self._forget(task.task_id)
            return
        try:
            await self.dispatcher.dispatch(placement, task)
        except DispatchError as exc:
            # The node is gone: the task fails with a reason the client sees
            # (UNAVAILABLE), the planner forgets it and stops using the node.
            self.num_dispatch_failures += 1
            telemetry.observe_dispatch_failure(placement.node_id)
            now_s = self.clock()
            self.planner.on_task_finished(placement.task_id, now_s, is_success=False)
            self._set_health(placement.node_id, False, now_s)
            self.dispatch_failed_s[placement.node_id] = now_s
            if task.is_training:
                self.planner.submit(task, now_s)  # to another node at the next plan
                return
            self._forget(placement.task_id)
            await self.writer.end_task(placement.task_id, "failed",
                                       f"UNAVAILABLE: executor of node {placement.node_id} "
                                       f"did not take the task ({exc})")
            return
        self.num_placed += 1
        telemetry.observe_placed(self.policy, task.kind.value)
        await self.writer.mark_placed(placement.task_id, placement.node_id)
