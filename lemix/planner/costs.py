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
  before its first token, one every period / M (its chunks ride whichever
  group forms next); and a training item holds a stage at most one slice,
  so that is what an inference iteration waits behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import add
from typing import Protocol

from lemix.latency import LatencyModel
from lemix.planner.trace import DecodeLoad, NodeView, TaskCosts
from lemix.types import Task, TaskKind

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


@dataclass(slots=True)  # not frozen: a frozen __init__ is ~5x slower
class _BatchFacts:
    """What the decode-aware estimator derives from a node's held requests.

    Algorithm 1 asks for these on every node for every task, but they change
    only when the node's requests do: they are kept in `NodeView.cached` with
    the estimator that made them (two estimators may look at one view), and
    are valid at the version they were made at or while the request sums they
    come from (`key`) are the same, so placing training keeps them, and so
    does a copy of the view (training's what-if probe).
    """

    owner: DecodeAwareCostEstimator
    version: int
    key: tuple[int, int, int, int, bool]  # `_batch_key` of the view they were made from
    num_running: int
    sum_context: int  # KV tokens of the running requests, mid-decode on average
    step_s: tuple[float, ...]  # per stage: one decode round (`iteration_s`)
    half_step_s: tuple[float, ...]  # 0.5 × step_s: the decode item a training item waits out
    period_s: float  # time between tokens of the batch as it is
    # period_s once the node trains: one decode group with gathered decodes
    period_training_s: float
    join_delay_s: float  # half a period (iteration boundary) + the slot/KV wait
    decode_busy_fraction: tuple[float, ...] | None  # per stage; None: no decode load
    drain_s: float  # until the longest request drains: max remaining × period


@dataclass(slots=True)  # not frozen: a frozen __init__ is ~5x slower
class _TrainingLoad:
    """`NodeView.training_load` at one `now_s`, with what follows from it (it
    changes with the version and with time: old placements leave the window)."""

    owner: DecodeAwareCostEstimator
    version: int
    now_s: float
    busy_fraction: float
    mean_item_s: float
    num_items: int  # forwards and backwards in the window (2 per placement)
    stall_term_s: float  # k · min(u, 1) · stall (`stall_stages`): a joiner's TBT's training part


_BATCH_KEY = "decode-aware-batch"


def _batch_key(view: NodeView) -> tuple[int, int, int, int, bool]:
    """Everything `_BatchFacts` is computed from (with the estimator); whether
    the node trains decides how many groups it decodes in (gathered decodes)."""
    return (
        len(view.requests),
        view.sum_request_prompt_tokens,
        view.sum_request_output_tokens,
        view.max_request_output_tokens,
        bool(view.training_tasks),
    )


_LOAD_KEY = "decode-aware-training-load"
_MAX_SHAPES = 4096  # memoized task shapes before the memo starts over


