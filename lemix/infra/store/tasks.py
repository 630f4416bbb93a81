"""Task state hashes: merge a state, end a task (once), look tasks up.

A task is keyed by id, so a redelivered write is harmless: `set_task_state`
cannot overwrite a final state, and a task ends once (`finish_task`: the final
state and the ``end`` output message in one Lua script, so a reader sees both
or neither; a second call is a no-op). An executor's end is also fenced by
attempt (`finish_task_fenced`; docs/protocol.md, "Fencing").

Readers of per-task truth (GetTask, WatchTasks, AuditTasks) HMGET named fields
only (`get_task_states`, `scan_task_states`): a task hash also holds its
payload (token ids).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from lemix.infra.store.base import (
    as_fields,
    batch_items,
    chunks,
    end_items,
    flatten,
    glob_escape,
    named_fields,
    to_ms,
)
from lemix.infra.store.codec import Fields, FieldValue, encode_fields
from lemix.infra.store.fencing import FencingOps, FinishOutcome


class StoredTask(NamedTuple):
    """What Redis holds about one task id (`Store.get_task_states`)."""

    fields: Fields  # the asked-for fields of its state hash that are set ({}: no hash)
    is_submitted: bool  # its intake dedupe marker exists: a Submit stored it
    has_output: bool  # its output stream exists: its node produced output for it


class TaskOps(FencingOps):
    """Task state hashes: state writes, ends, lookups. On `FencingOps`:
    `finish_task` with an attempt is `finish_task_fenced`."""

    async def set_task_state(self, task_id: str, fields: Mapping[str, FieldValue]) -> bool:
        """Merge `fields` into the task's state hash (status, node_id, times...).

        Returns False, changing nothing, when the task is already final: a late
        or redelivered update cannot undo `finish_task`.
        """
        encoded = encode_fields(fields)
        if not encoded:
            raise ValueError("set_task_state needs at least one field")
        done = await self._set_state(keys=[self.keys.task(task_id)], args=flatten(encoded))
        return bool(int(done))

    async def set_task_states(
        self, updates: Sequence[tuple[str, Mapping[str, FieldValue]]]
    ) -> list[bool]:
        """`set_task_state` for many tasks in one round trip (one script call
        per `TASKS_PER_SCRIPT_CALL` tasks, `scripts.SET_STATES_LUA`)."""
        if not updates:
            return []
        pipe = self.client.pipeline(transaction=False)
        for chunk in chunks(updates):
            counts, items = batch_items(chunk, "set_task_states")
            keys = [self.keys.task(task_id) for task_id, _ in chunk]
            self.queue_script(pipe, self._set_states, keys, [*counts, *items])
        return [bool(int(done)) for reply in await self.execute_scripted(pipe) for done in reply]

    async def get_task_state(self, task_id: str) -> Fields:
        """The task's state hash; empty when unknown (or expired)."""
        return as_fields(await self.client.hgetall(self.keys.task(task_id)))

    async def get_task_state_hashes(self, task_ids: Sequence[str]) -> list[Fields]:
        """`get_task_state` for many tasks, in order, one pipelined round trip."""
        if not task_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hgetall(self.keys.task(task_id))
        return [as_fields(reply) for reply in await pipe.execute()]

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
        hash (e.g. ``finish_t``). One Lua script: a reader sees both or neither.
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
        state_items, message_items = end_items(status, reason, state_fields, output_fields)
        ttl_ms = 0 if ttl_s is None else to_ms(ttl_s, "ttl_s")
        entry_id = await self._finish(
            keys=[self.keys.task(task_id), self.keys.output(task_id)],
            args=[
                self.output_maxlen,
                ttl_ms,
                ttl_ms,
                len(state_items),
                *state_items,
                *message_items,
            ],
        )
        return entry_id is not None

    async def finish_tasks(
        self,
        ends: Sequence[tuple[str, str, str]],
        *,
        state_fields: Mapping[str, FieldValue] | None = None,
        output_fields: Mapping[str, FieldValue] | None = None,
        ttl_s: float | None = None,
        output_ttl_s: float | None = None,
    ) -> list[bool]:
        """`finish_task` for many (task_id, status, reason) in one pipelined
        round trip; the same extra fields go to every task. `ttl_s` expires
        each hash, `output_ttl_s` (default: `ttl_s`) each output stream.
        Per task: True when this call ended it, False when it was already final."""
        if not ends:
            return []
        ttl_ms = 0 if ttl_s is None else to_ms(ttl_s, "ttl_s")
        output_ttl_ms = ttl_ms
        if output_ttl_s is not None:
            output_ttl_ms = to_ms(output_ttl_s, "output_ttl_s") if output_ttl_s > 0 else 0
        pipe = self.client.pipeline(transaction=False)
        for task_id, status, reason in ends:
            state_items, message_items = end_items(status, reason, state_fields, output_fields)
            self.queue_script(
                pipe,
                self._finish,
                [self.keys.task(task_id), self.keys.output(task_id)],
                [
                    self.output_maxlen,
                    ttl_ms,
                    output_ttl_ms,
                    len(state_items),
                    *state_items,
                    *message_items,
                ],
            )
        return [entry_id is not None for entry_id in await self.execute_scripted(pipe)]

    async def expire_finished_tasks(self, task_ids: Sequence[str], ttl_s: float) -> int:
        """Expire the state hash and output stream of each task that is final,
        `ttl_s` from now (a task not final is left alone). One round trip;
        returns how many were final."""
        if not task_ids:
            return 0
        ttl_ms = to_ms(ttl_s, "ttl_s")
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            self.queue_script(
                pipe,
                self._expire_finished,
                [self.keys.task(task_id), self.keys.output(task_id)],
                [ttl_ms],
            )
        return sum(int(n) for n in await self.execute_scripted(pipe))

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
                named_fields(field_names, replies[3 * i]),
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
            cursor, match=glob_escape(prefix) + "*", count=count, _type="hash"
        )
        if not keys:
            return int(next_cursor), []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(key, list(field_names))
        replies = await pipe.execute()
        found = [
            (str(key)[len(prefix) :], named_fields(field_names, reply))
            for key, reply in zip(keys, replies, strict=True)
        ]
        # A hash deleted (expired) between SCAN and HMGET reads as all-None.
        return int(next_cursor), [(task_id, fields) for task_id, fields in found if fields]
