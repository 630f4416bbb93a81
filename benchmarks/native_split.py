"""Where each process's CPU goes, by the native code it was running (`perf`).

`control_plane.py --perf perf` samples every process of the stack, Redis
and its own client while one level runs (`perf record -F 997`) and splits
each process's measured CPU per request over the shared object each sample
fell in: the Python interpreter (`libpython`: Python code of LeMix and of
its libraries alike), the kernel (system calls, wake-ups, the loopback
network), gRPC's core, the event loop (uvloop), libc, protobuf's C
runtime, hiredis, redis-server, other. A Python profiler cannot show this
split: it sees only Python frames, and prices its own hooks into them.

The kernel's, gRPC's and Redis's shares are what a request costs whatever
its Python does; the interpreter's is what faster Python could cut
(docs/control-plane.md, eleventh round). perf needs permission to read the
processes' counters (root, or `kernel.perf_event_paranoid` <= 1).
"""

from __future__ import annotations

import collections
import subprocess
from pathlib import Path

# (category, a substring of the shared object's path), first match wins.
_RULES = (
    ("interpreter", "libpython"),
    ("interpreter", "/bin/python"),
    ("kernel", "kernel"),
    ("grpc core", "cygrpc"),
    ("event loop", "uvloop"),
    ("event loop", "/loop.cpython"),
    ("event loop", "_asyncio.cpython"),
    ("libc", "libc.so"),
    ("protobuf C", "_message"),
    ("protobuf C", "upb"),
    ("hiredis", "hiredis"),
    ("redis-server", "redis-server"),
)
CATEGORIES = (
    "interpreter",
    "kernel",
    "grpc core",
    "event loop",
    "libc",
    "protobuf C",
    "hiredis",
    "redis-server",
    "other",
)
PERF_FREQUENCY_HZ = 997  # prime, so the sampling does not beat with a periodic loop


def category(dso: str) -> str:
    """The category of a shared object's path (or perf's name for it)."""
    for name, part in _RULES:
        if part in dso:
            return name
    return "other"


def start(perf: str, pids: dict[str, int], duration_s: float, data: Path) -> subprocess.Popen:
    """Start sampling `pids` (every thread of each) for `duration_s` into `data`."""
    return subprocess.Popen(
        [
            perf,
            "record",
            "-F",
            str(PERF_FREQUENCY_HZ),
            "-p",
            ",".join(str(pid) for pid in pids.values()),
            "-o",
            str(data),
            "--",
            "sleep",
            f"{duration_s:g}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait(recording: subprocess.Popen, timeout_s: float) -> None:
    """Wait for a `start`ed recording; raise RuntimeError, with perf's own
    message, when it failed (commonly: no permission to read the counters)."""
    _, err = recording.communicate(timeout=timeout_s)
    if recording.returncode != 0:
        raise RuntimeError(
            f"perf record exited {recording.returncode}: {err.strip()[-500:]} "
            "(run as root, or set kernel.perf_event_paranoid <= 1)"
        )


def shares(perf: str, data: Path, pids: dict[str, int]) -> dict[str, dict[str, float]]:
    """Each named process's samples in `data` by category, as shares of its
    own samples (`sample_shares`)."""
    script = subprocess.run(
        [perf, "script", "-i", str(data), "-F", "pid,ip,dso"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sample_shares(script, pids)


def sample_shares(script: str, pids: dict[str, int]) -> dict[str, dict[str, float]]:
    """Shares by category of each named process's samples, from `perf script
    -F pid,ip,dso` lines ("<pid> <ip> (<shared object>)"); categories a
    process never ran in, and processes without samples, are left out."""
    names = {str(pid): name for name, pid in pids.items()}
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in script.splitlines():
        pid, _, rest = line.strip().partition(" ")
        name = names.get(pid)
        if name is not None:
            counts[name][category(rest.rpartition("(")[2].rstrip(")"))] += 1
    return {
        name: {c: n / sum(counter.values()) for c, n in counter.items()}
        for name, counter in counts.items()
    }


def split_ms(
    cpu_ms_by_process: dict[str, float], by_process: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """CPU ms per request by process and category: each process's measured
    CPU spread over its sample shares; "stack" sums every process but the
    benchmark's client."""
    out: dict[str, dict[str, float]] = {}
    stack: collections.Counter[str] = collections.Counter()
    for name, split in by_process.items():
        ms = cpu_ms_by_process.get(name, 0.0)
        out[name] = {c: ms * split.get(c, 0.0) for c in CATEGORIES}
        if name != "client":
            stack.update(out[name])
    out["stack"] = {c: stack[c] for c in CATEGORIES}
    return out
