"""The scheduler's intake loop (a part of `SchedulerService`).

New tasks come from the intake stream (consumer group), at least once: a
redelivered task the core already holds, or one already final, is only
acked; a malformed one is ended REJECTED; one cancelled before it was read is
ended FAILED. The decisions a batch causes are made durable (events flushed)
before its entries are acked, so a crash in between replays to the same state.
"""

from __future__ import annotations

import time

import structlog

from lemix.infra.store.codec import Entry, Fields
from lemix.infra.store.task_fields import task_from_fields
from lemix.infra.store.task_hash import GATEWAY_ID_FIELD, STATUS_FIELD, TASK_ID_FIELD, StoredStatus
from lemix.types import Task, TaskPayload
from services.scheduler.service_base import ServiceBase

log = structlog.get_logger(__name__)

CANCELLED_BEFORE_PLACEMENT = "CANCELLED: cancelled before it was scheduled"


class IntakeLoop(ServiceBase):
    """Reads, checks and hands new tasks to the core (module doc)."""

    async def _intake_step(self) -> None:
        if self._has_unacked_intake:
            # The last batch failed half-way (Redis blip): its entries are still
            # pending for us and XREADGROUP ">" will not return them again.
            stale = await self.store.claim_stale(self.config.consumer_name, 0)
            if stale:
                await self._handle_intake(stale)
            self._has_unacked_intake = False
        entries = await self._until_stop(
            self.store.read_intake(
                self.config.consumer_name, self.config.intake_batch, self._block_ms
            )
        )
        if entries:
            self._has_unacked_intake = True
            await self._handle_intake(entries)
            self._has_unacked_intake = False

    async def _handle_intake(self, entries: list[Entry]) -> None:
        taken = [t for t in [await self._parse(fields) for _, fields in entries] if t]
        # One pipelined round trip checks every task and records those taken:
        # per-task round trips made this loop the stack's bottleneck. The
        # task's fields go to its state hash too: a restart finds the payload
        # of deferred training there (the intake entry is deleted).
        queued_t = time.time()
        lookup = await self.store.accept_intake(
            [
                (
                    task.task_id,
                    {
                        **fields,
                        STATUS_FIELD: StoredStatus.QUEUED,
                        "arrival_s": task.arrival_s,
                        "queued_t": queued_t,
                    },
                )
                for task, _, fields in taken
            ]
        )
        accepted = []
        attempts: dict[str, int] = {}
        leased: list[tuple[str, str]] = []
        for (task, payload, fields), check in zip(taken, lookup, strict=True):
            if check.is_final:
                continue  # finished before a restart; its result stands (not written)
            if check.is_cancelled:  # not written either
                await self.writer.end_task(
                    task.task_id, StoredStatus.FAILED, CANCELLED_BEFORE_PLACEMENT
                )
                continue
            self._payloads[task.task_id] = payload
            accepted.append(task)
            attempts[task.task_id] = check.attempt
            if check.has_lease and not task.is_training:
                leased.append((task.task_id, str(fields[GATEWAY_ID_FIELD])))
        self.leases.note(leased)  # before the core: it may end them at once
        await self.core.on_tasks(accepted, attempts)
        # Write-ahead: the decisions these entries caused are stored before the
        # entries go, so a crash in between replays them (and the redelivered
        # entries are recognised as known).
        await self.events.flush()
        await self.store.ack_intake([entry_id for entry_id, _ in entries])

    async def _parse(self, fields: Fields) -> tuple[Task, TaskPayload, Fields] | None:
        """The entry's task, or None when it is malformed (ended) or already known."""
        task_id = fields.get(TASK_ID_FIELD, "")
        try:
            task, payload = task_from_fields(fields, arrival_s=self.clock())
        except (KeyError, ValueError) as exc:
            log.error("intake_malformed", task_id=task_id, error=str(exc))
            if task_id:
                await self.writer.end_task(
                    task_id,
                    StoredStatus.REJECTED,
                    f"INVALID_ARGUMENT: malformed task fields ({exc})",
                )
            return None
        if self.core.knows(task_id):
            return None  # redelivered; the planner has it
        return task, payload, fields
