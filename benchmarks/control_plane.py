"""Control-plane overhead: gateway -> scheduler -> Redis -> executor -> gateway.

A zero-latency copy of the shipped A100 profile (every latency coefficient and
optimizer step 0, memory kept) makes compute free, so a Generate of one token,
timed at the client from send to its final message, measures only the plumbing:
the gRPC hop in, the gateway's intake write, the planner, Dispatch, the executor's
Redis sink and the gateway's output reader (a few multiplexed blocking XREADs)
back out. The stack runs as real processes (`lemix.stack.launcher.Stack`) with
embedded Redis; the client is a lean open-loop Poisson loop, one channel per
gateway (`--gateways N`: requests go round robin over them; no metrics
objects per request).

Each level also reads the tasks' state hashes back from Redis and splits E2E
at the services' own epoch stamps (same host, so one clock):
  gw_in  = submit_t - client send   (client + gateway; before 12-02 also the Submit RPC)
  intake = taken - submit_t         (the intake script, the scheduler's XREADGROUP wake and
                                     its check before 12-02 late; taken: the task's "submit"
                                     input in the scheduler's event log)
  exec   = finish_t - taken         (planner, Dispatch RPC, engine, sink writes)
  gw_out = client end - finish_t    (gateway XREAD wake, stream to the client)

and counts, per request sent, the stack's CPU (`cpu_ms_per_req`: every
service and Redis, the benchmark's client apart, `cpu_ms_by_process` has
each) and the commands Redis ran (`redis_calls_per_req`: INFO commandstats,
those inside Lua scripts and MULTI/EXEC included, background loops too;
`redis_calls_by_command` has each).

    .venv/bin/python benchmarks/control_plane.py --rates 200,800 --json runs/cp.json

Targets (issue 15): at 200 req/s p50 <= 4 ms and p99 <= 15 ms; at 800 req/s
>= 95% of offered completed, 0 lost, p99 <= 60 ms; <= 15 Redis commands and
<= 3 ms CPU per request; the same with 2 gateways.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import native_split  # noqa: E402
from benchmarks.host_load import describe, host_load  # noqa: E402
from lemix._proto.lemix.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from lemix.infra.rpc.client import channel
from lemix.infra.store.client import RedisClientConfig, connect
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.server import EmbeddedRedis
from lemix.latency import DecodeCoeffs, QuadCoeffs
from lemix.profile import Profile, default_profile_path, load_profile, save_profile
from lemix.report.metrics import format_table
from lemix.stack.launcher import Stack, StackConfig

TARGET_RATE = 200.0
TARGET_P50_MS = 4.0
TARGET_P99_MS = 15.0
HIGH_RATE = 800.0
HIGH_MIN_ACHIEVED_SHARE = 0.95
HIGH_P99_MS = 60.0
TARGET_REDIS_CALLS_PER_REQ = 15.0
TARGET_CPU_MS_PER_REQ = 3.0
NAMESPACE = "cpbench"
PROMPT = [100] * 4  # a few tokens
HOPS = ("gw_in", "intake", "exec", "gw_out")


def zero_latency_profile(base: Profile) -> Profile:
    """`base` with every latency 0 and memory untouched."""
    n = base.num_stages
    ours = dataclasses.replace(
        base.ours,
        forward=tuple(QuadCoeffs(0.0, 0.0, 0.0) for _ in range(n)),
        backward=tuple(QuadCoeffs(0.0, 0.0, 0.0) for _ in range(n)),
        decode=tuple(DecodeCoeffs(0.0, 0.0, 0.0) for _ in range(n)),
    )
    paper = dataclasses.replace(base.paper, eta_forward=(0.0,) * n, eta_backward=(0.0,) * n)
    return dataclasses.replace(
        base, name=f"{base.name}-zero-latency", ours=ours, paper=paper, optimizer_step_s=(0.0,) * n
    )


async def _one(
    stub: gateway_pb2_grpc.GatewayStub, task_id: str, rec: dict[str, Any], timeout_s: float
) -> None:
    request = gateway_pb2.GenerateRequest(
        request_id=task_id,
        prompt_token_ids=PROMPT,
        max_tokens=1,
        sampling=common_pb2.SamplingParams(ignore_eos=True),
    )
    rec["send_epoch"] = time.time()
    start = time.perf_counter()
    try:
        async for message in stub.Generate(request, timeout=timeout_s):
            if message.is_finished:
                rec["status"] = "completed"
        if "status" not in rec:
            rec["status"], rec["reason"] = "failed", "stream ended without a final message"
    except grpc.aio.AioRpcError as err:
        rejected = err.code() in (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        rec["status"] = "rejected" if rejected else "failed"
        rec["reason"] = f"{err.code().name}: {(err.details() or '')[:80]}"
    rec["e2e_s"] = time.perf_counter() - start
    rec["end_epoch"] = time.time()


async def _fire(
    stubs: Sequence[gateway_pb2_grpc.GatewayStub],
    rate: float,
    duration_s: float,
    seed: int,
    prefix: str,
    timeout_s: float,
) -> tuple[list[dict[str, Any]], float]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * duration_s * 2) + 10))
    arrivals = arrivals[arrivals < duration_s]
    records: list[dict[str, Any]] = []
    jobs = []
    t0 = time.perf_counter()
    for i, at in enumerate(arrivals):
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        rec: dict[str, Any] = {"id": f"{prefix}-{i}", "lag_s": time.perf_counter() - t0 - at}
        records.append(rec)
        stub = stubs[i % len(stubs)]  # spread over the gateways, round robin
        jobs.append(asyncio.create_task(_one(stub, rec["id"], rec, timeout_s)))
    send_window_s = time.perf_counter() - t0
    _, pending = await asyncio.wait(jobs, timeout=timeout_s + 5.0)
    for job in pending:  # past its own deadline: counted as lost, not left running
        job.cancel()
    return records, send_window_s


async def _taken_epochs(client: Any, keys: RedisKeys) -> dict[str, float]:
    """Per task id, when the scheduler's core took it (epoch s): its
    ``submit`` input in the scheduler's event log, at planner time (seconds
    since the namespace's stored epoch)."""
    epoch_s = float(await client.get(keys.scheduler_epoch) or "nan")
    taken: dict[str, float] = {}
    for _, fields in await client.xrange(keys.events_stream):
        for line in fields.get("jsonl", fields.get("json", "")).splitlines():
            if '"input":"submit"' not in line:
                continue
            event = json.loads(line)
            taken.setdefault(event["task"]["task_id"], epoch_s + float(event["now_s"]))
    return taken


