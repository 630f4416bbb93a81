"""Writes a node's engine outcomes to Redis, as docs/protocol.md fixes them.

Per `write` (one driver flush, usually one iteration) ONE script call
(`Store.write_node_batch`), which runs atomically, in this order:

1. the placed state (``status=placed``, node, time taken) of each task the
   node took since the last write (`Placed`), unless the task ends in this
   write: then its end carries the time taken (one write, not two);
2. every token message of the batch, so per-stream order follows engine order;
3. then, per task that ended, its final state and ``end`` message
   (fenced, once per task) and its completion entry for the scheduler.

The counters (tokens written, each end by its outcome) are summed in memory
(`counters`) and written by the executor's heartbeat: per flush they cost a
command per counter, i.e. about one per request.

Tokens go first, so a task's ``end`` never precedes its last token. A task
that completes in the batch sends its last token message's fields on its
``end`` message instead (one stream entry, not two: a short request's
token and end were two XADDs); readers take the tokens an ``end`` adds
(`gateway.convert.OutputStream`). If a write
fails the driver retries the whole batch: the script either ran whole or not
at all, unless its reply was lost; then token messages may repeat (readers go
by ``n``), the end is a no-op the second time (counted as a duplicate), and a
completion may repeat (the scheduler treats completions by task id).

Fencing (docs/protocol.md): every write carries the attempt number the
task was dispatched with (`TaskLedger.attempt_of`) and lands only while it is
the task's current one. A fenced task was placed again elsewhere (this node
was declared dead, then came back): its writes are dropped and counted
(`lemix_executor_fenced_writes_total`), it is logged once, and the ledger is
told (`on_fenced`) so the node lets it go. Its completion still goes out,
with the attempt: the scheduler ignores a stale one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import structlog

from lemix.engine import (
    BlockingDone,
    Failed,
    Finished,
    FirstToken,
    Requeued,
    TokensEmitted,
)
from lemix.infra import telemetry
from lemix.infra.store.codec import FieldValue
from lemix.infra.store.counters import BatchedCounters
from lemix.infra.store.fencing import FinishOutcome, NodeEnd, NodeEndKind, PlaceOutcome
from lemix.infra.store.messages import (
    TYPE_FIELD,
    completion_fields,
    end_message,
    first_token_message,
    token_message,
)
from lemix.infra.store.store import Store
from lemix.infra.store.task_hash import (
    FINISH_T_FIELD,
    NODE_ID_FIELD,
    NUM_OUTPUT_TOKENS_FIELD,
    PLACED_T_FIELD,
    STATUS_FIELD,
    WEIGHT_VERSION_FIELD,
    StoredStatus,
)
from lemix.outputs import (
    LOGPROBS_FIELD,
    PROMPT_LOGPROBS_FIELD,
    TOKEN_IDS_FIELD,
    format_logprobs,
    format_token_ids,
)
from services.executor.backends.base import ExecutorBackend
from services.executor.backends.emulated import EmulatedBackend
from services.executor.driver import Placed, SinkItem

log = structlog.get_logger(__name__)

TOKENS_STAT = "tokens_generated"  # token messages written (a message per token and iteration)


class TaskLedger(Protocol):
    """What the sink asks the node about held tasks (`ExecutorNode`)."""

    def attempt_of(self, task_id: str) -> int:
        """The attempt the task was dispatched with (0: none)."""
        ...

    def on_fenced(self, task_id: str) -> None:
        """The task was placed again elsewhere: stop running it here."""
        ...


@runtime_checkable
class LedgerSink(Protocol):
    """A sink that fences, and records the placements noted (`Placed`): the
    node binds itself as its `TaskLedger`."""

    def bind(self, ledger: TaskLedger) -> None: ...


class RedisOutcomeSink:
    """`OutcomeSink` for `NodeDriver`: outcomes -> output streams, task states,
    the completions stream and the stats counters. Unbound (no `TaskLedger`),
    every write carries attempt 0. `backend` (default: emulated) gives the
    token ids and end fields."""

    def __init__(
        self,
        store: Store,
        node_id: int,
        *,
        clock: Callable[[], float] = time.time,
        backend: ExecutorBackend | None = None,
    ) -> None:
        self.store = store
        self.node_id = node_id
        # A real model's token ids and end fields (finish reason, inference
        # loss) ride on the messages; the emulated backend has none.
        self.backend: ExecutorBackend = backend if backend is not None else EmulatedBackend()
        self._clock = clock  # epoch seconds for the `t` fields
        self._num_tokens: dict[str, int] = {}  # tokens emitted so far, by live task id
        # Weight version that served each live inference task (its first token
        # carries it), recorded in its task hash at the end for GetTask.
        self._weight_versions: dict[str, int] = {}
        self._ledger: TaskLedger | None = None
        # Live tasks found fenced, with the attempt: their writes are dropped here.
        self._fenced: dict[str, int] = {}
        # Stack-wide counters of what this sink wrote; its owner flushes them.
        self.counters = BatchedCounters(store)

    def bind(self, ledger: TaskLedger) -> None:
        """Take attempts from `ledger` and tell it of fenced tasks."""
        self._ledger = ledger

    async def write(self, batch: list[tuple[float, SinkItem]]) -> None:
        t = self._clock()
        placed: dict[str, float] = {}
        tokens: list[tuple[str, int, dict[str, FieldValue]]] = []
        ends: list[Finished | Failed | Requeued] = []
        for _, outcome in batch:
            if isinstance(outcome, Placed):
                placed[outcome.task_id] = outcome.t
            elif isinstance(outcome, FirstToken):
                self._num_tokens[outcome.task_id] = 1
                self._weight_versions[outcome.task_id] = outcome.weight_updates
                fields = first_token_message(self.node_id, outcome.weight_updates, t)
                self._add_ids(fields, outcome.task_id, 0, 1)
                tokens.append((outcome.task_id, self._attempt(outcome.task_id), fields))
            elif isinstance(outcome, TokensEmitted):
                for task_id, n in zip(outcome.task_ids, outcome.num_generated, strict=True):
                    previous = self._num_tokens.get(task_id, n - 1)
                    self._num_tokens[task_id] = n
                    fields = token_message(n, self.node_id, t)
                    self._add_ids(fields, task_id, previous, n)
                    tokens.append((task_id, self._attempt(task_id), fields))
            elif isinstance(outcome, Finished | Failed | Requeued):
                ends.append(outcome)
            elif isinstance(outcome, BlockingDone):
                log.info("executor.blocking_done", node=self.node_id, tag=outcome.tag)
        tokens, node_ends = _carry_last_tokens(tokens, [self._end_of(end, t) for end in ends])
        places, node_ends = self._places(placed, node_ends)
        await self._write_batch(tokens, node_ends, places)

    def _places(
        self, placed: dict[str, float], ends: list[NodeEnd]
    ) -> tuple[list[TokenMessage], list[NodeEnd]]:
        """The placed state of each task taken since the last write: on its
        own, or on the task's end in this write (its time taken added to the
        end's state; a requeued or fenced end needs none)."""
        if not placed:
            return [], ends
        ended: list[NodeEnd] = []
        for end in ends:
            t = placed.pop(end.task_id, None)
            if t is not None and end.kind is NodeEndKind.FINISH:
                end = dataclasses.replace(end, state_fields={**end.state_fields, PLACED_T_FIELD: t})
            ended.append(end)
        places: list[TokenMessage] = []
        for task_id, t in placed.items():
            attempt = self._attempt(task_id)
            if not self._is_fenced(task_id, attempt):
                fields: dict[str, FieldValue] = {
                    STATUS_FIELD: StoredStatus.PLACED,
                    NODE_ID_FIELD: self.node_id,
                    PLACED_T_FIELD: t,
                }
                places.append((task_id, attempt, fields))
        return places, ended

    def _attempt(self, task_id: str) -> int:
        return self._ledger.attempt_of(task_id) if self._ledger is not None else 0

    def _is_fenced(self, task_id: str, attempt: int) -> bool:
        return self._fenced.get(task_id) == attempt

    async def _write_batch(
        self,
        tokens: list[TokenMessage],
        ends: list[NodeEnd],
        places: list[TokenMessage],
    ) -> None:
        """One script call for the whole batch (`Store.write_node_batch`), then
        the bookkeeping of what it found fenced and of the tasks that ended."""
        live = [item for item in tokens if not self._is_fenced(item[0], item[1])]
        telemetry.observe_fenced_writes(self.node_id, "token", len(tokens) - len(live))
        place_outcomes, written, outcomes = await self.store.write_node_batch(live, ends, places)
        for (task_id, attempt, _), place in zip(places, place_outcomes, strict=True):
            if place is PlaceOutcome.FENCED:
                self._fence(task_id, attempt, "place")
        num_tokens = sum(written)
        for (task_id, attempt, _), is_written in zip(live, written, strict=True):
            if not is_written:
                self._fence(task_id, attempt, "token")
        for end, outcome in zip(ends, outcomes, strict=True):
            self.counters.add(end.counted_stat(outcome))
            if outcome is FinishOutcome.ENDED:
                num_tokens += end.num_carried_tokens
            if outcome is FinishOutcome.FENCED:
                self._fence(end.task_id, end.attempt, "end")
            if end.kind is not NodeEndKind.REPORT:
                self._num_tokens.pop(end.task_id, None)
                self._weight_versions.pop(end.task_id, None)
            self._fenced.pop(end.task_id, None)
        if num_tokens:
            self.counters.add(TOKENS_STAT, num_tokens)

    def _fence(self, task_id: str, attempt: int, what: str) -> None:
        """Count a dropped write; the first for a task logs it and tells the ledger."""
        telemetry.observe_fenced_writes(self.node_id, what)
        if self._is_fenced(task_id, attempt):
            return
        self._fenced[task_id] = attempt
        log.warning(
            "executor.fenced", node=self.node_id, task_id=task_id, attempt=attempt, what=what
        )
        if self._ledger is not None:
            self._ledger.on_fenced(task_id)

    def _add_ids(self, fields: dict[str, FieldValue], task_id: str, start: int, end: int) -> None:
        if self.backend.produces_tokens:
            fields[TOKEN_IDS_FIELD] = format_token_ids(self.backend.output_ids(task_id)[start:end])
            logprobs = self.backend.output_logprobs(task_id)  # one per id, when asked for
            if logprobs:
                fields[LOGPROBS_FIELD] = format_logprobs(logprobs[start:end])
            prompt_logprobs = self.backend.prompt_logprobs(task_id) if start == 0 else ()
            if prompt_logprobs:  # with the first token: the prefill made them
                fields[PROMPT_LOGPROBS_FIELD] = format_logprobs(prompt_logprobs)

    def _end_of(self, outcome: Finished | Failed | Requeued, t: float) -> NodeEnd:
        """One task's end as `Store.write_node_batch` writes it, with its
        completion: always reported, even when the task was already final (a
        redelivery) or fenced, since the scheduler needs to learn that this
        node freed the task's memory (it ignores a stale attempt)."""
        task_id = outcome.task_id
        attempt = self._attempt(task_id)
        if isinstance(outcome, Requeued):
            # Training handed back: the scheduler re-submits it, so the task is
            # not final and gets no `end` message.
            return NodeEnd(
                task_id,
                attempt,
                NodeEndKind.REPORT,
                self._completion(task_id, StoredStatus.REQUEUED, outcome.reason, t, attempt),
                stat="requeued_training",
                duplicate_stat="requeued_training",
                fenced_stat="requeued_training",
            )
        if isinstance(outcome, Finished):
            status, reason, n = StoredStatus.COMPLETED, "", outcome.num_output_tokens
            # Training finishes with 0 output tokens; inference always has >= 1.
            stat = "num_completed_inference" if n > 0 else "num_completed_training"
        else:
            status, reason = StoredStatus.FAILED, outcome.reason
            n = self._num_tokens.get(task_id, 0)
            stat = "num_failed"
        output_fields = end_message(n, self.node_id, t)
        state_fields: dict[str, FieldValue] = {
            NODE_ID_FIELD: self.node_id,
            FINISH_T_FIELD: t,
            NUM_OUTPUT_TOKENS_FIELD: n,
        }
        version = self._weight_versions.get(task_id)
        if version is not None:
            state_fields[WEIGHT_VERSION_FIELD] = version
        if isinstance(outcome, Finished):
            # Inference: finish reason, inference loss; training: its loss
            # (none, emulated). The hash keeps them for GetTask (gateway.tasks).
            end_fields = self.backend.end_fields(task_id)
            state_fields.update(end_fields)
            if n > 0:
                output_fields.update(end_fields)
        # Attempts only grow: a task known fenced need not be asked again.
        is_fenced = self._is_fenced(task_id, attempt)
        return NodeEnd(
            task_id,
            attempt,
            NodeEndKind.FENCED if is_fenced else NodeEndKind.FINISH,
            self._completion(task_id, status, reason, t, attempt),
            # Each task counted once.
            stat=stat,
            duplicate_stat="num_duplicate_ends",
            fenced_stat="num_fenced_ends",
            status=status,
            reason=reason,
            output_fields=output_fields,
            state_fields=state_fields,
        )

    def _completion(
        self, task_id: str, status: str, reason: str, t: float, attempt: int
    ) -> dict[str, FieldValue]:
        return completion_fields(
            task_id, status, reason, node_id=self.node_id, t=t, attempt=attempt
        )


