"""The chat workload: ShareGPT-fitted lengths (medians and means as
published), clipped to Llama-2's context, seeded, selectable from the CLI."""

from __future__ import annotations

import numpy as np
import pytest

from lemix.cli.main import build_parser, configs_from_args
from lemix.types import TaskKind
from lemix.workload import CHAT_MAX_TOTAL_TOKENS, WorkloadConfig, build_workload, chat_lengths
from lemix.workload.base import stream_rng
from lemix.workload.chat import (
    SHAREGPT_OUTPUT_MEAN,
    SHAREGPT_OUTPUT_MEDIAN,
    SHAREGPT_PROMPT_MEAN,
    SHAREGPT_PROMPT_MEDIAN,
)


def _config(**kwargs: object) -> WorkloadConfig:
    base: dict[str, object] = {
        "source": "chat",
        "request_rate": 4.0,
        "duration_s": 300.0,
        "seed": 5,
        "max_total_tokens": CHAT_MAX_TOTAL_TOKENS,
    }
    return WorkloadConfig(**{**base, **kwargs})  # type: ignore[arg-type]


def test_fit_reproduces_the_published_medians_and_means() -> None:
    prompt, output = chat_lengths().sample(stream_rng(0, 1), 200_000)
    assert np.median(prompt) == pytest.approx(SHAREGPT_PROMPT_MEDIAN, rel=0.02)
    assert prompt.mean() == pytest.approx(SHAREGPT_PROMPT_MEAN, rel=0.02)
    assert np.median(output) == pytest.approx(SHAREGPT_OUTPUT_MEDIAN, rel=0.02)
    assert output.mean() == pytest.approx(SHAREGPT_OUTPUT_MEAN, rel=0.02)


def test_built_lengths_fit_the_context_and_clip_the_tail() -> None:
    wl = build_workload(_config())
    inference = [t for t in wl.tasks if t.kind is TaskKind.INFERENCE]
    total = np.array([t.num_prompt_tokens + t.max_output_tokens for t in inference])
    assert total.max() <= CHAT_MAX_TOTAL_TOKENS and min(total) >= 2
    # The fit puts ~17% of requests over 4,096 tokens; those prompts are cut.
    assert 0.1 < wl.num_clipped / len(inference) < 0.3
    assert len(inference) / 300.0 == pytest.approx(4.0, rel=0.15)


def test_seeded_and_deterministic() -> None:
    assert build_workload(_config()).tasks == build_workload(_config()).tasks
    assert build_workload(_config(seed=6)).tasks != build_workload(_config()).tasks
    with pytest.raises(ValueError, match="draws its own lengths"):
        _config(length_source="trace", trace_path="x.csv")


def test_cli_flag_maps_to_the_chat_source() -> None:
    args = build_parser().parse_args(
        ["sim", "--policy", "lemix", "--workload", "chat", "--poisson", "2", "--seed", "1"]
    )
    config = configs_from_args(args).workload
    assert (config.source, config.request_rate, config.seed) == ("chat", 2.0, 1)
    assert config.max_total_tokens == CHAT_MAX_TOTAL_TOKENS
