"""Workload generation: Poisson (or trace-replay, long-prompt bursty,
long-output or chat) inference plus Poisson training.

`build_workload(config)` is the entry point. Streams and their seeded RNGs:
- inference arrivals: Poisson at request_rate, or the trace time-scaled to it;
- inference lengths: lognormal (Azure conv fit), the trace's pairs, the
  long-prompt / long-output source's own uniform ranges, or the chat
  source's ShareGPT lognormal fit;
- training arrivals: Poisson at request_rate·r/(1−r), so training tasks are a
  fraction r of all tasks in expectation;
- training lengths: hh-rlhf (query + reference) token estimates from a file, a
  lognormal fitted to that split's measured stats (no file), or, for trace
  lengths, the trace's
  prompt + output.
Each stream has its own RNG derived from (seed, stream id), so the inference
tasks are identical for every train_rate at one seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lemix.types import TaskKind
from lemix.workload.azure_csv import AzureTrace, read_azure_csv, segment, time_scale
from lemix.workload.base import (
    HH_RLHF_SEQ_MEAN,
    HH_RLHF_SEQ_MEDIAN,
    STREAM_INFERENCE_ARRIVALS,
    STREAM_INFERENCE_LENGTHS,
    STREAM_TRAINING_ARRIVALS,
    STREAM_TRAINING_LENGTHS,
    EmpiricalLengths,
    LengthSampler,
    LognormalLengths,
    TaskStream,
    Workload,
    WorkloadConfig,
    clip_to_context,
    merge_streams,
    stream_rng,
)
from lemix.workload.chat import chat_lengths
from lemix.workload.hh_jsonl import Pair, pair_num_tokens, read_hh_pairs
from lemix.workload.long_output import long_output_lengths
from lemix.workload.long_prompt import UniformLengths, gamma_arrivals

ARRIVAL_CHUNK = 1024  # gaps drawn per RNG call; fixed, so prefixes never depend on n


@dataclass(frozen=True)
class WorkloadData:
    """Files a config names, loaded once and reusable across seeds."""

    trace: AzureTrace | None = None
    train_pairs: tuple[Pair, ...] | None = None


def load_workload_data(config: WorkloadConfig) -> WorkloadData:
    """Read the trace and training pairs that `config` points to (if any)."""
    trace = read_azure_csv(config.trace_path) if config.uses_trace and config.trace_path else None
    pairs = tuple(read_hh_pairs(config.train_data_path)) if config.train_data_path else None
    if pairs is not None and not pairs:
        raise ValueError(f"{config.train_data_path}: no training pairs")
    return WorkloadData(trace=trace, train_pairs=pairs)


def poisson_arrivals(rate: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times of a Poisson process of `rate`/s in [0, duration_s).

    Gaps are exponential with mean 1/rate; rate 0 gives no arrivals.
    """
    if rate < 0 or duration_s < 0:
        raise ValueError(f"need rate >= 0 and duration_s >= 0, got {rate}, {duration_s}")
    if rate == 0 or duration_s == 0:
        return np.empty(0, dtype=np.float64)
    chunks: list[np.ndarray] = []
    last = 0.0
    while last < duration_s:
        times = last + np.cumsum(rng.exponential(1.0 / rate, size=ARRIVAL_CHUNK))
        chunks.append(times)
        last = float(times[-1])
    arrivals = np.concatenate(chunks)
    return arrivals[arrivals < duration_s]


def build_workload(config: WorkloadConfig, data: WorkloadData | None = None) -> Workload:
    """Build the deterministic task list `config` describes.

    `data` (from `load_workload_data`) avoids re-reading files per seed; by
    default the files are read here.
    """
    data = load_workload_data(config) if data is None else data
    inference, window_s, num_clipped = _inference_stream(config, data)
    training, num_clipped_train = _training_stream(config, data, window_s)
    tasks, samples = merge_streams(inference, training, config.batch_size)
    return Workload(
        config=config,
        tasks=tasks,
        duration_s=window_s,
        num_clipped=num_clipped + num_clipped_train,
        train_sample_index=samples,
    )


def _require_trace(data: WorkloadData) -> AzureTrace:
    if data.trace is None:
        raise ValueError("this workload needs a trace (trace_path), none was loaded")
    return data.trace


