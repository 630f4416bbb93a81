"""Typed Redis operations of the LeMix services (async, `redis.asyncio`).

One `Store` wraps a client created with ``decode_responses=True`` and a
`RedisKeys`. Services call its methods and never spell a key or a command.

Rules it keeps (STYLE.md, "Redis hygiene", arq as the model):

- Every task is keyed by id. `submit_task` is idempotent (a dedupe key set in
  the same Lua script as the XADD); `finish_task` happens once per task (a
  second call is a no-op), and `set_task_state` cannot overwrite a final state,
  so a redelivered task cannot publish two results.
- A result and the state that records it are written in one Lua script
  (`finish_task`); recording a task and acking its intake entry is one
  MULTI/EXEC (`accept_task`). Readers never see one half.
- Hot paths take one round trip: `append_outputs_batch` pipelines a whole
  executor iteration's tokens (`append_outputs_fenced`, the executor's, does
  it in one script call, fenced by attempt: section "fencing").

Field values are strings on the wire. `encode_fields` and the ``get_*``
helpers below are the one place numbers, booleans and ``None`` are converted.
The store assumes one Redis instance (no cluster): scripts touch several keys.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any, NamedTuple, TypeVar

import grpc
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from lemix.infra import telemetry
from lemix.infra.rpc.errors import ServiceError
from lemix.infra.store.keys import (
    DEDUPE_TTL_S,
    NODE_HEARTBEAT_TTL_S,
    OUTPUT_MAXLEN,
    STREAM_LEASE_TTL_S,
    RedisKeys,
)

FieldValue = str | int | float | bool | None
Fields = dict[str, str]
Entry = tuple[str, Fields]  # (stream entry id, fields)

# Field names the store itself writes into task hashes and output streams.
TASK_ID_FIELD = "task_id"
STATUS_FIELD = "status"
REASON_FIELD = "reason"
IS_FINAL_FIELD = "is_final"  # "1" on a finished task's hash and its last output message

# ------------------------------------------------------------------ codec


def encode_value(value: FieldValue) -> str:
    """One field value as a string: bools as "1"/"0", floats exactly, None as ""."""
    if value is None:
        return ""
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "1" if value else "0"
    if isinstance(value, str):
        return str(value)  # plain str, also for StrEnum members
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # shortest text that round-trips exactly
    raise TypeError(f"cannot store {type(value).__name__} in a Redis field: {value!r}")


def encode_fields(fields: Mapping[str, FieldValue]) -> Fields:
    """A mapping as str -> str, ready for HSET/XADD."""
    return {str(name): encode_value(value) for name, value in fields.items()}


def get_int(fields: Mapping[str, str], name: str, default: int = 0) -> int:
    """`fields[name]` as an int; `default` when missing or empty."""
    text = fields.get(name, "")
    return int(text) if text else default


def get_float(fields: Mapping[str, str], name: str, default: float = 0.0) -> float:
    """`fields[name]` as a float; `default` when missing or empty."""
    text = fields.get(name, "")
    return float(text) if text else default


def get_optional_float(fields: Mapping[str, str], name: str) -> float | None:
    """`fields[name]` as a float, or None when missing or empty (encoded None)."""
    text = fields.get(name, "")
    return float(text) if text else None


def get_optional_int(fields: Mapping[str, str], name: str) -> int | None:
    """`fields[name]` as an int, or None when missing or empty (encoded None)."""
    text = fields.get(name, "")
    return int(text) if text else None


def get_bool(fields: Mapping[str, str], name: str, default: bool = False) -> bool:
    """`fields[name]` as a bool ("1"/"0"); `default` when missing or empty."""
    text = fields.get(name, "")
    return text == "1" if text else default


def _ms(seconds: float, what: str) -> int:
    if seconds <= 0:
        raise ValueError(f"{what} must be > 0 seconds, got {seconds}")
    return max(1, round(seconds * 1000))


def _flatten(fields: Fields) -> list[str]:
    return [item for pair in fields.items() for item in pair]


def _as_fields(raw: Any) -> Fields:
    """A decoded reply mapping (None for a deleted stream entry) as str -> str."""
    return {str(name): str(value) for name, value in (raw or {}).items()}


def _named_fields(names: Sequence[str], values: Sequence[Any]) -> Fields:
    """An HMGET reply as {name: value} for the fields that are set."""
    return {
        name: str(value) for name, value in zip(names, values, strict=True) if value is not None
    }


def _glob_escape(text: str) -> str:
    """`text` matched literally in a SCAN/KEYS pattern."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


def _stream_entries(response: Any) -> list[Entry]:
    """Entries of a single-stream XREAD/XREADGROUP reply (RESP2 list or RESP3 dict)."""
    if not response:
        return []
    streams = response.values() if isinstance(response, dict) else (s[1] for s in response)
    entries: list[Entry] = []
    for stream in streams:
        # RESP3 XREADGROUP nests the entries one level deeper.
        items = stream[0] if stream and isinstance(stream[0], list) else stream
        entries.extend((str(entry_id), _as_fields(fields)) for entry_id, fields in items)
    return entries


