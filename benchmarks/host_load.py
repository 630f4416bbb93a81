"""How busy the host was when a benchmark started.

On a 2-core machine other jobs' CPU moves latency and throughput figures more
than most code changes do (docs/control-plane.md, seventh round: the same
code measured 7.1 ms of CPU per request on a shared host and 4.0 on an idle
one). Hosts also differ in speed: a later session's "idle" 2-core VM ran
the same pure-Python loop 2-3x slower than an earlier one's. Benchmarks
record both in their JSON and print them, so a table can say which host it
came from, and comparisons stay within one run.
"""

from __future__ import annotations

import os
import timeit
from typing import Any

# Above this 1-minute load per CPU before a run starts, the host is called busy.
BUSY_LOAD_PER_CPU = 0.5
# The speed probe: one core's time for this pure-Python loop, best of
# `_SPEED_REPEATS` (the interpreter's speed on this host; ~0.2 s in all).
_SPEED_STMT = "sum(range(10_000))"
_SPEED_LOOPS = 200
_SPEED_REPEATS = 5


def python_speed_us() -> float:
    """µs per `_SPEED_STMT` on one core, best of a few repeats (lower: faster)."""
    best_s = min(timeit.repeat(_SPEED_STMT, number=_SPEED_LOOPS, repeat=_SPEED_REPEATS))
    return best_s / _SPEED_LOOPS * 1e6


def host_load(*, speed_us: float | None = None) -> dict[str, Any]:
    """The CPU count, the 1/5/15-minute load averages now, whether the host
    counts as busy (`BUSY_LOAD_PER_CPU`), and its Python speed
    (`python_speed_us`, measured unless given)."""
    num_cpus = os.cpu_count() or 1
    load_1m, load_5m, load_15m = os.getloadavg()  # before the probe adds to it
    return {
        "num_cpus": num_cpus,
        "load_avg_1m": round(load_1m, 2),
        "load_avg_5m": round(load_5m, 2),
        "load_avg_15m": round(load_15m, 2),
        "is_busy": load_1m > BUSY_LOAD_PER_CPU * num_cpus,
        "python_speed_us": round(python_speed_us() if speed_us is None else speed_us, 1),
        "python_speed_stmt": _SPEED_STMT,
    }


def describe(load: dict[str, Any]) -> str:
    """One line for the benchmark's output."""
    line = (
        f"host at start: load average {load['load_avg_1m']} / {load['load_avg_5m']} / "
        f"{load['load_avg_15m']} (1/5/15 min) on {load['num_cpus']} CPUs; "
        f"{load['python_speed_stmt']} takes {load['python_speed_us']} µs on one core"
    )
    if load["is_busy"]:
        line += "; BUSY: other jobs are running, compare only within this run"
    return line
