"""The `lemix` command: sim, compare, demo, report (lemix/cli/report.py), and the
service-stack commands (up, replay, profile, audit).

All mapping from flags to the typed configs happens in `configs_from_args`;
every command then works on those configs only. A ValueError (bad flag value,
unknown policy, unreadable file) prints "error: ..." and exits 2, no traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lemix import __version__
from lemix.batching import BatchingConfig
from lemix.cli.engine_args import add_engine_args, engine_knobs
from lemix.cli.workload_args import (
    DEMO_DURATION_S,
    WORKLOAD_HELP,
    WORKLOADS,
    add_segment_args,
    workload_config,
)
from lemix.infra.rpc.errors import ServiceError
from lemix.planner.configure import TRAINING_NODES_HELP
from lemix.planner.registry import POLICIES
from lemix.profile import Profile, default_profile_path, load_profile
from lemix.report.compare import (
    SweepConfig,
    run_sweep,
    workload_fingerprint,
    write_json,
    write_report,
)
from lemix.report.metrics import LATENCY_TABLE_ROWS, OUTCOME_TABLE_ROWS, format_table
from lemix.sim.run import SimRunConfig, run_simulation
from lemix.workload import WorkloadConfig, build_workload

DEMO_POLICIES = ("separate", "mix-rr", "mix-luf", "lemix-paper", "lemix")
DEMO_SEEDS = 3
DEMO_RATES = (6.0, 12.0)  # light load, and near the 4x2 A100 profile's saturation
DEMO_TRAIN_RATE = 0.5

# (dotted key, label) of the one-run table `lemix sim` prints.
SIM_TABLE_ROWS: tuple[tuple[str, str], ...] = (
    ("policy", "policy"),
    ("seed", "seed"),
    ("request_rate", "request rate (req/s)"),
    ("train_rate", "train rate"),
    *OUTCOME_TABLE_ROWS,
    ("throughput_tasks_s_paper", "throughput, prototype def. (tasks/s)"),
    *LATENCY_TABLE_ROWS,
    ("training_samples_s", "training samples/s"),
    ("serving_staleness_updates", "serving staleness (updates)"),
    ("utilization", "utilization"),
    ("slo_ttft_s", "SLO TTFT (s)"),
    ("slo_tbt_s", "SLO TBT (s)"),
    ("decision_latency_us.p50", "decision p50 (us)"),
    ("decision_latency_us.p99", "decision p99 (us)"),
)


@dataclass(frozen=True)
class CliSetup:
    """The typed configs one command runs with (built only by `configs_from_args`)."""

    profile: Profile
    workload: WorkloadConfig  # compare: the base; rate, train rate and seed are swept
    run: SimRunConfig  # compare: the template; policy, train rate and seed are swept
    sweep: SweepConfig | None = None
    num_workers: int | None = None


# ------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lemix", description="LeMix: co-located LLM serving and continuous retraining."
    )
    parser.add_argument("--version", action="version", version=f"lemix {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sim = sub.add_parser("sim", help="simulate one policy on one workload (virtual time)")
    sim.add_argument("--policy", required=True, help=f"one of: {', '.join(POLICIES)}")
    _add_cluster_args(sim)
    _add_workload_args(sim)
    sim.add_argument(
        "--poisson",
        type=float,
        metavar="RATE",
        help="Poisson arrivals at RATE req/s (with --trace: time-scale it to RATE)",
    )
    sim.add_argument(
        "--train-rate",
        type=float,
        default=0.3,
        help="fraction of tasks that are training (default 0.3)",
    )
    sim.add_argument(
        "--duration",
        type=float,
        help="arrival window in s (default 60; with --trace the whole trace)",
    )
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--json", metavar="OUT", help="write the metrics JSON (a list of one run)")

    cmp = sub.add_parser("compare", help="many sims on identical workloads, with 95%% CIs")
    cmp.add_argument("--policies", default=",".join(DEMO_POLICIES))
    cmp.add_argument("--seeds", type=int, default=3, help="repetitions, seeds SEED..SEED+K-1")
    cmp.add_argument("--seed", type=int, default=0, help="the first seed (default 0)")
    cmp.add_argument("--rates", default="4,8,16,24,32", help="request rates, req/s")
    cmp.add_argument("--train-rates", default="0.1,0.3,0.5,0.7,0.9")
    cmp.add_argument(
        "--fixed-rate",
        type=float,
        help="request rate of the train-rate sweep (default: middle of --rates)",
    )
    cmp.add_argument(
        "--fixed-train-rate",
        type=float,
        help="train rate of the request-rate sweep (default: middle of --train-rates)",
    )
    cmp.add_argument("--grid", action="store_true", help="run every rate × train-rate pair")
    cmp.add_argument(
        "--duration", type=float, help="arrival window in s (default 60; --trace: whole trace)"
    )
    _add_cluster_args(cmp)
    _add_workload_args(cmp)
    cmp.add_argument("--workers", type=int, help="worker processes (default min(2, CPUs))")
    cmp.add_argument("--out", required=True, metavar="DIR")

    demo = sub.add_parser(
        "demo",
        help="the main job: a real torch model (LeMix vs SEPARATE), the live emulated "
        "stack, then every baseline vs LeMix in the simulator",
    )
    demo.add_argument("--out", default="runs/demo", metavar="DIR")
    demo.add_argument("--workers", type=int, help="worker processes (default min(2, CPUs))")

    from lemix.cli.report import add_report_parser
    from lemix.cli.services import add_parsers
    from lemix.harness.audit import add_audit_parser

    add_report_parser(sub)
    add_parsers(sub)
    add_audit_parser(sub)
    return parser


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument(
        "--sync-every",
        type=int,
        default=SimRunConfig().sync_every_tasks,
        metavar="K",
        help="SEPARATE: copy the trained weights to the serving nodes every K training tasks",
    )
    p.add_argument(
        "--replica-sync-every",
        type=int,
        default=0,
        metavar="M",
        help="average the training nodes' replicas every M training tasks (0 = off)",
    )
    p.add_argument(
        "--slo-headroom",
        type=float,
        default=SimRunConfig().slo_headroom,
        metavar="H",
        help="lemix*, mix-*-capped: defer training once the next request's predicted "
        "TTFT or TBT passes H x its SLO (default %(default)s)",
    )
    p.add_argument(
        "--training-nodes",
        default=SimRunConfig().training_nodes,
        metavar="all|auto|N",
        help=TRAINING_NODES_HELP,
    )
    p.add_argument(
        "--admission",
        choices=("node", "cluster"),
        default="node",
        help="lemix*, mix-*-capped: defer training when the next request would miss its SLO "
        "on the training's node (node, default) or on every node (cluster)",
    )
    p.add_argument("--stages", type=int, help="stages per node (must match the profile)")
    p.add_argument("--profile", metavar="FILE", help="profile JSON (default: shipped A100 one)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=BatchingConfig().max_batch_size,
        help="C, the running-batch cap",
    )
    p.add_argument(
        "--join-window",
        type=float,
        metavar="S",
        help="T_w, Algorithm 3's join window (default: join at any iteration)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="do not measure decision latency (the only wall-clock field)",
    )
    add_engine_args(p)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", metavar="FILE", help="Azure-format CSV to replay")
    p.add_argument(
        "--lengths-from",
        metavar="FILE",
        help="resample lengths from this Azure CSV (with Poisson arrivals)",
    )
    p.add_argument("--train-data", metavar="FILE", help="hh-rlhf JSON lines: training lengths")
    add_segment_args(p)
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="conversation",
        help=WORKLOAD_HELP,
    )


# ------------------------------------------------------------------ configs


def configs_from_args(args: argparse.Namespace) -> CliSetup:
    """The simulator commands' flags as typed configs (ValueError on bad values)."""
    if args.command == "demo":
        sweep = SweepConfig(
            DEMO_POLICIES,
            DEMO_RATES,
            (DEMO_TRAIN_RATE,),
            tuple(range(DEMO_SEEDS)),
            fixed_train_rate=DEMO_TRAIN_RATE,
        )
        workload = WorkloadConfig(request_rate=DEMO_RATES[0], duration_s=DEMO_DURATION_S)
        return CliSetup(
            load_profile(default_profile_path()), workload, SimRunConfig(), sweep, args.workers
        )
    profile = _resolve_profile(args.profile, args.stages)
    batching = BatchingConfig(args.batch_size, args.join_window)
    knobs = engine_knobs(args)
    if args.command == "sim":
        workload = workload_config(args, args.poisson, args.train_rate, args.seed)
        run = SimRunConfig(
            policy=args.policy,
            num_nodes=args.nodes,
            seed=args.seed,
            batching=batching,
            train_rate=args.train_rate,
            sync_every_tasks=args.sync_every,
            replica_sync_every_tasks=args.replica_sync_every or None,
            slo_headroom=args.slo_headroom,
            training_nodes=args.training_nodes,
            is_admission_cluster_wide=args.admission == "cluster",
            measure_decision_latency=not args.deterministic,
            **knobs,
        )
        return CliSetup(profile, workload, run)
    sweep = _sweep_config(args)
    rate = None if args.trace else sweep.request_rates[0]
    workload = workload_config(args, rate, sweep.train_rates[0], sweep.seeds[0])
    run = SimRunConfig(
        num_nodes=args.nodes,
        batching=batching,
        sync_every_tasks=args.sync_every,
        replica_sync_every_tasks=args.replica_sync_every or None,
        slo_headroom=args.slo_headroom,
        training_nodes=args.training_nodes,
        is_admission_cluster_wide=args.admission == "cluster",
        measure_decision_latency=not args.deterministic,
        **knobs,
    )
    return CliSetup(profile, workload, run, sweep, args.workers)


