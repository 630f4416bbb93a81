"""A memory-bound run (issue 10, item 3): on the shipped A100 7B profile the
long-output workload fills a node's KV room, so the memory-aware runtime acts
(`lemix` offloads KV for training activations, and queues requests) where the
wait-then-drop ablation (`lemix-nomem`) fails requests for want of KV memory.
The conversation shape at the same rate never binds (the control)."""

from __future__ import annotations

from typing import Any

import pytest

from lemix.profile import Profile, default_profile_path, load_profile
from lemix.sim.run import SimRunConfig, run_simulation
from lemix.workload import LONG_OUTPUT_MAX_TOTAL_TOKENS, WorkloadConfig, build_workload

# One node, so ~33 long-output requests fill it (89k KV tokens / 2.7k per
# request); 1.5 req/s over 40 s offers 54 that each decode for ~a minute.
RATE_RPS = 1.5
DURATION_S = 40.0
TRAIN_RATE = 0.5


@pytest.fixture(scope="module")
def profile() -> Profile:
    return load_profile(default_profile_path())


def _run(profile: Profile, policy: str, source: str, rate: float = RATE_RPS) -> dict[str, Any]:
    config = WorkloadConfig(
        source=source,
        request_rate=rate,
        train_rate=TRAIN_RATE,
        duration_s=DURATION_S,
        seed=0,
        max_total_tokens=LONG_OUTPUT_MAX_TOTAL_TOKENS,
    )
    tasks = build_workload(config).tasks
    run = SimRunConfig(
        policy=policy,
        num_nodes=1,
        seed=0,
        train_rate=TRAIN_RATE,
        measure_decision_latency=False,
    )
    metrics, _ = run_simulation(run, profile, tasks, request_rate=rate, duration_s=DURATION_S)
    return metrics


def test_long_output_binds_memory_and_the_runtimes_differ(profile: Profile) -> None:
    aware = _run(profile, "lemix", "long-output")
    nomem = _run(profile, "lemix-nomem", "long-output")
    # Memory-aware: training activations got room by offloading KV; no request
    # was dropped (they wait for memory instead).
    assert aware["num_kv_offloads"] > 0
    assert aware["num_failed"] == 0
    # Wait-then-drop: never offloads; requests whose KV did not fit within
    # T_max failed, a visible share of those offered.
    assert nomem["num_kv_offloads"] == 0
    assert nomem["num_failed_kv_memory"] >= 0.1 * nomem["num_inference"]
    assert nomem["num_completed_inference"] < aware["num_completed_inference"]


@pytest.mark.parametrize(
    ("source", "rate"),
    [("poisson", RATE_RPS), ("long-output", 0.5)],
    ids=["conversation-same-rate", "long-output-light"],
)
def test_memory_does_not_bind_without_many_long_sequences(
    profile: Profile, source: str, rate: float
) -> None:
    aware = _run(profile, "lemix", source, rate)
    nomem = _run(profile, "lemix-nomem", source, rate)
    for m in (aware, nomem):
        assert m["num_kv_offloads"] == 0 and m["num_failed_kv_memory"] == 0
    assert aware["slo_attainment"] == nomem["slo_attainment"]
