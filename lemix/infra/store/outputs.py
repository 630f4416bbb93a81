"""Output streams (one per task: its token and ``end`` messages, `messages`)
and the streaming gateways' leases on them.

Hot paths take one round trip: `append_outputs_batch` pipelines a whole
executor iteration's tokens (`FencingOps.append_outputs_fenced`, the
executor's, does it in one script call). A gateway holds one lease
(``ns:lease:<gateway_id>``, with TTL) on every stream it reads; the scheduler
cancels a task whose gateway's lease lapsed (its gateway is gone).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lemix.infra.store.base import StoreBase, as_fields, stream_entries, to_ms
from lemix.infra.store.codec import Entry, FieldValue, encode_fields
from lemix.infra.store.keys import STREAM_LEASE_TTL_S


class OutputOps(StoreBase):
    """Append to, read and expire output streams; take and drop gateway leases."""

    async def append_output(self, task_id: str, fields: Mapping[str, FieldValue]) -> str:
        """Append one message to the task's output stream; returns its entry id."""
        entry_id = await self.client.xadd(
            self.keys.output(task_id),
            encode_fields(fields),  # type: ignore[arg-type]
            maxlen=self.output_maxlen,
            approximate=True,
        )
        return str(entry_id)

    async def append_outputs_batch(
        self, items: Sequence[tuple[str, Mapping[str, FieldValue]]]
    ) -> list[str]:
        """Append many messages (task_id, fields) in ONE pipelined round trip.

        An executor emits one token per running request per iteration; this is
        its per-iteration call. Not a transaction: each XADD is atomic alone,
        and per-stream order follows `items`. Returns the entry ids in order.
        """
        if not items:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for task_id, fields in items:
                pipe.xadd(
                    self.keys.output(task_id),
                    encode_fields(fields),  # type: ignore[arg-type]
                    maxlen=self.output_maxlen,
                    approximate=True,
                )
            entry_ids = await pipe.execute()
        return [str(entry_id) for entry_id in entry_ids]

    async def read_output(
        self,
        task_id: str,
        last_id: str = "0-0",
        block_ms: int | None = None,
        count: int | None = None,
    ) -> list[Entry]:
        """Output messages after `last_id` (XREAD); the last one has ``is_final``.

        ``block_ms=None`` returns at once; a positive value waits up to that long
        (the client's socket timeout must exceed it). Pass the last entry id seen
        to continue.
        """
        response = await self.client.xread(
            {self.keys.output(task_id): last_id}, count=count, block=block_ms
        )
        return stream_entries(response)

    async def read_outputs(
        self,
        last_ids: Mapping[str, str],
        *,
        block_ms: int | None = None,
        wake: tuple[str, str] | None = None,
    ) -> tuple[dict[str, list[Entry]], str | None]:
        """ONE XREAD over many tasks' output streams: {task_id: last entry id
        seen} -> ({task_id: its newer entries}, for the tasks that have some).

        `wake` = (owner, last wake entry seen) adds `owner`'s wake stream
        (`wake_reader`) to the read; the second item returned is its newest
        entry id when one arrived (the caller then reads again with its new
        set of streams), else None. `block_ms` as in `read_output`.
        """
        streams = {self.keys.output(task_id): last_id for task_id, last_id in last_ids.items()}
        task_of = {key: task_id for key, task_id in zip(streams, last_ids, strict=True)}
        wake_key = None
        if wake is not None:
            wake_key = self.keys.reader_wake(wake[0])
            streams[wake_key] = wake[1]
        response = await self.client.xread(streams, block=block_ms)  # type: ignore[arg-type]
        found: dict[str, list[Entry]] = {}
        woken: str | None = None
        pairs: Any = response.items() if isinstance(response, dict) else (response or [])
        for key, items in pairs:
            # RESP3 nests a stream's entries one level deeper.
            items = items[0] if items and isinstance(items[0], list) else items
            entries = [(str(entry_id), as_fields(fields)) for entry_id, fields in items]
            if not entries:
                continue
            if str(key) == wake_key:
                woken = entries[-1][0]
            else:
                found[task_of[str(key)]] = entries
        return found, woken

    async def renew_gateway_lease(
        self, owner: str, ttl_s: float = STREAM_LEASE_TTL_S, *, wake: bool = False
    ) -> None:
        """(Re)take gateway `owner`'s lease (`RedisKeys.gateway_lease`), and
        with `wake` wake `owner`'s output reader (`wake_reader`), one round trip."""
        pipe = self.client.pipeline(transaction=False)
        self.queue_gateway_hold(pipe, owner, lease_ttl_s=ttl_s, wake=wake)
        await pipe.execute()

    async def wake_reader(self, owner: str) -> None:
        """Append to `owner`'s wake stream: its reader's blocking `read_outputs`
        (given `wake`) returns, to read again with the streams added since."""
        pipe = self.client.pipeline(transaction=False)
        self.queue_gateway_hold(pipe, owner, lease_ttl_s=None, wake=True)
        await pipe.execute()

    async def keep_gateway_lease(self, owner: str, ttl_s: float = STREAM_LEASE_TTL_S) -> None:
        """Renew gateway `owner`'s lease and its wake stream's TTL (its lease
        loop's step), one round trip."""
        ttl_ms = to_ms(ttl_s, "ttl_s")
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.gateway_lease(owner), owner, px=ttl_ms)
        pipe.pexpire(self.keys.reader_wake(owner), ttl_ms)
        await pipe.execute()

    async def drop_reader_wake(self, owner: str) -> None:
        """Delete `owner`'s wake stream (its gateway stops)."""
        await self.client.delete(self.keys.reader_wake(owner))

    async def drop_gateway_lease(self, owner: str) -> None:
        """Gateway `owner` stops: its lease goes (the scheduler cancels what
        it still streamed at its next check)."""
        await self.client.delete(self.keys.gateway_lease(owner))

    async def gateway_leases_held(self, gateway_ids: Sequence[str]) -> list[bool]:
        """Per gateway: is its lease live? One round trip."""
        if not gateway_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for gateway_id in gateway_ids:
            pipe.exists(self.keys.gateway_lease(gateway_id))
        return [bool(n) for n in await pipe.execute()]