# ------------------------------------------------------------------ scripts

# KEYS[1] dedupe key, KEYS[2] intake stream.
# ARGV[1] dedupe TTL in ms; ARGV[2] the request's hash (`request_hash`);
# ARGV[3..] the task's field/value items.
# The dedupe key holds "<intake entry id> <request hash>" (a marker written
# before hashes existed holds the entry id alone: its hash is unknown, so any
# payload counts as the same request).
# Returns 1 (added), 0 (same id, same request: nothing written) or -1 (same id,
# another request: nothing written).
_SUBMIT_LUA = """
local seen = redis.call('GET', KEYS[1])
if seen then
  local hash = string.match(seen, ' (%x+)$')
  if hash and hash ~= ARGV[2] then
    return -1
  end
  return 0
end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('SET', KEYS[1], id .. ' ' .. ARGV[2], 'PX', ARGV[1])
return 1
"""

# Task fields that differ between two Submits of one request (stamped by the
# submitter or on intake), so they are not part of its hash: the scheduler's
# submit wall time (`services.scheduler.codec.SUBMIT_T_FIELD`), arrival time
# and arrival order.
UNHASHED_TASK_FIELDS = frozenset({"submit_t", "arrival_s", "seq"})


def request_hash(fields: Mapping[str, str]) -> str:
    """Hex SHA-256 of a task's encoded fields, less `UNHASHED_TASK_FIELDS`:
    what makes two Submits of one task id the same request."""
    digest = hashlib.sha256()
    for name in sorted(fields):
        if name not in UNHASHED_TASK_FIELDS:
            # Length-prefixed, so no choice of values can make two field sets
            # serialize alike.
            for part in (name, fields[name]):
                data = part.encode("utf-8")
                digest.update(len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


class TaskIdConflict(ServiceError):
    """A Submit reuses a task id (a client's `request_id`) for a different
    request. Retrying cannot succeed: the client must pick a new id."""

    code = grpc.StatusCode.ALREADY_EXISTS


# KEYS[1] task state hash. ARGV: field/value items.
# Returns 1, or 0 when the task is already final (its state is then kept).
_SET_STATE_LUA = """
if redis.call('HGET', KEYS[1], 'is_final') == '1' then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

# KEYS[1] task state hash, KEYS[2] output stream.
# ARGV[1] output MAXLEN (approximate), ARGV[2] TTL in ms for both keys (0: none),
# ARGV[3] n = number of state items, ARGV[4 .. 3+n] state field/value items,
# ARGV[4+n ..] the final output message's field/value items.
# Returns the output entry id, or false when the task was already final.
_FINISH_LUA = """
if redis.call('HGET', KEYS[1], 'is_final') == '1' then
  return false
end
local n = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], unpack(ARGV, 4, 3 + n))
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 4 + n))
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return id
"""


class StoredTask(NamedTuple):
    """What Redis holds about one task id (`Store.get_task_states`)."""

    fields: Fields  # the asked-for fields of its state hash that are set ({}: no hash)
    is_submitted: bool  # its intake dedupe marker exists: a Submit stored it
    has_output: bool  # its output stream exists: its node produced output for it


# KEYS[1] task state hash, KEYS[2] output stream. ARGV[1] TTL in ms.
# Expires both only when the task is final; returns 1 then, else 0.
_EXPIRE_FINISHED_LUA = """
if redis.call('HGET', KEYS[1], 'is_final') ~= '1' then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""

# Fencing (services/PROTOCOL.md, "Fencing"): a task hash's ATTEMPT_FIELD is
# the attempt number of its current placement; an executor's write for an
# older attempt is dropped. A hash without the field fences nothing.
ATTEMPT_FIELD = "attempt"

# One executor iteration's token messages. Per message i: KEYS[2i-1] its task
# hash, KEYS[2i] its output stream. ARGV[1] output MAXLEN (approximate); then
# per message: the writer's attempt, the number n of field/value items, the n
# items. A message is appended only while its hash's attempt is unset or equal
# (read once per hash per call). Returns per message its entry id, or false
# when fenced (nothing written for it).
_APPEND_FENCED_LUA = """
local written = {}
local held_of = {}
local at = 2
for i = 1, #KEYS / 2 do
  local hash = KEYS[2 * i - 1]
  local n = tonumber(ARGV[at + 1])
  local held = held_of[hash]
  if held == nil then
    held = redis.call('HGET', hash, 'attempt')
    held_of[hash] = held
  end
  if held == false or held == ARGV[at] then
    written[i] = redis.call('XADD', KEYS[2 * i], 'MAXLEN', '~', ARGV[1], '*',
                            unpack(ARGV, at + 2, at + 1 + n))
  else
    written[i] = false
  end
  at = at + 2 + n
end
return written
"""

