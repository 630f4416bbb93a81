"""Simulator wall time on the whole Azure conversation trace.

The trace (19,366 requests over 58 min) replays at its own rate, plus training
tasks at train rate 0.1, on 4 nodes × 2 stages, for each policy. Reports wall
seconds, events per second and the headline metrics. Without the trace file
it says so and runs a parametric Poisson workload of the same size instead.

    .venv/bin/python benchmarks/sim_speed.py --json runs/bench/sim_speed.json

Target: <= 60 s wall per run. `--profile-top N` adds a cProfile of the first
policy's run and prints its N largest cumulative/internal hotspots.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import sys
import time
from pathlib import Path
from typing import Any

from lemix.profile import Profile, default_profile_path, load_profile
from lemix.report.metrics import format_table
from lemix.sim.run import SimRunConfig, run_simulation
from lemix.workload import Workload, WorkloadConfig, build_workload, read_azure_csv

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "azure_llm_conv_2023.csv"
TRACE_NUM_REQUESTS = 19_366  # the Azure conv 2023 trace
TRACE_DURATION_S = 3501.7
TARGET_WALL_S = 60.0


def make_workload(trace_path: Path, train_rate: float, seed: int) -> tuple[Workload, str]:
    """The whole trace at its own rate, or a same-size parametric stand-in."""
    if trace_path.exists():
        trace = read_azure_csv(trace_path)
        own_rate = (trace.num_requests - 1) / trace.duration_s  # time_scale's identity
        config = WorkloadConfig(
            source="trace",
            trace_path=str(trace_path),
            request_rate=own_rate,
            train_rate=train_rate,
            duration_s=None,
            seed=seed,
        )
        return build_workload(config), f"azure trace {trace_path}"
    print(
        f"trace file {trace_path} is absent: running a parametric Poisson workload of the "
        f"same size ({TRACE_NUM_REQUESTS} requests over {TRACE_DURATION_S:g} s) instead"
    )
    config = WorkloadConfig(
        request_rate=TRACE_NUM_REQUESTS / TRACE_DURATION_S,
        train_rate=train_rate,
        duration_s=TRACE_DURATION_S,
        seed=seed,
    )
    return build_workload(config), "parametric poisson (trace absent)"


def run_one(
    policy: str, wl: Workload, profile: Profile, num_nodes: int, seed: int
) -> dict[str, Any]:
    config = SimRunConfig(
        policy=policy, num_nodes=num_nodes, seed=seed, train_rate=wl.config.train_rate
    )
    start = time.perf_counter()
    metrics, result = run_simulation(
        config, profile, wl.tasks, request_rate=wl.config.request_rate, duration_s=wl.duration_s
    )
    wall_s = time.perf_counter() - start
    return {
        "policy": policy,
        "num_tasks": len(wl.tasks),
        "num_events": result.num_events,
        "wall_s": wall_s,
        "events_per_s": result.num_events / wall_s,
        "meets_target": wall_s <= TARGET_WALL_S,
        "metrics": metrics,
    }


def profile_run(
    policy: str, wl: Workload, profile: Profile, num_nodes: int, seed: int, top: int
) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    run_one(policy, wl, profile, num_nodes, seed)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--policies", default="lemix,mix-rr")
    parser.add_argument("--train-rate", type=float, default=0.1)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--profile", default=str(default_profile_path()))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile-top",
        type=int,
        default=0,
        metavar="N",
        help="also cProfile the first policy and print the top N functions",
    )
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    wl, source = make_workload(Path(args.trace), args.train_rate, args.seed)
    print(
        f"workload: {source}: {wl.num_inference} inference + {wl.num_training} training "
        f"tasks over {wl.duration_s:.0f} s; {args.nodes} nodes x {profile.num_stages} stages"
    )
    rows = [run_one(p, wl, profile, args.nodes, args.seed) for p in args.policies.split(",")]
    print(
        format_table(
            rows,
            [
                ("policy", "policy"),
                ("num_tasks", "tasks"),
                ("num_events", "events"),
                ("wall_s", "wall s"),
                ("events_per_s", "events/s"),
                ("meets_target", "<= 60 s"),
                ("metrics.slo_attainment", "SLO att."),
                ("metrics.goodput_rps", "goodput/s"),
                ("metrics.throughput_tasks_s", "tasks/s"),
                ("metrics.ttft_s.p50", "TTFT p50 s"),
                ("metrics.ttft_s.p99", "TTFT p99 s"),
                ("metrics.tbt_s.p50", "TBT p50 s"),
                ("metrics.training_samples_s", "train smp/s"),
                ("metrics.num_failed", "failed"),
            ],
        )
    )
    hotspots = ""
    if args.profile_top:
        hotspots = profile_run(
            rows[0]["policy"], wl, profile, args.nodes, args.seed, args.profile_top
        )
        print(hotspots)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "benchmark": "sim_speed",
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "workload": source,
            "train_rate": args.train_rate,
            "num_nodes": args.nodes,
            "profile": profile.name,
            "target_wall_s": TARGET_WALL_S,
            "results": rows,
        }
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