TokenMessage = tuple[str, int, dict[str, FieldValue]]  # (task_id, attempt, fields)


def _carry_last_tokens(
    tokens: list[TokenMessage], ends: list[NodeEnd]
) -> tuple[list[TokenMessage], list[NodeEnd]]:
    """Merge, for each task completed in this batch, its last token message of
    the batch into its end message: the end adds those tokens (`n`, `ids`,
    first-token fields...) and the stream gets one entry instead of two.
    Only a FINISH end of a completed task of the same attempt carries tokens
    (a failed end carries none: its reader gets the error, as before); a
    token message of a task that does not end here is left as it is."""
    carriers = {
        end.task_id: end
        for end in ends
        if end.kind is NodeEndKind.FINISH and end.status == StoredStatus.COMPLETED
    }
    if not carriers:
        return tokens, ends
    last_of: dict[str, int] = {}
    for i, (task_id, attempt, _) in enumerate(tokens):
        end = carriers.get(task_id)
        if end is not None and end.attempt == attempt:
            last_of[task_id] = i
    if not last_of:
        return tokens, ends
    carried = set(last_of.values())

    def with_tokens(end: NodeEnd) -> NodeEnd:
        i = last_of.get(end.task_id)
        if i is None or end is not carriers[end.task_id]:  # not a carrier (or a second end)
            return end
        return dataclasses.replace(
            end,
            # The end's own fields (type, n, node, t, finish reason) win.
            output_fields={
                **{k: v for k, v in tokens[i][2].items() if k != TYPE_FIELD},
                **end.output_fields,
            },
            num_carried_tokens=1,
        )

    return (
        [item for i, item in enumerate(tokens) if i not in carried],
        [with_tokens(end) for end in ends],
    )