# `_FINISH_LUA`, fenced: ARGV[1] is the writer's attempt, ARGV[2..] are
# `_FINISH_LUA`'s ARGV. Returns 1 (ended), 0 (already final) or -1 (fenced:
# the hash's attempt is set and differs); nothing is written unless 1.
_FINISH_FENCED_LUA = """
local held = redis.call('HGET', KEYS[1], 'attempt')
if held and held ~= ARGV[1] then
  return -1
end
if redis.call('HGET', KEYS[1], 'is_final') == '1' then
  return 0
end
local n = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], unpack(ARGV, 5, 4 + n))
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 5 + n))
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return 1
"""

# KEYS[1] task hash, KEYS[2] output stream; ARGV[1] the attempt taken away.
# Makes it stale (attempt := ARGV[1] + 1) unless a newer placement already
# moved past it; a missing hash is not created. Then, in the same step, reads
# {is_final, status, output stream exists}: any output that exists was written
# before the fence, and none can follow from that attempt.
_FENCE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local held = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0')
  local taken = tonumber(ARGV[1])
  if held <= taken then
    redis.call('HSET', KEYS[1], 'attempt', taken + 1)
  end
end
return {redis.call('HGET', KEYS[1], 'is_final') or '',
        redis.call('HGET', KEYS[1], 'status') or '',
        redis.call('EXISTS', KEYS[2])}
"""


class FinishOutcome(StrEnum):
    """What a fenced `Store.finish_task_fenced` did."""

    ENDED = "ended"  # this call wrote the final state and end message
    ALREADY_FINAL = "already_final"  # the task had ended: nothing written
    FENCED = "fenced"  # the task was placed again since: nothing written


class FencedProgress(NamedTuple):
    """A task's state right after `Store.fence_attempts` fenced it."""

    is_final: bool
    status: str  # its final status when `is_final`
    has_output: bool  # its output stream exists


_C = TypeVar("_C", bound=type)