async def _hops(redis_url: str, records: list[dict[str, Any]]) -> dict[str, list[float]]:
    keys = RedisKeys(NAMESPACE)
    client = connect(RedisClientConfig(redis_url, max_connections=1, socket_timeout_s=30.0))
    try:
        async with client.pipeline(transaction=False) as pipe:
            for rec in records:
                pipe.hgetall(keys.task(rec["id"]))
            states = await pipe.execute()
        taken = await _taken_epochs(client, keys)
    finally:
        await client.aclose()
    hops: dict[str, list[float]] = {h: [] for h in HOPS}
    for rec, state in zip(records, states, strict=True):
        try:
            t = [
                rec["send_epoch"],
                float(state["submit_t"]),
                taken[rec["id"]],
                float(state["finish_t"]),
                rec["end_epoch"],
            ]
        except (KeyError, ValueError):
            continue
        for name, a, b in zip(HOPS, t, t[1:], strict=False):
            hops[name].append(b - a)
    return hops


async def _command_calls(redis_url: str) -> dict[str, int]:
    """Redis INFO commandstats: calls so far, per command."""
    client = connect(RedisClientConfig(redis_url, max_connections=1, socket_timeout_s=30.0))
    try:
        info = await client.info("commandstats")
    finally:
        await client.aclose()
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


