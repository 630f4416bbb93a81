"""Attempt numbers fence stale executors (docs/protocol.md, "Fencing").

The scheduler numbers each placement in the task hash (`task_hash.ATTEMPT_FIELD`)
before its Dispatch; an executor's writes carry its attempt and land only while
it is current. Each op is one round trip for the whole batch. The fenced end
of a task is `finish_task_fenced` (`TaskOps.finish_task` with an attempt).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from lemix.infra.store.base import StoreBase, end_items, flatten, to_ms
from lemix.infra.store.codec import FieldValue, encode_fields
from lemix.infra.store.task_hash import ATTEMPT_FIELD, CANCELLED_FIELD


class FencedProgress(NamedTuple):
    """A task's state right after `Store.fence_attempts` fenced it."""

    is_final: bool
    status: str  # its final status when `is_final`
    has_output: bool  # its output stream exists


class FinishOutcome(StrEnum):
    """What a fenced `Store.finish_task_fenced` did."""

    ENDED = "ended"  # this call wrote the final state and end message
    ALREADY_FINAL = "already_final"  # the task had ended: nothing written
    FENCED = "fenced"  # the task was placed again since: nothing written


class NodeEndKind(StrEnum):
    """How `Store.write_node_batch` treats one `NodeEnd`."""

    FINISH = "finish"  # write the final state and end message, fenced by attempt
    REPORT = "report"  # the completion alone (the task is not final: requeued training)
    FENCED = "fenced"  # known fenced by the writer: the completion alone, counted fenced


@dataclass(frozen=True)
class NodeEnd:
    """One task's end as an executor writes it (`Store.write_node_batch`)."""

    task_id: str
    attempt: int  # the placement the writer ran (0: none, unfenced)
    kind: NodeEndKind
    completion: Mapping[str, FieldValue]  # its completions entry, appended in every case
    stat: str  # counter bumped when it ended the task (or, for REPORT, always)
    duplicate_stat: str  # counter bumped when the task was already final
    fenced_stat: str  # counter bumped when fenced
    status: str = ""
    reason: str = ""
    output_fields: Mapping[str, FieldValue] = field(default_factory=dict)
    state_fields: Mapping[str, FieldValue] = field(default_factory=dict)
    ttl_s: float | None = None
    # Token messages merged into `output_fields` (the task's last tokens ride
    # on its end message): counted as written tokens when the end is written.
    num_carried_tokens: int = 0

    def counted_stat(self, outcome: FinishOutcome) -> str:
        """The counter its `write_node_batch` outcome bumps by one (a REPORT
        end is always ENDED)."""
        if outcome is FinishOutcome.ENDED:
            return self.stat
        return self.duplicate_stat if outcome is FinishOutcome.ALREADY_FINAL else self.fenced_stat


class PlaceOutcome(StrEnum):
    """What `Store.write_node_batch` did with one placement it records."""

    WRITTEN = "written"  # the placed state is stored
    SKIPPED = "skipped"  # the task is final (or has no hash): nothing written
    FENCED = "fenced"  # the task was placed again since: nothing written


_PLACE_OUTCOMES = {1: PlaceOutcome.WRITTEN, 0: PlaceOutcome.SKIPPED, -1: PlaceOutcome.FENCED}
_END_OUTCOMES = {1: FinishOutcome.ENDED, 0: FinishOutcome.ALREADY_FINAL, -1: FinishOutcome.FENCED}


class NodeBatchResult(NamedTuple):
    """`Store.write_node_batch`'s outcome, item by item in the order given."""

    places: list[PlaceOutcome]
    written: list[bool]  # per token message: appended (False: fenced)
    ends: list[FinishOutcome]  # per end (a REPORT end is ENDED)


