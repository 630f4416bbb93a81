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
number, counted in the task hash (`AttemptLedger.begin_attempts`, one round
trip per batch, before any Dispatch of it) and sent with the Dispatch; the
executor's writes land only while it is current. A task taken away from a
node is fenced at once (`_evacuate`, `_place`) and again before the node is
told to Cancel it (`fence_revoked`), so neither a resumed executor's tokens
nor its "CANCELLED" end can reach a task that moved. Completions of an
attempt that is not the current one are stale. If the attempts cannot be
counted (Redis), the batch is not dispatched: its placements are rolled back
and planned again at the next `retry_writes`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from lemix.infra import telemetry
from lemix.infra.store.task_hash import StoredStatus
from lemix.planner.recording import RecordingPlanner
from lemix.types import Decision, Deferral, Placement, Rejection, Task, WeightSync
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


DEFAULT_MAX_CONCURRENT_DISPATCHES = 32
DEFAULT_MAX_TASK_MOVES = 3
# Revoked ids remembered per node (oldest dropped): a node gone for good must
# not grow the scheduler's memory without bound.
_MAX_REVOKED_PER_NODE = 100_000


@dataclass(frozen=True)
class _Sending:
    """A placement on its way: its Dispatch is sent without the planner lock."""

    placement: Placement
    task: Task
    attempt: int  # the attempt numbered for it (0: no fencing)


