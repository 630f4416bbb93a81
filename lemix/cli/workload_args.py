"""The one mapping from the workload flags (--poisson/--trace, --duration,
--lengths-from, --train-data) to a `WorkloadConfig`: `lemix sim`, `compare`
and `replay` share it."""

from __future__ import annotations

import argparse
from typing import Any

from lemix.workload import WorkloadConfig, read_azure_csv

DEMO_DURATION_S = 60.0  # `lemix demo`, and Poisson runs given no --duration


def workload_config(
    args: argparse.Namespace, rate: float | None, train_rate: float, seed: int
) -> WorkloadConfig:
    """Arrivals: --trace (time-scaled to `rate` if given) or Poisson at `rate`."""
    common: dict[str, Any] = {
        "train_rate": train_rate,
        "seed": seed,
        "train_data_path": args.train_data,
    }
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
            **common,
        )
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
