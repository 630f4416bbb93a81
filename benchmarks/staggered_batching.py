"""Continuous batching against static `generate` batches, on staggered arrivals.

One seeded request mix: prompts of varied length arriving one after another
(exponential gaps), each wanting its own number of tokens (end-of-sequence
off). Both sides get the same mix on the same clock (arrivals in wall time
from the run's start) and at most `max_batch` requests at once:

* ours (continuous): every iteration admits the requests that have arrived,
  as far as slots are free, and prefills them in the same packed iteration as
  the running decodes; a request leaves as soon as it has its tokens, freeing
  its slot for the next arrival (`InferenceRunner`, 2 stages, one thread).
* static `generate`: a batch starts once `max_batch` requests have arrived
  (or the last ones of the mix), runs as one left-padded greedy `generate`
  until its longest request is done, and only then does the next batch start.

Throughput = generated tokens / (time from the start to the last request
done); latency = done - arrival, per request. Greedy tokens are compared
request by request (a static batch's extra tokens past a request's own count
are dropped).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lemix.model.runner import GenRequest, InferenceRunner
from lemix.report.metrics import format_table


@dataclass(frozen=True)
class Arrival:
    """One request of the mix."""

    key: str
    arrive_s: float  # since the run's start
    prompt: tuple[int, ...]
    new_tokens: int


@dataclass(frozen=True)
class MixRun:
    """One side's run over the whole mix."""

    makespan_s: float  # start -> last request done
    done_s: dict[str, float]  # per request, since the start
    tokens: dict[str, list[int]]


# (prompt ids, new tokens, pad id) -> Timing-like with .tokens [B][new_tokens]
GenerateFn = Callable[[nn.Module, list[tuple[int, ...]], int, int], Any]


def make_mix(
    num_requests: int,
    mean_gap_s: float,
    vocab_size: int,
    seed: int,
    prompt_range: tuple[int, int] = (16, 96),
    new_range: tuple[int, int] = (8, 128),
) -> list[Arrival]:
    """Seeded mix: exponential inter-arrival gaps, uniform prompt and output lengths."""
    generator = torch.Generator().manual_seed(seed)
    gaps = torch.empty(num_requests).exponential_(1.0 / mean_gap_s, generator=generator)
    arrive = torch.cumsum(gaps, 0) - gaps[0]  # the first arrives at 0
    mix = []
    for i in range(num_requests):
        lo, hi = prompt_range
        n = int(torch.randint(lo, hi + 1, (1,), generator=generator))
        ids = torch.randint(3, vocab_size, (n,), generator=generator).tolist()
        new = int(torch.randint(new_range[0], new_range[1] + 1, (1,), generator=generator))
        mix.append(Arrival(f"m{i}", float(arrive[i]), tuple(ids), new))
    return mix


def _wait_until(t0: float, at_s: float) -> None:
    delay = t0 + at_s - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_continuous(runner: InferenceRunner, mix: list[Arrival], max_batch: int, tag: str) -> MixRun:
    """Admit arrivals into free slots every iteration; leave when done."""
    pending = deque(mix)
    reqs: dict[str, GenRequest] = {}
    running: list[str] = []
    done_s: dict[str, float] = {}
    iteration = 0
    t0 = time.perf_counter()
    while pending or running:
        now_s = time.perf_counter() - t0
        prefill: list[str] = []
        while pending and pending[0].arrive_s <= now_s and len(running) + len(prefill) < max_batch:
            a = pending.popleft()
            req = GenRequest(f"{tag}-{a.key}", a.prompt, a.new_tokens, ignore_eos=True)
            runner.admit(req)
            reqs[a.key] = req
            prefill.append(a.key)
        if not running and not prefill:
            _wait_until(t0, pending[0].arrive_s)
            continue
        keys = {k: reqs[k].key for k in (*prefill, *running)}
        for s in range(runner.staged.num_stages):
            runner.run_stage(s, iteration, [keys[k] for k in prefill], [keys[k] for k in running])
        iteration += 1
        still = []
        for k in (*running, *prefill):
            if len(reqs[k].generated) >= reqs[k].max_tokens:
                done_s[k] = time.perf_counter() - t0
                runner.release(reqs[k].key)
            else:
                still.append(k)
        running = still
    return MixRun(max(done_s.values()), done_s, {k: list(r.generated) for k, r in reqs.items()})


