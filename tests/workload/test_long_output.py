"""The long-output workload: lengths in range and unclipped, Poisson arrivals
at the asked rate, seeded and prefix-stable, selectable from the CLI flags."""

from __future__ import annotations

import numpy as np
import pytest

from lemix.cli.main import build_parser, configs_from_args
from lemix.types import Task, TaskKind
from lemix.workload import LONG_OUTPUT_MAX_TOTAL_TOKENS, WorkloadConfig, build_workload


def _config(**kwargs: object) -> WorkloadConfig:
    base: dict[str, object] = {
        "source": "long-output",
        "request_rate": 4.0,
        "duration_s": 300.0,
        "seed": 3,
        "max_total_tokens": LONG_OUTPUT_MAX_TOTAL_TOKENS,
    }
    return WorkloadConfig(**{**base, **kwargs})  # type: ignore[arg-type]


def _inference_lengths(config: WorkloadConfig) -> tuple[np.ndarray, np.ndarray]:
    tasks = [t for t in build_workload(config).tasks if t.kind is TaskKind.INFERENCE]
    return (
        np.array([t.num_prompt_tokens for t in tasks]),
        np.array([t.max_output_tokens for t in tasks]),
    )


def test_lengths_are_moderate_prompts_and_long_outputs() -> None:
    prompts, outputs = _inference_lengths(_config())
    assert prompts.min() >= 256 and prompts.max() <= 1024
    assert outputs.min() >= 1024 and outputs.max() <= 3072
    # Uniform over each range: near both ends, mean near the middle.
    assert prompts.min() < 300 and prompts.max() > 980
    assert outputs.min() < 1150 and outputs.max() > 2950
    assert abs(prompts.mean() - 640) < 40 and abs(outputs.mean() - 2048) < 100
    assert (prompts + outputs).max() <= LONG_OUTPUT_MAX_TOTAL_TOKENS
    assert build_workload(_config()).num_clipped == 0


def test_arrivals_are_poisson_at_the_asked_rate() -> None:
    wl = build_workload(_config(request_rate=2.0, duration_s=5000.0))
    arrivals = np.array([t.arrival_s for t in wl.tasks if t.kind is TaskKind.INFERENCE])
    gaps = np.diff(arrivals)
    assert arrivals.min() >= 0 and arrivals.max() < 5000.0
    assert len(arrivals) / 5000.0 == pytest.approx(2.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential gaps


def test_seeded_deterministic_and_prefix_stable() -> None:
    a, b = build_workload(_config()), build_workload(_config())
    assert a.tasks == b.tasks
    assert build_workload(_config(seed=4)).tasks != a.tasks
    # A longer window only appends tasks; training does not move inference.
    short = build_workload(_config(duration_s=100.0))
    long = build_workload(_config(duration_s=300.0))
    inf_short = [t for t in short.tasks if t.kind is TaskKind.INFERENCE]
    inf_long = [t for t in long.tasks if t.kind is TaskKind.INFERENCE]
    assert inf_long[: len(inf_short)] == inf_short
    trained = build_workload(_config(train_rate=0.5))
    assert trained.num_training > 0
    assert _inference_rows(trained.tasks) == _inference_rows(a.tasks)


def _inference_rows(tasks: tuple[Task, ...]) -> list[tuple[str, float, int, int]]:
    """Inference tasks without `seq`, which training arrivals shift."""
    return [
        (t.task_id, t.arrival_s, t.num_prompt_tokens, t.max_output_tokens)
        for t in tasks
        if t.kind is TaskKind.INFERENCE
    ]


def test_rejects_trace_lengths() -> None:
    with pytest.raises(ValueError, match="draws its own lengths"):
        _config(length_source="trace", trace_path="x.csv")


def _workload(*flags: str) -> WorkloadConfig:
    """The WorkloadConfig `lemix sim` builds from these flags."""
    args = build_parser().parse_args(["sim", "--policy", "lemix", *flags])
    return configs_from_args(args).workload


def test_cli_flag_maps_to_the_source_and_its_context_limit() -> None:
    flags = ["--workload", "long-output", "--train-rate", "0.3", "--duration", "30", "--seed", "2"]
    config = _workload(*flags, "--poisson", "1.5")
    assert config.source == "long-output"
    assert config.max_total_tokens == LONG_OUTPUT_MAX_TOTAL_TOKENS
    assert (config.request_rate, config.train_rate, config.seed, config.duration_s) == (
        1.5,
        0.3,
        2,
        30.0,
    )
    with pytest.raises(ValueError, match="no --trace"):
        _workload(*flags, "--trace", "t.csv")
    with pytest.raises(ValueError, match="--poisson RATE"):
        _workload(*flags)
