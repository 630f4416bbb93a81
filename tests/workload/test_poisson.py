"""Poisson workloads: determinism, stream independence, rates, lengths, config."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from lemix.types import Task, TaskKind
from lemix.workload import (
    LognormalLengths,
    WorkloadConfig,
    build_workload,
    clip_to_context,
    load_workload_data,
    poisson_arrivals,
)


def inference_of(tasks: tuple[Task, ...]) -> list[tuple[str, float, int, int]]:
    return [
        (t.task_id, t.arrival_s, t.num_prompt_tokens, t.max_output_tokens)
        for t in tasks
        if t.kind is TaskKind.INFERENCE
    ]


def test_same_seed_same_tasks_different_seed_differs() -> None:
    cfg = WorkloadConfig(request_rate=5.0, train_rate=0.3, duration_s=30.0, seed=7)
    assert build_workload(cfg).tasks == build_workload(cfg).tasks
    assert build_workload(cfg).tasks != build_workload(replace(cfg, seed=8)).tasks


def test_tasks_are_ordered_with_seq_and_unique_ids() -> None:
    wl = build_workload(WorkloadConfig(request_rate=10.0, train_rate=0.4, duration_s=20.0))
    tasks = wl.tasks
    assert [t.seq for t in tasks] == list(range(len(tasks)))
    assert [t.arrival_s for t in tasks] == sorted(t.arrival_s for t in tasks)
    assert len({t.task_id for t in tasks}) == len(tasks)
    assert all(0.0 <= t.arrival_s < 20.0 for t in tasks)
    inf_ids = [t.task_id for t in tasks if t.kind is TaskKind.INFERENCE]
    assert inf_ids == [f"inf-{i:06d}" for i in range(len(inf_ids))]
    trn_ids = [t.task_id for t in tasks if t.kind is TaskKind.TRAINING]
    assert trn_ids == [f"trn-{i:06d}" for i in range(len(trn_ids))]
    assert wl.num_inference + wl.num_training == len(tasks)


def test_inference_stream_does_not_depend_on_train_rate() -> None:
    base = WorkloadConfig(request_rate=8.0, duration_s=60.0, seed=11)
    low = build_workload(replace(base, train_rate=0.1)).tasks
    high = build_workload(replace(base, train_rate=0.5)).tasks
    none = build_workload(replace(base, train_rate=0.0)).tasks
    assert inference_of(low) == inference_of(high) == inference_of(none)
    assert not any(t.is_training for t in none)


def test_training_fraction_matches_train_rate() -> None:
    # ~57k tasks: the fraction's std is ~0.002, the bound is 5 std.
    wl = build_workload(WorkloadConfig(request_rate=20.0, train_rate=0.3, duration_s=2000.0))
    assert wl.num_training / len(wl.tasks) == pytest.approx(0.3, abs=0.01)


def test_empirical_rate_matches_request_rate() -> None:
    # ~50k arrivals: std of the count is ~0.45%, the bound is 2%.
    wl = build_workload(WorkloadConfig(request_rate=10.0, duration_s=5000.0, seed=2))
    assert wl.num_inference / 5000.0 == pytest.approx(10.0, rel=0.02)
    gaps = np.diff([t.arrival_s for t in wl.tasks])
    assert gaps.mean() == pytest.approx(0.1, rel=0.02)
    assert gaps.std() == pytest.approx(0.1, rel=0.05)  # exponential: std = mean


def test_poisson_arrivals_prefix_is_stable_and_rate_zero_is_empty() -> None:
    short = poisson_arrivals(3.0, 100.0, np.random.default_rng(0))
    long = poisson_arrivals(3.0, 1000.0, np.random.default_rng(0))
    np.testing.assert_array_equal(long[: len(short)], short)
    assert poisson_arrivals(0.0, 100.0, np.random.default_rng(0)).size == 0


def test_parametric_lengths_match_azure_conv_stats() -> None:
    prompt, output = LognormalLengths.azure_conv().sample(np.random.default_rng(0), 40_000)
    assert np.median(prompt) == pytest.approx(1020, rel=0.03)
    assert prompt.mean() == pytest.approx(1155, rel=0.03)
    assert np.median(output) == pytest.approx(129, rel=0.03)
    assert output.mean() == pytest.approx(211, rel=0.05)
    assert prompt.min() >= 1 and output.min() >= 1


def test_all_tasks_fit_context_and_clips_are_counted() -> None:
    cfg = WorkloadConfig(request_rate=10.0, train_rate=0.5, duration_s=100.0, max_total_tokens=512)
    wl = build_workload(cfg)
    assert all(t.num_total_tokens <= 512 for t in wl.tasks)
    assert wl.num_clipped > 0
    assert all(t.max_output_tokens > 0 for t in wl.tasks if not t.is_training)


def test_clip_to_context_hand_values() -> None:
    prompt, output, n = clip_to_context(np.array([100, 90, 5, 0]), np.array([10, 20, 200, 3]), 100)
    assert prompt.tolist() == [90, 80, 1, 1]
    assert output.tolist() == [10, 20, 99, 3]
    assert n == 4
    _, _, n_none = clip_to_context(np.array([50]), np.array([50]), 100)
    assert n_none == 0


def test_trace_lengths_are_resampled_pairs(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,11,1\n1,22,2\n2,33,3\n")
    cfg = WorkloadConfig(
        length_source="trace",
        trace_path=str(path),
        request_rate=5.0,
        duration_s=50.0,
        train_rate=0.2,
    )
    wl = build_workload(cfg)
    pairs = {(t.num_prompt_tokens, t.max_output_tokens) for t in wl.tasks if not t.is_training}
    assert pairs == {(11, 1), (22, 2), (33, 3)}
    assert {t.num_prompt_tokens for t in wl.tasks if t.is_training} <= {12, 24, 36}
    # Loading once and reusing the data gives the same workload.
    assert build_workload(cfg, load_workload_data(cfg)).tasks == wl.tasks


def test_training_lengths_from_hh_pairs(tmp_path: Path) -> None:
    path = tmp_path / "hh.json"
    rows = [{"query": "a" * 40, "reference": "b" * 21}, {"query": "c" * 4, "reference": "d"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = WorkloadConfig(
        request_rate=4.0, train_rate=0.5, duration_s=50.0, train_data_path=str(path), batch_size=3
    )
    wl = build_workload(cfg)
    training = [t for t in wl.tasks if t.is_training]
    assert training and all(t.batch_size == 3 and t.max_output_tokens == 0 for t in training)
    # 40/4 + ceil(21/4) = 16 tokens; 4/4 + ceil(1/4) = 2 tokens.
    expected = {0: 16, 1: 2}
    for t in training:
        assert t.num_prompt_tokens == expected[wl.train_sample_index[t.task_id]]
    assert set(wl.train_sample_index) == {t.task_id for t in training}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"source": "replay"},
        {"length_source": "uniform"},
        {"request_rate": 0.0},
        {"request_rate": float("nan")},
        {"train_rate": 1.0},
        {"train_rate": -0.1},
        {"duration_s": None},
        {"duration_s": -1.0},
        {"seed": -1},
        {"batch_size": 0},
        {"max_total_tokens": 1},
        {"chars_per_token": 0.0},
        {"source": "trace"},
        {"length_source": "trace"},
    ],
)
def test_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(**kwargs)  # type: ignore[arg-type]


def test_train_arrival_rate() -> None:
    cfg = WorkloadConfig(request_rate=6.0, train_rate=0.25)
    assert cfg.train_arrival_rate == pytest.approx(2.0)
