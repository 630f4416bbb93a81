"""The bound-ordered early exit (`lemix.planner.candidates`) changes no decision.

A loaded cluster built from a seeded random stream of requests, training and
completions; at every step a fresh inference and a fresh training task are
ranked twice: with Algorithm 1 on every node, and through the planner's
early exit. The first k nodes (and their scores) must be the same, and the
bound must hold on every node.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from factories import drive_planner, make_planner, make_request, make_training

from lemix.planner.base import PolicyContext, ScoreBoundedPolicy
from lemix.planner.planner import Planner
from lemix.planner.trace import Prediction
from lemix.types import Placement, Task


def loaded_planner(
    seed: int, num_nodes: int = 12, **overrides: object
) -> tuple[Planner, random.Random, float]:
    planner = make_planner("lemix", num_nodes=num_nodes, **overrides)
    rng = random.Random(seed)
    now_s = 0.0
    held: list[str] = []
    for i in range(150):
        now_s += rng.expovariate(40.0)
        if rng.random() < 0.3:
            task = make_training(f"t{i}", now_s, rng.randint(20, 200), rng.randint(1, 4))
        else:
            task = make_request(f"r{i}", now_s, rng.randint(10, 400), rng.randint(5, 80))
        planner.submit(task, now_s)
        held += [d.task_id for d in planner.plan(now_s) if isinstance(d, Placement)]
        if held and rng.random() < 0.4:
            planner.on_task_finished(held.pop(rng.randrange(len(held))), now_s)
    return planner, rng, now_s


def fresh_tasks(
    planner: Planner, rng: random.Random, now_s: float, num_steps: int
) -> Iterator[tuple[float, PolicyContext, Task]]:
    """Per step, 10 ms apart: a fresh inference and a fresh training task,
    each with the time and the planner's context then."""
    for step in range(num_steps):
        now_s += 0.01
        context = planner.context(now_s)
        yield (
            now_s,
            context,
            make_request(f"q{step}", now_s, rng.randint(10, 400), rng.randint(5, 80)),
        )
        yield (
            now_s,
            context,
            make_training(f"p{step}", now_s, rng.randint(20, 200), rng.randint(1, 4)),
        )


@pytest.mark.parametrize("overrides", [{}, {"max_training_slice_s": 0.05}])
def test_early_exit_keeps_the_first_nodes_and_their_scores(overrides: dict) -> None:
    planner, rng, start_s = loaded_planner(seed=7, **overrides)
    policy = planner.policy
    assert isinstance(policy, ScoreBoundedPolicy)
    num_predicted = num_possible = 0
    for now_s, context, task in fresh_tasks(planner, rng, start_s, num_steps=40):
        every = {v.node_id: planner.predictor.predict(v, task, now_s) for v in planner.views}
        full = policy.rank(task, planner.views, every, context)
        for view in planner.views:
            costs = planner.estimator.costs(view, task, now_s)
            bound = policy.score_upper_bound(
                task,
                view,
                planner.predictor.response_floor_s(view, task, now_s, costs),
                costs.time_between_tokens_s,
                context,
            )
            assert bound is not None
            assert policy.score(task, view, every[view.node_id], context) <= bound
        for k in (1, 3):
            some = planner.predictor.candidates(task, now_s, planner.views, context, k, False)
            ranked = policy.rank(task, planner.views, some, context)
            assert [(r.node_id, r.score) for r in ranked[:k]] == [
                (r.node_id, r.score) for r in full[:k]
            ]
            num_predicted += len(some)
            num_possible += len(planner.views)
    # The exit is taken (else this test would not test it).
    assert num_predicted < num_possible / 2


def test_ties_go_to_the_lower_node_id_as_without_the_exit() -> None:
    planner = make_planner("lemix", num_nodes=8)
    planner.submit(make_request("a", 0.0), 0.0)
    decisions = planner.plan(0.0)
    assert [(d.node_id) for d in decisions if isinstance(d, Placement)] == [0]


def test_paper_form_has_no_bound_and_predicts_every_node() -> None:
    planner = make_planner("lemix-paper", num_nodes=6)
    task = make_request("a", 0.0)
    context = planner.context(0.0)
    assert len(planner.predictor.candidates(task, 0.0, planner.views, context, 1, False)) == 6


def _decisions(planner: Planner, seed: int) -> list[str]:
    return drive_planner(planner, seed)[0]


def test_cluster_admission_probe_memo_changes_no_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    config = {"num_training_nodes": 2, "is_admission_cluster_wide": True, "slo_ttft_s": 0.3}
    memo = _decisions(make_planner("lemix", num_nodes=6, **config), seed=3)
    unmemoized = make_planner("lemix", num_nodes=6, **config)
    admission = unmemoized.admission
    monkeypatch.setattr(admission, "_other_probe_misses", admission._probe_misses)
    assert _decisions(unmemoized, seed=3) == memo
    assert any("Deferral" in d for d in memo)  # the admission check ran and said no


def test_the_lazy_ranking_yields_the_full_ranking_and_stops_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    planner, rng, start_s = loaded_planner(seed=11, num_nodes=24)
    policy = planner.policy
    predictor = planner.predictor
    num_predicted = [0]
    predict = predictor.predict

    def counted_predict(*args: object) -> Prediction:
        num_predicted[0] += 1
        return predict(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(predictor, "predict", counted_predict)
    num_for_first = num_possible = 0
    for now_s, context, task in fresh_tasks(planner, rng, start_s, num_steps=20):
        every = {v.node_id: predict(v, task, now_s) for v in planner.views}
        full = [(r.node_id, r.score) for r in policy.rank(task, planner.views, every, context)]
        lazy = predictor.ranked_lazily(task, now_s, planner.views, context)
        assert lazy is not None  # 24 nodes: the vector bounds' path
        assert [(node_id, score) for node_id, score, _ in lazy] == full
        first = predictor.ranked_lazily(task, now_s, planner.views, context)
        assert first is not None
        num_predicted[0] = 0
        assert next(first)[:2] == full[0]
        num_for_first += num_predicted[0]
        num_possible += len(planner.views)
    assert num_for_first < num_possible / 2  # the first node costs far fewer than all


@pytest.mark.parametrize("num_nodes", [20, 24])
def test_training_placed_through_the_lazy_ranking_makes_the_same_decisions(
    num_nodes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = {"slo_ttft_s": 0.3, "max_training_slice_s": None}
    lazy = _decisions(make_planner("lemix", num_nodes=num_nodes, **config), seed=5)
    eager = make_planner("lemix", num_nodes=num_nodes, **config)
    monkeypatch.setattr(eager.predictor, "ranked_lazily", lambda *a: None)
    assert _decisions(eager, seed=5) == lazy
    assert any("Deferral" in d for d in lazy)  # admission said no, and the next nodes were tried
