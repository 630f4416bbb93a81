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
from collections.abc import Callable
from typing import Protocol

import structlog

from lemix.planner.recording import RecordingPlanner
from lemix.types import Decision, Deferral, Placement, Rejection, Task, WeightSync

log = structlog.get_logger(__name__)


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
    def __init__(self, planner: RecordingPlanner, dispatcher: Dispatcher, writer: ResultWriter,
                 clock: Callable[[], float]) -> None:
        self.planner = planner
        self.dispatcher = dispatcher
        self.writer = writer
        self.clock = clock
        self._lock = asyncio.Lock()
        self._tasks: dict[str, Task] = {}  # placed or deferred, not finished
        self.num_placed = 0
        self.num_rejected = 0
        self.num_dispatch_failures = 0
        self.wakeup = asyncio.Event()  # set when the next timer may have changed

    def knows(self, task_id: str) -> bool:
        return task_id in self._tasks

    async def on_task(self, task: Task) -> None:
        """A new task from the intake (idempotent: a redelivered id is ignored)."""
        async with self._lock:
            if task.task_id in self._tasks:
                return
            self._tasks[task.task_id] = task
            now_s = self.clock()
            self.planner.submit(task, now_s)
            await self._apply(self.planner.plan(now_s))

    async def on_finished(self, task_id: str, is_success: bool, is_requeue: bool = False) -> None:
        """An executor finished (or gave back) a task."""
        async with self._lock:
            now_s = self.clock()
            task = self._tasks.get(task_id)
            decisions = self.planner.on_task_finished(task_id, now_s, is_success)
            if is_requeue and task is not None:
                self.planner.submit(task, now_s)  # training goes back, never lost
            else:
                self._tasks.pop(task_id, None)
            decisions += self.planner.plan(now_s)
            await self._apply(decisions)

    async def on_node_health(self, node_id: int, is_healthy: bool) -> None:
        async with self._lock:
            now_s = self.clock()
            self.planner.on_node_health(node_id, is_healthy, now_s)
            await self._apply(self.planner.plan(now_s))

    async def on_timer(self) -> None:
        async with self._lock:
            await self._apply(self.planner.plan(self.clock()))

    def next_wakeup_s(self) -> float | None:
        return self.planner.planner.next_wakeup_s()

    async def _apply(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            if isinstance(decision, Placement):
                await self._dispatch(decision)
            elif isinstance(decision, Rejection):
                self.num_rejected += 1
                self._tasks.pop(decision.task_id, None)
                await self.writer.end_task(decision.task_id, "rejected", decision.reason)
            elif isinstance(decision, WeightSync):
                try:
                    await self.dispatcher.sync_weights(decision)
                except DispatchError as exc:
                    log.warning("weight_sync_failed", error=str(exc))
            elif isinstance(decision, Deferral):
                log.debug("deferred", task_id=decision.task_id)
        self.wakeup.set()

    async def _dispatch(self, placement: Placement) -> None:
        task = self._tasks[placement.task_id]
        try:
            await self.dispatcher.dispatch(placement, task)
        except DispatchError as exc:
            # The node is gone: the task fails with a reason the client sees
            # (UNAVAILABLE), the planner forgets it and stops using the node.
            self.num_dispatch_failures += 1
            now_s = self.clock()
            self.planner.on_task_finished(placement.task_id, now_s, is_success=False)
            self.planner.on_node_health(placement.node_id, False, now_s)
            if task.is_training:
                self.planner.submit(task, now_s)  # to another node at the next plan
                return
            self._tasks.pop(placement.task_id, None)
            await self.writer.end_task(placement.task_id, "failed",
                                       f"UNAVAILABLE: executor of node {placement.node_id} "
                                       f"did not take the task ({exc})")
            return
        self.num_placed += 1
        await self.writer.mark_placed(placement.task_id, placement.node_id)