class SchedulerCore:
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

    def __init__(
        self,
        planner: RecordingPlanner,
        dispatcher: Dispatcher,
        writer: ResultWriter,
        clock: Callable[[], float],
        *,
        on_forget: Callable[[str], None] | None = None,
        ledger: AttemptLedger | None = None,
        policy: str = "",
        max_concurrent_dispatches: int = DEFAULT_MAX_CONCURRENT_DISPATCHES,
        max_task_moves: int = DEFAULT_MAX_TASK_MOVES,
    ) -> None:
        if max_concurrent_dispatches < 1:
            raise ValueError(
                f"max_concurrent_dispatches must be >= 1, got {max_concurrent_dispatches}"
            )
        if max_task_moves < 0:
            raise ValueError(f"max_task_moves must be >= 0, got {max_task_moves}")
        self.planner = planner
        self.policy = policy
        self.dispatcher = dispatcher
        self.writer = writer
        self.clock = clock
        self.max_task_moves = max_task_moves
        self._lock = asyncio.Lock()  # planner inputs, one at a time (module doc)
        self._flush_lock = asyncio.Lock()
        self._num_batches_out = 0  # batches of Dispatches sent, not yet settled
        self._is_plan_due = False  # a plan was put off while one was out
        self._dispatch_slots = asyncio.Semaphore(max_concurrent_dispatches)
        self._tasks: dict[str, Task] = {}  # placed, deferred or queued; not finished
        self._num_moves: dict[str, int] = {}  # re-placements so far, by task id
        self._attempts: dict[str, int] = {}  # attempt of the latest placement, by task id
        self._is_replan_due = False  # placements rolled back for want of Redis
        self._unwritten: dict[str, StateWrite] = {}  # latest state per task, not yet stored
        self.num_placed = 0
        self.num_rejected = 0
        self.num_dispatch_failures = 0
        self.num_refused = 0
        self.num_moved = 0
        # Nodes the planner has down, and when (planner time) a failed dispatch
        # took one down: the service re-admits it only after a pause.
        self.down_nodes: set[int] = set()
        self.dispatch_failed_s: dict[int, float] = {}
        # Tasks taken away from each node, with the attempt taken (insertion
        # ordered): the service cancels them there before the node gets work again.
        self.revoked: dict[int, dict[str, int]] = {}
        self.wakeup = asyncio.Event()  # set when the next timer may have changed
        self._on_forget = on_forget
        self._ledger = ledger

    # ------------------------------------------------------------ queries

    def knows(self, task_id: str) -> bool:
        return task_id in self._tasks

    def node_of(self, task_id: str) -> int | None:
        """The node a task is placed on, or None (queued, deferred or unknown)."""
        return self.planner.node_of(task_id)

    def task(self, task_id: str) -> Task | None:
        return self._tasks.get(task_id)

    def attempt_of(self, task_id: str) -> int:
        """The attempt number of the task's latest placement (0: none known)."""
        return self._attempts.get(task_id, 0)

    @property
    def num_tasks(self) -> int:
        return len(self._tasks)

    @property
    def num_unwritten(self) -> int:
        """State writes waiting for Redis."""
        return len(self._unwritten)

    def tasks_by_node(self) -> dict[int, list[str]]:
        """The held tasks placed on each node (nodes with none are absent)."""
        by_node: dict[int, list[str]] = {}
        for task_id in self._tasks:
            node_id = self.node_of(task_id)
            if node_id is not None:
                by_node.setdefault(node_id, []).append(task_id)
        return by_node

    @property
    def num_deferred(self) -> int:
        """Training the planner holds back for now (deferred, not rejected)."""
        return self.planner.num_deferred

    def next_wakeup_s(self) -> float | None:
        """When (planner time) deferred work must be looked at again, or None."""
        return self.planner.next_wakeup_s()

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
            if not is_new:
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
        batch: list[_Sending] = []
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

    # ------------------------------------------------------------ internals

    def _forget(self, task_id: str) -> None:
        self._num_moves.pop(task_id, None)
        self._attempts.pop(task_id, None)
        if self._tasks.pop(task_id, None) is not None and self._on_forget is not None:
            self._on_forget(task_id)

    def _note(self, write: StateWrite) -> None:
        self._unwritten[write.task_id] = write  # a later state supersedes an unstored one

    def _end(self, task_id: str, status: StoredStatus, reason: str) -> None:
        self._forget(task_id)
        self._note(StateWrite(task_id, status, reason=reason))

    def _revoke(self, node_id: int, task_id: str) -> None:
        held = self.revoked.setdefault(node_id, {})
        held[task_id] = self._attempts.get(task_id, 0)  # before it is placed again
        if len(held) > _MAX_REVOKED_PER_NODE:
            del held[next(iter(held))]

    def _set_health(self, node_id: int, is_healthy: bool, now_s: float) -> None:
        self.planner.on_node_health(node_id, is_healthy, now_s)
        telemetry.set_node_health(node_id, is_healthy)
        if is_healthy:
            self.down_nodes.discard(node_id)
            self.dispatch_failed_s.pop(node_id, None)
        else:
            self.down_nodes.add(node_id)

    def _plan(self, now_s: float) -> list[Decision]:
        """The planner's decisions now; its wall time is the decision latency."""
        start_s = time.perf_counter()
        decisions = self.planner.plan(now_s)
        telemetry.observe_decision(time.perf_counter() - start_s)
        return decisions

    def _move(self, task: Task, now_s: float, why: str) -> bool:
        """Submit a rolled-back task again, or end it once it has moved too often.

        True when it went back to the planner (a plan must follow).
        """
        num_moves = self._num_moves.get(task.task_id, 0) + 1
        if num_moves > self.max_task_moves:
            log.warning("task_gave_up", task_id=task.task_id, num_moves=num_moves - 1, why=why)
            self._end(
                task.task_id,
                StoredStatus.FAILED,
                f"{why}; gave up after placing it {num_moves} times",
            )
            return False
        self._num_moves[task.task_id] = num_moves
        self.num_moved += 1
        self.planner.submit(task, now_s)
        self._note(StateWrite(task.task_id, StoredStatus.QUEUED))
        return True

    async def _decide(self, decisions: list[Decision]) -> list[_Sending]:
        """Under the lock: apply decisions, and number the placements to send
        (`_begin_attempts`, one round trip). The Dispatches are sent by
        `_carry_out`, after the lock is released."""
        placements = await self._apply_decisions(decisions)
        if not placements:
            return []
        now_s = self.clock()
        sendable: list[tuple[Placement, Task]] = []
        for placement in placements:
            task = self._tasks.get(placement.task_id)
            if task is None:  # the planner placed a task the core does not hold: a bug
                log.error("placement_of_unknown_task", task_id=placement.task_id)
                self.planner.on_task_finished(placement.task_id, now_s, is_success=False)
                continue
            sendable.append((placement, task))
        sendable = await self._begin_attempts(sendable, now_s)
        if sendable:
            self._num_batches_out += 1
        return [_Sending(p, t, self._attempts.get(t.task_id, 0)) for p, t in sendable]

    def _plan_unless_batch_out(self, now_s: float) -> list[Decision]:
        """`_plan`, or nothing while a batch of Dispatches is out: its carrier
        plans once it settles (`_is_plan_due`). Completions then gather into
        one plan per Dispatch round trip, as when the lock was held across
        Dispatch; planning per completion batch instead starved Submit with
        10,000 training tasks flowing (docs/control-plane.md). New tasks are
        planned at once (a hung node's Dispatch must not hold them up)."""
        if self._num_batches_out > 0:
            self._is_plan_due = True
            return []
        return self._plan(now_s)

    async def _carry_out(self, batch: list[_Sending]) -> None:
        """Without the lock: send a batch's Dispatches (bounded), then settle
        each under the lock; plan again while rolled-back tasks went back to
        the planner; store the state writes.

        The planner lock is not held across Dispatch round trips (issue 15): a
        slow or hung executor no longer holds up intake, completions and other
        nodes' placements. Meanwhile the task may end (its completion beat the
        Dispatch's reply) or move (its node went down: that attempt was
        fenced); a result about an attempt that is no longer current is then
        only counted (`_is_in_flight`). Terminates: each round either places
        everything, or a task moved (bounded by `max_task_moves`) or a node
        went down.
        """
        while batch:
            sent, failed_nodes = batch, set[int]()
            errors = await asyncio.gather(*(self._dispatch(s, failed_nodes) for s in sent))
            async with self._lock:
                now_s = self.clock()
                is_moved = False
                for sending, error in zip(sent, errors, strict=True):
                    is_moved |= self._resolve(sending, error, now_s)
                self._num_batches_out -= 1
            # A Dispatch that may have reached its node: that attempt is fenced
            # now, before the task is numbered again, not only once it is.
            await self._fence_quietly(
                [
                    (s.placement.task_id, s.attempt)
                    for s, error in zip(sent, errors, strict=True)
                    if isinstance(error, DispatchError) and error.is_maybe_taken
                ]
            )
            batch = []
            if is_moved or self._is_plan_due:
                async with self._lock:
                    self._is_plan_due = False
                    batch = await self._decide(self._plan(self.clock()))
        await self._flush_writes()
        self.wakeup.set()

    async def _apply_decisions(self, decisions: list[Decision]) -> list[Placement]:
        placements: list[Placement] = []
        for decision in decisions:
            if isinstance(decision, Placement):
                placements.append(decision)
            elif isinstance(decision, Rejection):
                self.num_rejected += 1
                rejected = self._tasks.get(decision.task_id)
                telemetry.observe_rejected(self.policy, rejected.kind.value if rejected else "")
                self._end(
                    decision.task_id, StoredStatus.REJECTED, rejection_reason(decision.reason)
                )
            elif isinstance(decision, WeightSync):
                try:
                    await self.dispatcher.sync_weights(decision)
                except DispatchError as exc:
                    log.warning("weight_sync_failed", error=str(exc))
            elif isinstance(decision, Deferral):
                log.debug("deferred", task_id=decision.task_id)
        return placements

    async def _begin_attempts(
        self, sendable: list[tuple[Placement, Task]], now_s: float
    ) -> list[tuple[Placement, Task]]:
        """Number each placement (before its Dispatch) and drop training
        cancelled while it waited (inference is checked at intake): one round
        trip. If it fails, nothing is dispatched: an unnumbered Dispatch could
        not be fenced. The placements are rolled back, planned again later."""
        if self._ledger is None or not sendable:
            return sendable
        training = [task.task_id for _, task in sendable if task.is_training]
        try:
            attempts, cancelled_flags = await self._ledger.begin_attempts(
                [task.task_id for _, task in sendable], training
            )
        except Exception as exc:
            log.warning(
                "placements_deferred",
                num_placements=len(sendable),
                error=f"{type(exc).__name__}: {exc}",
            )
            for _, task in sendable:
                # Back to the planner, not a move: the node is not at fault.
                self.planner.on_task_finished(task.task_id, now_s, is_success=False)
                self.planner.submit(task, now_s)
            self._is_replan_due = True
            return []
        for (_, task), attempt in zip(sendable, attempts, strict=True):
            self._attempts[task.task_id] = attempt
        cancelled = {t for t, c in zip(training, cancelled_flags, strict=True) if c}
        for task_id in cancelled:
            self.planner.on_task_finished(task_id, now_s, is_success=False)
            self._forget(task_id)
        return [(p, t) for p, t in sendable if t.task_id not in cancelled]

    async def _fence_quietly(self, taken: list[tuple[str, int]]) -> None:
        """Fence these attempts now if Redis lets us; `fence_revoked` fences
        them again before their node is told to cancel them."""
        if not taken or self._ledger is None:
            return
        try:
            await self._ledger.fence(taken)
        except Exception as exc:
            log.warning(
                "fence_deferred", num_tasks=len(taken), error=f"{type(exc).__name__}: {exc}"
            )

    async def _dispatch(self, sending: _Sending, failed_nodes: set[int]) -> BaseException | None:
        """One Dispatch under the concurrency bound; its error, or None if taken.

        Once a node failed one Dispatch of this batch, the batch's calls still
        waiting for a slot skip it: a hung node costs one deadline per wave of
        calls in flight, not one per task queued for it.
        """
        placement = sending.placement
        async with self._dispatch_slots:
            if placement.node_id in failed_nodes:
                return DispatchError(
                    f"skipped: node {placement.node_id} failed another dispatch of this batch"
                )
            try:
                await self.dispatcher.dispatch(placement, sending.task)
            except Exception as exc:
                if isinstance(exc, DispatchError) and not isinstance(exc, TaskRefused):
                    failed_nodes.add(placement.node_id)
                return exc
        return None

    def _is_in_flight(self, sending: _Sending) -> bool:
        """Whether the planner still has the task on the node of this Dispatch,
        at its attempt (`_carry_out`: it may have ended or moved meanwhile)."""
        task_id = sending.placement.task_id
        return (
            task_id in self._tasks
            and self.node_of(task_id) == sending.placement.node_id
            and self._attempts.get(task_id, 0) == sending.attempt
        )

    def _resolve(self, sending: _Sending, error: BaseException | None, now_s: float) -> bool:
        """Settle one dispatched placement; True when the task went back to the planner."""
        placement, task = sending.placement, sending.task
        node_id, task_id = placement.node_id, placement.task_id
        if error is None:
            self.num_placed += 1
            # The intake stamps arrival_s with this clock (codec.task_from_fields).
            telemetry.observe_placed(self.policy, task.kind.value, now_s - task.arrival_s)
            if self._is_in_flight(sending):
                self._note(StateWrite(task_id, StoredStatus.PLACED, node_id=node_id))
            return False
        if not self._is_in_flight(sending):
            # Ended or moved while its Dispatch failed: nothing left to settle.
            log.info("stale_dispatch_failure", task_id=task_id, node_id=node_id, error=str(error))
            return False
        self.planner.on_task_finished(task_id, now_s, is_success=False)
        if isinstance(error, TaskRefused):
            # The executor looked at this task and said no: a fact about the
            # task, not the node. Only the task ends.
            self.num_refused += 1
            log.info("task_refused", task_id=task_id, node_id=node_id, reason=error.reason)
            self._end(task_id, StoredStatus.REJECTED, error.reason)
            return False
        if isinstance(error, DispatchError):
            self.num_dispatch_failures += 1
            telemetry.observe_dispatch_failure(node_id)
            log.warning("dispatch_failed", task_id=task_id, node_id=node_id, error=str(error))
            self._set_health(node_id, False, now_s)
            self.dispatch_failed_s[node_id] = now_s
            if error.is_maybe_taken:
                self._revoke(node_id, task_id)
            return self._move(
                task,
                now_s,
                f"UNAVAILABLE: executor of node {node_id} did not take the task ({error})",
            )
        log.error("dispatch_error", task_id=task_id, node_id=node_id, exc_info=error)
        return self._move(
            task,
            now_s,
            f"UNAVAILABLE: dispatching to node {node_id} failed ({type(error).__name__}: {error})",
        )

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

    async def _flush_writes(self) -> None:
        # One flush at a time, so a later state of a task is never stored
        # before an earlier one that is still on its way.
        async with self._flush_lock:
            await self._flush_writes_now()

    async def _flush_writes_now(self) -> None:
        if not self._unwritten:
            return
        writes = list(self._unwritten.values())
        try:
            await self.writer.write_states(writes)
        except Exception as exc:
            log.warning(
                "state_writes_deferred",
                num_writes=len(writes),
                error=f"{type(exc).__name__}: {exc}",
            )
            return
        for write in writes:
            if self._unwritten.get(write.task_id) is write:
                del self._unwritten[write.task_id]
