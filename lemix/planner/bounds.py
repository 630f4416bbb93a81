"""Score bounds of one task on every node at once, as numpy arrays.

`best_candidates` bounds each node's score from the estimator's costs before it
runs Algorithm 1 on the few that can win. At 64 nodes computing those costs
and bounds node by node (~5 µs each in Python) is most of a decision.
`VectorBounds` computes the same quantities for every node in a handful of
array operations:

- from `DecodeAwareCostEstimator.costs`: the forward per stage, the start
  delay and the TBT after joining (inference) or of the running batch with the
  task's training added;
- from `response_lower_bound_s` and `Predictor.response_floor_s`: the floor
  under the response (and the sliced response, when lower);
- from the policy's `score_upper_bounds`: the bound.

Each element goes through the same IEEE operations in the same order as the
per-node path, except `exp` (numpy's may differ from `math.exp` in the last
bit) and the per-node path's `sum()` over stages (compensated summation from
Python 3.12 on), so the bounds are raised by `BOUND_MARGIN`: still an upper bound on every
node's score, which is all the early exit needs to stay exact (a looser bound
only predicts a node more). A parity test checks both paths on random states.

What each node contributes is a row of a table kept for the views last asked
about: valid at the node's version while no training placement leaves its
load window, so a decision refreshes only the nodes that changed. Pure and
synchronous, like the planner.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lemix.planner.base import PlannerConfig, PolicyContext
from lemix.planner.costs import TRAINING_LOAD_WINDOW_S, DecodeAwareCostEstimator
from lemix.planner.policies.lemix import LemixPolicy
from lemix.planner.trace import NodeView
from lemix.types import Task, TaskKind

# Added to every bound: far above the last-bit differences of `exp`, far below
# any score difference that matters (scores are O(1) and ties go by node id).
BOUND_MARGIN = 1e-9
# The columns of a node's row, then 3 blocks of one column per stage.
_PERIOD, _JOIN, _RUNNING, _CONTEXT, _HAS_REQUESTS, _STALL = range(6)
_LOAD_BUSY, _LOAD_MEAN_ITEM, _LOAD_ITEMS, _IS_EMPTY, _HAS_TRAINING = range(6, 11)
_LENGTH_MEAN, _LENGTH_STD, _PERIOD_TRAINING = 11, 12, 13
_NUM_SCALARS = 14


class VectorBounds:
    """`score_upper_bound` of one task on many nodes at once (module doc)."""

    def __init__(
        self, config: PlannerConfig, policy: LemixPolicy, estimator: DecodeAwareCostEstimator
    ) -> None:
        self.config = config
        self.policy = policy
        self.estimator = estimator
        # The table of the views last asked about (the same objects, in order):
        # one row per view, refreshed when its version changes or a training
        # placement leaves its load window.
        self._views: list[NodeView] = []
        self._versions: list[int] = []
        self._load_now_s = np.empty(0)
        self._first_recent_s = np.empty(0)  # +inf: no training in the window
        self._table = np.empty((0, 0))

    @classmethod
    def supported(
        cls, config: PlannerConfig, policy: object, estimator: object
    ) -> VectorBounds | None:
        """One for a policy and estimator this module mirrors; else None (the
        per-node path serves them)."""
        if isinstance(policy, LemixPolicy) and isinstance(estimator, DecodeAwareCostEstimator):
            return cls(config, policy, estimator)
        return None

    def _row(self, view: NodeView, now_s: float) -> tuple[float, ...]:
        estimator = self.estimator
        batch = estimator.batch_facts(view)
        load = estimator.training_load_facts(view, now_s)
        scalars = [0.0] * _NUM_SCALARS
        scalars[_PERIOD] = batch.period_s
        scalars[_JOIN] = batch.join_delay_s
        scalars[_RUNNING] = batch.num_running
        scalars[_CONTEXT] = batch.sum_context
        scalars[_HAS_REQUESTS] = 1.0 if view.requests else 0.0
        scalars[_STALL] = load.stall_term_s
        scalars[_LOAD_BUSY] = load.busy_fraction
        scalars[_LOAD_MEAN_ITEM] = load.mean_item_s
        scalars[_LOAD_ITEMS] = load.num_items
        scalars[_IS_EMPTY] = 1.0 if view.last_arrival_s is None else 0.0
        scalars[_HAS_TRAINING] = 1.0 if view.training_tasks else 0.0
        scalars[_LENGTH_MEAN] = view.length_mean
        scalars[_LENGTH_STD] = view.length_std
        scalars[_PERIOD_TRAINING] = batch.period_training_s
        return (*scalars, *batch.step_s, *batch.half_step_s, *view.forward_end_s)

    def _refresh(self, views: Sequence[NodeView], now_s: float) -> np.ndarray:
        """The table for `views` at `now_s`, recomputing only stale rows."""
        known = self._views
        if len(known) != len(views) or any(a is not b for a, b in zip(views, known, strict=True)):
            self._views = list(views)
            self._versions = [-1] * len(views)
            self._load_now_s = np.full(len(views), np.nan)
            self._first_recent_s = np.full(len(views), np.inf)
            self._table = np.empty((len(views), _NUM_SCALARS + 3 * views[0].num_stages))
        versions = [view.version for view in views]
        stale = {i for i, (a, b) in enumerate(zip(versions, self._versions, strict=True)) if a != b}
        # `DecodeAwareCostEstimator._training_load`'s own test, per row: an
        # older placement would leave the window now.
        expired = (self._first_recent_s < now_s - TRAINING_LOAD_WINDOW_S) & (
            self._load_now_s != now_s
        )
        if expired.any():
            stale.update(np.flatnonzero(expired).tolist())
        for i in stale:
            view = views[i]
            self._table[i] = self._row(view, now_s)
            self._versions[i] = versions[i]
            self._load_now_s[i] = now_s
            recent = view.recent_training
            self._first_recent_s[i] = recent[0][0] if recent else np.inf
        return self._table

    def bounds(
        self, task: Task, views: Sequence[NodeView], now_s: float, context: PolicyContext
    ) -> np.ndarray | None:
        """Per view (in order), a float no smaller than the policy's `score` of
        `task` there; None when the policy has no bound."""
        num_stages = views[0].num_stages
        if any(view.num_stages != num_stages for view in views):
            return None
        col = self._refresh(views, now_s).T
        step = col[_NUM_SCALARS : _NUM_SCALARS + num_stages]
        half_step = col[_NUM_SCALARS + num_stages : _NUM_SCALARS + 2 * num_stages]
        forward_end = col[_NUM_SCALARS + 2 * num_stages :]
        estimator = self.estimator
        forward_task, backward_task = estimator.task_shape_s(task, num_stages)
        is_training = task.kind is TaskKind.TRAINING
        if not is_training:
            forward = [forward_task[s] + step[s] for s in range(num_stages)]
            delay = col[_JOIN]
            budget = estimator.prefill_token_budget
            if budget is not None and task.num_prompt_tokens > budget:
                num_chunks = -(-task.num_prompt_tokens // budget)
                delay = delay + (num_chunks - 1) * col[_PERIOD] / estimator.num_micro_batches
            tbt = self._tbt_after_join_s(task, col, num_stages)
        else:
            forward = [forward_task[s] + half_step[s] for s in range(num_stages)]
            backward = [backward_task[s] + half_step[s] for s in range(num_stages)]
            work = forward[0] + backward[0]
            for s in range(1, num_stages):
                work = np.maximum(work, forward[s] + backward[s])
            delay = np.zeros(len(views))
            tbt = self._batch_tbt_with_training_s(col, work, num_stages)
        floor = self._response_floor_s(task, now_s, col, forward, delay, forward_end)
        if not is_training and self.config.max_training_slice_s is not None:
            total = forward[0]
            for s in range(1, num_stages):
                total = total + forward[s]
            stall = np.where(
                col[_HAS_TRAINING] > 0, num_stages * self.config.max_training_slice_s, 0.0
            )
            floor = np.minimum(floor, delay + total + stall)
        bounds = self.policy.score_upper_bounds(
            task, col[_LENGTH_MEAN], col[_LENGTH_STD], floor, tbt, context
        )
        return None if bounds is None else bounds + BOUND_MARGIN

    def _step_s(self, stage: int, batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        return np.asarray(self.estimator.latency.decode_step_s(stage, batch, context), dtype=float)  # type: ignore[arg-type]

    def _tbt_after_join_s(self, task: Task, col: np.ndarray, num_stages: int) -> np.ndarray:
        """`DecodeAwareCostEstimator._tbt_after_join_s` per node."""
        estimator = self.estimator
        running = col[_RUNNING].astype(np.int64)
        num_after = np.minimum(running + 1, estimator.max_batch_size)
        context_after = (
            col[_CONTEXT].astype(np.int64) + task.num_prompt_tokens + task.max_output_tokens // 2
        )
        max_groups = np.full(len(running), estimator.num_micro_batches)
        if estimator.is_decode_gathered:  # a node that trains decodes in one group
            max_groups = np.where(col[_HAS_TRAINING] > 0, 1, max_groups)
        groups = np.minimum(max_groups, num_after)
        # One group (`_round`'s first branch): the stages' steps, summed.
        one = [self._step_s(s, num_after, context_after) for s in range(num_stages)]
        period_one = one[0]
        for s in range(1, num_stages):
            period_one = period_one + one[s]
        if estimator.num_micro_batches <= 1:
            return period_one + col[_STALL]  # (one group: nothing is gathered or paced)
        per_group = -(-num_after // groups)
        per_context = context_after // groups
        many = [groups * self._step_s(s, per_group, per_context) for s in range(num_stages)]
        total, busiest = many[0], many[0]
        for s in range(1, num_stages):
            total = total + many[s]
            busiest = np.maximum(busiest, many[s])
        period_many = np.maximum(total / groups, busiest)
        tbt = np.where(groups <= 1, period_one, period_many) + col[_STALL]
        return self._paced(tbt, col[_HAS_TRAINING] > 0)

    def _batch_tbt_with_training_s(
        self, col: np.ndarray, work: np.ndarray, num_stages: int
    ) -> np.ndarray:
        """`DecodeAwareCostEstimator._batch_tbt_with_training_s` per node."""
        num_items = col[_LOAD_ITEMS]
        mean_item = (col[_LOAD_MEAN_ITEM] * num_items + work) / (num_items + 2)
        busy = col[_LOAD_BUSY] + work / TRAINING_LOAD_WINDOW_S
        slice_s = self.estimator.max_training_slice_s
        stall = mean_item if slice_s is None else np.minimum(mean_item, slice_s)
        stall_stages = self.estimator.stall_stages(num_stages, True)
        tbt = col[_PERIOD_TRAINING] + stall_stages * np.minimum(busy, 1.0) * stall
        tbt = self._paced(tbt, True)
        return np.where(col[_HAS_REQUESTS] > 0, tbt, 0.0)

    def _paced(self, tbt: np.ndarray, is_training: np.ndarray | bool) -> np.ndarray:
        """`DecodeAwareCostEstimator.paced_tbt_s` per node."""
        estimator = self.estimator
        pace_s = estimator.decode_pace_s
        if pace_s is None or not estimator.is_decode_gathered or estimator.num_micro_batches <= 1:
            return tbt
        return np.where(is_training, np.maximum(tbt, pace_s), tbt)

    @staticmethod
    def _response_floor_s(
        task: Task,
        now_s: float,
        col: np.ndarray,
        forward: list[np.ndarray],
        delay: np.ndarray,
        forward_end: np.ndarray,
    ) -> np.ndarray:
        """`response_lower_bound_s` per node."""
        arrival_s = task.arrival_s
        begin = max(arrival_s, now_s) + delay
        is_empty = col[_IS_EMPTY] > 0
        for stage, duration in enumerate(forward):
            prev_end = np.where(is_empty, arrival_s, forward_end[stage])
            begin = np.maximum(prev_end, begin) + duration
        return begin - arrival_s
