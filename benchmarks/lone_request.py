"""Where a lone request's live TTFT goes: per-hop timestamps against the simulator.

Starts the live stack as `benchmarks/sim_vs_live.py` does (the shipped A100
profile, 4 emulated nodes, its SLO, time scale 1), then sends one request at a
time (`--num` of them, `--gap-s` apart, nothing else running) and compares each
one's TTFT, measured at the client from send to the first streamed message, with
the simulator's for the same task. The first request runs on a fresh stack and
channel (what sim_vs_live's warm-up request measures); the others are warm.

With `--trace` the stack's processes load `benchmarks/hop_trace` (a
`sitecustomize` that stamps a few functions on the request path, in epoch s:
one host, one clock) and each request's TTFT is split into hops:

  gw_in      client send -> the gateway's Generate begins (`_require_live_stack`)
  gw_submit  -> the gateway writes the task to the intake (with its lease and wake)
  intake     -> the intake loop handles the entry (the XADD, XREADGROUP wake)
  plan       -> the scheduler sends Dispatch (accept_intake, planner)
  dispatch   -> the executor takes the task (Dispatch, or one of a DispatchMany)
  admit      -> the engine is given the task (`NodeDriver.add_task`)
  stage wait -> the first stage starts
  stages     -> the last prefill stage ends (sum of stage work and hand-offs)
  sink       -> the sink's write of the first token returns (Redis script)
  gw_read    -> the gateway's reader delivers it (XREAD wake)
  gw_out     -> the client gets the first message (gRPC stream)

    PYTHONPATH=$PWD .venv/bin/python benchmarks/lone_request.py --trace --num 10
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from lemix._proto.lemix.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from lemix.cli.engine_args import add_engine_args, engine_knobs
from lemix.infra.engine_options import EngineKnobs
from lemix.infra.rpc.client import channel
from lemix.profile import default_profile_path, load_profile
from lemix.sim.run import SimRunConfig, run_simulation
from lemix.slo import SloConfig, compute_slo
from lemix.stack.launcher import Stack, StackConfig
from lemix.types import Task, TaskKind

REPO = Path(__file__).resolve().parent.parent
TRACE_DIR = Path(__file__).resolve().parent / "hop_trace"
HOPS = (
    "gw_in",
    "gw_submit",
    "intake",
    "plan",
    "dispatch",
    "admit",
    "stage_wait",
    "stages",
    "sink",
    "gw_read",
    "gw_out",
)


async def send_one(stub: gateway_pb2_grpc.GatewayStub, task: Task) -> dict[str, Any]:
    request = gateway_pb2.GenerateRequest(
        request_id=task.task_id,
        prompt_token_ids=[100] * task.num_prompt_tokens,
        max_tokens=task.max_output_tokens,
        sampling=common_pb2.SamplingParams(ignore_eos=True),
    )
    rec: dict[str, Any] = {"task_id": task.task_id, "send_t": time.time()}
    async for message in stub.Generate(request, timeout=60.0):
        if "first_t" not in rec:
            rec["first_t"] = time.time()
        if message.is_finished:
            rec["end_t"] = time.time()
    return rec


def read_trace(trace_dir: Path) -> list[tuple[float, str, str]]:
    lines = []
    for path in trace_dir.glob("*.log"):
        for line in path.read_text().splitlines():
            parts = line.split(" ", 3)
            lines.append((float(parts[0]), parts[2], parts[3] if len(parts) > 3 else ""))
    return sorted(lines)


def hops_of(rec: dict[str, Any], trace: list[tuple[float, str, str]]) -> dict[str, float] | None:
    """Hop durations in ms for one request, from its trace lines (None: incomplete)."""
    tid = rec["task_id"]
    mine = [(t, label, detail) for t, label, detail in trace if rec["send_t"] <= t <= rec["end_t"]]

    def first(label: str, pred: Any = None) -> float | None:
        for t, lab, detail in mine:
            if lab == label and (pred(detail) if pred else tid in detail):
                return t
        return None

    stages = [(t, lab, d) for t, lab, d in mine if lab.startswith("NodeDriver._run_stage")]
    first_write = first("RedisOutcomeSink.write<", lambda d: f"FirstToken:{tid}" in d)
    stage_ends = [
        t for t, lab, _ in stages if lab.endswith("<") and first_write and t <= first_write
    ]
    points = [
        rec["send_t"],
        first("GatewayCore._require_live_stack>", lambda d: True),
        first("GatewayCore._submit>"),
        first("SchedulerService._handle_intake>"),
        first("Placing._dispatch>"),
        first("ExecutorServicer._dispatch>"),
        first("NodeDriver.add_task"),
        next((t for t, lab, _ in stages if lab.endswith(">")), None),
        max(stage_ends) if stage_ends else None,
        first_write,
        first("Follower.deliver"),
        rec["first_t"],
    ]
    if any(p is None for p in points):
        return None
    return {h: 1e3 * (b - a) for h, a, b in zip(HOPS, points[:-1], points[1:], strict=True)}


async def run_live(
    args: argparse.Namespace, tasks: list[Task], extra_env: dict[str, str]
) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="lemix-lone-") as tmp:
        config = StackConfig(
            num_nodes=args.nodes,
            profile_path=Path(args.profile),
            policy=args.policy,
            gateway_port=0,
            namespace="lone",
            time_scale=1.0,
            latency_noise_cv=args.noise_cv,
            engine=args.engine,
            redis_fsync=args.redis_fsync,
            log_dir=Path(tmp) / "logs",
            extra_env=extra_env,
        )
        records = []
        async with Stack(config) as stack, channel(stack.gateway_address) as chan:
            stub = gateway_pb2_grpc.GatewayStub(chan)
            for task in tasks:
                records.append(await send_one(stub, task))
                await asyncio.sleep(args.gap_s)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num", type=int, default=10, help="requests, one at a time")
    parser.add_argument("--gap-s", type=float, default=0.3, help="idle time between them")
    parser.add_argument("--prompt", type=int, default=1000, help="prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--policy", default="lemix")
    parser.add_argument("--noise-cv", type=float, default=0.0)
    parser.add_argument("--profile", default=str(default_profile_path()))
    parser.add_argument("--redis-fsync", default="always", choices=("always", "everysec"))
    parser.add_argument("--trace", action="store_true", help="split TTFT into hops")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--trace-out", metavar="PATH", help="write the raw trace lines here")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    tasks = [
        Task(f"lone{i}", TaskKind.INFERENCE, 0.0, args.prompt, args.max_tokens)
        for i in range(args.num)
    ]
    slo = compute_slo(profile, tasks, SloConfig())
    sim_config = SimRunConfig(
        policy=args.policy,
        num_nodes=args.nodes,
        latency_noise_cv=0.0,
        **engine_knobs(args),
    )
    engine = sim_config.engine_config(slo, profile)
    args.engine = EngineKnobs.of_engine(engine)
    _, result = run_simulation(
        sim_config, profile, tasks[:1], request_rate=1.0, duration_s=1.0, slo=slo
    )
    sim = result.records[0]
    sim_ttft_ms = 1e3 * ((sim.first_token_s or 0.0) - sim.arrival_s)
    extra_env = {"LEMIX_SLO_TTFT_S": repr(slo.ttft_s), "LEMIX_SLO_TBT_S": repr(slo.tbt_s)}
    with tempfile.TemporaryDirectory(prefix="lemix-hops-") as trace_dir:
        if args.trace:
            path = os.pathsep.join(
                [str(TRACE_DIR), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
            )
            extra_env |= {"PYTHONPATH": path, "LEMIX_HOP_TRACE_DIR": trace_dir}
        records = asyncio.run(run_live(args, tasks, extra_env))
        trace = read_trace(Path(trace_dir)) if args.trace else []
    if args.trace_out:
        Path(args.trace_out).write_text("".join(f"{t:.6f} {lab} {d}\n" for t, lab, d in trace))
    print(f"engine {args.engine}; sim TTFT {sim_ttft_ms:.2f} ms ({args.prompt} prompt tokens)")
    rows = []
    for i, rec in enumerate(records):
        ttft_ms = 1e3 * (rec["first_t"] - rec["send_t"])
        hops = hops_of(rec, trace) if trace else None
        rows.append({"i": i, "ttft_ms": ttft_ms, "gap_ms": ttft_ms - sim_ttft_ms, "hops_ms": hops})
        hop_text = " ".join(f"{h}={v:.1f}" for h, v in hops.items()) if hops else ""
        print(f"#{i} TTFT {ttft_ms:7.2f} ms  live-sim {ttft_ms - sim_ttft_ms:+6.2f}  {hop_text}")
    warm = rows[1:]
    if warm:
        gaps = [r["gap_ms"] for r in warm]
        print(
            f"warm requests: live-sim TTFT p50 {np.median(gaps):+.2f} ms, "
            f"min {min(gaps):+.2f}, max {max(gaps):+.2f}; cold (first) {rows[0]['gap_ms']:+.2f}"
        )
        with_hops = [r["hops_ms"] for r in warm if r["hops_ms"]]
        if with_hops:
            print(
                "warm hop medians (ms): "
                + " ".join(f"{h}={np.median([x[h] for x in with_hops]):.2f}" for h in HOPS)
            )
    if args.json:
        out = {"sim_ttft_ms": sim_ttft_ms, "engine": dataclasses.asdict(args.engine), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