def _ms(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if values else None


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pids(stack: Stack, redis: EmbeddedRedis) -> dict[str, int]:
    pids = {child.name: child.process.pid for child in stack.children}
    if redis.pid is not None:
        pids["redis"] = redis.pid
    pids["client"] = os.getpid()
    return pids


def _hotspots(raw: Path, top: int) -> dict[str, Any]:
    """Top functions of a py-spy raw (collapsed) profile: self and inclusive share."""
    own: collections.Counter[str] = collections.Counter()
    package: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")[1:]  # drop the process/thread label
        if not frames:
            continue
        n = int(count)
        total += n
        own[frames[-1]] += n
        path = frames[-1].rpartition("(")[2].rstrip(")")
        package[path.split("/")[0] if "/" in path else path] += n
        for frame in set(frames):
            incl[frame] += n
    ours = [
        (f, n)
        for f, n in incl.most_common()
        if any(d in f for d in ("services/", "gateway/", "lemix/"))
    ]
    return {
        "samples": total,
        "self_by_package": [(p, n / total) for p, n in package.most_common(top)],
        "self": [(f, n / total) for f, n in own.most_common(top)] if total else [],
        "inclusive_ours": [(f, n / total) for f, n in ours[:top]] if total else [],
    }


async def run_level(
    stubs: Sequence[gateway_pb2_grpc.GatewayStub],
    stack: Stack,
    redis: EmbeddedRedis,
    rate: float,
    seed: int,
    args: argparse.Namespace,
    spy_dir: Path | None,
) -> dict[str, Any]:
    duration_s = args.duration_s
    pids = _pids(stack, redis)
    spies = {}
    if spy_dir is not None and args.py_spy:  # sample every service while this level runs
        for name, pid in pids.items():
            if name not in ("redis", "client"):
                spies[name] = subprocess.Popen(
                    [
                        args.py_spy,
                        "record",
                        "--pid",
                        str(pid),
                        "--rate",
                        "100",
                        "--nonblocking",
                        "--nolineno",
                        "--format",
                        "raw",
                        "--duration",
                        str(round(duration_s)),
                        "--output",
                        str(spy_dir / f"{name}.txt"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
    perf = None
    if spy_dir is not None and args.perf:  # every process, Redis and the client included
        perf = native_split.start(args.perf, pids, duration_s, spy_dir / "perf.data")
    calls0 = await _command_calls(redis.url)
    cpu0 = {name: _cpu_s(pid) for name, pid in pids.items()}
    wall0 = time.perf_counter()
    records, send_window_s = await _fire(
        stubs, rate, duration_s, seed, f"r{rate:g}-s{seed}", args.timeout_s
    )
    wall_s = time.perf_counter() - wall0
    cpu = {name: _cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
    calls = {c: n - calls0.get(c, 0) for c, n in (await _command_calls(redis.url)).items()}
    for spy in spies.values():
        spy.wait(timeout=duration_s + 30)
    if perf is not None:
        native_split.wait(perf, timeout_s=duration_s + 30)
    done = [r for r in records if r.get("status") == "completed"]
    e2e = [r["e2e_s"] for r in done]
    reasons = collections.Counter(r["reason"] for r in records if "reason" in r)
    hops = await _hops(redis.url, done)
    row: dict[str, Any] = {
        "rate": rate,
        "num_sent": len(records),
        "num_completed": len(done),
        "num_rejected": sum(r.get("status") == "rejected" for r in records),
        "num_failed": sum(r.get("status") == "failed" for r in records),
        "num_lost": sum("status" not in r for r in records),
        "reasons": dict(reasons),
        "offered_rps": len(records) / max(send_window_s, 1e-9),
        # completions over first send .. last completion (a backlog stretches it)
        "achieved_rps": len(done)
        / max(
            max((r["end_epoch"] for r in done), default=0.0)
            - min((r["send_epoch"] for r in records), default=0.0),
            1e-9,
        ),
        "p50_ms": _ms(e2e, 50),
        "p90_ms": _ms(e2e, 90),
        "p99_ms": _ms(e2e, 99),
        "max_ms": max(e2e) * 1e3 if e2e else None,
        "client_lag_p99_ms": _ms([r["lag_s"] for r in records], 99),
        "hops_ms": {h: {"p50": _ms(v, 50), "p99": _ms(v, 99)} for h, v in hops.items()},
    }
    num_sent = max(len(records), 1)
    row["cpu_ms_by_process"] = {n: 1e3 * c / num_sent for n, c in cpu.items()}
    # The stack's cost: every service and Redis; the benchmark's own client apart.
    row["cpu_ms_per_req"] = sum(v for n, v in row["cpu_ms_by_process"].items() if n != "client")
    row["client_cpu_ms_per_req"] = row["cpu_ms_by_process"]["client"]
    # Redis INFO commandstats: every command Redis ran, those inside Lua
    # scripts and MULTI/EXEC included, background loops too (heartbeats...).
    row["redis_calls_by_command"] = {
        c: n / num_sent for c, n in sorted(calls.items(), key=lambda kv: -kv[1]) if n
    }
    row["redis_calls_per_req"] = sum(row["redis_calls_by_command"].values())
    row["cpu_cores_busy"] = sum(cpu.values()) / wall_s
    if spies:
        assert spy_dir is not None
        row["py_spy"] = {
            n: _hotspots(spy_dir / f"{n}.txt", args.top)
            for n in spies
            if (spy_dir / f"{n}.txt").exists()
        }
    if perf is not None:
        assert spy_dir is not None
        row["native_split_ms"] = native_split.split_ms(
            row["cpu_ms_by_process"],
            native_split.shares(args.perf, spy_dir / "perf.data", pids),
        )
    for h in HOPS:
        row[f"{h}_p50"] = row["hops_ms"][h]["p50"]
        row[f"{h}_p99"] = row["hops_ms"][h]["p99"]
    return row


async def run(args: argparse.Namespace) -> dict[str, Any]:
    zero = zero_latency_profile(load_profile(args.profile))
    redis = EmbeddedRedis().start()  # ours, so the services' URL can carry pool options
    url = redis.url
    if args.redis_url_query:  # e.g. redis-py pool size / socket timeout for every service
        url += f"?{args.redis_url_query}"
    try:
        return await _run_stack(args, zero, redis, url)
    finally:
        redis.stop()


async def _run_stack(
    args: argparse.Namespace, zero: Profile, redis: EmbeddedRedis, url: str
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lemix-cp-") as tmp:
        profile_path = Path(tmp) / "zero.json"
        save_profile(zero, profile_path)
        config = StackConfig(
            num_nodes=args.nodes,
            profile_path=profile_path,
            gateway_port=0,
            redis_url=url,
            latency_noise_cv=0.0,
            namespace=NAMESPACE,
            log_dir=Path(tmp) / "logs",
            num_gateways=args.gateways,
            # A zero-latency profile derives zero SLOs: give the planner fixed ones.
            extra_env={
                "LEMIX_SLO_TTFT_S": "1.0",
                "LEMIX_SLO_TBT_S": "1.0",
                "LEMIX_LOG_LEVEL": args.log_level,
                "LEMIX_EVENT_LOOP": args.event_loop,
            },
        )
        async with Stack(config) as stack, contextlib.AsyncExitStack() as channels:
            stubs = [
                gateway_pb2_grpc.GatewayStub(await channels.enter_async_context(channel(address)))
                for address in stack.gateway_addresses
            ]
            await _fire(stubs, 20.0, args.warmup_s, 999, "warmup", args.timeout_s)
            rows = []
            for k, rate in enumerate(float(r) for r in args.rates.split(",")):
                is_profiled = (args.py_spy or args.perf) and rate == args.spy_rate
                spy_dir = Path(tmp) if is_profiled else None
                rows.append(
                    await run_level(stubs, stack, redis, rate, args.seed + k, args, spy_dir)
                )
                print(
                    f"  {rate:g} req/s: p50 {rows[-1]['p50_ms']} ms, lost {rows[-1]['num_lost']}",
                    file=sys.stderr,
                )
            dead = stack.failed_child()
    return {"rows": rows, "dead_service": dead, "profile": zero.name}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="50,200,500", help="req/s levels, comma-separated")
    parser.add_argument("--duration-s", type=float, default=10.0, help="seconds per level")
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument(
        "--gateways", type=int, default=1, help="gateways; requests go round robin over them"
    )
    parser.add_argument("--profile", default=str(default_profile_path()))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=30.0, help="per-request deadline")
    parser.add_argument("--log-level", default="info", help="the services' log level")
    parser.add_argument(
        "--event-loop",
        default="uvloop",
        choices=("asyncio", "uvloop"),
        help="the services' event loop (LEMIX_EVENT_LOOP)",
    )
    parser.add_argument(
        "--redis-url-query",
        default="",
        metavar="Q",
        help="appended to the services' Redis URL, e.g. "
        "'max_connections=4096&socket_timeout=120' (redis-py defaults: 100, 5 s)",
    )
    parser.add_argument("--py-spy", metavar="BIN", help="py-spy binary: profile the services")
    parser.add_argument(
        "--perf",
        metavar="BIN",
        help="perf binary: split each process's CPU by native code (benchmarks/native_split.py)",
    )
    parser.add_argument(
        "--spy-rate",
        type=float,
        default=TARGET_RATE,
        help="the level (req/s) to profile with --py-spy and --perf",
    )
    parser.add_argument("--top", type=int, default=12, help="hotspots listed per service")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    host = host_load()  # before the stack starts
    print(describe(host))
    result = asyncio.run(run(args))
    rows = result["rows"]
    print(
        f"control plane, zero-latency profile, {args.nodes} nodes, {args.gateways} gateway(s), "
        f"{args.duration_s:g} s per level (times in ms)"
    )
    print(
        format_table(
            rows,
            [
                ("rate", "req/s"),
                ("offered_rps", "sent/s"),
                ("achieved_rps", "done/s"),
                ("num_sent", "sent"),
                ("num_completed", "ok"),
                ("num_rejected", "rej"),
                ("num_failed", "fail"),
                ("num_lost", "lost"),
                ("p50_ms", "p50"),
                ("p90_ms", "p90"),
                ("p99_ms", "p99"),
                ("max_ms", "max"),
                ("client_lag_p99_ms", "lag p99"),
            ],
        )
    )
    print("\nper hop (service timestamps), p50 / p99 ms")
    print(
        format_table(
            rows,
            [("rate", "req/s")] + [(f"{h}_{q}", f"{h} {q}") for h in HOPS for q in ("p50", "p99")],
        )
    )
    print(f"\nCPU ms per request by process, and cores busy (of {os.cpu_count()})")
    names = sorted({n for r in rows for n in r["cpu_ms_by_process"]})
    print(
        format_table(
            rows,
            [("rate", "req/s")]
            + [(f"cpu_ms_by_process.{n}", n) for n in names]
            + [("cpu_ms_per_req", "stack"), ("cpu_cores_busy", "cores")],
        )
    )
    for row in rows:
        per_req = row["redis_calls_by_command"]
        print(
            f"Redis commands per request at {row['rate']:g} req/s "
            f"({row['redis_calls_per_req']:.1f} in all): "
            + ", ".join(f"{c} {n:.2f}" for c, n in per_req.items() if n >= 0.05)
        )
    for row in rows:
        for name, spots in row.get("py_spy", {}).items():
            print(f"\npy-spy {name} at {row['rate']:g} req/s ({spots['samples']} samples):")
            for kind in ("self_by_package", "self", "inclusive_ours"):
                print(f"  {kind}:")
                for frame, share in spots[kind]:
                    print(f"    {100 * share:5.1f}%  {frame}")
        if "native_split_ms" in row:
            print(f"\nCPU ms per request by native code at {row['rate']:g} req/s (perf)")
            split_rows = [
                {"process": name, "total": sum(by.values()), **by}
                for name, by in row["native_split_ms"].items()
            ]
            print(
                format_table(
                    split_rows,
                    [("process", "process"), ("total", "total")]
                    + [(c, c) for c in native_split.CATEGORIES],
                )
            )
        for reason, count in row["reasons"].items():
            print(f"  {row['rate']:g} req/s: {count} x {reason}")
    for row in rows:
        checks = [
            (
                f"<= {TARGET_REDIS_CALLS_PER_REQ:g} Redis commands/req",
                row["redis_calls_per_req"] <= TARGET_REDIS_CALLS_PER_REQ,
            ),
            (
                f"<= {TARGET_CPU_MS_PER_REQ:g} ms CPU/req",
                row["cpu_ms_per_req"] <= TARGET_CPU_MS_PER_REQ,
            ),
        ]
        if row["rate"] == TARGET_RATE and row["p50_ms"] is not None:
            checks.append(
                (
                    f"p50 <= {TARGET_P50_MS:g} ms, p99 <= {TARGET_P99_MS:g} ms",
                    row["p50_ms"] <= TARGET_P50_MS and row["p99_ms"] <= TARGET_P99_MS,
                )
            )
        if row["rate"] == HIGH_RATE:
            checks.append(
                (
                    f">= {HIGH_MIN_ACHIEVED_SHARE:.0%} done, 0 lost, p99 <= {HIGH_P99_MS:g} ms",
                    row["achieved_rps"] >= HIGH_MIN_ACHIEVED_SHARE * row["offered_rps"]
                    and row["num_lost"] == 0
                    and row["p99_ms"] is not None
                    and row["p99_ms"] <= HIGH_P99_MS,
                )
            )
        print(
            f"targets at {row['rate']:g} req/s: "
            + "; ".join(f"{what}: {'met' if ok else 'NOT met'}" for what, ok in checks)
        )
    if result["dead_service"]:
        print(f"warning: {result['dead_service']} exited during the run")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "benchmark": "control_plane",
                    "host_at_start": host,
                    "python": sys.version.split()[0],
                    "machine": platform.machine(),
                    "num_nodes": args.nodes,
                    "num_gateways": args.gateways,
                    "event_loop": args.event_loop,
                    "profile": result["profile"],
                    "duration_s": args.duration_s,
                    "targets": {
                        "rate": TARGET_RATE,
                        "p50_ms": TARGET_P50_MS,
                        "p99_ms": TARGET_P99_MS,
                        "high_rate": HIGH_RATE,
                        "high_min_achieved_share": HIGH_MIN_ACHIEVED_SHARE,
                        "high_p99_ms": HIGH_P99_MS,
                        "redis_calls_per_req": TARGET_REDIS_CALLS_PER_REQ,
                        "cpu_ms_per_req": TARGET_CPU_MS_PER_REQ,
                    },
                    "results": rows,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