def _sweep_config(args: argparse.Namespace) -> SweepConfig:
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    return SweepConfig(
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
        request_rates=_floats("--rates", args.rates),
        train_rates=_floats("--train-rates", args.train_rates),
        seeds=tuple(range(args.seed, args.seed + args.seeds)),
        fixed_request_rate=args.fixed_rate,
        fixed_train_rate=args.fixed_train_rate,
        is_grid=args.grid,
    )


def _floats(flag: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} needs comma-separated numbers, got {text!r}") from None


def _resolve_profile(path: str | None, num_stages: int | None) -> Profile:
    if path is None and num_stages is not None:
        candidate = default_profile_path().with_name(f"a100-llama2-7b-{num_stages}stage.json")
        if not candidate.exists():
            raise ValueError(f"no shipped profile with {num_stages} stages; pass --profile FILE")
        path = str(candidate)
    profile = load_profile(path or default_profile_path())
    if num_stages is not None and profile.num_stages != num_stages:
        raise ValueError(
            f"--stages {num_stages} but profile {profile.name!r} has {profile.num_stages} stages"
        )
    return profile


# ------------------------------------------------------------------ commands


def cmd_sim(setup: CliSetup, json_path: str | None) -> int:
    workload = build_workload(setup.workload)
    metrics, _ = run_simulation(
        setup.run,
        setup.profile,
        workload.tasks,
        request_rate=setup.workload.request_rate,
        duration_s=workload.duration_s,
    )
    metrics["workload_sha256"] = workload_fingerprint(workload.tasks)
    rows = [{"metric": label, "value": _lookup(metrics, key)} for key, label in SIM_TABLE_ROWS]
    print(format_table(rows, [("metric", "metric"), ("value", "value")]))
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, [metrics])
        print(f"metrics JSON: {path}")
    return 0


