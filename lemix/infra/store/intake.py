"""The intake stream: Submit's durable, idempotent queue of new tasks, and the
scheduler's consumer group on it (claim, then ack).

`submit_task` is idempotent by task id: a dedupe key is set in the same Lua
script as the XADD (`scripts.SUBMIT_LUA`), and a Submit that reuses an id for
another request is refused (`TaskIdConflict`). The same script writes the
task's hash, queued with its first placement's attempt number, and tells the
scheduler in the entry (`INTAKE_STATE_FIELD`) whether that hash was the
task's own; when it was not, or the scheduler has other reasons to look
(`accept_intake`), the scheduler checks the task before taking it. Acked
entries are deleted, so the stream stays bounded (the scheduler's event log
is the record for replay). Cancel-before-placement markers live here too:
the intake loop checks them.
"""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import grpc
from redis.exceptions import ResponseError

from lemix.infra.rpc.errors import ServiceError
from lemix.infra.store.base import (
    StoreBase,
    as_fields,
    batch_items,
    chunks,
    flatten,
    range_entries,
    stream_entries,
    to_ms,
)
from lemix.infra.store.codec import Entry, FieldValue, encode_fields
from lemix.infra.store.task_hash import (
    ALSO_GATEWAY_PREFIX,
    ATTEMPT_FIELD,
    CANCELLED_FIELD,
    GATEWAY_ID_FIELD,
    STATUS_FIELD,
    SUBMIT_T_FIELD,
    TASK_ID_FIELD,
    StoredStatus,
)

# An intake entry's field, added by `scripts.SUBMIT_LUA`: "1" when the task's
# hash was written there whole (queued, attempt 1) into an empty key, so the
# scheduler may take the task as it is; "0" (or absent: an entry of an older
# writer) when the scheduler must check it first (`IntakeOps.accept_intake`).
INTAKE_STATE_FIELD = "intake_state"
# The attempt number of a task's first placement, written at intake.
FIRST_ATTEMPT = 1

# Task fields that differ between two Submits of one request (stamped by the
# submitter or on intake), so they are not part of its hash: the scheduler's
# submit wall time, arrival time and arrival order.
# A retry of one request through another gateway is the same request.
UNHASHED_TASK_FIELDS = frozenset({SUBMIT_T_FIELD, "arrival_s", "seq", GATEWAY_ID_FIELD})


def request_hash(fields: Mapping[str, str]) -> str:
    """Hex SHA-256 of a task's encoded fields, less `UNHASHED_TASK_FIELDS`:
    what makes two Submits of one task id the same request."""
    pieces: list[bytes] = []
    for name in sorted(fields):
        if name not in UNHASHED_TASK_FIELDS:
            # Length-prefixed, so no choice of values can make two field sets
            # serialize alike.
            for part in (name, fields[name]):
                data = part.encode("utf-8")
                pieces += (len(data).to_bytes(8, "big"), data)
    # One update of the whole text: the same digest as one per piece.
    return hashlib.sha256(b"".join(pieces)).hexdigest()


class IntakeCheck(NamedTuple):
    """What `IntakeOps.accept_intake` found, and did, for one task."""

    is_final: bool  # it ended already (a redelivery after a restart): nothing written
    is_cancelled: bool  # cancelled before placement: nothing written
    has_lease: bool  # the gateway its fields name holds its lease (False: none named)
    attempt: int  # its first placement's number, written to its hash (0: not taken)


class SubmitOutcome(enum.IntEnum):
    """What `IntakeOps.submit_tasks` did with one task (`scripts.SUBMIT_LUA`'s reply)."""

    CONFLICT = -1  # its id names another request: nothing written
    DUPLICATE = 0  # the same request again: nothing written
    ADDED = 1


class GatewayHold(NamedTuple):
    """What a streaming gateway writes ahead of its tasks (`IntakeOps.submit_tasks`)."""

    owner: str  # the gateway's id
    lease_ttl_s: float | None = None  # rewrite its lease with this TTL (None: still fresh)
    is_wake: bool = False  # wake its output reader (blocked without the new stream)


class TaskIdConflict(ServiceError):
    """A Submit reuses a task id (a client's `request_id`) for a different
    request. Retrying cannot succeed: the client must pick a new id."""

    code = grpc.StatusCode.ALREADY_EXISTS


