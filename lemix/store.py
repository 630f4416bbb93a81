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
  executor iteration's tokens.

Field values are strings on the wire. `encode_fields` and the ``get_*``
helpers below are the one place numbers, booleans and ``None`` are converted.
The store assumes one Redis instance (no cluster): scripts touch several keys.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from lemix import telemetry
from lemix.redis_keys import (
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
# ARGV[1] dedupe TTL in ms; ARGV[2..] the task's field/value items.
# Returns the new entry id, or false for a task id seen before.
_SUBMIT_LUA = """
if not redis.call('SET', KEYS[1], '', 'NX', 'PX', ARGV[1]) then
  return false
end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 2))
redis.call('SET', KEYS[1], id, 'KEEPTTL')
return id
"""

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

    # ================================================================ intake

    async def submit_task(self, task_fields: Mapping[str, FieldValue]) -> bool:
        """Append a task to the intake stream unless its ``task_id`` was seen.

        Returns True when added, False for a duplicate (nothing written). The
        dedupe check and the XADD are one Lua script, so two racing submits of
        one id add exactly one entry.
        """
        fields = encode_fields(task_fields)
        task_id = fields.get(TASK_ID_FIELD, "")
        if not task_id:
            raise ValueError(f"task fields need a non-empty {TASK_ID_FIELD!r}")
        entry_id = await self._submit(
            keys=[self.keys.dedupe(task_id), self.keys.intake_stream],
            args=[self._dedupe_ttl_ms, *_flatten(fields)],
        )
        return entry_id is not None

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

    async def claim_stale(
        self, consumer: str, min_idle_ms: int, count: int = 100
    ) -> list[Entry]:
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
            summary = await self.client.xpending(
                self.keys.intake_stream, self.keys.intake_group
            )
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

    async def set_task_states(self, updates: Sequence[tuple[str, Mapping[str, FieldValue]]]
                              ) -> list[bool]:
        """`set_task_state` for many tasks in one pipelined round trip."""
        if not updates:
            return []
        pipe = self.client.pipeline(transaction=False)
        for task_id, fields in updates:
            encoded = encode_fields(fields)
            if not encoded:
                raise ValueError("set_task_states needs at least one field per task")
            await self._set_state(keys=[self.keys.task(task_id)], args=_flatten(encoded),
                                  client=pipe)
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
    ) -> bool:
        """Write the final state and append the final output message, atomically.

        Both carry ``status``, ``reason`` and ``is_final="1"``; `output_fields`
        go into the message (e.g. token counts, loss) and `state_fields` into the
        hash (e.g. ``finish_s``). One Lua script: a reader sees both or neither.
        Returns False, writing nothing, when the task was already finished.
        `ttl_s`, if given, expires both keys after that long. Append this task's
        last tokens (and await that) before calling this.
        """
        final = {STATUS_FIELD: str(status), REASON_FIELD: reason, IS_FINAL_FIELD: "1"}
        state = {**encode_fields(state_fields or {}), **final}
        message = {**encode_fields(output_fields or {}), **final}
        ttl_ms = 0 if ttl_s is None else _ms(ttl_s, "ttl_s")
        state_items = _flatten(state)
        entry_id = await self._finish(
            keys=[self.keys.task(task_id), self.keys.output(task_id)],
            args=[self.output_maxlen, ttl_ms, len(state_items), *state_items,
                  *_flatten(message)],
        )  # fmt: skip
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
            self.keys.completions_stream, encode_fields(fields)  # type: ignore[arg-type]
        )
        return str(entry_id)

    async def read_completions(self, last_id: str, block_ms: int | None = None,
                               count: int = 500) -> list[Entry]:
        """Completions after `last_id` (XREAD; one reader, the scheduler)."""
        reply = await self.client.xread({self.keys.completions_stream: last_id}, count=count,
                                        block=block_ms)
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

    async def renew_stream_leases(self, owner: str, task_ids: Sequence[str],
                                  ttl_s: float = STREAM_LEASE_TTL_S) -> None:
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
            self.keys.events_stream, encode_fields(fields)  # type: ignore[arg-type]
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
