"""Turn a task and a node view into predicted per-stage costs.

Two estimators share one interface:
- `PaperCostEstimator`: the prototype's view, prefill-only — a task is one
  forward (and, for training, one backward) of `η·C·ℓ²` per stage.
- `DecodeAwareCostEstimator`: ours. Inference joins the node's running batch,
  so its forward is the iteration it rides (prefill + the batch's decode step);
  it may first wait for a batch slot or KV memory; and the running batch's
  decode iterations occupy every stage until they drain (`DecodeLoad`), which
  is busy time, not idleness. This answers the review's main objection.
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
    max_batch_size: int  # C: the executor's running-batch cap
    kv_capacity_tokens: int  # KV tokens that fit under the memory threshold, per node
    is_memory_aware: bool = True

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
            step = tuple(
                self.latency.decode_step_s(s, num_running, sum_context)
                for s in range(view.num_stages)
            )
        view.cached["iteration_s"] = (view.version, step)
        return step

    def _slot_wait_s(
        self, view: NodeView, task: Task, period_s: float, mean_output: float
    ) -> float:
        """Expected wait for a free batch slot (and KV room when memory-aware)."""
        num_slots = self.max_batch_size
        if self.is_memory_aware and view.requests:
            kv_tokens = view.sum_request_prompt_tokens + view.sum_request_output_tokens
            mean_kv = kv_tokens / len(view.requests)
            num_slots = min(num_slots, max(1, int(self.kv_capacity_tokens // max(mean_kv, 1.0))))
        num_ahead = len(view.requests) - num_slots + 1
        if num_ahead <= 0:
            return 0.0
        # One slot frees about every mean_output·period/num_slots seconds.
        return num_ahead * mean_output * period_s / num_slots

    def costs(self, view: NodeView, task: Task, now_s: float) -> TaskCosts:
        stages = range(view.num_stages)
        step = self.iteration_s(view)
        period_s = sum(step)
        if not task.is_training:
            _, _, _, mean_output = self._batch_state(view)
            forward = tuple(
                self.latency.forward_s(s, 1, task.num_prompt_tokens) + step[s] for s in stages
            )
            # Joining happens at an iteration boundary: half a period on average.
            delay_s = 0.5 * period_s + self._slot_wait_s(view, task, period_s, mean_output)
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
        period_s = sum(
            self.latency.decode_step_s(s, num_after, context_after) for s in range(view.num_stages)
        )
        busy_fraction, mean_item_s = view.training_load(now_s, TRAINING_LOAD_WINDOW_S)
        return period_s + view.num_stages * min(busy_fraction, 1.0) * mean_item_s

    def _batch_tbt_with_training_s(self, view: NodeView, now_s: float, work_s: float) -> float:
        """The running batch's time between tokens if training of `work_s` joins the
        node's recent training load (0 when nothing is decoding there)."""
        if not view.requests:
            return 0.0
        period_s = sum(self.iteration_s(view))
        busy_fraction, mean_item_s = view.training_load(now_s, TRAINING_LOAD_WINDOW_S)
        num_items = 2 * len(view.recent_training)
        mean_item_s = (mean_item_s * num_items + work_s) / (num_items + 2)
        busy_fraction += work_s / TRAINING_LOAD_WINDOW_S
        return period_s + view.num_stages * min(busy_fraction, 1.0) * mean_item_s

    def decode_load(self, view: NodeView, now_s: float) -> DecodeLoad | None:
        num_running, _, max_remaining, _ = self._batch_state(view)
        if num_running == 0:
            return None
        step = self.iteration_s(view)
        period_s = sum(step)
        if period_s <= 0:
            return None
        # Until the longest request drains (at most max_remaining iterations).
        return DecodeLoad(
            busy_fraction=tuple(x / period_s for x in step),
            until_s=now_s + max_remaining * period_s,
        )
