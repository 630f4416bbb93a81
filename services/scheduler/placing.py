"""Sending the planner's placements (`SchedulerCore`'s middle layer).

`_decide` applies a plan's decisions under the planner lock and numbers the
placements to send (one round trip); `_carry_out` sends their Dispatch calls
after the lock is released, settles each under it again (`_resolve`), fences
an attempt that may have reached a failed node, plans again while tasks
moved, and stores the state writes. See `services.scheduler.core`'s module
doc for what happens to a placement whatever fails.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog

from lemix.infra import telemetry
from lemix.infra.store.task_hash import StoredStatus
from lemix.types import (
    Decision,
    Deferral,
    Placement,
    Rejection,
    ReplicaAverage,
    Task,
    WeightSync,
)
from services.scheduler.core_base import CoreBase
from services.scheduler.ports import DispatchError, StateWrite, TaskRefused, rejection_reason

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Sending:
    """A placement on its way: its Dispatch is sent without the planner lock."""

    placement: Placement
    task: Task
    attempt: int  # the attempt numbered for it (0: no fencing)


class Placing(CoreBase):
    """Placements from decision to settled (module doc)."""

    async def _decide(self, decisions: list[Decision]) -> list[Sending]:
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
        return [Sending(p, t, self._attempts.get(t.task_id, 0)) for p, t in sendable]

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

    async def _carry_out(self, batch: list[Sending]) -> None:
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
        went down; each plan after a training cap placed a training task.
        """
        while True:
            await self._send(batch)
            if not self.is_release_pending:
                break
            # The plan stopped at its training cap (`Planner.is_release_pending`):
            # what is ready (intake, completions) runs first, then plan again.
            await asyncio.sleep(0)
            async with self._lock:
                batch = await self._decide(self._plan(self.clock()))
        await self._flush_writes()
        self.wakeup.set()

    async def _send(self, batch: list[Sending]) -> None:
        """`_carry_out`'s Dispatches: send, settle, and plan again while
        rolled-back tasks went back to the planner."""
        while batch:
            sent, failed_nodes = batch, set[int]()
            results = await asyncio.gather(*(self._dispatch(s, failed_nodes) for s in sent))
            errors = [r if isinstance(r, BaseException) else None for r in results]
            async with self._lock:
                now_s = self.clock()
                is_moved = False
                for sending, error, result in zip(sent, errors, results, strict=True):
                    is_moved |= self._resolve(sending, error, now_s, is_recorded=result is True)
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
            elif isinstance(decision, WeightSync | ReplicaAverage):
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
        trip, none when the intake numbered every placement (a task's first)
        and none is training. If it fails, nothing is dispatched: an
        unnumbered Dispatch could not be fenced. The placements are rolled
        back, planned again later."""
        if self._ledger is None or not sendable:
            return sendable
        training = [task.task_id for _, task in sendable if task.is_training]
        # A first placement numbered at intake needs no HINCRBY of its own.
        to_number = [t.task_id for _, t in sendable if t.task_id not in self._numbered]
        try:
            if to_number or training:
                numbered, cancelled_flags = await self._ledger.begin_attempts(to_number, training)
            else:
                numbered, cancelled_flags = [], []
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
        attempt_of = dict(zip(to_number, numbered, strict=True))
        for _, task in sendable:
            task_id = task.task_id
            attempt = attempt_of.get(task_id)
            self._attempts[task_id] = self._numbered.pop(task_id) if attempt is None else attempt
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

    async def _dispatch(self, sending: Sending, failed_nodes: set[int]) -> BaseException | bool:
        """One Dispatch under the concurrency bound; its error, or, when taken,
        whether the executor records the placed state itself.

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
                return bool(await self.dispatcher.dispatch(placement, sending.task))
            except Exception as exc:
                if isinstance(exc, DispatchError) and not isinstance(exc, TaskRefused):
                    failed_nodes.add(placement.node_id)
                return exc

    def _is_in_flight(self, sending: Sending) -> bool:
        """Whether the planner still has the task on the node of this Dispatch,
        at its attempt (`_carry_out`: it may have ended or moved meanwhile)."""
        task_id = sending.placement.task_id
        return (
            task_id in self._tasks
            and self.node_of(task_id) == sending.placement.node_id
            and self._attempts.get(task_id, 0) == sending.attempt
        )

    def _resolve(
        self,
        sending: Sending,
        error: BaseException | None,
        now_s: float,
        *,
        is_recorded: bool = False,
    ) -> bool:
        """Settle one dispatched placement; True when the task went back to the
        planner. `is_recorded`: the executor writes the placed state itself
        (its reply said so); otherwise it is written here."""
        placement, task = sending.placement, sending.task
        node_id, task_id = placement.node_id, placement.task_id
        if error is None:
            self.num_placed += 1
            # The intake stamps arrival_s with this clock (task_fields.task_from_fields).
            telemetry.observe_placed(self.policy, task.kind.value, now_s - task.arrival_s)
            if not is_recorded and self._is_in_flight(sending):
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
