"""Turn a task and a node view into predicted per-stage costs.

Two estimators share one interface:
- `PaperCostEstimator`: the prototype's view, prefill-only — a task is one
  forward (and, for training, one backward) of `η·C·ℓ²` per stage.
- `DecodeAwareCostEstimator`: ours. Inference joins the node's running batch,
  so its forward is the iteration it rides (prefill + the batch's decode step);
  it may first wait for a batch slot or for KV memory (at most T_max, as in the
  engine, which fails it then); and the running batch's
  decode iterations occupy every stage until they drain (`DecodeLoad`), which
  is busy time, not idleness. This answers the review's main objection.

  Engine v2 shapes (`PlannerConfig`'s engine knobs): with M micro-batches the
  running requests form M groups of ~n/M, each an iteration that visits the
  stages in turn, so a stage is busy M × step(n/M) per round and a request
  waits for the slower of its group's pass through the stages and the busiest
  stage's round; a chunked prompt of P tokens takes ceil(P/B) iterations
  before its first token; and a training item holds a stage at most one slice,
  so that is what an inference iteration waits behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from lemix.latency import LatencyModel
from lemix.planner.trace import DecodeLoad, NodeView, TaskCosts
from lemix.types import Task

# Training placed on a node within this window sets its predicted training load.
TRAINING_LOAD_WINDOW_S = 10.0


class CostEstimator(Protocol):
    def costs(self, view: NodeView, task: Task, now_s: float) -> TaskCosts: ...

    def decode_load(self, view: NodeView, now_s: float) -> DecodeLoad | None: ...


@dataclass(frozen=True)
class PaperCostEstimator:
    latency: LatencyModel
    optimizer_step_s: tuple[float, ...]

    def costs(self, view: NodeView, task: Task, now_s: float) -> TaskCosts:
        stages = range(view.num_stages)
        forward = tuple(
            self.latency.forward_s(s, task.batch_size, task.num_prompt_tokens) for s in stages
        )
        if not task.is_training:
            return TaskCosts(forward_s=forward)
        backward = tuple(
            self.latency.backward_s(s, task.batch_size, task.num_prompt_tokens)
            + self.optimizer_step_s[s]
            for s in stages
        )
        return TaskCosts(forward_s=forward, backward_s=backward)

    def decode_load(self, view: NodeView, now_s: float) -> DecodeLoad | None:
        return None


@dataclass(frozen=True)
class DecodeAwareCostEstimator:
    """Ours: prefill + decode occupancy + slot and KV-memory waits."""

    latency: LatencyModel
    optimizer_step_s: tuple[float, ...]
    max_batch_size: int  # requests a node runs at once (`PlannerConfig.max_running_per_node`)
    kv_capacity_tokens: int  # KV tokens that fit under the memory threshold, per node
    is_memory_aware: bool = True
    num_micro_batches: int = 1  # M: inference iterations in flight per node
    prefill_token_budget: int | None = None  # B: tokens per iteration (None: whole prompts)
    max_training_slice_s: float | None = None  # longest piece of a training item on a stage
    # T_max (`MemoryConfig.max_wait_s`): the engine fails a request still short
    # of KV then (`lemix.engine_memory`), so no request it serves waited longer
    # for KV; None: a wait without a bound.
    max_kv_wait_s: float | None = None

    def _training_stall_s(self, mean_item_s: float) -> float:
        """What an inference iteration waits behind a training item it finds
        on a stage: the item, or one slice of it."""
        if self.max_training_slice_s is None:
            return mean_item_s
        return min(mean_item_s, self.max_training_slice_s)

    def _round(self, num_running: int, sum_context: int, num_stages: int) -> tuple[float, ...]:
        """Per-stage busy time of one decode round of `num_running` requests."""
        groups = min(self.num_micro_batches, num_running)
        if groups <= 1:
            return tuple(
                self.latency.decode_step_s(s, num_running, sum_context) for s in range(num_stages)
            )
        per_group, per_context = -(-num_running // groups), sum_context // groups
        return tuple(
            groups * self.latency.decode_step_s(s, per_group, per_context)
            for s in range(num_stages)
        )

    def _period_s(self, busy: tuple[float, ...], num_running: int) -> float:
        """Time between a request's tokens, given the stages' busy time per round."""
        groups = min(self.num_micro_batches, num_running)
        if groups <= 1:
            return sum(busy)
        # The slower of: the request's own group through every stage, and the
        # busiest stage working through all groups once.
        return max(sum(busy) / groups, max(busy))

    def _batch_state(self, view: NodeView) -> tuple[int, int, int, float]:
        """(running, sum_context, max_remaining, mean_output) of the held requests."""
        num_requests = len(view.requests)
        if num_requests == 0:
            return 0, 0, 0, 0.0
        num_running = min(num_requests, self.max_batch_size)
        # Mid-decode on average: the prompt plus half the output is cached.
        sum_context = view.sum_request_prompt_tokens + view.sum_request_output_tokens // 2
        sum_context = sum_context * num_running // num_requests
        mean_output = view.sum_request_output_tokens / num_requests
        return num_running, sum_context, view.max_request_output_tokens, mean_output

    def iteration_s(self, view: NodeView) -> tuple[float, ...]:
        """Per-stage time of one decode iteration of the node's running batch."""
        hit = view.cached.get("iteration_s")
        if hit is not None and hit[0] == view.version:
            return hit[1]  # type: ignore[return-value]
        num_running, sum_context, _, _ = self._batch_state(view)
        if num_running == 0:
            step = (0.0,) * view.num_stages
        else:
            step = self._round(num_running, sum_context, view.num_stages)
        view.cached["iteration_s"] = (view.version, step)
        return step

    def period_s(self, view: NodeView) -> float:
        """Time between tokens of the node's running batch as it is."""
        num_running = min(len(view.requests), self.max_batch_size)
        return self._period_s(self.iteration_s(view), num_running)

    def _slot_wait_s(
        self, view: NodeView, task: Task, period_s: float, mean_output: float
    ) -> float:
        """Expected wait for a free batch slot (and KV room when memory-aware).

        The wait for KV is at most `max_kv_wait_s`: past it the engine fails
        the request (an SLO miss, as any wait past the TTFT SLO is), and the
        requests queued ahead of it leave the same way, so the queue does not
        grow past what T_max lets through. The wait for a batch slot has no
        such bound (requests finish)."""
        num_requests = len(view.requests)

        def wait_s(num_slots: int) -> float:
            # One slot frees about every mean_output·period/num_slots seconds.
            num_ahead = num_requests - num_slots + 1
            return max(num_ahead, 0) * mean_output * period_s / num_slots

        slot_wait_s = wait_s(self.max_batch_size)
        if not self.is_memory_aware or not view.requests:
            return slot_wait_s
        kv_tokens = view.sum_request_prompt_tokens + view.sum_request_output_tokens
        mean_kv = kv_tokens / num_requests
        kv_slots = max(1, int(self.kv_capacity_tokens // max(mean_kv, 1.0)))
        kv_wait_s = wait_s(min(kv_slots, self.max_batch_size))
        if self.max_kv_wait_s is not None:
            kv_wait_s = min(kv_wait_s, self.max_kv_wait_s)
        return max(slot_wait_s, kv_wait_s)

    def costs(self, view: NodeView, task: Task, now_s: float) -> TaskCosts:
        stages = range(view.num_stages)
        step = self.iteration_s(view)
        period_s = self.period_s(view)
        if not task.is_training:
            _, _, _, mean_output = self._batch_state(view)
            forward = tuple(
                self.latency.forward_s(s, 1, task.num_prompt_tokens) + step[s] for s in stages
            )
            # Joining happens at an iteration boundary: half a period on average.
            delay_s = 0.5 * period_s + self._slot_wait_s(view, task, period_s, mean_output)
            budget = self.prefill_token_budget
            if budget is not None and task.num_prompt_tokens > budget:
                # The chunks before the last ride one iteration each.
                delay_s += (-(-task.num_prompt_tokens // budget) - 1) * period_s
            return TaskCosts(
                forward_s=forward,
                start_delay_s=delay_s,
                time_between_tokens_s=self._tbt_after_join_s(view, task, now_s),
            )
        # Inference goes first at each stage, so a training item waits out the
        # decode item in progress: half a step on average.
        forward = tuple(
            self.latency.forward_s(s, task.batch_size, task.num_prompt_tokens) + 0.5 * step[s]
            for s in stages
        )
        backward = tuple(
            self.latency.backward_s(s, task.batch_size, task.num_prompt_tokens)
            + self.optimizer_step_s[s]
            + 0.5 * step[s]
            for s in stages
        )
        # What the node's running batch would see per token with this task
        # added to its training load: placement steers training to idle time.
        work_s = max(f + b for f, b in zip(forward, backward, strict=True))
        return TaskCosts(
            forward_s=forward,
            backward_s=backward,
            time_between_tokens_s=self._batch_tbt_with_training_s(view, now_s, work_s),
        )

    def _tbt_after_join_s(self, view: NodeView, task: Task, now_s: float) -> float:
        """Predicted time between tokens for `task` once it joins the batch.

        The batch's decode period with the request added, plus training
        stalls. Inference goes first on every stage but items are not
        preempted, and while the pipeline's one iteration is on another stage a
        ready training item takes this one; so an iteration waits about one
        item per stage whenever training keeps the stage busy. With training
        busy fraction u (from the node's recent training placements) and mean
        item length w, that is S·min(u, 1)·w per token.
        """
        num_running, sum_context, _, _ = self._batch_state(view)
        num_after = min(num_running + 1, self.max_batch_size)
        context_after = sum_context + task.num_prompt_tokens + task.max_output_tokens // 2
        period_s = self._period_s(self._round(num_after, context_after, view.num_stages), num_after)
        busy_fraction, mean_item_s = view.training_load(now_s, TRAINING_LOAD_WINDOW_S)
        stall_s = self._training_stall_s(mean_item_s)
        return period_s + view.num_stages * min(busy_fraction, 1.0) * stall_s

    def _batch_tbt_with_training_s(self, view: NodeView, now_s: float, work_s: float) -> float:
        """The running batch's time between tokens if training of `work_s` joins the
        node's recent training load (0 when nothing is decoding there)."""
        if not view.requests:
            return 0.0
        period_s = self.period_s(view)
        busy_fraction, mean_item_s = view.training_load(now_s, TRAINING_LOAD_WINDOW_S)
        num_items = 2 * len(view.recent_training)
        mean_item_s = (mean_item_s * num_items + work_s) / (num_items + 2)
        busy_fraction += work_s / TRAINING_LOAD_WINDOW_S
        stall_s = self._training_stall_s(mean_item_s)
        return period_s + view.num_stages * min(busy_fraction, 1.0) * stall_s

    def decode_load(self, view: NodeView, now_s: float) -> DecodeLoad | None:
        num_running, _, max_remaining, _ = self._batch_state(view)
        if num_running == 0:
            return None
        step = self.iteration_s(view)
        period_s = self.period_s(view)
        if period_s <= 0:
            return None
        # Until the longest request drains (at most max_remaining iterations).
        return DecodeLoad(
            busy_fraction=tuple(x / period_s for x in step),
            until_s=now_s + max_remaining * period_s,
        )
