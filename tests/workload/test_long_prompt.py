"""The long-prompt bursty workload: lengths in range, Gamma gaps of the asked
mean and CV, seeded and prefix-stable, selectable as a WorkloadConfig source."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lemix.types import TaskKind
from lemix.workload import (
    LONG_PROMPT_MAX_TOTAL_TOKENS,
    UniformLengths,
    WorkloadConfig,
    build_workload,
    gamma_arrivals,
)
from lemix.workload.base import stream_rng


def _config(**kwargs: object) -> WorkloadConfig:
    base: dict[str, object] = {
        "source": "long-prompt",
        "request_rate": 4.0,
        "duration_s": 300.0,
        "seed": 3,
        "max_total_tokens": LONG_PROMPT_MAX_TOTAL_TOKENS,
    }
    return WorkloadConfig(**{**base, **kwargs})  # type: ignore[arg-type]


def test_lengths_are_long_prompts_and_short_outputs() -> None:
    wl = build_workload(_config())
    inference = [t for t in wl.tasks if t.kind is TaskKind.INFERENCE]
    prompts = np.array([t.num_prompt_tokens for t in inference])
    outputs = np.array([t.max_output_tokens for t in inference])
    assert prompts.min() >= 1024 and prompts.max() <= 8192
    assert outputs.min() >= 5 and outputs.max() <= 30
    # Uniform: both halves of each range are used, the mean near the middle.
    assert prompts.min() < 1500 and prompts.max() > 7700
    assert abs(prompts.mean() - 4608) < 300 and abs(outputs.mean() - 17.5) < 1.5
    assert wl.num_clipped == 0


def test_uniform_lengths_hit_both_inclusive_bounds() -> None:
    prompt, output = UniformLengths(1, 3, 5, 6).sample(np.random.default_rng(0), 2000)
    assert set(prompt.tolist()) == {1, 2, 3} and set(output.tolist()) == {5, 6}
    with pytest.raises(ValueError):
        UniformLengths(10, 5)


@pytest.mark.parametrize("cv", [3.0, 4.0])
def test_gamma_gaps_have_the_asked_mean_and_cv(cv: float) -> None:
    arrivals = gamma_arrivals(2.0, cv, 50_000.0, stream_rng(11, 0))
    gaps = np.diff(arrivals)
    assert gaps.mean() == pytest.approx(0.5, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)
    assert arrivals.min() >= 0 and arrivals.max() < 50_000.0


def test_gamma_cv_one_is_poisson_like_and_bursts_are_burstier() -> None:
    calm = np.diff(gamma_arrivals(5.0, 1.0, 4000.0, stream_rng(1, 0)))
    bursty = np.diff(gamma_arrivals(5.0, 3.0, 4000.0, stream_rng(1, 0)))
    assert calm.std() / calm.mean() == pytest.approx(1.0, rel=0.1)
    # Bursty: most gaps are far shorter than the mean, a few are very long.
    assert np.median(bursty) < 0.1 * bursty.mean() < np.median(calm)


def test_gamma_arrivals_prefix_stable_and_edge_cases() -> None:
    short = gamma_arrivals(3.0, 3.0, 100.0, stream_rng(5, 0))
    long = gamma_arrivals(3.0, 3.0, 1000.0, stream_rng(5, 0))
    assert np.array_equal(long[: len(short)], short)
    assert len(gamma_arrivals(0.0, 3.0, 10.0, stream_rng(5, 0))) == 0
    for bad in ((-1.0, 3.0, 10.0), (1.0, 0.0, 10.0), (1.0, float("nan"), 10.0)):
        with pytest.raises(ValueError):
            gamma_arrivals(*bad, stream_rng(5, 0))


def test_seeded_and_deterministic() -> None:
    config = _config(train_rate=0.3)
    assert build_workload(config).tasks == build_workload(config).tasks
    assert build_workload(config).tasks != build_workload(replace(config, seed=4)).tasks


def test_inference_stream_independent_of_train_rate() -> None:
    def inference(train_rate: float) -> list[tuple[float, int, int]]:
        wl = build_workload(_config(train_rate=train_rate))
        return [
            (t.arrival_s, t.num_prompt_tokens, t.max_output_tokens)
            for t in wl.tasks
            if t.kind is TaskKind.INFERENCE
        ]

    assert inference(0.0) == inference(0.5)
    trained = build_workload(_config(train_rate=0.5))
    assert trained.num_training > 0  # HH-RLHF-shaped training, Poisson arrivals


def test_default_context_limit_clips_long_prompts() -> None:
    wl = build_workload(replace(_config(), max_total_tokens=4096))
    assert wl.num_clipped > 0
    assert all(t.num_prompt_tokens + t.max_output_tokens <= 4096 for t in wl.tasks)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"duration_s": None},
        {"duration_s": 0.0},
        {"burst_cv": 0.0},
        {"burst_cv": float("inf")},
        {"length_source": "trace", "trace_path": "x.csv"},
    ],
)
def test_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        _config(**kwargs)