class FencingOps(StoreBase):
    """Number placements, fence taken-away ones, write output and ends fenced."""

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
            pipe.hexists(self.keys.task(task_id), CANCELLED_FIELD)
        replies = await pipe.execute()
        num = len(task_ids)
        return [int(n) for n in replies[:num]], [bool(n) for n in replies[num:]]

    async def fence_attempts(self, taken: Sequence[tuple[str, int]]) -> list[FencedProgress]:
        """Make each (task_id, attempt) stale, unless the task was placed again
        since, and read what it left (final? output?) in the same atomic step
        (`scripts.FENCE_LUA`): a node's tasks taken away cannot write after this.
        One pipelined round trip; a task with no hash is not created."""
        if not taken:
            return []
        pipe = self.client.pipeline(transaction=False)
        for task_id, attempt in taken:
            self.queue_script(
                pipe,
                self._fence,
                [self.keys.task(task_id), self.keys.output(task_id)],
                [int(attempt)],
            )
        return [
            FencedProgress(str(is_final) == "1", str(status), bool(int(has_output)))
            for is_final, status, has_output in await self.execute_scripted(pipe)
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
            flat = flatten(encode_fields(fields))
            args += [int(attempt), len(flat), *flat]
        replies = await self._append_fenced(keys=keys, args=args)
        # A Lua table converts to a list up to its first nil; false -> None.
        written = list(replies or [])
        written += [None] * (len(items) - len(written))
        return [None if entry_id is None else str(entry_id) for entry_id in written]

    async def write_node_batch(
        self,
        tokens: Sequence[tuple[str, int, Mapping[str, FieldValue]]],
        ends: Sequence[NodeEnd],
        places: Sequence[tuple[str, int, Mapping[str, FieldValue]]] = (),
    ) -> NodeBatchResult:
        """An executor's whole flush in ONE script call (`scripts.WRITE_NODE_BATCH_LUA`):
        the placements it records (task_id, attempt, placed-state fields),
        each written only while the task's attempt is `attempt` and it is not
        final; the token messages (task_id, attempt, fields) fenced as in
        `append_outputs_fenced`; then each end fenced as in
        `finish_task_fenced` and each end's completion entry, all atomically:
        a crash never leaves an end without its completion. Counting is the
        caller's (`NodeEnd.counted_stat` of each outcome).
        """
        if not tokens and not ends and not places:
            return NodeBatchResult([], [], [])
        keys: list[str] = [self.keys.completions_stream]
        args: list[str | int] = [self.output_maxlen, len(places), len(tokens)]
        for task_id, attempt, fields in places:
            keys.append(self.keys.task(task_id))
            flat = flatten(encode_fields(fields))
            args += [int(attempt), len(flat), *flat]
        for task_id, attempt, fields in tokens:
            keys += [self.keys.task(task_id), self.keys.output(task_id)]
            flat = flatten(encode_fields(fields))
            args += [int(attempt), len(flat), *flat]
        for end in ends:
            keys += [self.keys.task(end.task_id), self.keys.output(end.task_id)]
            state_items, message_items = end_items(
                end.status, end.reason, end.state_fields, end.output_fields
            )
            completion = flatten(encode_fields(end.completion))
            ttl_ms = 0 if end.ttl_s is None else to_ms(end.ttl_s, "ttl_s")
            args += [str(end.kind), int(end.attempt), ttl_ms]
            args += [len(state_items), *state_items, len(message_items), *message_items]
            args += [len(completion), *completion]
        replies = [int(n) for n in await self._write_node_batch(keys=keys, args=args)]
        num_places, num_tokens = len(places), len(tokens)
        return NodeBatchResult(
            [_PLACE_OUTCOMES[n] for n in replies[:num_places]],
            [n == 1 for n in replies[num_places : num_places + num_tokens]],
            [_END_OUTCOMES[n] for n in replies[num_places + num_tokens :]],
        )

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
        state_items, message_items = end_items(status, reason, state_fields, output_fields)
        ttl_ms = 0 if ttl_s is None else to_ms(ttl_s, "ttl_s")
        outcome = int(
            await self._finish_fenced(
                keys=[self.keys.task(task_id), self.keys.output(task_id)],
                args=[
                    int(attempt),
                    self.output_maxlen,
                    ttl_ms,
                    len(state_items),
                    *state_items,
                    *message_items,
                ],
            )
        )
        if outcome > 0:
            return FinishOutcome.ENDED
        return FinishOutcome.ALREADY_FINAL if outcome == 0 else FinishOutcome.FENCED
