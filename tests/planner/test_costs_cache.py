"""The decode-aware estimator's caches give what a fresh computation gives.

They are keyed by the view's version and the estimator (`_BatchFacts`), and
for the training load also by whether the window has dropped a placement
since; a copy of a view starts with no cache, so it is the reference.
"""

from __future__ import annotations

from factories import make_profile, make_request, make_training

from lemix.planner.costs import TRAINING_LOAD_WINDOW_S, DecodeAwareCostEstimator
from lemix.planner.trace import NodeView, Prediction

PROFILE = make_profile(decode_d0_s=0.01, decode_d1_s=0.001, forward_s_per_token=0.0001)


def estimator(**kw: object) -> DecodeAwareCostEstimator:
    args: dict[str, object] = {"kv_capacity_tokens": 10**9, "max_batch_size": 64, **kw}
    return DecodeAwareCostEstimator(PROFILE.ours, PROFILE.optimizer_step_s, **args)  # type: ignore[arg-type]


def _prediction(work_s: float = 0.0) -> Prediction:
    return Prediction(0, 0.0, 0.0, 0.0, (0.0, 0.0), (work_s, work_s), None, 0)


def test_two_estimators_on_one_view_each_see_their_own_batch() -> None:
    view = NodeView(0, 2)
    for i in range(32):
        view.commit(make_request(f"r{i}", 0.0, 100, 10), _prediction())
    split, whole = estimator(num_micro_batches=2), estimator()
    assert split.period_s(view) == split.period_s(view.copy())
    assert whole.period_s(view) == whole.period_s(view.copy())
    assert split.period_s(view) != whole.period_s(view)


def test_a_placement_or_finish_refreshes_the_batch() -> None:
    est = estimator()
    view = NodeView(0, 2)
    view.commit(make_request("a", 0.0, 100, 10), _prediction())
    before_s = est.period_s(view)
    view.commit(make_request("b", 0.0, 300, 50), _prediction())
    assert est.period_s(view) == est.period_s(view.copy()) != before_s
    view.finish("b")
    assert est.period_s(view) == before_s


def test_training_load_is_recomputed_once_the_window_drops_a_placement() -> None:
    est = estimator()
    view = NodeView(0, 2)
    for i in range(4):
        view.commit(make_request(f"r{i}", 0.0, 100, 10), _prediction())
    view.commit(make_training("t0", 0.0, 100), _prediction(work_s=0.4), now_s=0.0)
    view.commit(make_training("t1", 5.0, 100), _prediction(work_s=0.2), now_s=5.0)
    task = make_request("new", 0.0, 100, 10)
    # Inside the window: the cached load; past it for t0: t1's alone.
    for now_s in (5.0, 6.0, TRAINING_LOAD_WINDOW_S + 1.0, TRAINING_LOAD_WINDOW_S + 2.0):
        tbt_s = est.costs(view, task, now_s).time_between_tokens_s
        assert tbt_s == est.costs(view.copy(), task, now_s).time_between_tokens_s
    assert len(view.recent_training) == 1
    train = make_training("new-t", 0.0, 100)
    assert (
        est.costs(view, train, 20.0).time_between_tokens_s
        == est.costs(view.copy(), train, 20.0).time_between_tokens_s
    )