def _length_sampler(config: WorkloadConfig, data: WorkloadData) -> LengthSampler:
    if config.resolved_length_source == "trace":
        trace = _require_trace(data)
        return EmpiricalLengths(trace.prompt_tokens, trace.output_tokens)
    return LognormalLengths.azure_conv()


def _inference_stream(config: WorkloadConfig, data: WorkloadData) -> tuple[TaskStream, float, int]:
    """Inference arrivals and lengths; returns (stream, window_s, num_clipped)."""
    rng_arrivals = stream_rng(config.seed, STREAM_INFERENCE_ARRIVALS)
    rng_lengths = stream_rng(config.seed, STREAM_INFERENCE_LENGTHS)
    if config.source == "trace":
        trace = segment(_require_trace(data), config.segment, config.num_segments)
        scaled = time_scale(trace.arrival_s, config.request_rate)
        # The whole scaled trace spans n mean gaps; a longer window would leave
        # a tail with training only, so the window is capped there.
        full_s = len(scaled) / config.request_rate
        window_s = min(config.duration_s, full_s) if config.duration_s else full_s
        keep = scaled < window_s
        arrivals = scaled[keep]
        if config.resolved_length_source == "trace":  # replay the rows' own lengths
            prompt, output = trace.prompt_tokens[keep], trace.output_tokens[keep]
        else:
            prompt, output = _length_sampler(config, data).sample(rng_lengths, len(arrivals))
    elif config.source == "long-prompt":
        window_s = float(config.duration_s or 0.0)
        arrivals = gamma_arrivals(config.request_rate, config.burst_cv, window_s, rng_arrivals)
        prompt, output = UniformLengths().sample(rng_lengths, len(arrivals))
    elif config.source in ("long-output", "chat"):
        window_s = float(config.duration_s or 0.0)
        arrivals = poisson_arrivals(config.request_rate, window_s, rng_arrivals)
        sampler = long_output_lengths() if config.source == "long-output" else chat_lengths()
        prompt, output = sampler.sample(rng_lengths, len(arrivals))
    else:
        window_s = float(config.duration_s or 0.0)
        arrivals = poisson_arrivals(config.request_rate, window_s, rng_arrivals)
        prompt, output = _length_sampler(config, data).sample(rng_lengths, len(arrivals))
    prompt, output, num_clipped = clip_to_context(prompt, output, config.max_total_tokens)
    stream = TaskStream(TaskKind.INFERENCE, arrivals, prompt, output)
    return stream, float(window_s), num_clipped


def _training_stream(
    config: WorkloadConfig, data: WorkloadData, window_s: float
) -> tuple[TaskStream, int]:
    """Training arrivals and sequence lengths; returns (stream, num_clipped)."""
    rng_arrivals = stream_rng(config.seed, STREAM_TRAINING_ARRIVALS)
    rng_lengths = stream_rng(config.seed, STREAM_TRAINING_LENGTHS)
    arrivals = poisson_arrivals(config.train_arrival_rate, window_s, rng_arrivals)
    n = len(arrivals)
    sample_index: np.ndarray | None = None
    if data.train_pairs:
        query, reference = pair_num_tokens(data.train_pairs, config.chars_per_token)
        sample_index = rng_lengths.integers(0, len(data.train_pairs), size=n)
        seq_tokens = query[sample_index] + reference[sample_index]
    elif config.resolved_length_source == "trace":
        prompt, output = _length_sampler(config, data).sample(rng_lengths, n)
        seq_tokens = prompt + output
    else:
        # HH-RLHF-shaped sequences (the paper's training data), not chat prompts.
        seq_tokens, _ = LognormalLengths.from_median_mean(
            HH_RLHF_SEQ_MEDIAN, HH_RLHF_SEQ_MEAN, HH_RLHF_SEQ_MEDIAN, HH_RLHF_SEQ_MEAN
        ).sample(rng_lengths, n)
    clipped = np.minimum(seq_tokens, config.max_total_tokens)
    num_clipped = int(np.count_nonzero(clipped != seq_tokens))
    stream = TaskStream(
        TaskKind.TRAINING, arrivals, clipped, np.zeros(n, dtype=np.int64), sample_index
    )
    return stream, num_clipped
