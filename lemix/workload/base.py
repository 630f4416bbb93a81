"""Workload configuration, length distributions and task assembly.

A workload is a deterministic, arrival-ordered tuple of `lemix.types.Task`.
This module holds the pieces every generator shares: the validated config,
the length samplers, context-limit clipping, per-stream seeded RNGs, and the
merge of an inference and a training stream into one ordered task list.
The generators themselves live in `lemix.workload.poisson`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from lemix.types import Task, TaskKind

SOURCES = ("poisson", "trace", "long-prompt", "long-output", "chat")
# Sources that draw their own lengths: no trace lengths with them.
OWN_LENGTH_SOURCES = ("long-prompt", "long-output", "chat")
LENGTH_SOURCES = ("auto", "parametric", "trace")

# Published stats of the Azure LLM conversation trace 2023
# (../shared/traces/README.md, from the Splitwise paper): context tokens
# median 1,020 / mean 1,155; generated tokens median 129 / mean 211.
AZURE_CONV_PROMPT_MEDIAN = 1020.0
AZURE_CONV_PROMPT_MEAN = 1155.0
AZURE_CONV_OUTPUT_MEDIAN = 129.0
AZURE_CONV_OUTPUT_MEAN = 211.0

# Training sequences (query + reference) of the Anthropic HH-RLHF test split, the
# data the paper trains on, measured with the 4-chars-per-token estimate below:
# 5,756 pairs, median 100 / mean 137 tokens. Used when no training file is given.
HH_RLHF_SEQ_MEDIAN = 100.0
HH_RLHF_SEQ_MEAN = 137.0

# Token estimate for raw text without a tokenizer: ~4 characters per token is
# the usual rule of thumb for English BPE vocabularies (GPT/Llama tokenizers).
DEFAULT_CHARS_PER_TOKEN = 4.0

# Independent RNG streams, one per (kind, what). Deriving each from
# (seed, stream id) keeps the inference stream identical whatever train_rate.
STREAM_INFERENCE_ARRIVALS = 0
STREAM_INFERENCE_LENGTHS = 1
STREAM_TRAINING_ARRIVALS = 2
STREAM_TRAINING_LENGTHS = 3


@dataclass(frozen=True)
class WorkloadConfig:
    """How to build a workload. Validated on construction (ValueError).

    `source`: "poisson" (synthetic arrivals), "trace" (replay an Azure-format
    CSV time-scaled so its mean inter-arrival gap is 1/request_rate),
    "long-prompt" (`lemix.workload.long_prompt`: prompts of 1–8k tokens,
    outputs of 5–30, Gamma inter-arrivals of mean 1/request_rate and CV
    `burst_cv`), "long-output" (`lemix.workload.long_output`: prompts of
    256–1,024 tokens, outputs of 1,024–3,072, Poisson arrivals) or "chat"
    (`lemix.workload.chat`: ShareGPT-fitted lognormal lengths, Poisson
    arrivals). The last three draw their own lengths, so `length_source`
    must stay "auto" or "parametric".
    `train_rate` r is the fraction of all tasks that are training tasks; they
    arrive as their own Poisson stream at request_rate·r/(1−r).
    `length_source`: "parametric" (lognormal fitted to the Azure conv trace),
    "trace" (the trace's lengths: resampled for poisson, the row's own for a
    trace replay) or "auto" (trace for a trace replay, else parametric).
    `duration_s`: arrivals in [0, duration_s); None or 0 replays a whole trace.
    `max_total_tokens`: context limit; prompts are clipped so that
    prompt + output <= it, training sequences are clipped to it.
    `train_data_path`: hh-rlhf JSON lines; training lengths come from its
    (query, reference) pairs when given, else from the inference length source.
    """

    source: str = "poisson"
    request_rate: float = 4.0
    train_rate: float = 0.0
    duration_s: float | None = 60.0
    seed: int = 0
    batch_size: int = 1
    max_total_tokens: int = 4096
    length_source: str = "auto"
    trace_path: str | None = None
    train_data_path: str | None = None
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
    burst_cv: float = 3.0  # "long-prompt": CV of the Gamma inter-arrival gaps
    # "trace": replay the `segment`-th (0-based) of `num_segments` disjoint
    # equal slices of the trace (`lemix.workload.azure_csv.segment`).
    num_segments: int = 1
    segment: int = 0

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if self.length_source not in LENGTH_SOURCES:
            raise ValueError(
                f"length_source must be one of {LENGTH_SOURCES}, got {self.length_source!r}"
            )
        if not (math.isfinite(self.request_rate) and self.request_rate > 0):
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if not 0.0 <= self.train_rate < 1.0:
            raise ValueError(f"train_rate must be in [0, 1), got {self.train_rate}")
        self._validate_duration()
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {self.max_total_tokens}")
        if not self.chars_per_token > 0:
            raise ValueError(f"chars_per_token must be > 0, got {self.chars_per_token}")
        if self.uses_trace and not self.trace_path:
            raise ValueError("a trace source or trace lengths need trace_path")
        if not (math.isfinite(self.burst_cv) and self.burst_cv > 0):
            raise ValueError(f"burst_cv must be > 0, got {self.burst_cv}")
        if self.num_segments < 1 or not 0 <= self.segment < self.num_segments:
            raise ValueError(
                f"segment must be in 0..num_segments-1, got {self.segment} of {self.num_segments}"
            )
        if self.num_segments > 1 and self.source != "trace":
            raise ValueError("segments slice a trace replay: give --trace FILE")
        if self.source in OWN_LENGTH_SOURCES and self.length_source == "trace":
            raise ValueError(f"the {self.source} source draws its own lengths: no trace lengths")

    def _validate_duration(self) -> None:
        d = self.duration_s
        if d is not None and (not math.isfinite(d) or d < 0):
            raise ValueError(f"duration_s must be finite and >= 0, got {d}")
        if self.source != "trace" and not d:
            raise ValueError(f"a {self.source} workload needs duration_s > 0")

    @property
    def resolved_length_source(self) -> str:
        """The length source, "parametric" or "trace", with "auto" resolved."""
        if self.length_source == "auto":
            return "trace" if self.source == "trace" else "parametric"
        return self.length_source

    @property
    def uses_trace(self) -> bool:
        return self.source == "trace" or self.resolved_length_source == "trace"

    @property
    def train_arrival_rate(self) -> float:
        """Training tasks per second, so that they are a fraction r of all tasks."""
        return self.request_rate * self.train_rate / (1.0 - self.train_rate)


@dataclass(frozen=True)
class Workload:
    """A built workload: tasks sorted by (arrival_s, seq), seq = 0..n-1."""

    config: WorkloadConfig
    tasks: tuple[Task, ...]
    duration_s: float  # the arrival window actually used, [0, duration_s)
    num_clipped: int  # tasks whose lengths were cut to max_total_tokens
    # training task id -> index into the training (query, reference) pairs;
    # empty when training lengths are not drawn from a dataset.
    train_sample_index: Mapping[str, int] = field(default_factory=dict)

    @property
    def num_inference(self) -> int:
        return sum(1 for t in self.tasks if t.kind is TaskKind.INFERENCE)

    @property
    def num_training(self) -> int:
        return sum(1 for t in self.tasks if t.kind is TaskKind.TRAINING)


# ------------------------------------------------------------------ lengths


class LengthSampler(Protocol):
    """Draws n (prompt, output) token-length pairs with the given RNG."""

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class LognormalLengths:
    """Independent lognormal prompt and output lengths (tokens, >= 1).

    `from_median_mean` fits each lognormal from a median m and mean μ:
    mu = ln m, sigma² = 2·ln(μ/m). The default is the Azure conv 2023 fit
    (prompt sigma ≈ 0.50, output sigma ≈ 0.99). Prompt and output are drawn
    independently; the real trace has some correlation we do not model.
    """

    prompt_mu: float
    prompt_sigma: float
    output_mu: float
    output_sigma: float

    @classmethod
    def from_median_mean(
        cls, prompt_median: float, prompt_mean: float, output_median: float, output_mean: float
    ) -> LognormalLengths:
        """Fit both lognormals from medians and means (mean must be >= median)."""
        p_mu, p_sigma = _lognormal_params(prompt_median, prompt_mean)
        o_mu, o_sigma = _lognormal_params(output_median, output_mean)
        return cls(p_mu, p_sigma, o_mu, o_sigma)

    @classmethod
    def azure_conv(cls) -> LognormalLengths:
        """The fit to the Azure conv trace's published stats (traces/README.md)."""
        return cls.from_median_mean(
            AZURE_CONV_PROMPT_MEDIAN,
            AZURE_CONV_PROMPT_MEAN,
            AZURE_CONV_OUTPUT_MEDIAN,
            AZURE_CONV_OUTPUT_MEAN,
        )

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n pairs; one (prompt, output) normal pair per row keeps prefixes stable."""
        z = rng.standard_normal((n, 2))
        prompt = np.exp(self.prompt_mu + self.prompt_sigma * z[:, 0])
        output = np.exp(self.output_mu + self.output_sigma * z[:, 1])
        return _to_tokens(prompt), _to_tokens(output)


def _lognormal_params(median: float, mean: float) -> tuple[float, float]:
    if not (median > 0 and mean >= median):
        raise ValueError(f"lognormal fit needs 0 < median <= mean, got {median}, {mean}")
    return math.log(median), math.sqrt(2.0 * math.log(mean / median))


def _to_tokens(x: np.ndarray) -> np.ndarray:
    return np.maximum(np.rint(x), 1).astype(np.int64)


@dataclass(frozen=True)
class EmpiricalLengths:
    """Resamples (prompt, output) pairs, with replacement, from observed pairs."""

    prompt_tokens: np.ndarray  # int, shape (m,)
    output_tokens: np.ndarray  # int, shape (m,)

    def __post_init__(self) -> None:
        if len(self.prompt_tokens) == 0 or len(self.prompt_tokens) != len(self.output_tokens):
            raise ValueError("EmpiricalLengths needs equally long, non-empty arrays")

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n pairs drawn uniformly at random from the observed pairs."""
        idx = rng.integers(0, len(self.prompt_tokens), size=n)
        return self.prompt_tokens[idx].astype(np.int64), self.output_tokens[idx].astype(np.int64)


