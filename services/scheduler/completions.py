"""The scheduler's completions loop (a part of `SchedulerService`).

Executors' task ends are read from the completions stream, from the stored
cursor on, and applied to the core in batches (one plan per batch). The
cursor moves only after the resulting events are stored; it is stored at most
every `_CURSOR_STORE_S` (and when the stream goes idle), so a restart
re-applies at most that much, which is harmless (a re-applied end is stale).
"""

from __future__ import annotations

import asyncio
import time

import structlog

from lemix.infra.store.codec import Entry
from lemix.infra.store.events import CursorAdvance
from lemix.infra.store.messages import completion_from_fields
from lemix.infra.store.task_hash import TASK_ID_FIELD, StoredStatus
from services.scheduler.core import FinishReport
from services.scheduler.service_base import _LOOP_BACKOFF_S, ServiceBase

log = structlog.get_logger(__name__)

# The completions cursor is stored at most this often (a SET and an XTRIM per
# store): a restart re-applies at most this much, which is harmless.
_CURSOR_STORE_S = 0.1


class CompletionsLoop(ServiceBase):
    """Applies executors' task ends and moves the stored cursor (module doc)."""

    async def _completions_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                if self._completions_cursor is None:
                    self._completions_cursor = await self.store.get_completions_cursor()
                    self._stored_cursor = self._completions_cursor
                # The last batch's cursor step rides on this read (one round
                # trip, not two); it stays queued until such a read returned.
                advance = self._cursor_advance
                entries = await self._until_stop(
                    self.store.read_completions(
                        self._completions_cursor, self._block_ms, advance_first=advance
                    )
                )
                if entries is not None and advance is not None:
                    self._on_advanced(advance)
                if entries:
                    await self._handle_completions(entries)
                elif self._completions_cursor != self._stored_cursor:
                    await self._store_cursor()  # idle: the last cursor, now
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._log_loop_error("completions", exc)
                await self._sleep_or_stop(_LOOP_BACKOFF_S)

    async def _handle_completions(self, entries: list[Entry]) -> None:
        reports: list[FinishReport] = []
        for entry_id, fields in entries:
            if not fields.get(TASK_ID_FIELD):  # an entry without a task id is skipped
                continue
            try:
                completion = completion_from_fields(fields)
            except ValueError as exc:
                # Malformed (a foreign or corrupted writer): it can never be
                # applied, and retrying it would hold every later completion
                # behind it. Skipped and logged; the task's own hash still
                # has its end, which GetTask and the audit read.
                log.error("bad_completion", entry_id=entry_id, fields=fields, error=str(exc))
                continue
            reports.append(
                FinishReport(
                    completion.task_id,
                    is_success=completion.status == StoredStatus.COMPLETED,
                    is_requeue=completion.status == StoredStatus.REQUEUED,
                    node_id=completion.node_id,
                    attempt=completion.attempt,
                )
            )
        # The batch in one go (one plan). Applying a report twice is harmless:
        # once applied, the task is no longer on that node, so a second
        # application (after an error before the cursor moved) reads as stale.
        applied = await self.core.on_finished_many(reports)
        ended = [
            report.task_id
            for report, is_applied in zip(reports, applied, strict=True)
            if is_applied and not report.is_requeue
        ]
        entry_id = entries[-1][0]
        self._completions_cursor = entry_id
        is_stored = time.monotonic() - self._cursor_stored_s >= _CURSOR_STORE_S
        if is_stored:
            await self.events.flush()  # the stored cursor never runs ahead of the log
        # Entries before the cursor are applied and in the log: trimmed. An
        # applied end is final in its hash (the executor wrote the end and its
        # completion in one script), so its hash and output stream expire
        # with the cursor's step; executors write ends without a TTL, and
        # this is the stream's one expiry (a PEXPIRE is a command per task).
        # The cursor itself is stored at most every `_CURSOR_STORE_S` (and
        # when the stream goes idle): a restart re-applies what came since.
        # Sent with the next read (`_completions_loop`), or at stop.
        config = self.config
        self._cursor_advance = CursorAdvance.of(
            entry_id,
            expire_ids=ended,
            ttl_s=config.finished_task_ttl_s,
            output_ttl_s=config.output_ttl_s,
            is_stored=is_stored,
        )
        if is_stored:
            # Not again before this one is sent: the time counts from now.
            self._cursor_stored_s = time.monotonic()

    def _on_advanced(self, advance: CursorAdvance) -> None:
        if self._cursor_advance is advance:
            self._cursor_advance = None
        if advance.is_stored:
            self._stored_cursor = advance.entry_id

    async def _store_cursor(self) -> None:
        cursor = self._completions_cursor
        if cursor is None:
            return
        await self.events.flush()  # the stored cursor never runs ahead of the log
        await self.store.advance_completions_cursor(cursor)
        self._stored_cursor, self._cursor_stored_s = cursor, time.monotonic()

    async def _send_cursor_advance(self) -> None:
        """At stop: the last batch's cursor step, if no read carried it."""
        advance = self._cursor_advance
        if advance is None:
            return
        await self.store.apply_cursor_advance(advance)
        self._on_advanced(advance)
