"""What every part of `Store` stands on: the client, the keys, the registered
scripts, and the helpers that shape commands and read replies.

Each concern (intake, task state, fencing, outputs, events, node heartbeats
and stack-wide values) is a mixin on `StoreBase` in its own module;
`store.Store` puts them together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from lemix.infra.store import scripts
from lemix.infra.store.codec import Entry, Fields, FieldValue, encode_fields
from lemix.infra.store.keys import DEDUPE_TTL_S, OUTPUT_MAXLEN, RedisKeys
from lemix.infra.store.task_hash import final_fields

# The one entry of a gateway's reader wake stream (`RedisKeys.reader_wake`).
WAKE_FIELDS: dict[Any, Any] = {"wake": "1"}  # Any: redis-py's stub wants its own key union


class StoreBase:
    """The state `Store`'s mixins share, over a ``decode_responses=True`` client.

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
        self._dedupe_ttl_ms = to_ms(dedupe_ttl_s, "dedupe_ttl_s")
        self._submit = client.register_script(scripts.SUBMIT_LUA)
        self._set_state = client.register_script(scripts.SET_STATE_LUA)
        self._set_states = client.register_script(scripts.SET_STATES_LUA)
        self._finish = client.register_script(scripts.FINISH_LUA)
        self._append_fenced = client.register_script(scripts.APPEND_FENCED_LUA)
        self._finish_fenced = client.register_script(scripts.FINISH_FENCED_LUA)
        self._fence = client.register_script(scripts.FENCE_LUA)
        self._expire_finished = client.register_script(scripts.EXPIRE_FINISHED_LUA)
        self._write_node_batch = client.register_script(scripts.WRITE_NODE_BATCH_LUA)
        self._accept = client.register_script(scripts.ACCEPT_LUA)
        self._mark_cancelled = client.register_script(scripts.MARK_CANCELLED_LUA)

    # redis-py runs a script queued on a pipeline (``script(client=pipe)``)
    # with a SCRIPT EXISTS round trip before every execute. The store queues
    # EVALSHA itself (`queue_script`) and loads a script only when Redis
    # answers NOSCRIPT (`execute_scripted`): one round trip per pipeline.

    @staticmethod
    def queue_script(
        pipe: Pipeline, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]
    ) -> None:
        """Queue `script` on `pipe` as a bare EVALSHA (see `execute_scripted`)."""
        pipe.evalsha(script.sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]

    def queue_gateway_hold(
        self, pipe: Pipeline, owner: str, *, lease_ttl_s: float | None, wake: bool
    ) -> None:
        """Queue what a streaming gateway `owner` writes ahead of a request:
        its lease (`RedisKeys.gateway_lease`, when `lease_ttl_s` is given) and
        a wake of its output reader (`RedisKeys.reader_wake`, with `wake`)."""
        if lease_ttl_s is not None:
            pipe.set(self.keys.gateway_lease(owner), owner, px=to_ms(lease_ttl_s, "lease_ttl_s"))
        if wake:
            pipe.xadd(self.keys.reader_wake(owner), WAKE_FIELDS, maxlen=1, approximate=False)

    async def execute_scripted(self, pipe: Pipeline) -> list[Any]:
        """Execute a non-transactional `pipe` whose scripts were queued with
        `queue_script`, in one round trip while Redis has them cached.

        A NOSCRIPT reply (Redis restarted, or its script cache was flushed)
        means that command did not run: the scripts are loaded and exactly
        those commands run again, in order. Any other error is raised after
        the whole pipeline ran, as redis-py does.
        """
        commands = list(pipe.command_stack)
        replies = list(await pipe.execute(raise_on_error=False))
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            await self.load_scripts()
            again = self.client.pipeline(transaction=False)
            for i in missing:
                args, options = commands[i]
                again.execute_command(*args, **options)
            for i, reply in zip(missing, await again.execute(raise_on_error=False), strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def load_scripts(self) -> None:
        """Load every script into Redis's cache in one round trip: a fresh
        Redis (a stack's first request) answers NOSCRIPT once, and a load per
        script, awaited in turn, put ten round trips in that request's path."""
        scripts = self._scripts()
        pipe = self.client.pipeline(transaction=False)
        for script in scripts:
            pipe.script_load(script.script)
        for script, sha in zip(scripts, await pipe.execute(), strict=True):
            script.sha = sha

    def _scripts(self) -> list[AsyncScript]:
        return [
            self._submit,
            self._set_state,
            self._set_states,
            self._finish,
            self._append_fenced,
            self._finish_fenced,
            self._fence,
            self._expire_finished,
            self._write_node_batch,
            self._accept,
        ]


# ------------------------------------------------------ commands and replies


def to_ms(seconds: float, what: str) -> int:
    """A positive duration in whole milliseconds (at least 1), for PX/PEXPIRE."""
    if seconds <= 0:
        raise ValueError(f"{what} must be > 0 seconds, got {seconds}")
    return max(1, round(seconds * 1000))


# Tasks per call of a batch script (`scripts.ACCEPT_LUA`, `SET_STATES_LUA`):
# one call per batch saves a command per task, and the bound keeps one call
# from holding Redis (single-threaded) for long.
TASKS_PER_SCRIPT_CALL = 128


def chunks(items: Sequence[Any], size: int = TASKS_PER_SCRIPT_CALL) -> list[Sequence[Any]]:
    """`items` in consecutive slices of at most `size`."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def batch_items(
    updates: Sequence[tuple[str, Mapping[str, FieldValue]]], what: str
) -> tuple[list[int], list[str]]:
    """A batch script's per-task item counts and their items, task after task
    (`scripts.ACCEPT_LUA`, `SET_STATES_LUA`); ValueError naming `what` for a
    task without fields."""
    counts: list[int] = []
    items: list[str] = []
    for _, fields in updates:
        encoded = flatten(encode_fields(fields))
        if not encoded:
            raise ValueError(f"{what} needs at least one field per task")
        counts.append(len(encoded))
        items += encoded
    return counts, items


def flatten(fields: Fields) -> list[str]:
    """{name: value} as [name, value, ...]: a script's field/value ARGV items."""
    return [item for pair in fields.items() for item in pair]


def as_fields(raw: Any) -> Fields:
    """A decoded reply mapping (None for a deleted stream entry) as str -> str."""
    return {str(name): str(value) for name, value in (raw or {}).items()}


def named_fields(names: Sequence[str], values: Sequence[Any]) -> Fields:
    """An HMGET reply as {name: value} for the fields that are set."""
    return {
        name: str(value) for name, value in zip(names, values, strict=True) if value is not None
    }


def glob_escape(text: str) -> str:
    """`text` matched literally in a SCAN/KEYS pattern."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


def stream_entries(response: Any) -> list[Entry]:
    """Entries of a single-stream XREAD/XREADGROUP reply (RESP2 list or RESP3 dict)."""
    if not response:
        return []
    streams = response.values() if isinstance(response, dict) else (s[1] for s in response)
    entries: list[Entry] = []
    for stream in streams:
        # RESP3 XREADGROUP nests the entries one level deeper.
        items = stream[0] if stream and isinstance(stream[0], list) else stream
        entries.extend((str(entry_id), as_fields(fields)) for entry_id, fields in items)
    return entries


def range_entries(entries: Any) -> list[Entry]:
    """Entries of an XRANGE reply, oldest first."""
    return [(str(entry_id), as_fields(fields)) for entry_id, fields in entries or []]


def end_items(
    status: str,
    reason: str,
    state_fields: Mapping[str, FieldValue] | None,
    output_fields: Mapping[str, FieldValue] | None,
) -> tuple[list[str], list[str]]:
    """A task's end as script items: (its state hash's, its ``end`` message's).
    Both carry `final_fields`, which win over a same-named extra field."""
    final = final_fields(status, reason)
    return (
        flatten({**encode_fields(state_fields or {}), **final}),
        flatten({**encode_fields(output_fields or {}), **final}),
    )
