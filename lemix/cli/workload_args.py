"""The one mapping from the workload flags (--poisson/--trace, --duration,
--lengths-from, --train-data, --workload) to a `WorkloadConfig`: `lemix sim`,
`compare` and `replay` share it."""

from __future__ import annotations

import argparse
from typing import Any

from lemix.workload import (
    CHAT_MAX_TOTAL_TOKENS,
    LONG_OUTPUT_MAX_TOTAL_TOKENS,
    LONG_PROMPT_MAX_TOTAL_TOKENS,
    WorkloadConfig,
    read_azure_csv,
)

DEMO_DURATION_S = 60.0  # `lemix demo`, and Poisson runs given no --duration
# --workload: "conversation" = the Azure conversation shape (Poisson arrivals
# or a --trace replay); "long-prompt" = lemix.workload.long_prompt;
# "long-output" = lemix.workload.long_output; "chat" = lemix.workload.chat.
WORKLOADS = ("conversation", "long-prompt", "long-output", "chat")
WORKLOAD_HELP = (
    "conversation (default: Azure conversation lengths, --poisson or --trace), "
    "long-prompt (prompts 1-8k tokens, outputs 5-30, Gamma inter-arrivals of CV 3 "
    "at the --poisson mean rate), long-output (prompts 256-1024 tokens, outputs "
    "1024-3072, Poisson at --poisson: KV memory binds) or chat (ShareGPT-fitted "
    "lognormal lengths, prompt + output clipped to 4096, Poisson at --poisson)"
)
# The context limit of each workload that draws its own lengths: long-prompt
# and long-output fit it unclipped; chat's is Llama-2's, and clips its tail.
_MAX_TOTAL_TOKENS = {
    "long-prompt": LONG_PROMPT_MAX_TOTAL_TOKENS,
    "long-output": LONG_OUTPUT_MAX_TOTAL_TOKENS,
    "chat": CHAT_MAX_TOTAL_TOKENS,
}


def add_segment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--segments",
        type=int,
        default=1,
        metavar="N",
        help="with --trace: cut it into N disjoint slices of equal request counts (default 1)",
    )
    p.add_argument(
        "--segment",
        type=int,
        default=0,
        metavar="K",
        help="with --segments: replay slice K (0-based), time-scaled by --poisson RATE; "
        "`compare` replays slice seed mod N for each seed",
    )


def workload_config(
    args: argparse.Namespace, rate: float | None, train_rate: float, seed: int
) -> WorkloadConfig:
    """Arrivals: --trace (time-scaled to `rate` if given) or Poisson at `rate`."""
    common: dict[str, Any] = {
        "train_rate": train_rate,
        "seed": seed,
        "train_data_path": args.train_data,
    }
    kind = getattr(args, "workload", "conversation")
    if kind in _MAX_TOTAL_TOKENS:
        if args.trace or args.lengths_from:
            raise ValueError(
                f"--workload {kind} draws its own arrivals and lengths: "
                "no --trace or --lengths-from"
            )
        if rate is None:
            raise ValueError(f"--workload {kind} needs a mean rate: --poisson RATE")
        return WorkloadConfig(
            source=kind,
            request_rate=rate,
            duration_s=DEMO_DURATION_S if args.duration is None else args.duration,
            max_total_tokens=_MAX_TOTAL_TOKENS[kind],
            **common,
        )
    if args.trace:
        if args.lengths_from:
            raise ValueError(
                "--lengths-from goes with Poisson arrivals; "
                "a --trace replay uses the trace's own lengths"
            )
        return WorkloadConfig(
            source="trace",
            trace_path=args.trace,
            request_rate=rate or _trace_rate_rps(args.trace),
            duration_s=args.duration,
            num_segments=args.segments,
            segment=args.segment,
            **common,
        )
    if getattr(args, "segments", 1) != 1 or getattr(args, "segment", 0) != 0:
        raise ValueError("--segments/--segment slice a trace replay: give --trace FILE")
    if rate is None:
        raise ValueError("give arrivals: --poisson RATE or --trace FILE")
    lengths = (
        {"length_source": "trace", "trace_path": args.lengths_from}
        if args.lengths_from
        else {"length_source": "parametric"}
    )
    duration = DEMO_DURATION_S if args.duration is None else args.duration
    return WorkloadConfig(
        source="poisson", request_rate=rate, duration_s=duration, **lengths, **common
    )


def _trace_rate_rps(path: str) -> float:
    """The trace's own rate, (n − 1) / span: time-scaling to it changes nothing."""
    trace = read_azure_csv(path)
    if trace.num_requests < 2 or trace.duration_s <= 0:
        raise ValueError(f"{path}: need at least two distinct arrival times")
    return (trace.num_requests - 1) / trace.duration_s