def run_static(
    model: nn.Module, mix: list[Arrival], max_batch: int, pad_id: int, generate: GenerateFn
) -> MixRun:
    """Fill a batch, generate it to its longest request, then the next."""
    done_s: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i in range(0, len(mix), max_batch):
        batch = mix[i : i + max_batch]
        _wait_until(t0, batch[-1].arrive_s)  # arrivals are in order: the last one fills it
        out = generate(model, [a.prompt for a in batch], max(a.new_tokens for a in batch), pad_id)
        end_s = time.perf_counter() - t0
        for a, row in zip(batch, out.tokens, strict=True):
            tokens[a.key] = list(row[: a.new_tokens])
            done_s[a.key] = end_s
    return MixRun(max(done_s.values()), done_s, tokens)


def _summary(run: MixRun, mix: list[Arrival]) -> dict[str, float]:
    latencies = [run.done_s[a.key] - a.arrive_s for a in mix]
    return {
        "makespan_s": run.makespan_s,
        "tok_s": sum(a.new_tokens for a in mix) / run.makespan_s,
        "mean_latency_s": statistics.mean(latencies),
        "p90_latency_s": statistics.quantiles(latencies, n=10)[-1],
    }


def bench_staggered(
    runner: InferenceRunner,
    baseline: nn.Module,
    *,
    num_requests: int,
    mean_gap_s: float,
    max_batch: int,
    repeats: int,
    vocab_size: int,
    pad_id: int,
    generate: GenerateFn,
) -> dict[str, Any]:
    """Both sides over one mix, `repeats` times interleaved after a small warm-up."""
    mix = make_mix(num_requests, mean_gap_s, vocab_size, seed=7)
    warm = make_mix(max_batch, 0.0 + 1e-6, vocab_size, seed=8, new_range=(2, 4))
    run_continuous(runner, warm, max_batch, "warm")
    run_static(baseline, warm, max_batch, pad_id, generate)
    ours: list[MixRun] = []
    theirs: list[MixRun] = []
    for r in range(repeats):
        ours.append(run_continuous(runner, mix, max_batch, f"s{r}"))
        theirs.append(run_static(baseline, mix, max_batch, pad_id, generate))
    ours_runs = [_summary(run, mix) for run in ours]
    their_runs = [_summary(run, mix) for run in theirs]
    mismatched = [a.key for a in mix if ours[0].tokens[a.key] != theirs[0].tokens[a.key]]
    ours_tok_s = statistics.median(s["tok_s"] for s in ours_runs)
    their_tok_s = statistics.median(s["tok_s"] for s in their_runs)
    return {
        "num_requests": num_requests,
        "mean_gap_s": mean_gap_s,
        "max_batch": max_batch,
        "total_new_tokens": sum(a.new_tokens for a in mix),
        "last_arrival_s": mix[-1].arrive_s,
        "ours": ours_runs,
        "static_generate": their_runs,
        "ours_tok_s": ours_tok_s,
        "static_tok_s": their_tok_s,
        "ratio": ours_tok_s / their_tok_s,
        "tokens_equal": not mismatched,
        "mismatched_requests": mismatched,
    }


def print_staggered(result: dict[str, Any]) -> None:
    """The mix, one row per side, the ratio and whether the tokens agree."""
    print(
        f"\nstaggered mix: {result['num_requests']} requests, mean gap "
        f"{result['mean_gap_s']} s (last arrives at {result['last_arrival_s']:.2f} s), "
        f"{result['total_new_tokens']} new tokens, at most {result['max_batch']} at once"
    )
    table = []
    for side, runs in (
        ("ours (continuous)", result["ours"]),
        ("static generate", result["static_generate"]),
    ):
        table.append(
            {
                "side": side,
                "tok_s": statistics.median(r["tok_s"] for r in runs),
                "makespan": statistics.median(r["makespan_s"] for r in runs),
                "mean_lat": statistics.median(r["mean_latency_s"] for r in runs),
                "p90_lat": statistics.median(r["p90_latency_s"] for r in runs),
            }
        )
    print(
        format_table(
            table,
            [
                ("side", "side"),
                ("tok_s", "tok/s"),
                ("makespan", "makespan s"),
                ("mean_lat", "mean latency s"),
                ("p90_lat", "p90 latency s"),
            ],
        )
    )
    equal = "yes" if result["tokens_equal"] else f"NO ({len(result['mismatched_requests'])} differ)"
    print(f"ratio {result['ratio']:.2f}, tokens equal: {equal}")
