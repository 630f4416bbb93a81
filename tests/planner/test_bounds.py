"""The score bounds computed for every node at once (`lemix.planner.bounds`)
match the per-node ones and change no decision.

Loaded clusters of 20 nodes (past `VECTOR_MIN_NODES`) built from a seeded
random stream of requests, training and completions, on the v1 engine and on
v2's shapes (micro-batches, chunked prefill, training slices, gathered
decodes), with decode
steps that grow with the batch and its context.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from factories import drive_planner, make_planner, make_profile, make_request, make_training

import lemix.planner.predict as predict_module
from lemix.planner.bounds import BOUND_MARGIN, VectorBounds
from lemix.planner.planner import Planner
from lemix.types import Placement

NUM_NODES = 20
ENGINES = [
    pytest.param({}, id="v1"),
    pytest.param(
        {"num_micro_batches": 2, "prefill_token_budget": 96, "max_training_slice_s": 0.05},
        id="v2",
    ),
    pytest.param(
        {
            "num_micro_batches": 2,
            "prefill_token_budget": 96,
            "max_training_slice_s": 0.05,
            "is_decode_gathered": True,
        },
        id="v2-gathered",
    ),
    pytest.param(
        {
            "num_micro_batches": 2,
            "prefill_token_budget": 64,
            "max_training_slice_s": 0.05,
            "is_decode_gathered": True,
            "decode_pace_s": 0.08,
        },
        id="v2-paced",
    ),
]


def _planner(**overrides: object) -> Planner:
    profile = make_profile(decode_d1_s=0.002, decode_d2_s=1e-5, forward_a_s=0.003)
    return make_planner("lemix", num_nodes=NUM_NODES, profile=profile, **overrides)


def _drive(planner: Planner, seed: int, num_tasks: int) -> tuple[list[str], float]:
    return drive_planner(
        planner, seed, num_tasks, rate_rps=80.0, training_share=0.35, finish_share=0.4
    )


@pytest.mark.parametrize("overrides", ENGINES)
def test_every_nodes_bound_is_the_per_node_bound_raised_by_the_margin(overrides: dict) -> None:
    assert NUM_NODES >= predict_module.VECTOR_MIN_NODES
    planner = _planner(**overrides)
    _, now_s = _drive(planner, seed=11, num_tasks=300)
    vector = planner.predictor._vector
    assert vector is not None
    rng = random.Random(5)
    for step in range(30):
        # Later times too: training placements leave the load window.
        now_s += rng.choice([0.001, 0.5, 4.0])
        context = planner.context(now_s)
        for task in (
            make_request(f"q{step}", now_s, rng.randint(10, 400), rng.randint(5, 80)),
            make_training(f"p{step}", now_s, rng.randint(20, 300), rng.randint(1, 4)),
        ):
            bounds = vector.bounds(task, planner.views, now_s, context)
            assert bounds is not None
            for view, bound in zip(planner.views, bounds, strict=True):
                costs = planner.estimator.costs(view, task, now_s)
                expected = planner.policy.score_upper_bound(  # type: ignore[attr-defined]
                    task,
                    view,
                    planner.predictor.response_floor_s(view, task, now_s, costs),
                    costs.time_between_tokens_s,
                    context,
                )
                assert expected <= bound <= expected + 2 * BOUND_MARGIN
        if step % 3 == 0:  # the cluster changes between steps
            planner.submit(make_request(f"x{step}", now_s, 100, 20), now_s)
            planner.plan(now_s)


@pytest.mark.parametrize("overrides", ENGINES)
def test_the_vector_bounds_change_no_decision(
    overrides: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = VectorBounds.bounds

    def counted(self: VectorBounds, *args: object) -> object:
        calls.append(1)
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(VectorBounds, "bounds", counted)
    vector_decisions, _ = _drive(_planner(**overrides), seed=3, num_tasks=400)
    assert len(calls) > 100  # the vector path ran
    monkeypatch.setattr(predict_module, "VECTOR_MIN_NODES", 10**9)  # the per-node path
    scalar_decisions, _ = _drive(_planner(**overrides), seed=3, num_tasks=400)
    assert vector_decisions == scalar_decisions
    assert any("Placement" in d for d in vector_decisions)


def test_a_changed_node_refreshes_its_row_and_new_views_rebuild_the_table() -> None:
    planner = _planner()
    _, now_s = _drive(planner, seed=1, num_tasks=100)
    vector = planner.predictor._vector
    assert vector is not None
    task = make_request("probe", now_s, 50, 10)
    context = planner.context(now_s)
    before = vector.bounds(task, planner.views, now_s, context)
    view = planner.views[4]
    planner.submit(make_request("more", now_s, 120, 20), now_s)
    placed = [d for d in planner.plan(now_s) if isinstance(d, Placement)]
    after = vector.bounds(task, planner.views, now_s, planner.context(now_s))
    assert before is not None and after is not None
    changed = {d.node_id for d in placed}
    assert changed and np.any(before != after)
    assert all(before[i] == after[i] for i in range(NUM_NODES) if i not in changed)
    # Copies of the views (training's what-if probe) are other objects: a table of their own.
    copies = [v.copy() for v in planner.views]
    assert np.array_equal(vector.bounds(task, copies, now_s, context), after)
    assert view is planner.views[4]
