"""Simulator vs live stack on one task list, at paper scale.

4 nodes x 2 stages, the shipped A100 profile, the Azure conversation trace
time-scaled to --rate for --window-s, training at --train-rate. The same tasks
go to `run_simulation` and, in real time (time scale 1.0, same latency noise
CV, same policy, the same SLO from `compute_slo` passed to the scheduler), to a
live `Stack` through `run_replay`. Without the trace file it says so and uses
the parametric Poisson workload instead.

Reports both runs' headline metrics side by side with the gaps (percentage
points for SLO attainment, % for the rest), then where they differ: per-request
live-minus-sim TTFT / TBT / E2E over the inference tasks both completed, and
the CPU the stack used (a saturated host stretches live timers and decodes).

    .venv/bin/python benchmarks/sim_vs_live.py --json runs/bench/sim_vs_live.json

The simulator models the control plane as a fixed delay per request
(`--sim-control-plane`, default auto: what the stack adds to a lone request's
TTFT, measured on the warm-up request before the replay; half of it before the
planner sees a task, half between the engine and the client); the line above
the table gives the simulator's SLO attainment without it.

Target: SLO attainment within 5 pp, throughput within 5 %.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import lemix.harness.replay
from lemix.cli.engine_args import add_engine_args, engine_knobs
from lemix.harness.replay import ReplayConfig, run_replay
from lemix.infra.engine_options import EngineKnobs
from lemix.profile import Profile, default_profile_path, load_profile
from lemix.report.metrics import format_table
from lemix.sim.run import SimRunConfig, run_simulation
from lemix.slo import Slo, SloConfig, compute_slo
from lemix.stack.launcher import Stack, StackConfig
from lemix.types import Task, TaskKind, TaskRecord, TaskStatus
from lemix.workload import Workload, WorkloadConfig, build_workload

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "azure_llm_conv_2023.csv"
TARGET_PP = 5.0
TARGET_PCT = 5.0
# (metrics key, header, gap kind): "pp" = percentage points of a fraction, "%" = relative.
ROWS = (
    ("slo_attainment", "SLO attainment", "pp"),
    ("goodput_rps", "goodput req/s", "%"),
    ("throughput_tasks_s", "throughput tasks/s", "%"),
    ("throughput_tokens_s", "throughput tokens/s", "%"),
    ("ttft_s.p50", "TTFT p50 s", "%"),
    ("ttft_s.p99", "TTFT p99 s", "%"),
    ("tbt_s.p50", "TBT p50 s", "%"),
    ("tbt_s.mean", "TBT mean s", "%"),
    ("tbt_s.p90", "TBT p90 s", "%"),
    ("e2e_s.p50", "E2E p50 s", "%"),
    ("num_completed_inference", "completed inference", "%"),
    ("num_completed_training", "completed training", "%"),
    ("num_rejected", "rejected", "%"),
    ("num_failed", "failed", "%"),
    ("makespan_s", "makespan s", "%"),
)


def make_workload(args: argparse.Namespace) -> tuple[Workload, str]:
    trace = Path(args.trace)
    if trace.exists():
        config = WorkloadConfig(
            source="trace",
            trace_path=str(trace),
            request_rate=args.rate,
            train_rate=args.train_rate,
            duration_s=args.window_s,
            seed=args.seed,
        )
        return build_workload(config), f"azure trace {trace}, time-scaled"
    print(f"trace file {trace} is absent: using the parametric Poisson workload instead")
    config = WorkloadConfig(
        request_rate=args.rate, train_rate=args.train_rate, duration_s=args.window_s, seed=args.seed
    )
    return build_workload(config), "parametric poisson (trace absent)"


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ALONE = Task("alone-0", TaskKind.INFERENCE, 0.0, 1000, 200)  # one request on an idle cluster


async def run_live(
    args: argparse.Namespace, tasks: list[Task], wl: Workload, slo: Slo
) -> tuple[dict[str, Any], list[TaskRecord], TaskRecord, dict[str, float]]:
    """The live run; also replays ALONE first (a warm-up that isolates per-step overhead)."""
    captured: list[list[TaskRecord]] = []
    summarize = lemix.harness.replay.summarize

    def keep_records(records: list[TaskRecord], **kw: Any) -> dict[str, Any]:
        captured.append(list(records))  # run_replay returns only the summary; keep records
        return summarize(records, **kw)

    with tempfile.TemporaryDirectory(prefix="lemix-svl-") as tmp:
        config = StackConfig(
            num_nodes=args.nodes,
            profile_path=Path(args.profile),
            policy=args.policy,
            gateway_port=0,
            namespace="simlive",
            time_scale=1.0,
            latency_noise_cv=args.noise_cv,
            train_rate=args.train_rate,
            engine=args.engine,
            redis_fsync=args.redis_fsync,
            log_dir=Path(tmp) / "logs",
            extra_env={
                "LEMIX_SLO_TTFT_S": repr(slo.ttft_s),
                "LEMIX_SLO_TBT_S": repr(slo.tbt_s),
                "LEMIX_SEED": str(args.seed),
            },
        )
        lemix.harness.replay.summarize = keep_records  # type: ignore[assignment]
        try:
            async with Stack(config) as stack:
                replay = ReplayConfig(
                    target=stack.gateway_address,
                    slo_ttft_s=slo.ttft_s,
                    slo_tbt_s=slo.tbt_s,
                    drain_timeout_s=args.drain_timeout_s,
                    show_progress=False,
                )
                await run_replay(
                    replay,
                    [ALONE],
                    request_rate=1.0,
                    train_rate=0.0,
                    duration_s=1.0,
                    seed=args.seed,
                )
                pids = {c.name: c.process.pid for c in stack.children}
                if stack.redis is not None and stack.redis.pid is not None:
                    pids["redis"] = stack.redis.pid
                pids["client"] = os.getpid()
                cpu0 = {n: _cpu_s(p) for n, p in pids.items()}
                wall0 = time.perf_counter()
                metrics = await run_replay(
                    replay,
                    tasks,
                    request_rate=args.rate,
                    train_rate=args.train_rate,
                    duration_s=wl.duration_s,
                    seed=args.seed,
                )
                wall_s = time.perf_counter() - wall0
                cores = {n: (_cpu_s(p) - cpu0[n]) / wall_s for n, p in pids.items()}
                if stack.failed_child():
                    print(f"warning: {stack.failed_child()} exited during the run")
        finally:
            lemix.harness.replay.summarize = summarize  # type: ignore[assignment]
    return metrics, captured[1], captured[0][0], cores


async def sleep_overshoot(duration_s: float, num: int = 200) -> dict[str, float]:
    """How late asyncio.sleep(duration_s) wakes on this host, in ms (the emulated
    executor sleeps once per stage per iteration)."""
    late = []
    for _ in range(num):
        start = time.perf_counter()
        await asyncio.sleep(duration_s)
        late.append(time.perf_counter() - start - duration_s)
    p50, p99 = np.percentile(late, [50, 99])
    return {
        "sleep_ms": 1e3 * duration_s,
        "mean_ms": 1e3 * float(np.mean(late)),
        "p50_ms": 1e3 * float(p50),
        "p99_ms": 1e3 * float(p99),
    }


def _get(metrics: dict[str, Any], key: str) -> float | None:
    value: Any = metrics
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _timings(r: TaskRecord) -> dict[str, float] | None:
    if r.first_token_s is None or r.finish_s is None or r.num_output_tokens < 2:
        return None
    return {
        "ttft_ms": 1e3 * (r.first_token_s - r.arrival_s),
        "tbt_ms": 1e3 * (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1),
    }


def compare(sim: dict[str, Any], live: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, header, kind in ROWS:
        s, v = _get(sim, key), _get(live, key)
        gap = None
        if s is not None and v is not None:
            gap = 100.0 * (v - s) if kind == "pp" else (100.0 * (v - s) / s if s else None)
        rows.append(
            {
                "metric": header,
                "sim": s,
                "live": v,
                "gap": gap,
                "unit": "pp" if kind == "pp" else "%",
            }
        )
    return rows


def per_request(
    sim_records: list[TaskRecord], live_records: list[TaskRecord], slo: Slo
) -> dict[str, Any]:
    """Live minus sim, per inference task completed in both (the same task:
    a live id is the replay's run id, a dash, then the workload's id)."""
    sim_by_id = {
        r.task_id: r
        for r in sim_records
        if r.kind is TaskKind.INFERENCE and r.status is TaskStatus.COMPLETED
    }
    pairs = [
        (sim_by_id[workload_id], r)
        for r in live_records
        if r.kind is TaskKind.INFERENCE
        and r.status is TaskStatus.COMPLETED
        and (workload_id := r.task_id.partition("-")[2]) in sim_by_id
    ]

    def stats(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"p10": None, "p50": None, "p90": None, "mean": None}
        p10, p50, p90 = np.percentile(values, [10, 50, 90])
        return {
            "p10": float(p10),
            "p50": float(p50),
            "p90": float(p90),
            "mean": float(np.mean(values)),
        }

    def ttft(r: TaskRecord) -> float:
        return (r.first_token_s or 0.0) - r.arrival_s

    def tbt(r: TaskRecord) -> float | None:
        if r.num_output_tokens < 2 or r.first_token_s is None or r.finish_s is None:
            return None
        return (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)

    d_tbt = [tl - ts for s, v in pairs if (ts := tbt(s)) is not None and (tl := tbt(v)) is not None]

    def per_node(records: list[TaskRecord]) -> list[int]:
        nodes = [
            r.node_id
            for r in records
            if r.kind is TaskKind.INFERENCE
            and r.status is TaskStatus.COMPLETED
            and r.node_id is not None
        ]
        return [nodes.count(i) for i in range(max(nodes, default=-1) + 1)]

    return {
        "num_pairs": len(pairs),
        "inference_per_node": {"sim": per_node(sim_records), "live": per_node(live_records)},
        "same_node_share": (
            sum(s.node_id == v.node_id for s, v in pairs) / len(pairs) if pairs else None
        ),
        "ttft_diff_s": stats([ttft(v) - ttft(s) for s, v in pairs]),
        "tbt_diff_s": stats(d_tbt),
        "tbt_ratio": stats([tl / ts for s, v in pairs if (ts := tbt(s)) and (tl := tbt(v))]),
        "e2e_diff_s": stats([(v.finish_s or 0.0) - (s.finish_s or 0.0) for s, v in pairs]),
        "ttft_miss_live_only": sum(ttft(s) <= slo.ttft_s < ttft(v) for s, v in pairs),
        "ttft_miss_sim_only": sum(ttft(v) <= slo.ttft_s < ttft(s) for s, v in pairs),
        "tbt_miss_live_only": sum((tbt(s) or 0) <= slo.tbt_s < (tbt(v) or 0) for s, v in pairs),
        "tbt_miss_sim_only": sum((tbt(v) or 0) <= slo.tbt_s < (tbt(s) or 0) for s, v in pairs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--rate", type=float, default=5.5, help="inference req/s")
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--train-rate", type=float, default=0.1)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--policy", default="lemix")
    parser.add_argument("--noise-cv", type=float, default=0.05)
    parser.add_argument("--profile", default=str(default_profile_path()))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drain-timeout-s", type=float, default=120.0)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--redis-fsync",
        default="always",
        choices=("always", "everysec"),
        help="the embedded Redis's appendfsync (always: `lemix up`'s default)",
    )
    parser.add_argument(
        "--sim-control-plane",
        default="auto",
        metavar="auto|off|SECONDS",
        help="the control plane's delay in the simulator (`SimRunConfig.intake_delay_s` + "
        "`output_delay_s`, split evenly): auto = what it adds to a lone request's TTFT live "
        "(the warm-up request, live minus simulated TTFT); off = not modelled",
    )
    add_engine_args(parser)  # the same engine v2 flags as `lemix sim`, given to both runs
    args = parser.parse_args(argv)
    profile: Profile = load_profile(args.profile)
    wl, source = make_workload(args)
    tasks = list(wl.tasks)
    slo = compute_slo(profile, tasks, SloConfig())
    print(
        f"workload: {source}: {wl.num_inference} inference + {wl.num_training} training "
        f"over {wl.duration_s:.0f} s; {args.nodes} nodes x {profile.num_stages} stages; "
        f"SLO TTFT {slo.ttft_s:.3f} s, TBT {slo.tbt_s * 1e3:.1f} ms"
    )
    sim_config = SimRunConfig(
        policy=args.policy,
        num_nodes=args.nodes,
        seed=args.seed,
        latency_noise_cv=args.noise_cv,
        train_rate=args.train_rate,
        **engine_knobs(args),
    )
    engine = sim_config.engine_config(slo, profile)  # resolved (an auto slice needs the SLO)
    args.engine = EngineKnobs.of_engine(engine)
    print(f"engine: {args.engine}")
    live, live_records, live_alone, cores = asyncio.run(run_live(args, tasks, wl, slo))
    _, alone_result = run_simulation(
        sim_config, profile, [ALONE], request_rate=1.0, duration_s=1.0, slo=slo
    )
    alone = {"sim": _timings(alone_result.records[0]), "live": _timings(live_alone)}
    control_plane_s = _control_plane_s(args.sim_control_plane, alone)
    plain, _ = run_simulation(
        sim_config, profile, tasks, request_rate=args.rate, duration_s=wl.duration_s, slo=slo
    )
    sim_config = dataclasses.replace(
        sim_config, intake_delay_s=control_plane_s / 2, output_delay_s=control_plane_s / 2
    )
    sim, sim_result = run_simulation(
        sim_config, profile, tasks, request_rate=args.rate, duration_s=wl.duration_s, slo=slo
    )
    print(
        f"control plane in the simulator: {1e3 * control_plane_s:.1f} ms per request "
        f"({args.sim_control_plane}); without it the simulator's SLO attainment is "
        f"{plain['slo_attainment']:.3f}"
    )
    step_s = profile.ours.decode_step_s(
        0,
        1,
        int(
            np.median(
                [t.num_prompt_tokens + t.max_output_tokens // 2 for t in tasks if not t.is_training]
            )
        ),
    )
    overshoot = asyncio.run(sleep_overshoot(step_s))
    rows = compare(sim, live)
    print(
        format_table(
            rows,
            [
                ("metric", "metric"),
                ("sim", "sim"),
                ("live", "live"),
                ("gap", "live-sim"),
                ("unit", ""),
            ],
        )
    )
    gaps = {r["metric"]: r["gap"] for r in rows}
    slo_gap, thr_gap = gaps["SLO attainment"], gaps["throughput tasks/s"]
    is_met = (
        slo_gap is not None
        and abs(slo_gap) <= TARGET_PP
        and thr_gap is not None
        and abs(thr_gap) <= TARGET_PCT
    )
    print(
        f"target (|SLO gap| <= {TARGET_PP:g} pp, |throughput gap| <= {TARGET_PCT:g} %): "
        f"{'met' if is_met else 'NOT met'}"
    )
    detail = per_request(sim_result.records, live_records, slo)
    print(
        f"\nper request, live - sim, over {detail['num_pairs']} inference tasks completed "
        f"in both (same node in {100 * (detail['same_node_share'] or 0):.0f} %):"
    )
    print(
        format_table(
            [
                {"what": k, **detail[k]}
                for k in ("ttft_diff_s", "tbt_diff_s", "tbt_ratio", "e2e_diff_s")
            ],
            [
                ("what", "quantity"),
                ("p10", "p10"),
                ("p50", "p50"),
                ("p90", "p90"),
                ("mean", "mean"),
            ],
        )
    )
    print(
        f"completed inference per node: sim {detail['inference_per_node']['sim']}, "
        f"live {detail['inference_per_node']['live']}"
    )
    print(
        f"SLO misses only live / only sim: TTFT {detail['ttft_miss_live_only']} / "
        f"{detail['ttft_miss_sim_only']}, TBT {detail['tbt_miss_live_only']} / "
        f"{detail['tbt_miss_sim_only']}"
    )
    a_sim, a_live = alone["sim"], alone["live"]
    if a_sim is not None and a_live is not None:
        print(
            f"one request alone ({ALONE.num_prompt_tokens} prompt, {ALONE.max_output_tokens} "
            f"out): TTFT sim {a_sim['ttft_ms']:.2f} ms, live {a_live['ttft_ms']:.2f} ms "
            f"(+{a_live['ttft_ms'] - a_sim['ttft_ms']:.2f}); TBT sim {a_sim['tbt_ms']:.3f} ms,"
            f" live {a_live['tbt_ms']:.3f} ms (+{a_live['tbt_ms'] - a_sim['tbt_ms']:.3f})"
        )
    sim_tbt = sim["tbt_s"]["p50"] or 0.0
    print(
        f"asyncio.sleep({overshoot['sleep_ms']:.2f} ms) wakes late by {overshoot['mean_ms']:.2f}"
        f" ms on average (p99 {overshoot['p99_ms']:.2f}); x {profile.num_stages} stages per "
        f"decode step = +{profile.num_stages * overshoot['mean_ms']:.2f} ms per token, "
        f"{100 * profile.num_stages * overshoot['mean_ms'] / 1e3 / sim_tbt if sim_tbt else 0:.0f}"
        f" % of the sim's TBT p50 (observed per-request median: "
        f"+{1e3 * (detail['tbt_diff_s']['p50'] or 0):.2f} ms)"
    )
    print(
        f"live CPU, cores busy (of {os.cpu_count()}): "
        + ", ".join(f"{n} {c:.2f}" for n, c in sorted(cores.items()))
        + f"; total {sum(cores.values()):.2f}"
    )
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "benchmark": "sim_vs_live",
                    "python": sys.version.split()[0],
                    "machine": platform.machine(),
                    "workload": source,
                    "rate": args.rate,
                    "window_s": args.window_s,
                    "train_rate": args.train_rate,
                    "num_nodes": args.nodes,
                    "policy": args.policy,
                    "noise_cv": args.noise_cv,
                    "engine": dataclasses.asdict(args.engine),
                    "redis_fsync": args.redis_fsync,
                    "profile": profile.name,
                    "slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s},
                    "targets": {"slo_pp": TARGET_PP, "throughput_pct": TARGET_PCT},
                    "is_met": is_met,
                    "comparison": rows,
                    "per_request": detail,
                    "sleep_overshoot": overshoot,
                    "alone": alone,
                    "sim_control_plane_s": control_plane_s,
                    "sim_without_control_plane": plain,
                    "live_cores_busy": cores,
                    "sim": sim,
                    "live": live,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"JSON: {path}")
    return 0


def _control_plane_s(choice: str, alone: dict[str, Any]) -> float:
    """--sim-control-plane as seconds (auto: the lone request's live - sim TTFT)."""
    if choice == "off":
        return 0.0
    if choice != "auto":
        value = float(choice)
        if value < 0:
            raise SystemExit("--sim-control-plane must be auto, off or >= 0 seconds")
        return value
    a_sim, a_live = alone["sim"], alone["live"]
    if a_sim is None or a_live is None:
        raise SystemExit("--sim-control-plane auto: the lone request did not complete live")
    return max(a_live["ttft_ms"] - a_sim["ttft_ms"], 0.0) / 1e3


if __name__ == "__main__":
    sys.exit(main())
