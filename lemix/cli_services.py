"""`lemix up` and `lemix replay`: the commands that run or load the service stack.

Flag → typed-config mapping for these two commands lives here, beside
`lemix/cli.py`'s for the simulator commands; `lemix/cli.py` dispatches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from lemix.launcher import StackConfig, run_until_signalled
from lemix.metrics import format_table
from lemix.planner.registry import POLICIES
from lemix.profile import default_profile_path, load_profile
from lemix.replay import ReplayConfig, run_replay
from lemix.sim.run import SloConfig, compute_slo
from lemix.workload import build_workload

REPLAY_TABLE_ROWS: tuple[tuple[str, str], ...] = (
    ("num_inference", "inference requests"), ("num_training", "training tasks"),
    ("num_completed", "completed"), ("num_rejected", "rejected"), ("num_failed", "failed"),
    ("num_lost", "lost"), ("slo_attainment", "SLO attainment"),
    ("goodput_rps", "goodput (req/s)"), ("throughput_tasks_s", "throughput (tasks/s)"),
    ("throughput_tokens_s", "throughput (tokens/s)"), ("ttft_s.p50", "TTFT p50 (s)"),
    ("ttft_s.p99", "TTFT p99 (s)"), ("tbt_s.p50", "TBT p50 (s)"), ("e2e_s.p50", "E2E p50 (s)"),
    ("slo_ttft_s", "SLO TTFT (s)"), ("slo_tbt_s", "SLO TBT (s)"),
)  # fmt: skip


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    up = sub.add_parser("up", help="run the service stack in the foreground (Ctrl-C stops it)")
    up.add_argument("--nodes", type=int, default=2, help="executor nodes (default 2)")
    up.add_argument("--stages", type=int, help="stages per node: picks the shipped profile")
    up.add_argument("--backend", default="emulated", choices=("emulated", "torch"))
    up.add_argument("--profile", metavar="FILE", help="profile JSON (default: shipped A100 one)")
    up.add_argument("--policy", default="lemix", help=f"one of: {', '.join(POLICIES)}")
    up.add_argument("--gateway-port", type=int, default=50051)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--time-scale", type=float, default=1.0,
                    help="emulated stage time multiplier (<1 runs faster than the profile)")
    up.add_argument("--train-rate", type=float, default=0.0, help="SEPARATE's training share")
    up.add_argument("--log-dir", default="runs/stack-logs")

    rp = sub.add_parser("replay", help="open-loop load against a running gateway")
    rp.add_argument("--target", required=True, metavar="HOST:PORT")
    rp.add_argument("--poisson", type=float, metavar="RATE",
                    help="Poisson arrivals at RATE req/s (with --trace: time-scale it to RATE)")
    rp.add_argument("--trace", metavar="FILE", help="Azure-format CSV to replay")
    rp.add_argument("--lengths-from", metavar="FILE", help="resample lengths from an Azure CSV")
    rp.add_argument("--train-data", metavar="FILE", help="hh-rlhf JSON lines: training lengths")
    rp.add_argument("--train-rate", type=float, default=0.0)
    rp.add_argument("--duration", type=float, help="arrival window in s (default 60)")
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--profile", metavar="FILE",
                    help="profile for the SLO (5x unloaded latency, as `lemix sim` computes it)")
    rp.add_argument("--drain-timeout", type=float, default=120.0)
    rp.add_argument("--json", metavar="OUT", help="write the metrics JSON (a list of one run)")


def _profile_path(profile: str | None, num_stages: int | None) -> Path:
    if profile:
        return Path(profile)
    if num_stages is None:
        return default_profile_path()
    path = default_profile_path().with_name(f"a100-llama2-7b-{num_stages}stage.json")
    if not path.exists():
        raise ValueError(f"no shipped profile with {num_stages} stages; pass --profile FILE")
    return path


def stack_config(args: argparse.Namespace) -> StackConfig:
    if args.policy not in POLICIES:
        raise ValueError(f"unknown policy {args.policy!r}; choose from {', '.join(POLICIES)}")
    return StackConfig(
        num_nodes=args.nodes,
        profile_path=_profile_path(args.profile, args.stages),
        backend=args.backend,
        policy=args.policy,
        host=args.host,
        gateway_port=args.gateway_port,
        time_scale=args.time_scale,
        train_rate=args.train_rate,
        log_dir=Path(args.log_dir),
        redis_url=os.environ.get("LEMIX_REDIS_URL") or None,  # else an embedded one
    )


def cmd_up(args: argparse.Namespace) -> int:
    return asyncio.run(run_until_signalled(stack_config(args)))


def cmd_replay(args: argparse.Namespace) -> int:
    from lemix.cli import _workload_config  # the one mapping of workload flags

    workload_config = _workload_config(args, args.poisson, args.train_rate, args.seed)
    workload = build_workload(workload_config)
    tasks = list(workload.tasks)
    profile = load_profile(args.profile or default_profile_path())
    slo = compute_slo(profile, tasks, SloConfig())
    config = ReplayConfig(target=args.target, drain_timeout_s=args.drain_timeout,
                          slo_ttft_s=slo.ttft_s, slo_tbt_s=slo.tbt_s)
    metrics = asyncio.run(run_replay(config, tasks, request_rate=workload_config.request_rate,
                                     train_rate=args.train_rate, duration_s=workload.duration_s,
                                     seed=args.seed))
    rows = [{"metric": label, "value": _lookup(metrics, key)} for key, label in REPLAY_TABLE_ROWS]
    print(format_table(rows, [("metric", "metric"), ("value", "value")]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([metrics], indent=2) + "\n")
        print(f"metrics JSON: {args.json}")
    return 0 if metrics["num_lost"] == 0 else 1


# `make demo`'s live part: small enough for a 2-core laptop, real enough to
# exercise every service (2 emulated nodes x 2 stages, timing from the profile).
DEMO_LIVE_NODES = 2
DEMO_LIVE_RATE = 3.0
DEMO_LIVE_TRAIN_RATE = 0.3
DEMO_LIVE_DURATION_S = 20.0


async def _live_demo(out_dir: Path) -> dict:
    from lemix.workload import WorkloadConfig

    workload = build_workload(WorkloadConfig(request_rate=DEMO_LIVE_RATE,
                                             train_rate=DEMO_LIVE_TRAIN_RATE,
                                             duration_s=DEMO_LIVE_DURATION_S, seed=0))
    tasks = list(workload.tasks)
    slo = compute_slo(load_profile(default_profile_path()), tasks, SloConfig())
    config = StackConfig(num_nodes=DEMO_LIVE_NODES, gateway_port=0,
                         log_dir=out_dir / "stack-logs", namespace="demo")
    from lemix.launcher import Stack

    async with Stack(config) as stack:
        print(f"stack up: gateway {stack.gateway_address}, {DEMO_LIVE_NODES} emulated nodes; "
              f"replaying {len(tasks)} tasks over {DEMO_LIVE_DURATION_S:g} s ...", flush=True)
        return await run_replay(
            ReplayConfig(target=stack.gateway_address, slo_ttft_s=slo.ttft_s,
                         slo_tbt_s=slo.tbt_s, drain_timeout_s=120.0),
            tasks, request_rate=DEMO_LIVE_RATE, train_rate=DEMO_LIVE_TRAIN_RATE,
            duration_s=workload.duration_s, seed=0, label="lemix (live stack)")


def run_live_demo(out_dir: Path) -> dict:
    """The live half of `lemix demo`: `lemix up` + `lemix replay`, in-process."""
    metrics = asyncio.run(_live_demo(out_dir))
    rows = [{"metric": label, "value": _lookup(metrics, key)} for key, label in REPLAY_TABLE_ROWS]
    print(format_table(rows, [("metric", "live stack (emulated)"), ("value", "value")]))
    return metrics


def _lookup(row: dict, key: str) -> object:
    value: object = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value
