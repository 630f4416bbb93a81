"""The scheduler's intake loop (a part of `SchedulerService`).

New tasks come from the intake stream (consumer group), at least once: a
redelivered task the core already holds, or one already final, is only
acked; a malformed one is ended REJECTED; one cancelled before it was read is
ended FAILED. The decisions a batch causes are made durable (events flushed)
before its entries are acked, so a crash in between replays to the same state.

The submitter's script wrote each task's hash (queued, attempt 1) with its
entry and says in the entry whether that hash was the task's own
(`INTAKE_STATE_FIELD`). Such a task, read fresh by this process, is taken
as it is: no round trip before it is planned. The others are checked
first in one round trip (`Store.accept_intake`: final? cancelled? its
gateway's lease?): a hash that held something already, entries added before
this scheduler read the stream (a predecessor may have marked them
cancelled), redeliveries, and ids this process was told about meanwhile
(cancelled or submitted here: `_check_at_intake`). A task taken as it is
counts its gateway's lease as held; the lease watch finds out otherwise
within its check period and cancels the task then.
"""

from __future__ import annotations

import time

import structlog

from lemix.infra.store.codec import Entry, Fields
from lemix.infra.store.intake import FIRST_ATTEMPT, INTAKE_STATE_FIELD, IntakeCheck
from lemix.infra.store.task_fields import task_from_fields
from lemix.infra.store.task_hash import GATEWAY_ID_FIELD, STATUS_FIELD, TASK_ID_FIELD, StoredStatus
from lemix.types import Task, TaskPayload
from services.scheduler.service_base import ServiceBase

log = structlog.get_logger(__name__)

CANCELLED_BEFORE_PLACEMENT = "CANCELLED: cancelled before it was scheduled"
# Ids remembered for a check at intake (`_check_at_intake`); past this the
# oldest is forgotten (its entry, if still unread, is then taken unchecked).
_CHECK_AT_INTAKE_MAX = 100_000


def _entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("<ms>-<seq>") as a sortable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class IntakeLoop(ServiceBase):
    """Reads, checks and hands new tasks to the core (module doc)."""

    async def _intake_step(self) -> None:
        if self._has_unacked_intake:
            # The last batch failed half-way (Redis blip): its entries are still
            # pending for us and XREADGROUP ">" will not return them again.
            stale = await self.store.claim_stale(self.config.consumer_name, 0)
            if stale:
                await self._handle_intake(stale, is_redelivery=True)
            self._has_unacked_intake = False
        # Handled entries' acks ride on this read (one round trip, not two)
        # once due (`_due_intake_acks`); they stay queued until a read that
        # carried them returned. Write-ahead: the decisions those entries
        # caused are stored before the entries go, so a crash in between
        # replays them (and the redelivered entries are recognised as
        # known). Usually the event log's own coalescing has stored them by
        # then; the flush is for a read's worth of acks that cannot wait.
        acks = self._due_intake_acks()
        if acks:
            await self.events.flush()
        entries = await self._until_stop(
            self.store.read_intake(
                self.config.consumer_name,
                self.config.intake_batch,
                self._block_ms,
                ack_first=acks,
            )
        )
        if entries is not None:
            del self._intake_acks[: len(acks)]
        if entries:
            self._has_unacked_intake = True
            await self._handle_intake(entries)
            self._has_unacked_intake = False

    def _due_intake_acks(self) -> list[str]:
        """The acks to send with the next read: all of them once a read's
        worth waits, or once the oldest waited `intake_ack_delay_s` and the
        event log has stored what they caused; else none (they are shared by
        the entries handled meanwhile). Waiting for the log's own store,
        rather than flushing it, keeps it at one XADD per coalescing window."""
        acks = self._intake_acks
        if not acks:
            return []
        if len(acks) >= self.config.intake_batch:
            return list(acks)
        waited_s = time.monotonic() - self._intake_acks_since_s
        if waited_s < self.config.intake_ack_delay_s:
            return []
        if self.events.num_stored < self._intake_acks_num_events:
            return []
        return list(acks)

    def _check_at_intake_add(self, task_id: str) -> None:
        """Have the intake check `task_id` before taking it (module doc)."""
        self._check_at_intake[task_id] = None
        if len(self._check_at_intake) > _CHECK_AT_INTAKE_MAX:
            del self._check_at_intake[next(iter(self._check_at_intake))]

    def _is_taken_as_is(self, entry_id: str, fields: Fields, is_redelivery: bool) -> bool:
        task_id = fields.get(TASK_ID_FIELD, "")
        is_checked = self._check_at_intake.pop(task_id, 0) is None
        return (
            not is_redelivery
            and not is_checked
            and fields.get(INTAKE_STATE_FIELD) == "1"
            and _entry_key(entry_id) > _entry_key(self._intake_fresh_after)
        )

    async def _handle_intake(self, entries: list[Entry], *, is_redelivery: bool = False) -> None:
        taken: list[tuple[Task, TaskPayload, Fields, bool]] = []
        for entry_id, fields in entries:
            is_as_is = self._is_taken_as_is(entry_id, fields, is_redelivery)
            fields.pop(INTAKE_STATE_FIELD, None)  # the entry's, not the task's (its hash's)
            parsed = await self._parse(fields)
            if parsed is not None:
                taken.append((*parsed, is_as_is))
        # One pipelined round trip checks the tasks that need it and records
        # them: per-task round trips made this loop the stack's bottleneck.
        # The task's fields go to its state hash too (the submitter wrote
        # them there already; a hash that held something else gets them
        # merged): a restart finds the payload of deferred training there
        # (the intake entry is deleted).
        queued_t = time.time()
        checked = await self.store.accept_intake(
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
                for task, _, fields, is_as_is in taken
                if not is_as_is
            ]
        )
        checks = iter(checked)
        lookup = [
            IntakeCheck(False, False, bool(fields.get(GATEWAY_ID_FIELD)), FIRST_ATTEMPT)
            if is_as_is
            else next(checks)
            for _, _, fields, is_as_is in taken
        ]
        accepted = []
        attempts: dict[str, int] = {}
        leased: list[tuple[str, str]] = []
        for (task, payload, fields, _), check in zip(taken, lookup, strict=True):
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
        # The acks go with a later read, after the events are stored (there).
        self._intake_acks_num_events = self.events.num_recorded
        if not self._intake_acks:
            self._intake_acks_since_s = time.monotonic()
        self._intake_acks.extend(entry_id for entry_id, _ in entries)

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
