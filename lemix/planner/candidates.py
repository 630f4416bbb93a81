"""Which nodes Algorithm 1 must run on for one task: the best few by a bound.

LeMix scores every node and places on the best; at 64 nodes running Algorithm
1 on each is most of a decision. A `ScoreBoundedPolicy` bounds its score from
the estimator's costs alone (TBT exact, response floored, idleness profit at
its ceiling), so nodes are predicted in order of that bound until the next
bound is below the `num_needed`-th best score found. Every node left out
scores below that too, strictly, so the policy's first `num_needed` (ties to
the lower node id included) are the same as with every node predicted: an
exact early exit, not a heuristic.

`iter_ranked_by_bounds` is the same walk over bounds computed for every
node at once (`lemix.planner.bounds`), running the estimator only on the
nodes it predicts, and lazily: it hands out the ranking one node at a time,
each as soon as no node left can beat it. The first `num_needed` it hands
out cost the Algorithm 1 runs `best_candidates` would spend on them, and a
caller that stops at the first node it accepts (a training task whose best
node admits it) runs Algorithm 1 only as far as that node needed.

Pure and synchronous, like the planner that calls it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from lemix.planner.base import PolicyContext, ScoreBoundedPolicy
from lemix.planner.trace import NodeView, Prediction, TaskCosts
from lemix.types import Task


def best_candidates(
    policy: ScoreBoundedPolicy,
    task: Task,
    views: Sequence[NodeView],
    context: PolicyContext,
    num_needed: int,
    costs_of: Callable[[NodeView], TaskCosts],
    response_floor_s: Callable[[NodeView, TaskCosts], float],
    predict_with: Callable[[NodeView, TaskCosts], Prediction],
) -> dict[int, Prediction] | None:
    """Predictions of at least the `num_needed` best nodes among `views`
    (all of them when there are no more); None when the policy has no bound
    for this task (the caller predicts every node).

    `costs_of(view)` is the estimator's costs of the task on `view`,
    `response_floor_s(view, costs)` a floor under the response its prediction
    will have, and `predict_with(view, costs)` that prediction.
    """
    bounds: list[tuple[float, int, NodeView, TaskCosts]] = []
    for view in views:
        costs = costs_of(view)
        bound = policy.score_upper_bound(
            task, view, response_floor_s(view, costs), costs.time_between_tokens_s, context
        )
        if bound is None:
            return None
        bounds.append((-bound, view.node_id, view, costs))
    bounds.sort(key=lambda b: (b[0], b[1]))  # best bound first, ties to the lower node id
    predictions: dict[int, Prediction] = {}
    best: list[float] = []  # min-heap: the num_needed highest scores so far
    for neg_bound, node_id, view, costs in bounds:
        if len(best) == num_needed and -neg_bound < best[0]:
            break  # this node and every one after it score below the cut
        prediction = predict_with(view, costs)
        predictions[node_id] = prediction
        _keep_best(best, num_needed, policy.score(task, view, prediction, context))
    return predictions


def iter_ranked_by_bounds(
    policy: ScoreBoundedPolicy,
    task: Task,
    views: Sequence[NodeView],
    context: PolicyContext,
    bounds: np.ndarray,
    predict: Callable[[NodeView], Prediction],
) -> Iterator[tuple[int, float, Prediction]]:
    """The policy's ranking of `views` as (node id, score, prediction), best
    first (ties to the lower node id), computed lazily: each node is yielded
    once every node not yet predicted has a bound strictly below its score,
    so the first k yielded are `rank`'s first k with every node predicted.
    `bounds[i]` is no smaller than the score of `views[i]`; `predict(view)`
    is Algorithm 1."""
    node_ids = np.fromiter((view.node_id for view in views), dtype=np.int64, count=len(views))
    order = np.lexsort((node_ids, -bounds)).tolist()  # best bound first, ties to the lower id
    bound_of = bounds.tolist()
    pending: list[tuple[float, int, Prediction]] = []  # min-heap of (-score, node id, ...)
    num_walked = 0
    while True:
        # A bound equal to the best score so far may hide an equal score on a
        # lower node id: predict it before handing that best out.
        while num_walked < len(order) and (
            not pending or bound_of[order[num_walked]] >= -pending[0][0]
        ):
            view = views[order[num_walked]]
            num_walked += 1
            prediction = predict(view)
            score = policy.score(task, view, prediction, context)
            heapq.heappush(pending, (-score, view.node_id, prediction))
        if not pending:
            return
        neg_score, node_id, prediction = heapq.heappop(pending)
        yield node_id, -neg_score, prediction


def _keep_best(best: list[float], num_needed: int, score: float) -> None:
    """Keep the `num_needed` highest scores in the min-heap `best`."""
    if len(best) < num_needed:
        heapq.heappush(best, score)
    elif score > best[0]:
        heapq.heapreplace(best, score)