def cmd_compare(setup: CliSetup, out_dir: str, *, is_demo: bool = False) -> int:
    assert setup.sweep is not None  # configs_from_args sets it for compare and demo
    live_runs: list[dict[str, Any]] = []
    if is_demo:
        from lemix.cli.replay import run_live_demo
        from lemix.cli.torch_demo import TorchDemoConfig, run_demo, side_by_side

        print(
            "== 1/3: a real model (torch, tiny Llama, 2 nodes x 2 stages on the CPU): "
            "co-located LeMix vs SEPARATE, live =="
        )
        torch_runs, png = run_demo(TorchDemoConfig(duration_s=45.0), Path(out_dir))
        print(side_by_side(torch_runs))
        print(f"plot:    {png}")
        live_runs.extend(torch_runs)
        print("\n== 2/3: the stack at paper scale (emulated A100 timing, every service live) ==")
        live_runs.append(run_live_demo(Path(out_dir)))
        print("\n== 3/3: LeMix vs the baselines, simulated on identical workloads ==")
    start = time.perf_counter()
    runs = run_sweep(
        setup.sweep, setup.workload, setup.run, setup.profile, num_workers=setup.num_workers
    )
    elapsed_s = time.perf_counter() - start
    report = write_report(out_dir, runs, setup.sweep)
    print(report.table)
    print(f"\n{len(runs)} runs in {elapsed_s:.1f} s; one SLO per workload, shared by all policies")
    print(f"runs:    {report.runs_path}\nsummary: {report.summary_path}")
    for path in report.plot_paths:
        print(f"plot:    {path}")
    if is_demo:
        metrics_path = write_json(Path(out_dir) / "metrics.json", live_runs + runs)
        print(f"metrics: {metrics_path}")
    return 0


def _lookup(row: dict[str, Any], key: str) -> Any:
    value: Any = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 usage or input error)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command in ("up", "replay", "profile"):
            from lemix.cli.services import COMMANDS

            return COMMANDS[args.command](args)
        if args.command == "audit":
            from lemix.harness.audit import cmd_audit

            return cmd_audit(args)
        if args.command == "report":
            from lemix.cli.report import cmd_report

            return cmd_report(args, list(sys.argv[1:] if argv is None else argv))
        setup = configs_from_args(args)
        if args.command == "sim":
            return cmd_sim(setup, args.json)
        return cmd_compare(setup, args.out, is_demo=args.command == "demo")
    except (ValueError, OSError, ServiceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
