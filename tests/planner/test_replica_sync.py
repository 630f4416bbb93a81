"""Replica sync (`lemix.planner.replica_sync`): the planner averages the
training replicas every M completed training tasks; sim charges the exchange."""

from __future__ import annotations

import json

import pytest
from factories import make_planner, make_profile, make_request, make_training

from lemix.planner.recording import (
    RecordingPlanner,
    decision_key,
    recorded_decision_keys,
    replay,
)
from lemix.sim.run import SimRunConfig, run_simulation
from lemix.types import ReplicaAverage, Task, WeightSync


def _place_all(planner, tasks: list[Task]) -> None:
    for task in tasks:
        planner.submit(task, task.arrival_s)
        planner.plan(task.arrival_s)


def test_colocated_averages_every_m_training_tasks_over_the_training_nodes() -> None:
    planner = make_planner("mix-rr", num_nodes=3, replica_sync_every_tasks=3)
    _place_all(planner, [make_training(f"t{i}", 0.0, 100) for i in range(7)])
    _place_all(planner, [make_request("r0", 0.0)])
    assert planner.on_task_finished("t0", 1.0) == []
    assert planner.on_task_finished("r0", 1.1) == []  # inference does not count
    assert planner.on_task_finished("t1", 1.2) == []
    assert planner.on_task_finished("t2", 1.3) == [ReplicaAverage((0, 1, 2), 1)]
    assert planner.on_task_finished("t3", 2.0, is_success=False) == []  # no update
    planner.on_node_health(1, is_healthy=False, now_s=2.1)  # a down node sits it out
    assert planner.on_task_finished("t4", 2.2) == []
    assert planner.on_task_finished("t5", 2.3) == []
    assert planner.on_task_finished("t6", 2.4) == [ReplicaAverage((0, 2), 2)]


def test_off_by_default_and_never_with_a_single_trainer() -> None:
    planner = make_planner("mix-rr", num_nodes=2)
    _place_all(planner, [make_training(f"t{i}", 0.0, 100) for i in range(4)])
    assert all(planner.on_task_finished(f"t{i}", 1.0) == [] for i in range(4))
    single = make_planner("mix-rr", num_nodes=1, replica_sync_every_tasks=1)
    _place_all(single, [make_training("t", 0.0, 100)])
    assert single.on_task_finished("t", 1.0) == []  # one replica: nothing to average


def test_separate_averages_only_its_training_nodes_beside_its_weight_sync() -> None:
    # N = 4, r = 0.5: nodes 2 and 3 train, 0 and 1 serve.
    planner = make_planner(
        "separate", num_nodes=4, train_rate=0.5, sync_every_tasks=2, replica_sync_every_tasks=2
    )
    _place_all(planner, [make_training(f"t{i}", 0.0, 100) for i in range(2)])
    assert planner.on_task_finished("t0", 1.0) == []
    decisions = planner.on_task_finished("t1", 1.0)
    assert decisions[0] == ReplicaAverage((2, 3), 1)
    assert isinstance(decisions[1], WeightSync) and decisions[1].target_node_ids == (0, 1)


def test_the_count_and_round_survive_a_snapshot() -> None:
    planner = make_planner("mix-rr", num_nodes=2, replica_sync_every_tasks=2)
    _place_all(planner, [make_training(f"t{i}", 0.0, 100) for i in range(3)])
    planner.on_task_finished("t0", 1.0)
    planner.on_task_finished("t1", 1.0)  # round 1
    planner.on_task_finished("t2", 1.0)  # one towards round 2
    restored = make_planner("mix-rr", num_nodes=2, replica_sync_every_tasks=2)
    restored.restore(json.loads(json.dumps(planner.snapshot())))
    _place_all(restored, [make_training("t3", 2.0, 100)])
    assert restored.on_task_finished("t3", 3.0) == [ReplicaAverage((0, 1), 2)]


def test_a_recording_with_averages_replays_to_the_same_decisions() -> None:
    events: list[dict] = []
    live = RecordingPlanner(
        make_planner("lemix", num_nodes=2, replica_sync_every_tasks=2), events.append
    )
    _place_all(live, [make_training(f"t{i}", 0.1 * i, 80, seq=i) for i in range(4)])
    for i in range(4):
        live.on_task_finished(f"t{i}", 1.0 + i)
    wire = [json.loads(json.dumps(e)) for e in events]  # as stored in Redis
    fresh = make_planner("lemix", num_nodes=2, replica_sync_every_tasks=2)
    replayed = [decision_key(d) for d in replay(wire, fresh)]
    assert replayed == recorded_decision_keys(wire)
    averages = [k for k in replayed if k[0] == "ReplicaAverage"]
    assert averages == [("ReplicaAverage", (0, 1), 1), ("ReplicaAverage", (0, 1), 2)]


def test_invalid_period_is_refused() -> None:
    with pytest.raises(ValueError, match="replica_sync_every_tasks"):
        make_planner("lemix", replica_sync_every_tasks=0)


def test_the_simulator_charges_the_exchange_on_the_participants() -> None:
    # 100 kB of weights per stage at 1 MB/s over the host link: per round,
    # each of the 2 nodes' 2 stages is busy 0.1 (save) + 0.1 (load of the
    # mean) = 0.2 s; the exchange between (2·(2-1)/2 · 200 kB at 1 MB/s =
    # 0.2 s) is on the wire, not on the stages.
    profile = make_profile(weight_bytes=100_000, capacity_bytes=200_000)
    tasks = [make_training(f"t{i}", 0.1 * i, 100, seq=i) for i in range(8)]
    tasks.append(make_request("late", 5.0, 50, 3, seq=20))
    runs = {}
    for m in (None, 2):
        cfg = SimRunConfig(
            policy="mix-rr",
            num_nodes=2,
            latency_noise_cv=0.0,
            replica_sync_every_tasks=m,
            measure_decision_latency=False,
        )
        _, result = run_simulation(cfg, profile, tasks, request_rate=1.0, duration_s=5.0)
        runs[m] = result
    plain, synced = runs[None], runs[2]
    assert plain.num_replica_averages == 0
    assert synced.num_replica_averages == 4  # 8 training tasks, M = 2

    def busy_s(result) -> float:  # stage-seconds of work over the run
        return result.utilization * 2 * profile.num_stages * result.makespan_s

    assert busy_s(synced) - busy_s(plain) == pytest.approx(4 * 2 * 2 * 0.2, rel=1e-6)


def test_the_mean_is_loaded_only_after_the_exchange_crossed_the_wire() -> None:
    # A 1 kB/s wire: the one round's exchange takes 2·(2-1)/2 · 200 kB / 1 kB/s
    # = 200 s, and each node's loads end after it.
    profile = make_profile(weight_bytes=100_000, capacity_bytes=200_000, weight_sync_bytes_s=1e3)
    tasks = [make_training(f"t{i}", 0.1 * i, 100, seq=i) for i in range(2)]
    cfg = SimRunConfig(
        policy="mix-rr",
        num_nodes=2,
        latency_noise_cv=0.0,
        replica_sync_every_tasks=2,
        measure_decision_latency=False,
    )
    _, result = run_simulation(cfg, profile, tasks, request_rate=1.0, duration_s=1.0)
    assert result.num_replica_averages == 1
    assert all(span_s > 200.0 for span_s in result.node_active_spans_s)
