"""Homed training (`PlannerConfig.num_training_nodes`) and cluster-wide admission.

Factory profile as in test_planner.py: per stage forward = 0.001·C·ℓ s,
backward = 0.002·C·ℓ s; slo_ttft_s = 1.0.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from factories import make_planner, make_profile, make_request, make_training

from lemix.planner.configure import resolve_training_nodes
from lemix.sim.run import SimRunConfig, build_simulator
from lemix.slo import Slo
from lemix.types import Deferral, Placement, WeightSync


def _placed(decisions: list) -> list[int]:
    return [d.node_id for d in decisions if isinstance(d, Placement)]


def _plan(planner, task, now_s: float) -> list:
    planner.submit(task, now_s)
    return planner.plan(now_s)


@pytest.mark.parametrize(
    ("spec", "train_rate", "expected"),
    [("all", 0.3, None), ("auto", 0.3, 1), ("auto", 0.6, 2), ("auto", 0.9, 4), ("auto", 0.0, 1)],
)
def test_resolve_training_nodes(spec: str, train_rate: float, expected: int | None) -> None:
    assert resolve_training_nodes(spec, 4, train_rate) == expected


@pytest.mark.parametrize("bad", ["0", "5", "some", ""])
def test_resolve_training_nodes_refuses_what_is_not_a_node_count(bad: str) -> None:
    with pytest.raises(ValueError, match="training nodes"):
        resolve_training_nodes(bad, 4, 0.3)


def test_homed_training_goes_to_the_last_nodes_only_and_inference_anywhere() -> None:
    planner = make_planner("lemix-nodeprio", num_nodes=4, num_training_nodes=2)
    trained = [_placed(_plan(planner, make_training(f"t{i}", 0.0, 100), 0.0)) for i in range(6)]
    assert {n for nodes in trained for n in nodes} <= {2, 3}
    served = [_placed(_plan(planner, make_request(f"r{i}", 0.1, 10, 2), 0.1)) for i in range(4)]
    assert {n for nodes in served for n in nodes} & {0, 1}


def test_homed_training_syncs_weights_to_the_serving_only_nodes_every_k() -> None:
    planner = make_planner("lemix-nodeprio", num_nodes=4, num_training_nodes=1, sync_every_tasks=2)
    for i in range(4):
        assert _placed(_plan(planner, make_training(f"t{i}", 0.0, 10), 0.0)) == [3]
    assert planner.on_task_finished("t0", 1.0) == []
    assert planner.on_task_finished("t1", 2.0) == [WeightSync(3, (0, 1, 2), 2)]
    assert planner.on_task_finished("t2", 3.0) == []
    assert planner.on_task_finished("t3", 4.0) == [WeightSync(3, (0, 1, 2), 4)]


def test_training_on_every_node_never_syncs() -> None:
    planner = make_planner("lemix-nodeprio", num_nodes=2, sync_every_tasks=1)
    _plan(planner, make_training("t", 0.0, 10), 0.0)
    assert planner.on_task_finished("t", 1.0) == []


def _one_inference_seen(**overrides: object):
    planner = make_planner("lemix", num_nodes=2, max_defer_s=5.0, **overrides)
    assert _placed(_plan(planner, make_request("i", 0.0, 100, 10), 0.0)) == [0]
    planner.on_task_finished("i", 1.0)
    return planner


def test_node_admission_defers_training_that_would_slow_its_node() -> None:
    planner = _one_inference_seen(num_training_nodes=1)
    # Long training (fwd 1 s, bwd 2 s per stage) on node 1, the only training
    # node: a probe there would answer in ~4 s > 0.8 x 1 s.
    assert _plan(planner, make_training("long", 10.0, 1000), 10.0) == [
        Deferral("long", "placing it now would make the next inference miss its SLO")
    ]


def test_cluster_admission_places_it_when_the_next_request_can_go_elsewhere() -> None:
    planner = _one_inference_seen(num_training_nodes=1, is_admission_cluster_wide=True)
    # Node 0 is idle, so the next request meets its SLO there.
    assert _placed(_plan(planner, make_training("long", 10.0, 1000), 10.0)) == [1]


def test_cluster_admission_defers_when_no_node_would_meet_the_slo() -> None:
    planner = _one_inference_seen(num_training_nodes=1, is_admission_cluster_wide=True)
    # Node 0 busy with a long training task of its own? It cannot train (not a
    # training node); load it with a long prompt instead, so a probe there misses.
    assert _placed(_plan(planner, make_request("big", 10.0, 1200, 10), 10.0)) == [0]
    decisions = _plan(planner, make_training("long", 10.0, 1000), 10.0)
    assert [type(d) for d in decisions] == [Deferral]


def test_simulated_serving_only_nodes_keep_no_training_state() -> None:
    base = make_profile()
    memory = replace(base.memory, training_state_bytes=(1000,) * base.num_stages)
    profile = replace(base, memory=memory)
    homed = build_simulator(
        SimRunConfig(policy="lemix", train_rate=0.3, training_nodes="auto"),
        profile,
        [],
        Slo(ttft_s=1.0, tbt_s=0.5),
    )
    state = [sum(e.profile.memory.training_state_bytes) for e in homed.engines]
    assert state == [0, 0, 0, 2000]
    spread = build_simulator(
        SimRunConfig(policy="lemix", train_rate=0.3), profile, [], Slo(ttft_s=1.0, tbt_s=0.5)
    )
    assert all(sum(e.profile.memory.training_state_bytes) > 0 for e in spread.engines)
