"""What the planner ranks nodes by: Algorithm 1's prediction of a task on a node.

`Predictor` runs `lemix.planner.trace.compute_idleness` on the estimator's
costs, with an inference response that knows training slices (with
`PlannerConfig.max_training_slice_s` set, a request waits behind at most one
slice per stage). For a policy that bounds its score it predicts only the
nodes that can still be among the best few (`lemix.planner.candidates`).

Stateless beyond what it is built with: the planner owns the node views and
passes them in. Pure and synchronous, like the planner.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from itertools import islice

from lemix.planner.base import PlacementPolicy, PlannerConfig, PolicyContext, ScoreBoundedPolicy
from lemix.planner.bounds import VectorBounds
from lemix.planner.candidates import best_candidates, iter_ranked_by_bounds
from lemix.planner.costs import CostEstimator
from lemix.planner.trace import (
    NodeView,
    Prediction,
    TaskCosts,
    compute_idleness,
    response_lower_bound_s,
)
from lemix.types import Task

# From this many nodes up the bounds are computed for all nodes at once
# (`lemix.planner.bounds`): below it numpy's per-call overhead costs more
# than the Python loop it replaces.
VECTOR_MIN_NODES = 20


class Predictor:
    """Algorithm 1 predictions of a task on nodes, for one policy and config."""

    def __init__(
        self, config: PlannerConfig, policy: PlacementPolicy, estimator: CostEstimator
    ) -> None:
        self.config = config
        self.policy = policy
        # Policies that can bound their score let `candidates` skip nodes.
        self._bounded = policy if isinstance(policy, ScoreBoundedPolicy) else None
        self.estimator = estimator
        self._vector = VectorBounds.supported(config, policy, estimator)
        # Algorithm 1 runs so far (`idleness`): the planner bounds a call's
        # training work by them (`PlannerConfig.max_training_runs_per_plan`).
        self.num_runs = 0

    def candidates(
        self,
        task: Task,
        now_s: float,
        views: list[NodeView],
        context: PolicyContext,
        num_needed: int,
        is_any_node_down: bool,
    ) -> dict[int, Prediction]:
        """Predictions for the policy to rank: every node's, or (a policy that
        bounds its score, every node up) at least the `num_needed` best's
        (`lemix.planner.candidates`)."""
        if not self.policy.needs_prediction:
            return {}
        if self._bounded is not None and not is_any_node_down and len(views) > num_needed:
            lazy = self.ranked_lazily(task, now_s, views, context)
            if lazy is not None:
                return {node_id: p for node_id, _, p in islice(lazy, num_needed)}
            predictions = best_candidates(
                self._bounded,
                task,
                views,
                context,
                num_needed,
                lambda view: self.estimator.costs(view, task, now_s),
                lambda view, costs: self.response_floor_s(view, task, now_s, costs),
                lambda view, costs: self.predict_with(view, task, now_s, costs),
            )
            if predictions is not None:
                return predictions
        return {view.node_id: self.predict(view, task, now_s) for view in views}

    def ranked_lazily(
        self, task: Task, now_s: float, views: list[NodeView], context: PolicyContext
    ) -> Iterator[tuple[int, float, Prediction]] | None:
        """The policy's ranking of `views` for `task`, lazily, as (node id,
        score, prediction) best first (`iter_ranked_by_bounds`); None where
        `candidates` would not walk vector bounds (the caller ranks eagerly).
        Only for every node up: the views are all live."""
        bounded = self._bounded
        if (
            bounded is None
            or self._vector is None
            or not self.policy.needs_prediction
            or len(views) < VECTOR_MIN_NODES
        ):
            return None
        bounds = self._vector.bounds(task, views, now_s, context)
        if bounds is None:
            return None
        return iter_ranked_by_bounds(
            bounded, task, views, context, bounds, lambda view: self.predict(view, task, now_s)
        )

    def response_floor_s(self, view: NodeView, task: Task, now_s: float, costs: TaskCosts) -> float:
        """A floor under `predict_with(...).response_s` (Algorithm 1's, or the
        sliced one when that is lower)."""
        floor_s = response_lower_bound_s(view, task, now_s, costs)
        if task.is_training or self.config.max_training_slice_s is None:
            return floor_s
        return min(floor_s, self.sliced_response_s(view, costs))

    def predict(self, view: NodeView, task: Task, now_s: float) -> Prediction:
        """Algorithm 1 for `task` on `view`, with an inference response that
        knows training slices (see `sliced_response_s`)."""
        return self.predict_with(view, task, now_s, self.estimator.costs(view, task, now_s))

    def predict_with(
        self, view: NodeView, task: Task, now_s: float, costs: TaskCosts
    ) -> Prediction:
        """`predict` with the estimator's costs of `task` on `view` given."""
        prediction = self.idleness(view, task, now_s, costs)
        if task.is_training or self.config.max_training_slice_s is None:
            return prediction
        sliced_s = self.sliced_response_s(view, costs)
        if not sliced_s < prediction.response_s:
            return prediction  # the min would keep it: no copy
        return replace(prediction, response_s=sliced_s)

    def idleness(self, view: NodeView, task: Task, now_s: float, costs: TaskCosts) -> Prediction:
        """Algorithm 1 alone (no slice-aware response): the trace a placement
        commits for a policy that ranks without predictions."""
        self.num_runs += 1
        return compute_idleness(view, task, now_s, costs, self.estimator.decode_load(view, now_s))

    def sliced_response_s(self, view: NodeView, costs: TaskCosts) -> float:
        """An inference's response when training runs in slices: inference goes
        first at every slice boundary, so a request waits behind at most one
        slice per stage, not behind the training that Algorithm 1's FIFO trace
        queues ahead of it (the trace itself is kept: idleness still counts it)."""
        slice_s = self.config.max_training_slice_s or 0.0
        stall_s = view.num_stages * slice_s if view.training_tasks else 0.0
        return costs.start_delay_s + sum(costs.forward_s) + stall_s
