"""The scheduler's loop logic, apart from Redis and gRPC plumbing.

`SchedulerCore` turns inputs (a task from the intake, a completion from an
executor, a node going up or down, a timer) into planner calls and applies the
planner's decisions through two narrow ports: a `Dispatcher` (gRPC to the
executors) and a `ResultWriter` (Redis: task states, progress lookups). All
scheduling logic lives in the planner; this module only sequences it, one
input at a time under a lock, so the recorded event log is exactly what the
planner saw. The Dispatch calls a plan yields are sent after the lock is
released and their results settled under it again (`_carry_out`), so no
executor round trip holds up other inputs.

No ghost placements (issue 12): every `Placement` ends resolved, whatever
fails. The executor took the task -> it stands (its "placed" state write is
retried until stored). The executor refused THIS task (`TaskRefused`) -> the
task ends with the executor's reason; the node stays up. The node failed
(`DispatchError`) or anything else went wrong -> the placement is rolled back
in the planner (`on_task_finished(fail)`) and the task is submitted again, to
be placed elsewhere, at most `max_task_moves` times; then it fails with the
reason. Every rollback and re-submit is a recorded planner input, so a replay
of the event log reproduces it.

Dead nodes: `on_node_down` takes every task the planner has on the node away
from it (`_evacuate`): one round trip tells which produced output; training
and inference with no output yet are re-queued, inference mid-stream fails
("UNAVAILABLE: ..."), finished ones are only released. Their ids are kept in
`revoked` so the service cancels them on the node before it gets work again.

Fencing (docs/protocol.md, "Fencing"): every placement gets an attempt
number, counted in the task hash (a task's first at intake, passed to
`on_tasks`; later ones by `AttemptLedger.begin_attempts`, one round trip per
batch, before any Dispatch of it) and sent with the Dispatch; the
executor's writes land only while it is current. A task taken away from a
node is fenced at once (`_evacuate`, `_place`) and again before the node is
told to Cancel it (`fence_revoked`), so neither a resumed executor's tokens
nor its "CANCELLED" end can reach a task that moved. Completions of an
attempt that is not the current one are stale. If the attempts cannot be
counted (Redis), the batch is not dispatched: its placements are rolled back
and planned again at the next `retry_writes`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from lemix.infra.store.task_hash import StoredStatus
from lemix.types import Decision, Task
from services.scheduler.core_base import (
    DEFAULT_MAX_CONCURRENT_DISPATCHES,
    DEFAULT_MAX_TASK_MOVES,
)
from services.scheduler.placing import Placing, Sending
from services.scheduler.ports import (
    AttemptLedger,
    Dispatcher,
    DispatchError,
    ResultWriter,
    StateWrite,
    TaskProgress,
    TaskRefused,
    rejection_reason,
)

# The ports' names are re-exported: callers import them from here too.
__all__ = [
    "DEFAULT_MAX_CONCURRENT_DISPATCHES",
    "DEFAULT_MAX_TASK_MOVES",
    "AttemptLedger",
    "DispatchError",
    "Dispatcher",
    "FinishReport",
    "ResultWriter",
    "SchedulerCore",
    "StateWrite",
    "TaskProgress",
    "TaskRefused",
    "rejection_reason",
]

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class FinishReport:
    """An executor's report that a task ended (or, `is_requeue`, was given back)."""

    task_id: str
    is_success: bool
    is_requeue: bool = False
    node_id: int | None = None  # the reporting node (None: not checked)
    attempt: int | None = None  # the placement it ran (0/None: not checked)


