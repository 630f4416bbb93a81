"""`lemix replay` (open-loop load against a running gateway) and the live half of
`lemix demo` (a stack and a replay against it, in-process)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from lemix.cli import workload_args
from lemix.cli.service_args import add_api_key_flag, api_key_arg
from lemix.harness.replay import ReplayConfig, format_lost, run_replay
from lemix.profile import default_profile_path, load_profile
from lemix.report.metrics import LATENCY_TABLE_ROWS, OUTCOME_TABLE_ROWS, format_table
from lemix.slo import SloConfig, compute_slo
from lemix.stack.config import StackConfig
from lemix.workload import build_workload

REPLAY_TABLE_ROWS: tuple[tuple[str, str], ...] = (
    *OUTCOME_TABLE_ROWS,
    *LATENCY_TABLE_ROWS,
    ("slo_ttft_s", "SLO TTFT (s)"),
    ("slo_tbt_s", "SLO TBT (s)"),
)


def add_replay_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`lemix replay`'s subparser and flags."""
    rp = sub.add_parser("replay", help="open-loop load against a running gateway")
    rp.add_argument("--target", required=True, metavar="HOST:PORT")
    rp.add_argument(
        "--poisson",
        type=float,
        metavar="RATE",
        help="Poisson arrivals at RATE req/s (with --trace: time-scale it to RATE)",
    )
    rp.add_argument("--trace", metavar="FILE", help="Azure-format CSV to replay")
    rp.add_argument("--lengths-from", metavar="FILE", help="resample lengths from an Azure CSV")
    rp.add_argument("--train-data", metavar="FILE", help="hh-rlhf JSON lines: training lengths")
    workload_args.add_segment_args(rp)
    rp.add_argument("--train-rate", type=float, default=0.0)
    rp.add_argument("--duration", type=float, help="arrival window in s (default 60)")
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument(
        "--profile",
        metavar="FILE",
        help="profile for the SLO (5x unloaded latency, as `lemix sim` computes it)",
    )
    rp.add_argument("--drain-timeout", type=float, default=120.0)
    rp.add_argument("--json", metavar="OUT", help="write the metrics JSON (a list of one run)")
    rp.add_argument(
        "--tls-ca-file",
        default="",
        metavar="FILE",
        help="connect with TLS, trusting this CA (PEM) for the gateway's "
        "certificate (default: plaintext)",
    )
    add_api_key_flag(rp, "the gateway's API key")


def cmd_replay(args: argparse.Namespace) -> int:
    """Replay a workload against a gateway; 1 when a task was lost."""
    workload_config = workload_args.workload_config(args, args.poisson, args.train_rate, args.seed)
    workload = build_workload(workload_config)
    tasks = list(workload.tasks)
    profile = load_profile(args.profile or default_profile_path())
    slo = compute_slo(profile, tasks, SloConfig())
    config = ReplayConfig(
        target=args.target,
        drain_timeout_s=args.drain_timeout,
        slo_ttft_s=slo.ttft_s,
        slo_tbt_s=slo.tbt_s,
        tls_ca_file=args.tls_ca_file,
        api_key=api_key_arg(args),
    )
    metrics = asyncio.run(
        run_replay(
            config,
            tasks,
            request_rate=workload_config.request_rate,
            train_rate=args.train_rate,
            duration_s=workload.duration_s,
            seed=args.seed,
        )
    )
    rows = [{"metric": label, "value": _lookup(metrics, key)} for key, label in REPLAY_TABLE_ROWS]
    print(format_table(rows, [("metric", "metric"), ("value", "value")]))
    print(format_lost(metrics))
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

    workload = build_workload(
        WorkloadConfig(
            request_rate=DEMO_LIVE_RATE,
            train_rate=DEMO_LIVE_TRAIN_RATE,
            duration_s=DEMO_LIVE_DURATION_S,
            seed=0,
        )
    )
    tasks = list(workload.tasks)
    slo = compute_slo(load_profile(default_profile_path()), tasks, SloConfig())
    config = StackConfig(
        num_nodes=DEMO_LIVE_NODES, gateway_port=0, log_dir=out_dir / "stack-logs", namespace="demo"
    )
    from lemix.stack.launcher import Stack

    async with Stack(config) as stack:
        print(
            f"stack up: gateway {stack.gateway_address}, {DEMO_LIVE_NODES} emulated nodes; "
            f"replaying {len(tasks)} tasks over {DEMO_LIVE_DURATION_S:g} s ...",
            flush=True,
        )
        return await run_replay(
            ReplayConfig(
                target=stack.gateway_address,
                slo_ttft_s=slo.ttft_s,
                slo_tbt_s=slo.tbt_s,
                drain_timeout_s=120.0,
            ),
            tasks,
            request_rate=DEMO_LIVE_RATE,
            train_rate=DEMO_LIVE_TRAIN_RATE,
            duration_s=workload.duration_s,
            seed=0,
            label="lemix (live stack)",
        )


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
