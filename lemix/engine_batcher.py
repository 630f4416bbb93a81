"""Batch formation on one node: the inference requests' FIFO waiting queue, the
M micro-batches they run in, and the continuous-batching iterations formed from
them (`lemix.engine.NodeEngine` runs those iterations through its stages).

An iteration carries a micro-batch's decode steps, its prefill chunks (with a
`prefill_token_budget`) and the requests that join it at this boundary, under
`lemix.batching.admit`'s rules plus engine v2's (the node-wide cap, each
micro-batch's share of it, the balance rule: `lemix.engine_groups`). KV memory
is reserved when a request joins and released when it ends; waits for it are
`lemix.engine_memory`'s.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable
from itertools import islice

from lemix.batching import admit
from lemix.engine_config import EngineConfig
from lemix.engine_groups import (
    DECODE_GROUP,
    Iteration,
    MicroBatch,
    PrefillChunk,
    Request,
    fit_prefill_chunk,
    iteration_durations,
    micro_batch_cap,
    num_balanced_joins,
    num_within_budget,
    take_chunks,
)
from lemix.engine_memory import KV_WAIT_REASON, MemoryWaits
from lemix.engine_outputs import Failed, Finished, FirstToken, Outcome, TokensEmitted
from lemix.latency import LatencyModel
from lemix.memory import NodeMemory, kv_bytes
from lemix.profile import Profile
from lemix.reasons import ReasonCode, format_reason


class RequestBatcher:
    """One node's inference requests, from waiting to ended, in micro-batches."""

    def __init__(
        self,
        profile: Profile,
        truth: LatencyModel,
        config: EngineConfig,
        memory: NodeMemory,
        memory_waits: MemoryWaits,
        has_training: Callable[[], bool] = lambda: False,
    ) -> None:
        """`has_training`: whether the node has training in flight or waiting
        now (decodes are gathered only then, with `is_decode_gathered`)."""
        self.profile = profile
        self.truth = truth
        self.config = config
        self.num_stages = profile.num_stages
        self.memory = memory
        self.memory_waits = memory_waits
        self.waiting: deque[Request] = deque()
        num_micro_batches = config.num_micro_batches or self.num_stages
        self.micro_batches = [MicroBatch(i) for i in range(num_micro_batches)]
        cap = config.batching.max_batch_size
        if config.is_batch_cap_per_micro_batch:
            self._node_cap, self._micro_batch_cap = cap * num_micro_batches, cap
        else:
            self._node_cap = cap
            self._micro_batch_cap = micro_batch_cap(cap, num_micro_batches)
        self._can_gather = config.is_decode_gathered and num_micro_batches > 1
        self._has_training = has_training
        # While paced decodes hold the decode group: when it may start (the
        # engine's timer wakes it then).
        self.paced_until_s: float | None = None

    @property
    def is_gathering(self) -> bool:
        """Decodes go to `DECODE_GROUP` now (`lemix.engine_groups`)."""
        return self._can_gather and self._has_training()

    @property
    def swapped(self) -> deque[Request]:
        """Requests whose KV is on the host, oldest offload first."""
        return self.memory_waits.swapped

    @property
    def running(self) -> list[Request]:
        """The running requests of every micro-batch (a new list)."""
        return [req for batch in self.micro_batches for req in batch.running]

    @property
    def num_running(self) -> int:
        return sum(len(batch.running) for batch in self.micro_batches)

    def _reserve(self, req: Request) -> bool:
        """Admit `req`'s KV if it fits now."""
        need = kv_bytes(self.profile.memory, req.task.num_total_tokens)
        if not self.memory.can_admit(need):
            return False
        self.memory.admit(req.task.task_id, need)
        return True

    def shed_overdue_requests(self, now_s: float, outcomes: list[Outcome]) -> None:
        """Fail the requests that waited T_max for KV memory (`lemix.engine_memory`)."""
        for req in self.memory_waits.shed_overdue(self.waiting, now_s):
            outcomes.append(Failed(req.task.task_id, KV_WAIT_REASON))

    def form_iteration(
        self, batch: MicroBatch, now_s: float, outcomes: list[Outcome]
    ) -> tuple[Iteration, tuple[float, ...]] | None:
        """Form `batch`'s next iteration: its decodes, prefill chunks, new joins;
        with its duration on each stage (s). None: nothing to run."""
        if batch.index == DECODE_GROUP:
            self.paced_until_s = self._paced_until_s(batch, now_s)
            if self.paced_until_s is not None:
                return None
        self.memory_waits.resume(
            batch,
            min(self._node_cap - self.num_running, self._micro_batch_cap - len(batch.running)),
        )
        budget = self.config.prefill_token_budget
        decode = [r for r in batch.running if r.is_prefilled]
        # (A cancelled or failed prompt stays only while a chunk of it is in
        # another group's iteration: it gets no more chunks.)
        partial = [r for r in batch.running if not (r.is_prefilled or r.is_cancelled or r.failure)]
        prefill_budget = None if budget is None else max(budget - len(decode), 0)
        fit = None
        if budget is not None:
            fit = functools.partial(fit_prefill_chunk, self.profile.ours, self.num_stages)
        chunks, num_used = take_chunks(partial, prefill_budget, fit)
        if prefill_budget is not None:
            prefill_budget -= num_used
        if self.swapped:
            fits: list = []  # swapped requests go first: no new admissions
        else:
            fits = [
                lambda r=r: self._reserve(r)
                for r in self._join_candidates(batch, now_s, prefill_budget)
            ]
        decision = admit(self.config.batching, len(batch.running), batch.batch_start_s, fits, now_s)
        batch.batch_start_s = decision.batch_start_s
        joined = [self.waiting.popleft() for _ in range(decision.num_admitted)]
        if decision.blocked_by == "memory" or self.swapped:
            self.shed_overdue_requests(now_s, outcomes)
        for req in joined:
            req.micro_batch = batch.index
        joined_chunks, num_used = take_chunks(joined, prefill_budget, fit)
        chunks += joined_chunks
        if prefill_budget is not None:
            prefill_budget -= num_used
        chunks += self._borrowed_chunks(batch, chunks, decode, prefill_budget)
        if not chunks and not decode:
            return None
        reload_s = self.memory_waits.take_reload_s()  # owed once, by this iteration
        durations = iteration_durations(self.truth, self.num_stages, chunks, decode, reload_s)
        batch.running = decode + partial + joined
        batch.is_in_flight = True
        batch.last_start_s = now_s
        if len(self.micro_batches) > 1:  # only other groups read it (`_borrowed_chunks`)
            batch.planned_s = self._planned_s(chunks, decode)
        iteration = Iteration(
            [c.request for c in chunks],
            decode,
            batch.index,
            tuple((c.start, c.num_tokens) for c in chunks),
        )
        return iteration, durations

    def _paced_until_s(self, batch: MicroBatch, now_s: float) -> float | None:
        """When the decode group `batch` may start its next iteration if paced
        decodes hold it now (`EngineConfig.decode_pace_s`); None: it may start.

        Only gathered decodes are paced: the node trains, and a round sooner
        than the pace would take a stage from the training for a token its
        request does not need yet (the pace is below the TBT SLO)."""
        pace_s = self.config.decode_pace_s
        if pace_s is None or batch.last_start_s is None or not batch.running:
            return None
        until_s = batch.last_start_s + pace_s
        return until_s if now_s < until_s and self.is_gathering else None

    def _planned_s(self, chunks: list[PrefillChunk], decode: list[Request]) -> float:
        """An iteration's time on its slowest stage, by the profile's model."""
        return max(iteration_durations(self.profile.ours, self.num_stages, chunks, decode, 0.0))

    def _borrowed_chunks(
        self,
        batch: MicroBatch,
        chunks: list[PrefillChunk],
        decode: list[Request],
        prefill_budget: int | None,
    ) -> list[PrefillChunk]:
        """Pipelined chunks (`lemix.engine_groups`): the next chunks of other
        groups' prompts whose last chunk is in flight, within the budget left,
        while this iteration stays no longer than the longest one in flight.

        The groups' iterations follow each other on every stage, so the
        pipeline turns at the pace of the longest: up to that length this
        iteration's extra work fills time its stages would otherwise idle,
        and no running request waits longer between tokens for it."""
        limit_s = max(
            (b.planned_s for b in self.micro_batches if b is not batch and b.is_in_flight),
            default=0.0,
        )
        left = math.inf if prefill_budget is None else prefill_budget
        borrowed: list[PrefillChunk] = []
        if limit_s <= 0.0 or left < 1:  # no iteration in flight, or no budget left
            return borrowed
        for req in self._others_prompts(batch):
            if left < 1:
                break
            most = int(min(req.task.num_prompt_tokens - req.num_issued, left))

            def fits(n: int, req: Request = req) -> bool:
                chunk = PrefillChunk(req, req.num_issued, n)
                return self._planned_s([*chunks, *borrowed, chunk], decode) <= limit_s

            if not fits(1):
                break
            lo, hi = 1, most  # the most tokens that keep it within the limit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
            borrowed.append(PrefillChunk(req, req.num_issued, lo))
            req.num_issued += lo
            left -= lo
        return borrowed

    def _others_prompts(self, batch: MicroBatch) -> list[Request]:
        """The other groups' requests with prompt chunks still to run, in
        group order (each group's in the order they joined)."""
        return [
            req
            for other in self.micro_batches
            if other is not batch
            for req in other.running
            if not req.is_prefilled
            and req.has_chunks_to_issue
            and not (req.is_cancelled or req.failure)
        ]

    def _join_candidates(
        self, batch: MicroBatch, now_s: float, prefill_budget: int | None
    ) -> list[Request]:
        """The head of the waiting queue `batch` may take, before memory and the
        join window (`admit` checks those): within the node's cap C, the
        micro-batch's share of it, the prefill budget and the balance rule."""
        num_free = self._node_cap - self.num_running
        room = min(num_free, self._micro_batch_cap - len(batch.running))
        if room <= 0:
            return []
        head = list(islice(self.waiting, room))
        head = head[: num_within_budget([r.task.num_prompt_tokens for r in head], prefill_budget)]
        if len(self.micro_batches) == 1 or not head:
            return head
        # Gathering decodes: only the other groups take joins, balanced among them.
        groups = self.micro_batches
        if self.is_gathering:
            if batch.index == DECODE_GROUP:
                return []
            groups = [b for b in groups if b.index != DECODE_GROUP]
        window_s = self.config.batching.join_window_s
        is_eligible = [
            len(b.running) < self._micro_batch_cap
            and (window_s is None or not b.running or b.batch_start_s + window_s > now_s)
            for b in groups
        ]
        num_waiting_tokens = self._admissible_prompt_tokens(num_free)
        num = num_balanced_joins(
            groups.index(batch),
            [b.load_tokens for b in groups],
            is_eligible,
            [r.task.num_prompt_tokens for r in head],
            num_waiting_tokens,
            is_head_overdue=head[0].num_passed_over >= len(groups),
        )
        if num == 0:
            head[0].num_passed_over += 1
        return head[:num]

    def _admissible_prompt_tokens(self, num_free: int) -> int:
        """Prompt tokens of the waiting requests the node could admit now (the
        head, up to `num_free` of them, while their KV fits in free memory):
        what the balance rule's even share is taken over."""
        free = [self.memory.free_bytes(s) for s in range(self.num_stages)]
        total = 0
        for req in islice(self.waiting, num_free):
            need = kv_bytes(self.profile.memory, req.task.num_total_tokens)
            if any(n > f for n, f in zip(need, free, strict=True)):
                break
            free = [f - n for n, f in zip(need, free, strict=True)]
            total += req.task.num_prompt_tokens
        return total

    def finish_iteration(
        self, iteration: Iteration, visible_updates: int, outcomes: list[Outcome]
    ) -> None:
        """`iteration` left the last stage: advance its requests, end the finished,
        cancelled and failed ones (`visible_updates`: the serving weights')."""
        batch = self.micro_batches[iteration.micro_batch]
        batch.is_in_flight = False
        for req, (start, num_tokens) in zip(
            iteration.prefill, iteration.prefill_spans, strict=True
        ):
            req.num_prefilled = start + num_tokens
            if req.num_prefilled < req.task.num_prompt_tokens:
                req.context_tokens = req.num_prefilled  # more chunks to come
                continue
            req.num_generated = 1
            req.context_tokens = req.task.num_prompt_tokens + 1
            if not req.failure:  # a failed request's token was never made
                outcomes.append(FirstToken(req.task.task_id, visible_updates))
        for req in iteration.decode:
            req.num_generated += 1
            req.context_tokens += 1
        emitted = [r for r in iteration.decode if not r.failure]
        if self.config.emit_tokens and emitted:
            outcomes.append(
                TokensEmitted(
                    tuple(r.task.task_id for r in emitted), tuple(r.num_generated for r in emitted)
                )
            )
        batch.running = [req for req in batch.running if not self._end_if_done(req, outcomes)]
        # Another group's request whose chunk this iteration carried: it ends
        # here if it is done and its own group is between iterations (else
        # that group's iteration ends it when it comes back).
        for req in iteration.prefill:
            home = self.micro_batches[req.micro_batch]
            if home is not batch and not home.is_in_flight and self._end_if_done(req, outcomes):
                home.running.remove(req)
        if self.is_gathering:
            self._gather_decodes(batch, iteration)

    def _gather_decodes(self, batch: MicroBatch, iteration: Iteration) -> None:
        """Move the prefilled requests of `batch` (which just came back) and
        those whose last chunk `iteration` carried into `DECODE_GROUP`, while it
        has room. None of them has a chunk in flight, so no iteration in flight
        holds them: their home's, if in flight, was formed before they were
        prefilled and carries none of their chunks (stages run iterations in
        the order they were formed)."""
        decode_group = self.micro_batches[DECODE_GROUP]
        movable = [] if batch is decode_group else list(batch.running)
        movable += [r for r in iteration.prefill if r.micro_batch != batch.index]
        for req in movable:
            if len(decode_group.running) >= self._micro_batch_cap:
                return
            home = self.micro_batches[req.micro_batch]
            if home is decode_group or not req.is_prefilled or req.has_chunk_in_flight:
                continue
            if req not in home.running:  # ended above
                continue
            if self._is_ending(req):
                # Done, but its home is in flight: the home's iteration ends
                # it when it comes back. Moved, it would decode once more (a
                # token past max_output_tokens) before ending.
                continue
            home.running.remove(req)
            decode_group.running.append(req)
            req.micro_batch = DECODE_GROUP

    @staticmethod
    def _is_ending(req: Request) -> bool:
        """Whether `_end_if_done` ends `req` once no chunk of it is in flight."""
        return bool(
            req.is_cancelled
            or req.failure
            or (
                req.is_prefilled
                and (req.is_stopped or req.num_generated >= req.task.max_output_tokens)
            )
        )

    def _end_if_done(self, req: Request, outcomes: list[Outcome]) -> bool:
        """End `req` if it is cancelled, failed or finished and no chunk of it
        is still in flight: release its KV, note its outcome; True if it ended."""
        if req.has_chunk_in_flight or not self._is_ending(req):
            return False
        self.memory.release(req.task.task_id)
        if req.is_cancelled or req.failure:
            reason = (
                req.failure
                or req.cancel_reason
                or format_reason(ReasonCode.CANCELLED, "cancelled by the client")
            )
            outcomes.append(Failed(req.task.task_id, reason))
        else:
            outcomes.append(Finished(req.task.task_id, req.num_generated))
        return True
