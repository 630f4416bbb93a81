"""The scheduler's streams: its event log and the completions executors report.

The event log holds every planner input and decision (replay, parity, restart).
The scheduler records a snapshot of its planner into it every so many events
(services/scheduler/recovery.py); once one is stored, everything before it is
trimmed (`trim_events_before`), so the log and restarts stay bounded.

Completions (`messages.completion_fields`) have one reader, the scheduler: it
stores a cursor and trims what it applied (`advance_completions_cursor`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lemix.infra.store.base import StoreBase, range_entries, to_ms
from lemix.infra.store.codec import Entry, FieldValue, encode_fields


@dataclass(frozen=True)
class CursorAdvance:
    """What `EventOps.advance_completions_cursor` writes, to send now or ahead
    of the next completions read (`read_completions`'s `advance_first`)."""

    entry_id: str
    expire_ids: tuple[str, ...]
    ttl_ms: int  # 0: the task hashes keep their TTL
    output_ttl_ms: int  # 0: the output streams keep theirs
    is_stored: bool  # store the cursor and trim the stream before it

    @classmethod
    def of(
        cls,
        entry_id: str,
        *,
        expire_ids: Sequence[str] = (),
        ttl_s: float = 0.0,
        output_ttl_s: float | None = None,
        is_stored: bool = True,
    ) -> CursorAdvance | None:
        """The writes for these arguments (`advance_completions_cursor`);
        None when there are none."""
        ttl_ms = to_ms(ttl_s, "ttl_s") if ttl_s > 0 else 0
        output_ttl = ttl_s if output_ttl_s is None else output_ttl_s
        output_ttl_ms = to_ms(output_ttl, "output_ttl_s") if output_ttl > 0 else 0
        if not is_stored and not (expire_ids and (ttl_ms or output_ttl_ms)):
            return None
        return cls(entry_id, tuple(expire_ids), ttl_ms, output_ttl_ms, is_stored)


class EventOps(StoreBase):
    """Append and read the event log; append and consume completions."""

    async def append_event(self, fields: Mapping[str, FieldValue]) -> str:
        """Append to the scheduler's event log (kept whole for replay/parity)."""
        entry_id = await self.client.xadd(
            self.keys.events_stream,
            encode_fields(fields),  # type: ignore[arg-type]
        )
        return str(entry_id)

    async def append_events(self, events: Sequence[Mapping[str, FieldValue]]) -> list[str]:
        """Append many events in order in one pipelined round trip."""
        if not events:
            return []
        pipe = self.client.pipeline(transaction=False)
        for fields in events:
            pipe.xadd(self.keys.events_stream, encode_fields(fields))  # type: ignore[arg-type]
        return [str(entry_id) for entry_id in await pipe.execute()]

    async def read_events(
        self, start: str = "-", end: str = "+", count: int | None = None
    ) -> list[Entry]:
        """Event log entries from `start` to `end` inclusive (XRANGE), oldest first."""
        return range_entries(
            await self.client.xrange(self.keys.events_stream, start, end, count=count)
        )

    async def trim_events_before(self, entry_id: str) -> int:
        """Delete the event log entries older than `entry_id` (XTRIM MINID,
        exact; `entry_id` itself stays). Returns how many were deleted."""
        return int(
            await self.client.xtrim(self.keys.events_stream, minid=entry_id, approximate=False)
        )

    async def events_length(self) -> int:
        """Entries in the event log (XLEN)."""
        return int(await self.client.xlen(self.keys.events_stream))

    async def append_completion(self, fields: Mapping[str, FieldValue]) -> str:
        """An executor reports a task's end (`messages.completion_fields`)."""
        entry_id = await self.client.xadd(
            self.keys.completions_stream,
            encode_fields(fields),  # type: ignore[arg-type]
        )
        return str(entry_id)

    async def read_completions(
        self,
        last_id: str,
        block_ms: int | None = None,
        count: int = 500,
        *,
        advance_first: CursorAdvance | None = None,
    ) -> list[Entry]:
        """Completions after `last_id` (XREAD; one reader, the scheduler).

        `advance_first`: `advance_completions_cursor`'s writes, sent ahead of
        the read in the same pipelined round trip (Redis runs them in order):
        once this returns they are done."""
        stream = self.keys.completions_stream
        if advance_first is None:
            reply = await self.client.xread({stream: last_id}, count=count, block=block_ms)
        else:
            async with self.client.pipeline(transaction=False) as pipe:
                self._queue_advance(pipe, advance_first)
                pipe.xread({stream: last_id}, count=count, block=block_ms)
                *_, reply = await pipe.execute()
        streams: list[Any] = list(reply or [])  # type: ignore[arg-type]
        entries: list[Entry] = []
        for _stream, items in streams:
            entries.extend((str(i), dict(f)) for i, f in items)
        return entries

    async def set_completions_cursor(self, entry_id: str) -> None:
        """Store the last completions entry the scheduler applied."""
        await self.client.set(self.keys.completions_cursor, entry_id)

    async def get_completions_cursor(self) -> str:
        """The stored completions cursor; "0-0" (from the start) when none."""
        value = await self.client.get(self.keys.completions_cursor)
        return str(value) if value else "0-0"

    async def advance_completions_cursor(
        self,
        entry_id: str,
        *,
        expire_ids: Sequence[str] = (),
        ttl_s: float = 0.0,
        output_ttl_s: float | None = None,
        is_stored: bool = True,
    ) -> None:
        """Expire what the completions up to `entry_id` ended and, with
        `is_stored`, store the cursor and drop the entries before it, in one
        pipelined round trip: the scheduler is the stream's one reader, and
        what it has applied is in its event log (XTRIM MINID keeps `entry_id`
        itself).

        `expire_ids`: tasks those entries ended (final in their hashes): their
        hash expires `ttl_s` and their output stream `output_ttl_s` (default:
        `ttl_s`) from now; 0 leaves that key alone.

        Not a MULTI/EXEC (two commands more per call): every step is safe
        alone. A stored cursor behind the applied entries only makes a
        restart apply some again (harmless); entries trimmed with the cursor
        not stored were applied and logged, and a read from an older cursor
        returns the entries after it that remain.
        """
        advance = CursorAdvance.of(
            entry_id,
            expire_ids=expire_ids,
            ttl_s=ttl_s,
            output_ttl_s=output_ttl_s,
            is_stored=is_stored,
        )
        if advance is not None:
            await self.apply_cursor_advance(advance)

    async def apply_cursor_advance(self, advance: CursorAdvance) -> None:
        """`advance`'s writes now, in one pipelined round trip (what a
        completions read with `advance_first` would have sent)."""
        async with self.client.pipeline(transaction=False) as pipe:
            self._queue_advance(pipe, advance)
            await pipe.execute()

    def _queue_advance(self, pipe: Any, advance: CursorAdvance) -> None:
        for task_id in advance.expire_ids:
            if advance.ttl_ms:
                pipe.pexpire(self.keys.task(task_id), advance.ttl_ms)
            if advance.output_ttl_ms:
                pipe.pexpire(self.keys.output(task_id), advance.output_ttl_ms)
        if advance.is_stored:
            pipe.set(self.keys.completions_cursor, advance.entry_id)
            # Exact: "~" trims whole macro nodes only, i.e. nothing on a short stream.
            pipe.xtrim(self.keys.completions_stream, minid=advance.entry_id, approximate=False)
