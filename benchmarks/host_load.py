"""How busy the host was when a benchmark started.

On a 2-core machine other jobs' CPU moves latency and throughput figures more
than most code changes do (docs/control-plane.md, seventh round: the same
code measured 7.1 ms of CPU per request on a shared host and 4.0 on an idle
one). Benchmarks record this in their JSON and print it, so a table can say
which host it came from, and comparisons stay within one run.
"""

from __future__ import annotations

import os
from typing import Any

# Above this 1-minute load per CPU before a run starts, the host is called busy.
BUSY_LOAD_PER_CPU = 0.5


def host_load() -> dict[str, Any]:
    """The CPU count and the 1/5/15-minute load averages now, and whether the
    host counts as busy (`BUSY_LOAD_PER_CPU`)."""
    num_cpus = os.cpu_count() or 1
    load_1m, load_5m, load_15m = os.getloadavg()
    return {
        "num_cpus": num_cpus,
        "load_avg_1m": round(load_1m, 2),
        "load_avg_5m": round(load_5m, 2),
        "load_avg_15m": round(load_15m, 2),
        "is_busy": load_1m > BUSY_LOAD_PER_CPU * num_cpus,
    }


def describe(load: dict[str, Any]) -> str:
    """One line for the benchmark's output."""
    line = (
        f"host at start: load average {load['load_avg_1m']} / {load['load_avg_5m']} / "
        f"{load['load_avg_15m']} (1/5/15 min) on {load['num_cpus']} CPUs"
    )
    if load["is_busy"]:
        line += "; BUSY: other jobs are running, compare only within this run"
    return line