def estimate_num_tokens(text: str, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> int:
    """Token count of `text` as ceil(chars / chars_per_token), at least 1."""
    return max(1, math.ceil(len(text) / chars_per_token))


def clip_to_context(
    prompt_tokens: np.ndarray, output_tokens: np.ndarray, max_total_tokens: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Clip so prompt + output <= max_total_tokens, both >= 1.

    The output is kept whole where it fits (at most max_total_tokens − 1) and
    the prompt is cut; returns (prompt, output, number of pairs changed).
    """
    prompt = np.maximum(np.asarray(prompt_tokens, dtype=np.int64), 1)
    output = np.clip(np.asarray(output_tokens, dtype=np.int64), 1, max_total_tokens - 1)
    clipped_prompt = np.minimum(prompt, max_total_tokens - output)
    changed = (clipped_prompt != prompt_tokens) | (output != output_tokens)
    return clipped_prompt, output, int(np.count_nonzero(changed))


def stream_rng(seed: int, stream: int) -> np.random.Generator:
    """An RNG for one named stream of one seed, independent of all others."""
    return np.random.default_rng(np.random.SeedSequence([seed, stream]))


# ------------------------------------------------------------------ assembly


@dataclass(frozen=True)
class TaskStream:
    """One kind's tasks before merging: arrivals and per-task lengths."""

    kind: TaskKind
    arrival_s: np.ndarray  # float, sorted ascending
    prompt_tokens: np.ndarray  # int; training: sequence length
    output_tokens: np.ndarray  # int; 0 for training
    sample_index: np.ndarray | None = None  # training: index into dataset pairs


def task_id(kind: TaskKind, index: int) -> str:
    """ "inf-000042" / "trn-000007": the index counts tasks of that kind."""
    prefix = "inf" if kind is TaskKind.INFERENCE else "trn"
    return f"{prefix}-{index:06d}"


def merge_streams(
    inference: TaskStream, training: TaskStream, batch_size: int
) -> tuple[tuple[Task, ...], dict[str, int]]:
    """Merge two streams into tasks ordered by (arrival_s, inference first, index).

    Returns the tasks (seq = position) and the training sample index map.
    """
    keyed: list[tuple[float, int, int, TaskStream]] = []
    for order, stream in enumerate((inference, training)):
        keyed.extend((float(t), order, i, stream) for i, t in enumerate(stream.arrival_s))
    keyed.sort(key=lambda k: (k[0], k[1], k[2]))
    tasks: list[Task] = []
    samples: dict[str, int] = {}
    for seq, (arrival, _, i, stream) in enumerate(keyed):
        tid = task_id(stream.kind, i)
        is_training = stream.kind is TaskKind.TRAINING
        tasks.append(
            Task(
                task_id=tid,
                kind=stream.kind,
                arrival_s=arrival,
                num_prompt_tokens=int(stream.prompt_tokens[i]),
                max_output_tokens=0 if is_training else int(stream.output_tokens[i]),
                batch_size=batch_size if is_training else 1,
                seq=seq,
            )
        )
        if stream.sample_index is not None:
            samples[tid] = int(stream.sample_index[i])
    return tuple(tasks), samples