@dataclass(frozen=True)
class DecodeAwareCostEstimator:
    """Ours: prefill + decode occupancy + slot and KV-memory waits."""

    latency: LatencyModel
    optimizer_step_s: tuple[float, ...]
    max_batch_size: int  # requests a node runs at once (`PlannerConfig.max_running_per_node`)
    kv_capacity_tokens: int  # KV tokens that fit under the memory threshold, per node
    is_memory_aware: bool = True
    num_micro_batches: int = 1  # M: inference iterations in flight per node
    # `EngineConfig.is_decode_gathered`: a node that trains decodes in one group.
    is_decode_gathered: bool = False
    prefill_token_budget: int | None = None  # B: tokens per iteration (None: whole prompts)
    max_training_slice_s: float | None = None  # longest piece of a training item on a stage
    # `EngineConfig.decode_pace_s`: gathered decode rounds start at least this far apart.
    decode_pace_s: float | None = None
    # T_max (`MemoryConfig.max_wait_s`): the engine fails a request still short
    # of KV then (`lemix.engine_memory`), so no request it serves waited longer
    # for KV; None: a wait without a bound.
    max_kv_wait_s: float | None = None
    # (kind, batch size, tokens) -> per-stage forward and backward (+
    # optimizer step) times: a task's own costs are the same on every node.
    _shapes: dict[tuple[TaskKind, int, int], tuple[tuple[float, ...], tuple[float, ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def _training_stall_s(self, mean_item_s: float) -> float:
        """What an inference iteration waits behind a training item it finds
        on a stage: the item, or one slice of it."""
        if self.max_training_slice_s is None:
            return mean_item_s
        return min(mean_item_s, self.max_training_slice_s)

    def stall_stages(self, num_stages: int, is_training: bool) -> float:
        """k in the training part of a TBT, k · min(u, 1) · stall: the slices a
        token waits out per round when training keeps the stages busy.

        With M decode groups a stage is left by one group and reached by the
        next, and a slice starts in the gap: a full slice per stage, k = S.
        With gathered decodes (one group on a node that trains) only the stage
        the group just left starts a slice as it leaves; the group finds the
        slices of the other stages part run (half of one on average), so
        k = (S + 1) / 2. That is a model, checked against the simulator
        (realised / predicted TBT of placed requests, median, train rate 0.5,
        conversation trace, A100 7B 2 stages): 1.04 at 6 req/s, 1.01 at 10,
        1.05 at 14; with k = S it was 0.91 at 10 req/s (over-predicted, so
        training was held back). docs/results.md, 2026-12-03."""
        if self.is_decode_gathered and is_training and self.num_micro_batches > 1:
            return (num_stages + 1) / 2
        return float(num_stages)

    def paced_tbt_s(self, tbt_s: float, is_training: bool) -> float:
        """A time between tokens `tbt_s` as paced decodes make it: never below
        the pace while the node gathers its decodes (it trains); the decode
        load's busy share and drain time keep the unpaced period, which
        overstates the decode work a paced node does."""
        if (
            self.decode_pace_s is not None
            and self.decode_groups(is_training) == 1 < self.num_micro_batches
        ):
            return max(tbt_s, self.decode_pace_s)
        return tbt_s

    def decode_groups(self, is_training: bool) -> int:
        """Groups a node's requests decode in: one on a node that trains
        (`is_training`) with gathered decodes, else M."""
        return 1 if self.is_decode_gathered and is_training else self.num_micro_batches

    def _round(
        self, num_running: int, sum_context: int, num_stages: int, max_groups: int
    ) -> tuple[float, ...]:
        """Per-stage busy time of one decode round of `num_running` requests
        in up to `max_groups` groups."""
        groups = min(max_groups, num_running)
        step_s = self.latency.decode_step_s
        # (lists, not generators, into tuple(): this runs per node per task)
        if groups <= 1:
            return tuple([step_s(s, num_running, sum_context) for s in range(num_stages)])
        per_group, per_context = -(-num_running // groups), sum_context // groups
        return tuple([groups * step_s(s, per_group, per_context) for s in range(num_stages)])

    def _period_s(self, busy: tuple[float, ...], num_running: int, max_groups: int) -> float:
        """Time between a request's tokens, given the stages' busy time per round."""
        groups = min(max_groups, num_running)
        if groups <= 1:
            return sum(busy)
        # The slower of: the request's own group through every stage, and the
        # busiest stage working through all groups once.
        return max(sum(busy) / groups, max(busy))

    def _batch(self, view: NodeView) -> _BatchFacts:
        """The view's `_BatchFacts`, computed when its requests change."""
        facts = view.cached.get(_BATCH_KEY)
        if (
            isinstance(facts, _BatchFacts)
            and facts.owner is self
            and (facts.version == view.version or facts.key == _batch_key(view))
        ):
            return facts
        facts = self._batch_facts(view)
        view.cached[_BATCH_KEY] = facts
        return facts

    def _batch_facts(self, view: NodeView) -> _BatchFacts:
        num_stages = view.num_stages
        num_requests = len(view.requests)
        if num_requests == 0:
            step = (0.0,) * num_stages
            key = _batch_key(view)
            return _BatchFacts(self, view.version, key, 0, 0, step, step, 0.0, 0.0, 0.0, None, 0.0)
        num_running = min(num_requests, self.max_batch_size)
        # Mid-decode on average: the prompt plus half the output is cached.
        sum_context = view.sum_request_prompt_tokens + view.sum_request_output_tokens // 2
        sum_context = sum_context * num_running // num_requests
        mean_output = view.sum_request_output_tokens / num_requests
        groups = self.decode_groups(bool(view.training_tasks))
        step = self._round(num_running, sum_context, num_stages, groups)
        period_s = self._period_s(step, num_running, groups)
        period_training_s = period_s
        if groups != (training_groups := self.decode_groups(True)):
            period_training_s = self._period_s(
                self._round(num_running, sum_context, num_stages, training_groups),
                num_running,
                training_groups,
            )
        join_delay_s = 0.5 * period_s + self._slot_wait_s(view, period_s, mean_output)
        busy = tuple(x / period_s for x in step) if period_s > 0 else None
        return _BatchFacts(
            owner=self,
            version=view.version,
            key=_batch_key(view),
            num_running=num_running,
            sum_context=sum_context,
            step_s=step,
            half_step_s=tuple(0.5 * x for x in step),
            period_s=period_s,
            period_training_s=period_training_s,
            join_delay_s=join_delay_s,
            decode_busy_fraction=busy,
            drain_s=view.max_request_output_tokens * period_s,
        )

    def _training_load(self, view: NodeView, now_s: float) -> _TrainingLoad:
        """`view.training_load(now_s)`, recomputed only when the version changed
        or the window would drop a placement: otherwise that call would prune
        nothing and return what it did last time."""
        load = view.cached.get(_LOAD_KEY)
        if (
            isinstance(load, _TrainingLoad)
            and load.version == view.version
            and load.owner is self
            and (
                load.now_s == now_s
                # the prune's own test: nothing placed before the window
                or not view.recent_training
                or not view.recent_training[0][0] < now_s - TRAINING_LOAD_WINDOW_S
            )
        ):
            return load
        busy_fraction, mean_item_s = view.training_load(now_s, TRAINING_LOAD_WINDOW_S)
        stall_s = self._training_stall_s(mean_item_s)
        load = _TrainingLoad(
            owner=self,
            version=view.version,
            now_s=now_s,
            busy_fraction=busy_fraction,
            mean_item_s=mean_item_s,
            num_items=2 * len(view.recent_training),
            stall_term_s=self.stall_stages(view.num_stages, bool(view.training_tasks))
            * min(busy_fraction, 1.0)
            * stall_s,
        )
        view.cached[_LOAD_KEY] = load
        return load

    def _shape_s(self, task: Task, num_stages: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """`task`'s own per-stage (forward, backward + optimizer step) times;
        inference is one sequence and has no backward."""
        key = (task.kind, task.batch_size, task.num_prompt_tokens)
        hit = self._shapes.get(key)
        if hit is not None and len(hit[0]) == num_stages:
            return hit
        stages = range(num_stages)
        latency = self.latency
        if task.kind is not TaskKind.TRAINING:
            shape: tuple[tuple[float, ...], tuple[float, ...]] = (
                tuple(latency.forward_s(s, 1, task.num_prompt_tokens) for s in stages),
                (),
            )
        else:
            batch_size, num_tokens = task.batch_size, task.num_prompt_tokens
            shape = (
                tuple(latency.forward_s(s, batch_size, num_tokens) for s in stages),
                tuple(
                    latency.backward_s(s, batch_size, num_tokens) + self.optimizer_step_s[s]
                    for s in stages
                ),
            )
        if len(self._shapes) >= _MAX_SHAPES:
            self._shapes.clear()
        self._shapes[key] = shape
        return shape

    def batch_facts(self, view: NodeView) -> _BatchFacts:
        """The node's running-batch facts (cached per view; `lemix.planner.bounds`)."""
        return self._batch(view)

    def training_load_facts(self, view: NodeView, now_s: float) -> _TrainingLoad:
        """The node's recent training load at `now_s` (cached per view)."""
        return self._training_load(view, now_s)

    def task_shape_s(
        self, task: Task, num_stages: int
    ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """`task`'s own per-stage forward and backward (+ optimizer step) times."""
        return self._shape_s(task, num_stages)

    def iteration_s(self, view: NodeView) -> tuple[float, ...]:
        """Per-stage time of one decode iteration of the node's running batch."""
        return self._batch(view).step_s

    def period_s(self, view: NodeView) -> float:
        """Time between tokens of the node's running batch as it is."""
        return self._batch(view).period_s

    def _slot_wait_s(self, view: NodeView, period_s: float, mean_output: float) -> float:
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
        batch = self._batch(view)
        forward_s, backward_s = self._shape_s(task, view.num_stages)
        if task.kind is not TaskKind.TRAINING:
            # Prefill plus the running batch's decode step; joining happens at
            # an iteration boundary: half a period on average.
            delay_s = batch.join_delay_s
            budget = self.prefill_token_budget
            if budget is not None and task.num_prompt_tokens > budget:
                # The chunks before the last ride one iteration each, of
                # whichever of the M groups forms next (pipelined chunks):
                # one every period / M.
                num_chunks = -(-task.num_prompt_tokens // budget)
                delay_s += (num_chunks - 1) * batch.period_s / self.num_micro_batches
            return TaskCosts(
                tuple(map(add, forward_s, batch.step_s)),
                (),
                delay_s,
                self._tbt_after_join_s(view, batch, task, now_s),
            )
        # Inference goes first at each stage, so a training item waits out the
        # decode item in progress: half a step on average.
        forward = tuple(map(add, forward_s, batch.half_step_s))
        backward = tuple(map(add, backward_s, batch.half_step_s))
        # What the node's running batch would see per token with this task
        # added to its training load: placement steers training to idle time.
        work_s = max(map(add, forward, backward))
        return TaskCosts(
            forward,
            backward,
            0.0,
            self._batch_tbt_with_training_s(view, batch, now_s, work_s),
        )

    def _tbt_after_join_s(
        self, view: NodeView, batch: _BatchFacts, task: Task, now_s: float
    ) -> float:
        """Predicted time between tokens for `task` once it joins the batch.

        The batch's decode period with the request added, plus training
        stalls. Inference goes first on every stage but items are not
        preempted, and while the pipeline's one iteration is on another stage a
        ready training item takes this one; so an iteration waits about one
        item per stage whenever training keeps the stage busy. With training
        busy fraction u (from the node's recent training placements) and mean
        item length w, that is k·min(u, 1)·w per token (k: `stall_stages`).
        """
        num_after = min(batch.num_running + 1, self.max_batch_size)
        context_after = batch.sum_context + task.num_prompt_tokens + task.max_output_tokens // 2
        is_training = bool(view.training_tasks)
        groups = self.decode_groups(is_training)
        step = self._round(num_after, context_after, view.num_stages, groups)
        period_s = self._period_s(step, num_after, groups)
        return self.paced_tbt_s(
            period_s + self._training_load(view, now_s).stall_term_s, is_training
        )

    def _batch_tbt_with_training_s(
        self, view: NodeView, batch: _BatchFacts, now_s: float, work_s: float
    ) -> float:
        """The running batch's time between tokens if training of `work_s` joins the
        node's recent training load (0 when nothing is decoding there)."""
        if not view.requests:
            return 0.0
        load = self._training_load(view, now_s)
        num_items = load.num_items
        mean_item_s = (load.mean_item_s * num_items + work_s) / (num_items + 2)
        busy_fraction = load.busy_fraction + work_s / TRAINING_LOAD_WINDOW_S
        stall_s = self._training_stall_s(mean_item_s)
        stall_stages = self.stall_stages(view.num_stages, True)
        tbt_s = batch.period_training_s + stall_stages * min(busy_fraction, 1.0) * stall_s
        return self.paced_tbt_s(tbt_s, True)

    def decode_load(self, view: NodeView, now_s: float) -> DecodeLoad | None:
        batch = self._batch(view)
        if batch.decode_busy_fraction is None:
            return None  # nothing decoding (or a zero-cost decode step)
        # Until the longest request drains (at most max_remaining iterations).
        return DecodeLoad(busy_fraction=batch.decode_busy_fraction, until_s=now_s + batch.drain_s)
