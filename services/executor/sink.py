"""Writes a node's engine outcomes to Redis, as services/PROTOCOL.md fixes them.

Per `write` (one driver flush, usually one iteration):

1. every token message of the batch in ONE pipelined round trip
   (`Store.append_outputs_batch`), so per-stream order follows engine order;
2. then, per task that ended, its final state and ``end`` message atomically
   (`Store.finish_task`) and its completion entry for the scheduler;
3. then the counters.

Tokens go first, so a task's ``end`` never precedes its last token. If a write
fails the driver retries the whole batch: token messages may then repeat
(readers go by ``n``), ``finish_task`` is a no-op the second time, and a
completion may repeat (the scheduler treats completions by task id).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import structlog

from lemix.engine import (
    BlockingDone,
    Failed,
    Finished,
    FirstToken,
    Outcome,
    Requeued,
    TokensEmitted,
)
from lemix.outputs import TOKEN_IDS_FIELD, format_token_ids
from lemix.store import FieldValue, Store
from services.executor.driver import ModelBackend

log = structlog.get_logger(__name__)

# Output-stream message types (PROTOCOL.md, "Flow of one inference request").
TOKEN_MESSAGE = "token"
END_MESSAGE = "end"
# Completion statuses the scheduler consumes.
COMPLETED, FAILED, REQUEUED = "completed", "failed", "requeued"


class RedisOutcomeSink:
    """`OutcomeSink` for `NodeDriver`: outcomes -> output streams, task states,
    the completions stream and the stats counters."""

    def __init__(self, store: Store, node_id: int, *,
                 clock: Callable[[], float] = time.time,
                 model: ModelBackend | None = None) -> None:
        self.store = store
        self.node_id = node_id
        # A real model's token ids and end fields (finish reason, inference
        # loss) ride on the messages; the emulated backend has none.
        self.model = model
        self._clock = clock  # epoch seconds for the `t` fields
        self._num_tokens: dict[str, int] = {}  # tokens emitted so far, by live task id

    async def write(self, batch: list[tuple[float, Outcome]]) -> None:
        t = self._clock()
        node = str(self.node_id)
        tokens: list[tuple[str, dict[str, FieldValue]]] = []
        ends: list[Finished | Failed | Requeued] = []
        for _, outcome in batch:
            if isinstance(outcome, FirstToken):
                self._num_tokens[outcome.task_id] = 1
                fields: dict[str, FieldValue] = {
                    "type": TOKEN_MESSAGE, "n": 1, "first": True, "node": node,
                    "version": outcome.weight_updates, "t": t,
                }
                self._add_ids(fields, outcome.task_id, 0, 1)
                tokens.append((outcome.task_id, fields))
            elif isinstance(outcome, TokensEmitted):
                for task_id, n in zip(outcome.task_ids, outcome.num_generated, strict=True):
                    previous = self._num_tokens.get(task_id, n - 1)
                    self._num_tokens[task_id] = n
                    fields = {"type": TOKEN_MESSAGE, "n": n, "node": node, "t": t}
                    self._add_ids(fields, task_id, previous, n)
                    tokens.append((task_id, fields))
            elif isinstance(outcome, Finished | Failed | Requeued):
                ends.append(outcome)
            elif isinstance(outcome, BlockingDone):
                log.info("executor.blocking_done", node=self.node_id, tag=outcome.tag)
        if tokens:
            await self.store.append_outputs_batch(tokens)
        stats: Counter[str] = Counter({"tokens_generated": len(tokens)})
        for end in ends:
            stats[await self._write_end(end, t)] += 1
        for name, count in stats.items():
            if count:
                await self.store.incr_stat(name, count)

    def _add_ids(self, fields: dict[str, FieldValue], task_id: str, start: int,
                 end: int) -> None:
        if self.model is not None:
            fields[TOKEN_IDS_FIELD] = format_token_ids(self.model.output_ids(task_id)[start:end])

    async def _write_end(self, outcome: Finished | Failed | Requeued, t: float) -> str:
        """Write one task's end; returns the name of the counter it bumps."""
        task_id = outcome.task_id
        if isinstance(outcome, Requeued):
            # Training handed back: the scheduler re-submits it, so the task is
            # not final and gets no `end` message.
            await self._append_completion(task_id, REQUEUED, outcome.reason, t)
            return "requeued_training"
        if isinstance(outcome, Finished):
            status, reason, n = COMPLETED, "", outcome.num_output_tokens
            # Training finishes with 0 output tokens; inference always has >= 1.
            stat = "num_completed_inference" if n > 0 else "num_completed_training"
        else:
            status, reason, n = FAILED, outcome.reason, self._num_tokens.get(task_id, 0)
            stat = "num_failed"
        output_fields: dict[str, FieldValue] = {"type": END_MESSAGE, "n": n,
                                                "node": str(self.node_id), "t": t}
        if self.model is not None and isinstance(outcome, Finished) and n > 0:
            output_fields.update(self.model.end_fields(task_id))
        is_first_end = await self.store.finish_task(
            task_id, status, reason,
            output_fields=output_fields,
            state_fields={"node_id": self.node_id, "finish_t": t, "num_output_tokens": n},
        )
        # Always report it, even when the task was already final (a redelivery):
        # the scheduler needs to learn that this node freed the task's memory.
        await self._append_completion(task_id, status, reason, t)
        self._num_tokens.pop(task_id, None)
        return stat if is_first_end else "num_duplicate_ends"  # count each task once

    async def _append_completion(self, task_id: str, status: str, reason: str,
                                 t: float) -> None:
        await self.store.append_completion(
            {"task_id": task_id, "node_id": self.node_id, "status": status, "reason": reason,
             "t": t}
        )