class SchedulerCore(Placing):
    """Sequences planner inputs and applies decisions through the ports.

    `on_forget(task_id)` is called whenever a task leaves the core (finished,
    rejected, failed, cancelled), so the service can drop what it keeps beside
    the task (its payload). `ledger` numbers and fences placements (module
    docstring; None: no fencing, every attempt 0); its one round trip before
    a batch's Dispatches also asks which training was cancelled while it
    waited: that is dropped instead (its end was written by the canceller).
    `policy` labels the Prometheus counters (`lemix.infra.telemetry`).
    At most `max_concurrent_dispatches` Dispatch calls are in flight at once.
    """

    # ------------------------------------------------------------ restart

    def restore(self, tasks: Iterable[Task], num_placed: int = 0, num_rejected: int = 0) -> None:
        """After a restart: the tasks the replayed planner still holds, and counters."""
        self._tasks = {task.task_id: task for task in tasks}
        self.num_placed = num_placed
        self.num_rejected = num_rejected

    def restore_attempts(self, attempts: Mapping[str, int]) -> None:
        """After a restart: each held task's attempt, as its hash has it."""
        self._attempts.update((t, a) for t, a in attempts.items() if t in self._tasks and a > 0)

    def requeue_unconfirmed(self, task_ids: Iterable[str]) -> list[str]:
        """After a restart: placements the log has but no executor confirmed.

        The predecessor died between Dispatch and the "placed" write: the node
        may or may not have the task. It is rolled back and submitted again
        (placed at the next plan) and revoked on its old node. No plan here:
        at start every node is down until its first heartbeat.
        """
        now_s = self.clock()
        moved = []
        for task_id in task_ids:
            node_id = self.node_of(task_id)
            task = self._tasks.get(task_id)
            if node_id is None or task is None:
                continue
            self.planner.on_task_finished(task_id, now_s, is_success=False)
            self._revoke(node_id, task_id)
            self.planner.submit(task, now_s)
            moved.append(task_id)
        return moved

    # ------------------------------------------------------------ inputs

    async def on_task(self, task: Task) -> None:
        """A new task from the intake (idempotent: a redelivered id is ignored)."""
        await self.on_tasks([task])

    async def on_tasks(
        self, tasks: Iterable[Task], attempts: Mapping[str, int] | None = None
    ) -> None:
        """An intake batch: submit every new task, plan once, dispatch in parallel.

        `attempts`: per task id, the number of its first placement, already in
        its hash (the intake's step numbered it): that placement needs no
        numbering round trip of its own.
        """
        async with self._lock:
            now_s = self.clock()
            is_new = is_ended = False
            for task in tasks:
                if task.task_id in self._tasks:
                    continue  # redelivered; the planner has it
                reason = self._cancel_on_take.pop(task.task_id, None)
                if reason is not None:  # cancelled after the intake read it
                    self._note(StateWrite(task.task_id, StoredStatus.FAILED, reason=reason))
                    is_ended = True
                    continue
                self._tasks[task.task_id] = task
                attempt = (attempts or {}).get(task.task_id, 0)
                if attempt > 0:
                    self._numbered[task.task_id] = attempt
                self.planner.submit(task, now_s)
                is_new = True
            if not is_new:
                if is_ended:
                    await self._flush_writes()
                return
            batch = await self._decide(self._plan(now_s))
        await self._carry_out(batch)

    async def on_finished(
        self,
        task_id: str,
        is_success: bool,
        is_requeue: bool = False,
        node_id: int | None = None,
        attempt: int | None = None,
    ) -> bool:
        """An executor finished (or gave back) a task; False if ignored as stale.

        With `node_id` (the reporting node) a report for a task not placed on
        that node is stale (a redelivered completion, or one from a node the
        task was taken away from) and changes nothing; so is one whose
        `attempt` (0/None: sent without one) is not the task's current one
        (the task moved away and back to that node).
        """
        [is_applied] = await self.on_finished_many(
            [FinishReport(task_id, is_success, is_requeue, node_id, attempt)]
        )
        return is_applied

    async def on_finished_many(self, reports: Sequence[FinishReport]) -> list[bool]:
        """`on_finished` for a batch of reports, in order, under one lock with
        ONE plan after them all (completions arrive in batches at rate: a plan
        and a round of writes per completion made this the scheduler's hot
        spot). Per report: False if ignored as stale. Every input, the plan
        included, is recorded, so a replay of the log reproduces it."""
        async with self._lock:
            now_s = self.clock()
            applied: list[bool] = []
            decisions: list[Decision] = []
            for report in reports:
                is_applied = self._is_current(report)
                applied.append(is_applied)
                if not is_applied:
                    continue
                task_id = report.task_id
                task = self._tasks.get(task_id)
                decisions += self.planner.on_task_finished(task_id, now_s, report.is_success)
                if report.is_requeue and task is not None:
                    self.planner.submit(task, now_s)  # training goes back, never lost
                    self._note(StateWrite(task_id, StoredStatus.QUEUED))
                else:
                    self._forget(task_id)
            if not any(applied):
                return applied
            decisions += self._plan_unless_batch_out(now_s)
            batch = await self._decide(decisions)
        await self._carry_out(batch)
        return applied

    def _is_current(self, report: FinishReport) -> bool:
        """Whether a report is about the task's current placement (module doc)."""
        task_id, node_id, attempt = report.task_id, report.node_id, report.attempt
        if node_id is not None and self.node_of(task_id) != node_id:
            log.debug("stale_completion", task_id=task_id, node_id=node_id)
            return False
        current = self._attempts.get(task_id)
        if attempt and current is not None and attempt != current:
            log.info(
                "stale_attempt_completion",
                task_id=task_id,
                node_id=node_id,
                attempt=attempt,
                current=current,
            )
            return False
        return True

    async def on_node_health(self, node_id: int, is_healthy: bool) -> None:
        """A node came up (it gets work) or went quiet (no new work; what it
        holds stays on it until `on_node_down`)."""
        async with self._lock:
            now_s = self.clock()
            self._set_health(node_id, is_healthy, now_s)
            batch = await self._decide(self._plan(now_s))
        await self._carry_out(batch)

    async def on_node_down(self, node_id: int, why: str = "went down") -> None:
        """The node is lost: no new work, and its tasks are taken away from it.

        If the progress lookup fails (Redis), the node is down but its tasks
        stay on it; the service calls again at its next poll.
        """
        async with self._lock:
            now_s = self.clock()
            if node_id not in self.down_nodes:
                self._set_health(node_id, False, now_s)
            await self._evacuate(node_id, why, now_s)
            batch = await self._decide(self._plan(self.clock()))
        await self._carry_out(batch)

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
            batch = await self._decide(self._plan(self.clock()))
        await self._carry_out(batch)

    async def retry_writes(self) -> None:
        """Store the state writes an earlier Redis error left behind, and plan
        again what an earlier Redis error kept from being dispatched."""
        if not (self._unwritten or self._is_replan_due):
            return
        await self._flush_writes()
        batch: list[Sending] = []
        if self._is_replan_due:
            async with self._lock:
                self._is_replan_due = False
                batch = await self._decide(self._plan(self.clock()))
        await self._carry_out(batch)

    async def fence_revoked(self, node_id: int) -> None:
        """Fence every attempt taken away from `node_id`, one round trip; call
        before cancelling them there, so their CANCELLED ends are not written
        over a task that moved. Raises when Redis does (nothing is cancelled)."""
        taken = list(self.revoked.get(node_id, {}).items())
        if taken and self._ledger is not None:
            await self._ledger.fence(taken)

    def clear_revoked(self, node_id: int, task_ids: Iterable[str]) -> None:
        """The service cancelled these on `node_id`."""
        held = self.revoked.get(node_id)
        if held is None:
            return
        for task_id in task_ids:
            held.pop(task_id, None)
        if not held:
            del self.revoked[node_id]

    async def _evacuate(self, node_id: int, why: str, now_s: float) -> None:
        """Take every task the planner has on `node_id` away from it (module doc)."""
        task_ids = self.tasks_by_node().get(node_id, [])
        if not task_ids:
            return
        try:
            # Fenced and read in one atomic step: what output exists now is all
            # the node's executor will ever write for these attempts.
            if self._ledger is not None:
                progress = await self._ledger.fence(
                    [(t, self._attempts.get(t, 0)) for t in task_ids]
                )
            else:
                progress = await self.writer.progress(task_ids)
        except Exception as exc:
            log.warning(
                "evacuation_deferred",
                node_id=node_id,
                num_tasks=len(task_ids),
                error=f"{type(exc).__name__}: {exc}",
            )
            return
        num_requeued = num_failed = 0
        for task_id, state in zip(task_ids, progress, strict=True):
            task = self._tasks[task_id]
            if state.is_final:  # it ended; its completion is not applied yet
                self.planner.on_task_finished(
                    task_id, now_s, state.status == StoredStatus.COMPLETED
                )
                self._forget(task_id)
                continue
            self._revoke(node_id, task_id)
            self.planner.on_task_finished(task_id, now_s, is_success=False)
            if not task.is_training and state.has_output:
                num_failed += 1
                self._end(
                    task_id,
                    StoredStatus.FAILED,
                    f"UNAVAILABLE: executor of node {node_id} {why} while streaming; retry",
                )
            elif self._move(task, now_s, f"UNAVAILABLE: executor of node {node_id} {why}"):
                num_requeued += 1
        log.info(
            "node_evacuated",
            node_id=node_id,
            why=why,
            num_tasks=len(task_ids),
            num_requeued=num_requeued,
            num_failed=num_failed,
        )