def _counted(op: str, method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(method)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await method(*args, **kwargs)
        except (RedisError, OSError):
            telemetry.observe_redis_error(op)
            raise

    return wrapper


def _count_redis_errors(cls: _C) -> _C:
    """Every public async method counts its Redis failures in
    `lemix_redis_errors_total{op=<method>}`: the store's one error path."""
    for name, member in list(vars(cls).items()):
        if not name.startswith("_") and inspect.iscoroutinefunction(member):
            setattr(cls, name, _counted(name, member))
    return cls


@_count_redis_errors
class Store:
    """The services' Redis operations, over a ``decode_responses=True`` client.

    `output_maxlen` approximately caps each output stream; `dedupe_ttl_s` is how
    long a submitted task id is remembered by `submit_task`.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: RedisKeys | None = None,
        *,
        output_maxlen: int = OUTPUT_MAXLEN,
        dedupe_ttl_s: float = DEDUPE_TTL_S,
    ) -> None:
        if output_maxlen <= 0:
            raise ValueError(f"output_maxlen must be > 0, got {output_maxlen}")
        if not client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("Store needs a client created with decode_responses=True")
        self.client = client
        self.keys = keys if keys is not None else RedisKeys()
        self.output_maxlen = output_maxlen
        self._dedupe_ttl_ms = _ms(dedupe_ttl_s, "dedupe_ttl_s")
        self._submit = client.register_script(_SUBMIT_LUA)
        self._set_state = client.register_script(_SET_STATE_LUA)
        self._finish = client.register_script(_FINISH_LUA)
        self._append_fenced = client.register_script(_APPEND_FENCED_LUA)
        self._finish_fenced = client.register_script(_FINISH_FENCED_LUA)
        self._fence = client.register_script(_FENCE_LUA)

    # ================================================================ intake

    async def submit_task(self, task_fields: Mapping[str, FieldValue]) -> bool:
        """Append a task to the intake stream unless its ``task_id`` was seen.

        Returns True when added, False for a duplicate: the same id with the
        same request (`request_hash` of the fields), nothing written. The same
        id with a different request raises `TaskIdConflict` (ALREADY_EXISTS),
        nothing written. The check and the XADD are one Lua script, so two
        racing submits of one id add exactly one entry.
        """
        fields = encode_fields(task_fields)
        task_id = fields.get(TASK_ID_FIELD, "")
        if not task_id:
            raise ValueError(f"task fields need a non-empty {TASK_ID_FIELD!r}")
        outcome = int(
            await self._submit(
                keys=[self.keys.dedupe(task_id), self.keys.intake_stream],
                args=[self._dedupe_ttl_ms, request_hash(fields), *_flatten(fields)],
            )
        )
        if outcome < 0:
            raise TaskIdConflict(
                f"request_id {task_id!r} was already used with a different request; use a new id"
            )
        return outcome > 0

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
        self, consumer: str, count: int = 100, block_ms: int | None = None
    ) -> list[Entry]:
        """New intake entries for `consumer` (XREADGROUP ``>``).

        ``block_ms=None`` returns at once; a positive value waits up to that long
        for the first entry (``0`` waits forever). The client's socket timeout
        must exceed `block_ms`. Entries stay pending for `consumer` until
        `ack_intake`/`accept_task`; a missing group (e.g. Redis restarted
        without AOF) is re-created.
        """
        for attempt in range(2):
            try:
                response = await self.client.xreadgroup(
                    self.keys.intake_group,
                    consumer,
                    {self.keys.intake_stream: ">"},
                    count=count,
                    block=block_ms,
                )
                return _stream_entries(response)
            except ResponseError as exc:
                if "NOGROUP" not in str(exc) or attempt:
                    raise
                await self.ensure_group()
        return []  # unreachable; keeps mypy's return check simple

    async def ack_intake(self, entry_ids: Sequence[str]) -> int:
        """Ack and delete intake entries in one MULTI/EXEC; returns the number acked.

        Deleting keeps the intake bounded; the scheduler's event log, not the
        intake stream, is the record for replay.
        """
        if not entry_ids:
            return 0
        stream, group = self.keys.intake_stream, self.keys.intake_group
        async with self.client.pipeline(transaction=True) as pipe:
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
                    (str(entry_id), _as_fields(fields))
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

    async def pending_count(self) -> int:
        """Intake entries delivered to some consumer and not yet acked."""
        try:
            summary = await self.client.xpending(self.keys.intake_stream, self.keys.intake_group)
        except ResponseError as exc:
            if "NOGROUP" in str(exc):
                return 0
            raise
        return int(summary["pending"])

    # ============================================================ task state

    async def set_task_state(self, task_id: str, fields: Mapping[str, FieldValue]) -> bool:
        """Merge `fields` into the task's state hash (status, node_id, times...).

        Returns False, changing nothing, when the task is already final: a late
        or redelivered update cannot undo `finish_task`.
        """
        encoded = encode_fields(fields)
        if not encoded:
            raise ValueError("set_task_state needs at least one field")
        done = await self._set_state(keys=[self.keys.task(task_id)], args=_flatten(encoded))
        return bool(int(done))

    async def set_task_states(
        self, updates: Sequence[tuple[str, Mapping[str, FieldValue]]]
    ) -> list[bool]:
        """`set_task_state` for many tasks in one pipelined round trip."""
        if not updates:
            return []
        pipe = self.client.pipeline(transaction=False)
        for task_id, fields in updates:
            encoded = encode_fields(fields)
            if not encoded:
                raise ValueError("set_task_states needs at least one field per task")
            await self._set_state(
                keys=[self.keys.task(task_id)], args=_flatten(encoded), client=pipe
            )
        return [bool(int(done)) for done in await pipe.execute()]

    async def intake_lookup(self, task_ids: Sequence[str]) -> list[tuple[bool, bool]]:
        """Per task: (is it final already, was it cancelled before placement),
        in one pipelined round trip (the scheduler's intake checks)."""
        if not task_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hget(self.keys.task(task_id), IS_FINAL_FIELD)
            pipe.exists(self.keys.cancelled(task_id))
        replies = await pipe.execute()
        return [(replies[2 * i] == "1", bool(replies[2 * i + 1])) for i in range(len(task_ids))]

    async def get_task_state(self, task_id: str) -> Fields:
        """The task's state hash; empty when unknown (or expired)."""
        return _as_fields(await self.client.hgetall(self.keys.task(task_id)))

    async def finish_task(
        self,
        task_id: str,
        status: str,
        reason: str = "",
        output_fields: Mapping[str, FieldValue] | None = None,
        *,
        state_fields: Mapping[str, FieldValue] | None = None,
        ttl_s: float | None = None,
        attempt: int | None = None,
    ) -> bool:
        """Write the final state and append the final output message, atomically.

        Both carry ``status``, ``reason`` and ``is_final="1"``; `output_fields`
        go into the message (e.g. token counts, loss) and `state_fields` into the
        hash (e.g. ``finish_s``). One Lua script: a reader sees both or neither.
        Returns False, writing nothing, when the task was already finished.
        `ttl_s`, if given, expires both keys after that long. Append this task's
        last tokens (and await that) before calling this. With `attempt` the
        write is fenced (`finish_task_fenced`): False, nothing written, also
        when the task was placed again since.
        """
        if attempt is not None:
            outcome = await self.finish_task_fenced(
                task_id,
                attempt,
                status,
                reason,
                output_fields,
                state_fields=state_fields,
                ttl_s=ttl_s,
            )
            return outcome is FinishOutcome.ENDED
        final = {STATUS_FIELD: str(status), REASON_FIELD: reason, IS_FINAL_FIELD: "1"}
        state = {**encode_fields(state_fields or {}), **final}
        message = {**encode_fields(output_fields or {}), **final}
        ttl_ms = 0 if ttl_s is None else _ms(ttl_s, "ttl_s")
        state_items = _flatten(state)
        entry_id = await self._finish(
            keys=[self.keys.task(task_id), self.keys.output(task_id)],
            args=[self.output_maxlen, ttl_ms, len(state_items), *state_items, *_flatten(message)],
        )
        return entry_id is not None

    # =============================================================== outputs

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
        return _stream_entries(response)

    async def expire_output(self, task_id: str, ttl_s: float) -> None:
        """Drop the task's output stream `ttl_s` after now (readers are done)."""
        await self.client.pexpire(self.keys.output(task_id), _ms(ttl_s, "ttl_s"))

    # ============================================================== fencing
    # Attempt numbers fence stale executors (services/PROTOCOL.md, "Fencing"):
    # the scheduler numbers each placement in the task hash before its
    # Dispatch; an executor's writes carry its attempt and land only while it
    # is current. Each op is one round trip for the whole batch.

    async def begin_attempts(
        self, task_ids: Sequence[str], check_cancelled: Sequence[str] = ()
    ) -> tuple[list[int], list[bool]]:
        """Number a new placement of each task (HINCRBY of its attempt: 1 the
        first time) and tell, per id of `check_cancelled`, whether it was
        cancelled; one pipelined round trip. Call before the Dispatch."""
        if not task_ids and not check_cancelled:
            return [], []
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hincrby(self.keys.task(task_id), ATTEMPT_FIELD, 1)
        for task_id in check_cancelled:
            pipe.exists(self.keys.cancelled(task_id))
        replies = await pipe.execute()
        num = len(task_ids)
        return [int(n) for n in replies[:num]], [bool(n) for n in replies[num:]]

    async def fence_attempts(self, taken: Sequence[tuple[str, int]]) -> list[FencedProgress]:
        """Make each (task_id, attempt) stale, unless the task was placed again
        since, and read what it left (final? output?) in the same atomic step
        (`_FENCE_LUA`): a node's tasks taken away cannot write after this.
        One pipelined round trip; a task with no hash is not created."""
        if not taken:
            return []
        pipe = self.client.pipeline(transaction=False)
        for task_id, attempt in taken:
            await self._fence(
                keys=[self.keys.task(task_id), self.keys.output(task_id)],
                args=[int(attempt)],
                client=pipe,
            )
        return [
            FencedProgress(str(is_final) == "1", str(status), bool(int(has_output)))
            for is_final, status, has_output in await pipe.execute()
        ]

    async def append_outputs_fenced(
        self, items: Sequence[tuple[str, int, Mapping[str, FieldValue]]]
    ) -> list[str | None]:
        """`append_outputs_batch` for (task_id, attempt, fields), fenced: a
        message is appended only while its task's attempt is `attempt` (or the
        hash has none). ONE script call (EVALSHA) for the whole batch; per
        message its entry id, or None when fenced."""
        if not items:
            return []
        keys: list[str] = []
        args: list[str | int] = [self.output_maxlen]
        for task_id, attempt, fields in items:
            keys += [self.keys.task(task_id), self.keys.output(task_id)]
            flat = _flatten(encode_fields(fields))
            args += [int(attempt), len(flat), *flat]
        replies = await self._append_fenced(keys=keys, args=args)
        # A Lua table converts to a list up to its first nil; false -> None.
        written = list(replies or [])
        written += [None] * (len(items) - len(written))
        return [None if entry_id is None else str(entry_id) for entry_id in written]

    async def finish_task_fenced(
        self,
        task_id: str,
        attempt: int,
        status: str,
        reason: str = "",
        output_fields: Mapping[str, FieldValue] | None = None,
        *,
        state_fields: Mapping[str, FieldValue] | None = None,
        ttl_s: float | None = None,
    ) -> FinishOutcome:
        """`finish_task`, written only while the task's attempt is `attempt`
        (or its hash has none); says whether it ended the task, found it
        final, or was fenced."""
        final = {STATUS_FIELD: str(status), REASON_FIELD: reason, IS_FINAL_FIELD: "1"}
        state_items = _flatten({**encode_fields(state_fields or {}), **final})
        message = {**encode_fields(output_fields or {}), **final}
        ttl_ms = 0 if ttl_s is None else _ms(ttl_s, "ttl_s")
        outcome = int(
            await self._finish_fenced(
                keys=[self.keys.task(task_id), self.keys.output(task_id)],
                args=[
                    int(attempt),
                    self.output_maxlen,
                    ttl_ms,
                    len(state_items),
                    *state_items,
                    *_flatten(message),
                ],
            )
        )
        if outcome > 0:
            return FinishOutcome.ENDED
        return FinishOutcome.ALREADY_FINAL if outcome == 0 else FinishOutcome.FENCED

    # ============================================================ node state

    async def put_node_state(
        self,
        node_id: int,
        fields: Mapping[str, FieldValue],
        ttl_s: float = NODE_HEARTBEAT_TTL_S,
    ) -> None:
        """Replace the node's state hash and renew its heartbeat (TTL `ttl_s`).

        One MULTI/EXEC: the hash is replaced whole (no stale fields survive) and
        the node id is added to the node set.
        """
        ttl_ms = _ms(ttl_s, "ttl_s")
        encoded = encode_fields(fields)
        state_key = self.keys.node_state(node_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(state_key)
            if encoded:
                pipe.hset(state_key, mapping=encoded)  # type: ignore[arg-type]
            pipe.set(self.keys.node_heartbeat(node_id), "1", px=ttl_ms)
            pipe.sadd(self.keys.nodes, str(int(node_id)))
            await pipe.execute()

    async def get_node_states(self) -> dict[int, Fields]:
        """State of every live node (heartbeat not expired), by node id."""
        node_ids = sorted(int(n) for n in await self.client.smembers(self.keys.nodes))
        if not node_ids:
            return {}
        async with self.client.pipeline(transaction=True) as pipe:
            for node_id in node_ids:
                pipe.exists(self.keys.node_heartbeat(node_id))
                pipe.hgetall(self.keys.node_state(node_id))
            replies = await pipe.execute()
        states: dict[int, Fields] = {}
        for i, node_id in enumerate(node_ids):
            is_alive, fields = replies[2 * i], replies[2 * i + 1]
            if is_alive:
                states[node_id] = _as_fields(fields)
        return states

    # =========================================================== completions

    async def append_completion(self, fields: Mapping[str, FieldValue]) -> str:
        """An executor reports a task's end (task_id, node_id, status, reason)."""
        entry_id = await self.client.xadd(
            self.keys.completions_stream,
            encode_fields(fields),  # type: ignore[arg-type]
        )
        return str(entry_id)

    async def read_completions(
        self, last_id: str, block_ms: int | None = None, count: int = 500
    ) -> list[Entry]:
        """Completions after `last_id` (XREAD; one reader, the scheduler)."""
        reply = await self.client.xread(
            {self.keys.completions_stream: last_id}, count=count, block=block_ms
        )
        streams: list[Any] = list(reply or [])  # type: ignore[arg-type]
        entries: list[Entry] = []
        for _stream, items in streams:
            entries.extend((str(i), dict(f)) for i, f in items)
        return entries

    async def set_completions_cursor(self, entry_id: str) -> None:
        await self.client.set(self.keys.completions_cursor, entry_id)

    async def get_completions_cursor(self) -> str:
        value = await self.client.get(self.keys.completions_cursor)
        return str(value) if value else "0-0"

    async def mark_cancelled(self, task_id: str, ttl_s: float = 3600.0) -> None:
        await self.client.set(self.keys.cancelled(task_id), "1", px=int(ttl_s * 1000))

    async def is_cancelled(self, task_id: str) -> bool:
        return bool(await self.client.exists(self.keys.cancelled(task_id)))

    # ========================================================= stream leases

    async def renew_stream_leases(
        self, owner: str, task_ids: Sequence[str], ttl_s: float = STREAM_LEASE_TTL_S
    ) -> None:
        """(Re)take `owner`'s lease on every stream in `task_ids`, one round trip."""
        if not task_ids:
            return
        ttl_ms = _ms(ttl_s, "ttl_s")
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.set(self.keys.stream_lease(task_id), owner, px=ttl_ms)
        await pipe.execute()

    async def drop_stream_lease(self, task_id: str) -> None:
        """The reader is done with the stream (it ended or was cancelled)."""
        await self.client.delete(self.keys.stream_lease(task_id))

    async def stream_leases_held(self, task_ids: Sequence[str]) -> list[bool]:
        """Per task: is a gateway's lease on its stream live? One round trip."""
        if not task_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.exists(self.keys.stream_lease(task_id))
        return [bool(n) for n in await pipe.execute()]

    async def scheduler_epoch(self, now_epoch_s: float) -> float:
        """The planner's time origin: set once (NX), then read back forever."""
        await self.client.set(self.keys.scheduler_epoch, repr(now_epoch_s), nx=True)
        value = await self.client.get(self.keys.scheduler_epoch)
        return float(str(value))

    # ================================================================ events

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
        entries = await self.client.xrange(self.keys.events_stream, start, end, count=count)
        return [(str(entry_id), _as_fields(fields)) for entry_id, fields in entries or []]

    # ================================================= scheduler restart
    # The scheduler records a snapshot of its planner into the event log every
    # so many events (services/scheduler/recovery.py); once one is stored,
    # everything before it is trimmed, so the log and restarts stay bounded.
    # A restart then reads the hashes of the tasks it still holds in batches.

    async def trim_events_before(self, entry_id: str) -> int:
        """Delete the event log entries older than `entry_id` (XTRIM MINID,
        exact; `entry_id` itself stays). Returns how many were deleted."""
        return int(
            await self.client.xtrim(self.keys.events_stream, minid=entry_id, approximate=False)
        )

    async def events_length(self) -> int:
        """Entries in the event log (XLEN)."""
        return int(await self.client.xlen(self.keys.events_stream))

    async def get_task_state_hashes(self, task_ids: Sequence[str]) -> list[Fields]:
        """`get_task_state` for many tasks, in order, one pipelined round trip."""
        if not task_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hgetall(self.keys.task(task_id))
        return [_as_fields(reply) for reply in await pipe.execute()]

    # ================================================ scheduler: batched ops
    # The scheduler's per-batch round trips (issue 12): a burst of placements
    # or a node's worth of tasks costs one round trip, never one per task.

    async def intake_checks(self, task_ids: Sequence[str]) -> list[tuple[bool, bool, bool]]:
        """Per task: (is it final already, was it cancelled before placement,
        does a gateway hold a lease on its stream), in one pipelined round trip."""
        if not task_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hget(self.keys.task(task_id), IS_FINAL_FIELD)
            pipe.exists(self.keys.cancelled(task_id))
            pipe.exists(self.keys.stream_lease(task_id))
        replies = await pipe.execute()
        return [
            (replies[3 * i] == "1", bool(replies[3 * i + 1]), bool(replies[3 * i + 2]))
            for i in range(len(task_ids))
        ]

    async def cancelled_many(self, task_ids: Sequence[str]) -> list[bool]:
        """`is_cancelled` for many tasks in one pipelined round trip."""
        if not task_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.exists(self.keys.cancelled(task_id))
        return [bool(n) for n in await pipe.execute()]

    async def finish_tasks(
        self,
        ends: Sequence[tuple[str, str, str]],
        *,
        state_fields: Mapping[str, FieldValue] | None = None,
        output_fields: Mapping[str, FieldValue] | None = None,
        ttl_s: float | None = None,
    ) -> list[bool]:
        """`finish_task` for many (task_id, status, reason) in one pipelined
        round trip; the same extra fields go to every task. Per task: True
        when this call ended it, False when it was already final."""
        if not ends:
            return []
        ttl_ms = 0 if ttl_s is None else _ms(ttl_s, "ttl_s")
        pipe = self.client.pipeline(transaction=False)
        for task_id, status, reason in ends:
            final = {STATUS_FIELD: str(status), REASON_FIELD: reason, IS_FINAL_FIELD: "1"}
            state_items = _flatten({**encode_fields(state_fields or {}), **final})
            message = {**encode_fields(output_fields or {}), **final}
            await self._finish(
                keys=[self.keys.task(task_id), self.keys.output(task_id)],
                args=[
                    self.output_maxlen,
                    ttl_ms,
                    len(state_items),
                    *state_items,
                    *_flatten(message),
                ],
                client=pipe,
            )
        return [entry_id is not None for entry_id in await pipe.execute()]

    async def expire_finished_tasks(self, task_ids: Sequence[str], ttl_s: float) -> int:
        """Expire the state hash and output stream of each task that is final,
        `ttl_s` from now (a task not final is left alone). One round trip;
        returns how many were final."""
        if not task_ids:
            return 0
        script = self.client.register_script(_EXPIRE_FINISHED_LUA)
        ttl_ms = _ms(ttl_s, "ttl_s")
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            await script(
                keys=[self.keys.task(task_id), self.keys.output(task_id)],
                args=[ttl_ms],
                client=pipe,
            )
        return sum(int(n) for n in await pipe.execute())

    async def advance_completions_cursor(self, entry_id: str) -> None:
        """Store the completions cursor and drop the entries before it, in one
        MULTI/EXEC: the scheduler is the stream's one reader, and what it has
        applied is in its event log (XTRIM MINID keeps `entry_id` itself)."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.completions_cursor, entry_id)
            # Exact: "~" trims whole macro nodes only, i.e. nothing on a short stream.
            pipe.xtrim(self.keys.completions_stream, minid=entry_id, approximate=False)
            await pipe.execute()

    async def server_run_id(self) -> str:
        """The Redis server's run id: it changes when the server restarts."""
        info = await self.client.info("server")
        return str(info.get("run_id", ""))

    # ============================================================== profiles

    async def put_profile(self, name: str, json_text: str) -> None:
        """Store a fitted profile (JSON text) under `name`."""
        await self.client.set(self.keys.profile(name), json_text)

    async def get_profile(self, name: str) -> str | None:
        """The profile JSON text stored under `name`, or None."""
        text = await self.client.get(self.keys.profile(name))
        return None if text is None else str(text)

    # ================================================================= stats

    async def incr_stat(self, name: str, by: int = 1) -> int:
        """Add `by` to counter `name`; returns the new value."""
        return int(await self.client.hincrby(self.keys.stats, name, by))

    async def get_stats(self) -> dict[str, int]:
        """All counters."""
        raw = _as_fields(await self.client.hgetall(self.keys.stats))
        return {name: int(value) for name, value in raw.items()}

    # =================================================================== SLO

    async def put_slo(self, ttft_s: float, tbt_s: float) -> None:
        """Publish the SLO pair the scheduler plans for."""
        fields = encode_fields({"ttft_s": ttft_s, "tbt_s": tbt_s})
        await self.client.hset(self.keys.scheduler_slo, mapping=fields)  # type: ignore[arg-type]

    async def get_slo(self) -> tuple[float, float] | None:
        """(ttft_s, tbt_s) as the scheduler published it, or None."""
        fields = _as_fields(await self.client.hgetall(self.keys.scheduler_slo))
        if not fields.get("ttft_s") or not fields.get("tbt_s"):
            return None
        return get_float(fields, "ttft_s"), get_float(fields, "tbt_s")

    # ========================================================= task lookups
    # Readers of per-task truth (GetTask, WatchTasks, AuditTasks): HMGET of
    # named fields only, since a task hash also holds its payload (token ids).

    async def get_task_states(
        self, task_ids: Sequence[str], field_names: Sequence[str]
    ) -> list[StoredTask]:
        """Per task, in order: its `field_names` that are set, whether a Submit
        stored it, whether it has output. One pipelined round trip."""
        if not task_ids:
            return []
        if not field_names:
            raise ValueError("get_task_states needs at least one field name")
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hmget(self.keys.task(task_id), list(field_names))
            pipe.exists(self.keys.dedupe(task_id))
            pipe.exists(self.keys.output(task_id))
        replies = await pipe.execute()
        return [
            StoredTask(
                _named_fields(field_names, replies[3 * i]),
                bool(replies[3 * i + 1]),
                bool(replies[3 * i + 2]),
            )
            for i in range(len(task_ids))
        ]

    async def scan_task_states(
        self, cursor: int, field_names: Sequence[str], count: int = 500
    ) -> tuple[int, list[tuple[str, Fields]]]:
        """One SCAN step over this namespace's task hashes: (next cursor, [(task
        id, its set `field_names`)]). Start at cursor 0; a next cursor of 0 means
        done. SCAN's guarantee holds: a hash present for the whole scan is seen
        (maybe twice); `count` is a hint of keys per step. Two round trips."""
        prefix = self.keys.task("x")[:-1]  # "<namespace>:task:"
        next_cursor, keys = await self.client.scan(
            cursor, match=_glob_escape(prefix) + "*", count=count, _type="hash"
        )
        if not keys:
            return int(next_cursor), []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(key, list(field_names))
        replies = await pipe.execute()
        found = [
            (str(key)[len(prefix) :], _named_fields(field_names, reply))
            for key, reply in zip(keys, replies, strict=True)
        ]
        # A hash deleted (expired) between SCAN and HMGET reads as all-None.
        return int(next_cursor), [(task_id, fields) for task_id, fields in found if fields]

    async def read_intake_entries(self, end: str = "+", count: int | None = None) -> list[Entry]:
        """Intake entries from the oldest up to `end` (an entry id, or a
        millisecond time) inclusive: tasks stored by Submit that no scheduler has
        taken yet (taking one deletes it)."""
        entries = await self.client.xrange(self.keys.intake_stream, "-", end, count=count)
        return [(str(entry_id), _as_fields(fields)) for entry_id, fields in entries or []]

    # ====================================================== gateway upkeep
    # Batched writes of a gateway's background loop (`gateway.upkeep`): one
    # round trip each, whatever the number of requests behind them.

    async def incr_stats(self, deltas: Mapping[str, int]) -> None:
        """Add each `deltas[name]` to counter `name`, one pipelined round trip."""
        if not deltas:
            return
        pipe = self.client.pipeline(transaction=False)
        for name, by in deltas.items():
            pipe.hincrby(self.keys.stats, name, by)
        await pipe.execute()

    async def sync_stream_leases(
        self,
        owner: str,
        renew_ids: Sequence[str],
        drop_ids: Sequence[str],
        ttl_s: float = STREAM_LEASE_TTL_S,
    ) -> None:
        """(Re)take `owner`'s lease on `renew_ids` and delete the leases of
        `drop_ids` (streams whose reader is done), one round trip."""
        if not renew_ids and not drop_ids:
            return
        ttl_ms = _ms(ttl_s, "ttl_s")
        pipe = self.client.pipeline(transaction=False)
        for task_id in renew_ids:
            pipe.set(self.keys.stream_lease(task_id), owner, px=ttl_ms)
        if drop_ids:
            pipe.delete(*(self.keys.stream_lease(task_id) for task_id in drop_ids))
        await pipe.execute()