class IntakeOps(StoreBase):
    """Submit's intake stream, the scheduler's group on it, and cancel markers."""

    async def submit_task(self, task_fields: Mapping[str, FieldValue]) -> bool:
        """Append a task to the intake stream unless its ``task_id`` was seen.

        Returns True when added, False for a duplicate: the same id with the
        same request (`request_hash` of the fields), nothing written. The same
        id with a different request raises `TaskIdConflict` (ALREADY_EXISTS),
        nothing written. The check and the XADD are one Lua script, so two
        racing submits of one id add exactly one entry.
        """
        (outcome,) = await self.submit_tasks([task_fields])
        if outcome is SubmitOutcome.CONFLICT:
            raise TaskIdConflict(
                f"request_id {task_fields.get(TASK_ID_FIELD)!r} was already used with a "
                "different request; use a new id"
            )
        return outcome is SubmitOutcome.ADDED

    async def submit_tasks(
        self, tasks_fields: Sequence[Mapping[str, FieldValue]], *, hold: GatewayHold | None = None
    ) -> list[SubmitOutcome]:
        """`submit_task` for several tasks, in one round trip, an outcome per
        task (a conflict is reported, not raised: nothing of that task is
        written, the others are). With `hold`, the gateway's lease and reader
        wake (`StoreBase.queue_gateway_hold`) go first in the same round
        trip: Redis runs a connection's commands in order, so the lease is
        live before any task it covers exists."""
        encoded = [encode_fields(fields) for fields in tasks_fields]
        for fields in encoded:
            if not fields.get(TASK_ID_FIELD, ""):
                raise ValueError(f"task fields need a non-empty {TASK_ID_FIELD!r}")
        pipe = self.client.pipeline(transaction=False)
        if hold is not None:
            self.queue_gateway_hold(
                pipe, hold.owner, lease_ttl_s=hold.lease_ttl_s, wake=hold.is_wake
            )
        state = flatten(
            encode_fields(
                {
                    STATUS_FIELD: StoredStatus.QUEUED,
                    ATTEMPT_FIELD: FIRST_ATTEMPT,
                    "queued_t": time.time(),
                }
            )
        )
        for fields in encoded:
            task_id = fields[TASK_ID_FIELD]
            self.queue_script(
                pipe,
                self._submit,
                keys=[self.keys.dedupe(task_id), self.keys.intake_stream, self.keys.task(task_id)],
                args=[
                    self._dedupe_ttl_ms,
                    request_hash(fields),
                    len(state),
                    *state,
                    *flatten(fields),
                ],
            )
        replies = await self.execute_scripted(pipe)
        return [SubmitOutcome(int(reply)) for reply in replies[len(replies) - len(encoded) :]]

    async def ensure_group(self) -> None:
        """Create the intake stream and its consumer group if missing.

        The group starts at id 0, so tasks submitted before any scheduler ran
        are delivered too.
        """
        try:
            await self.client.xgroup_create(
                self.keys.intake_stream, self.keys.intake_group, id="0", mkstream=True
            )
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read_intake(
        self,
        consumer: str,
        count: int = 100,
        block_ms: int | None = None,
        *,
        ack_first: Sequence[str] = (),
    ) -> list[Entry]:
        """New intake entries for `consumer` (XREADGROUP ``>``).

        ``block_ms=None`` returns at once; a positive value waits up to that long
        for the first entry (``0`` waits forever). The client's socket timeout
        must exceed `block_ms`. Entries stay pending for `consumer` until
        `ack_intake`/`accept_task`, or until a read that acks them first
        (`ack_first`: `ack_intake` in the same pipelined round trip, ahead of
        the read; Redis runs them in order, so once this returns they are
        acked and deleted); a missing group (e.g. Redis restarted without
        AOF) is re-created.
        """
        stream, group = self.keys.intake_stream, self.keys.intake_group
        for attempt in range(2):
            try:
                if not ack_first:
                    response = await self.client.xreadgroup(
                        group, consumer, {stream: ">"}, count=count, block=block_ms
                    )
                    return stream_entries(response)
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.xack(stream, group, *ack_first)
                    pipe.xdel(stream, *ack_first)
                    pipe.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
                    *_, response = await pipe.execute()
                return stream_entries(response)
            except ResponseError as exc:
                if "NOGROUP" not in str(exc) or attempt:
                    raise
                await self.ensure_group()
        return []  # unreachable; keeps mypy's return check simple

    async def ack_intake(self, entry_ids: Sequence[str]) -> int:
        """Ack and delete intake entries in one pipelined round trip; returns
        the number acked.

        Deleting keeps the intake bounded; the scheduler's event log, not the
        intake stream, is the record for replay. Not a MULTI/EXEC (two
        commands more per batch): Redis runs the pipeline in order, and were
        it cut between the two, an entry would be acked and left in the
        stream (never delivered again), not deleted while still pending.
        """
        if not entry_ids:
            return 0
        stream, group = self.keys.intake_stream, self.keys.intake_group
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.xack(stream, group, *entry_ids)
            pipe.xdel(stream, *entry_ids)
            num_acked, _ = await pipe.execute()
        return int(num_acked)

    async def accept_task(
        self, entry_id: str, task_id: str, state_fields: Mapping[str, FieldValue]
    ) -> None:
        """Record a task's state and ack its intake entry in one MULTI/EXEC.

        The claim-then-ack step of the scheduler: once this returns the task
        lives in its state hash, and a crash before it re-delivers the entry.
        """
        stream, group = self.keys.intake_stream, self.keys.intake_group
        fields = encode_fields(state_fields)
        async with self.client.pipeline(transaction=True) as pipe:
            if fields:
                pipe.hset(self.keys.task(task_id), mapping=fields)  # type: ignore[arg-type]
            pipe.xack(stream, group, entry_id)
            pipe.xdel(stream, entry_id)
            await pipe.execute()

    async def claim_stale(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[Entry]:
        """Take over intake entries pending longer than `min_idle_ms` (XAUTOCLAIM).

        For scheduler restarts: what a dead consumer read but never acked is
        re-delivered to `consumer`. Walks the whole pending list, `count`
        entries per call.
        """
        stream, group = self.keys.intake_stream, self.keys.intake_group
        claimed: list[Entry] = []
        start = "0-0"
        try:
            while True:
                response = await self.client.xautoclaim(
                    stream, group, consumer, min_idle_ms, start_id=start, count=count
                )
                start, entries = response[0], response[1]
                # A pending entry deleted from the stream comes back as None on
                # 6.2 (without its id; it stays pending) and is dropped from the
                # PEL by Redis >= 7. This store only deletes acked entries.
                claimed.extend(
                    (str(entry_id), as_fields(fields))
                    for entry_id, fields in entries
                    if entry_id is not None and fields
                )
                if start == "0-0":
                    return claimed
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self.ensure_group()
            return claimed

    async def intake_last_id(self) -> str:
        """The id of the newest entry ever added to the intake stream ("0-0":
        none, or no stream yet); deleted entries count."""
        try:
            info = await self.client.xinfo_stream(self.keys.intake_stream)
        except ResponseError as exc:
            if "no such key" not in str(exc).lower():
                raise
            return "0-0"
        return str(info["last-generated-id"])

    async def pending_count(self) -> int:
        """Intake entries delivered to some consumer and not yet acked."""
        try:
            summary = await self.client.xpending(self.keys.intake_stream, self.keys.intake_group)
        except ResponseError as exc:
            if "NOGROUP" in str(exc):
                return 0
            raise
        return int(summary["pending"])

    async def read_intake_entries(self, end: str = "+", count: int | None = None) -> list[Entry]:
        """Intake entries from the oldest up to `end` (an entry id, or a
        millisecond time) inclusive: tasks stored by Submit that no scheduler has
        taken yet (taking one deletes it)."""
        return range_entries(
            await self.client.xrange(self.keys.intake_stream, "-", end, count=count)
        )

    async def accept_intake(
        self, items: Sequence[tuple[str, Mapping[str, FieldValue]]]
    ) -> list[IntakeCheck]:
        """The scheduler's intake step for (task_id, state fields) items, in
        one pipelined round trip: per task its `IntakeCheck`, and, for a task
        neither final nor cancelled, its state fields merged into its hash
        with its next placement numbered (`attempt` + 1), in the same atomic
        step (`scripts.ACCEPT_LUA`, one call per `TASKS_PER_SCRIPT_CALL`
        tasks; a gateway's lease is read once per call, not once per task)."""
        if not items:
            return []
        pipe = self.client.pipeline(transaction=False)
        for chunk in chunks(items):
            counts, values = batch_items(chunk, "accept_intake")
            keys: list[str] = []
            for task_id, fields in chunk:
                gateway_id = str(fields.get(GATEWAY_ID_FIELD) or "")
                task_key = self.keys.task(task_id)
                # No gateway: the task's own hash stands in (the script reads
                # that as "no lease"), keeping two keys per task.
                lease_key = self.keys.gateway_lease(gateway_id) if gateway_id else task_key
                keys += [task_key, lease_key]
            self.queue_script(pipe, self._accept, keys, [len(chunk), *counts, *values])
        flags = [int(flag) for reply in await self.execute_scripted(pipe) for flag in reply]
        return [
            IntakeCheck(bool(flags[i]), bool(flags[i + 1]), bool(flags[i + 2]), flags[i + 3])
            for i in range(0, len(flags), 4)
        ]

    async def add_task_gateway(self, task_id: str, gateway_id: str) -> None:
        """Record that gateway `gateway_id` streams the task too (a retry
        through it; `task_hash.gateways_of` reads it back after a restart)."""
        await self.client.hset(self.keys.task(task_id), f"{ALSO_GATEWAY_PREFIX}{gateway_id}", "1")

    async def also_gateways(self, task_ids: Sequence[str]) -> dict[str, set[str]]:
        """Per task, the gateways `add_task_gateway` recorded (one round trip)."""
        if not task_ids:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hkeys(self.keys.task(task_id))
        replies = await pipe.execute()
        return {
            task_id: {
                name[len(ALSO_GATEWAY_PREFIX) :]
                for name in names
                if name.startswith(ALSO_GATEWAY_PREFIX)
            }
            for task_id, names in zip(task_ids, replies, strict=True)
        }

    async def mark_cancelled(self, task_id: str, ttl_s: float = 3600.0) -> None:
        """Mark the task cancelled before placement (`CANCELLED_FIELD` in its
        hash; a hash this creates expires after `ttl_s`): the intake loop ends
        it instead of placing it."""
        await self._mark_cancelled(keys=[self.keys.task(task_id)], args=[to_ms(ttl_s, "ttl_s")])

    async def is_cancelled(self, task_id: str) -> bool:
        """Whether `mark_cancelled` marked the task (and the mark is live)."""
        return bool(await self.client.hexists(self.keys.task(task_id), CANCELLED_FIELD))
