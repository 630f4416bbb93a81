"""Soak: a long run at a steady load with a random fault every minute.

A supervised stack (`lemix.stack.launcher.Stack`, real processes, embedded Redis
with AOF, 2 emulated nodes, the shipped A100 profile at --time-scale, the
production detection defaults) takes Poisson inference and a steady training
stream for --duration-s; every --fault-every-s one fault is drawn (seeded)
from: executor SIGKILL, executor SIGSTOP for 10 s, scheduler SIGKILL,
redis-server SIGKILL, gateway SIGKILL. Every --sample-s it records each
process's RSS (/proc/PID/status), Redis `used_memory` and the nodes'
busy fraction (GetStats). At the end every task id the client caused is read
back (GetTask) and the stack's own non-final list (AuditTasks) is taken.

Reported: ids acknowledged / lost / ghosts; per process the RSS at the first
sample after warm-up and at the end, over the spans it was not restarted;
Redis memory first / peak / last and per minute; mean busy fraction (the
load level). With --finished-task-ttl-s the stack expires finished records
after that long; a `FinalWatcher` takes every id's final state while the run
goes on, so the accounting still covers every id.

    .venv/bin/python benchmarks/soak.py --duration-s 1200 --json runs/bench/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from lemix._proto.lemix.v1 import gateway_pb2
from lemix.harness.faults import (
    FinalWatcher,
    Load,
    account,
    audit_clean,
    fault_stack,
    wait_ready,
)
from lemix.infra.store.client import RedisClientConfig, connect
from lemix.stack.launcher import Stack

FAULTS = ("executor-kill", "executor-stop", "scheduler-kill", "redis-kill", "gateway-kill")
_STOP_S = 10.0
_WARMUP_S = 60.0


@dataclass
class Samples:
    rss_bytes: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)
    redis_bytes: list[tuple[float, int]] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)


def _rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def _sample(stack: Stack, load: Load, samples: Samples, started_s: float) -> None:
    assert stack.redis is not None
    client = connect(RedisClientConfig(stack.redis.url, max_connections=1, socket_timeout_s=5.0))
    try:
        now_s = time.monotonic() - started_s
        for child in stack.children:
            pid = child.pid
            rss = _rss_bytes(pid) if pid else None
            if pid and rss is not None:
                samples.rss_bytes.setdefault(child.name, []).append((now_s, pid, rss))
        try:
            info = await client.info("memory")
            samples.redis_bytes.append((now_s, int(info["used_memory"])))
            stats = await load.stub.GetStats(gateway_pb2.GetStatsRequest(), timeout=5)
            if stats.nodes:
                samples.busy.append(statistics.fmean(n.busy_fraction for n in stats.nodes))
        except (OSError, grpc.aio.AioRpcError, Exception):  # mid-fault: skip this sample
            pass
    finally:
        await client.aclose()


async def _redis_breakdown(stack: Stack) -> dict[str, int]:
    """What Redis holds at the end: keys, and the bytes of the biggest kinds."""
    assert stack.redis is not None
    client = connect(RedisClientConfig(stack.redis.url, max_connections=1, socket_timeout_s=30.0))
    namespace = stack.config.namespace
    try:
        counts: dict[str, int] = {"num_keys": int(await client.dbsize())}
        events = f"{namespace}:events"
        counts["events_stream_len"] = int(await client.xlen(events))
        counts["events_stream_bytes"] = int(await client.memory_usage(events) or 0)
        for kind in ("task", "dedupe", "out", "lease"):
            num = 0
            async for _ in client.scan_iter(match=f"{namespace}:{kind}:*", count=1000):
                num += 1
            counts[f"num_{kind}_keys"] = num
        return counts
    finally:
        await client.aclose()


async def _fault(stack: Stack, kind: str) -> None:
    if kind == "executor-kill":
        stack.kill(f"executor-{random.randrange(stack.config.num_nodes)}")
    elif kind == "executor-stop":
        name = f"executor-{random.randrange(stack.config.num_nodes)}"
        stack.kill(name, signal.SIGSTOP)
        await asyncio.sleep(_STOP_S)
        stack.kill(name, signal.SIGCONT)
    else:
        stack.kill(kind.removesuffix("-kill"))


async def _poisson(load: Load, rate_rps: float, until_s: float, rng: random.Random) -> None:
    while time.monotonic() < until_s:
        load.generate()
        await asyncio.sleep(rng.expovariate(rate_rps))


async def _training(load: Load, rate_sps: float, until_s: float) -> None:
    per_call = max(1, round(rate_sps * 5))
    while time.monotonic() < until_s:
        called_s = time.monotonic()
        # Refused beyond the retry deadline: never acknowledged, not tracked.
        with contextlib.suppress(grpc.aio.AioRpcError):
            await load.train(per_call, per_call=per_call, deadline_s=60)
        await asyncio.sleep(max(0.0, 5.0 - (time.monotonic() - called_s)))


def _rss_report(samples: Samples) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name, series in samples.rss_bytes.items():
        late = [(t, pid, rss) for t, pid, rss in series if t >= _WARMUP_S]
        if not late:
            continue
        # Growth within each process lifetime (a restart starts a new one).
        spans: dict[int, list[int]] = {}
        for _, pid, rss in late:
            spans.setdefault(pid, []).append(rss)
        longest = max(spans.values(), key=len)
        report[name] = {
            "first_mib": round(longest[0] / 2**20, 1),
            "last_mib": round(longest[-1] / 2**20, 1),
            "growth": round(longest[-1] / longest[0] - 1, 3),
            "num_lifetimes": len(spans),
            "num_samples": len(longest),
        }
    return report


async def main_async(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    random.seed(args.seed)
    samples = Samples()
    faults: list[tuple[float, str]] = []
    with tempfile.TemporaryDirectory(prefix="lemix-soak-") as tmp:
        env = (
            {"LEMIX_FINISHED_TASK_TTL_S": repr(args.finished_task_ttl_s)}
            if args.finished_task_ttl_s
            else {}
        )
        async with fault_stack(
            Path(tmp), time_scale=args.time_scale, extra_env=env, is_fast=False
        ) as (stack, stub):
            await wait_ready(stub)
            load = Load(stub)
            started_s = time.monotonic()
            until_s = started_s + args.duration_s
            watcher = FinalWatcher(stub, load)
            drivers = [
                asyncio.create_task(_poisson(load, args.rate_rps, until_s, rng)),
                asyncio.create_task(_training(load, args.train_sps, until_s)),
                asyncio.create_task(watcher.run(until_s)),
            ]
            next_fault_s = started_s + args.fault_every_s
            next_sample_s = started_s
            while time.monotonic() < until_s:
                now = time.monotonic()
                if now >= next_sample_s:
                    await _sample(stack, load, samples, started_s)
                    next_sample_s += args.sample_s
                if now >= next_fault_s:
                    kind = rng.choice(FAULTS)
                    faults.append((round(now - started_s, 1), kind))
                    print(f"[{now - started_s:7.1f}s] fault: {kind}", file=sys.stderr, flush=True)
                    await _fault(stack, kind)
                    next_fault_s += args.fault_every_s
                await asyncio.sleep(0.5)
            await asyncio.gather(*drivers)
            await load.finish_streams(timeout_s=600)
            # Seconds past the end of arrivals until every stream ended: a few
            # when the stack keeps up, growing with the backlog when it does not.
            drain_s = time.monotonic() - until_s
            await _sample(stack, load, samples, started_s)
            await watcher.sweep()
            result = await account(stub, load, timeout_s=600, recorded=watcher.final)
            ghosts = await audit_clean(stub)
            redis_keys = await _redis_breakdown(stack)
    found = sum(1 for info in result.states.values() if info is not None)
    lost = sorted({*result.lost, *result.missing_training, *result.inconsistent, *watcher.expired})
    redis_mib = [b / 2**20 for _, b in samples.redis_bytes]
    # Redis memory at the end of each minute: flat once finished records expire.
    by_minute: dict[int, float] = {}
    for t_s, b in samples.redis_bytes:
        by_minute[int(t_s // 60)] = round(b / 2**20, 1)
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "duration_s": args.duration_s,
        "rate_rps": args.rate_rps,
        "train_sps": args.train_sps,
        "time_scale": args.time_scale,
        "seed": args.seed,
        "finished_task_ttl_s": args.finished_task_ttl_s,
        "faults": faults,
        "num_task_ids": len(result.states),
        "num_acked": found,
        "num_lost": len(lost),
        "lost_ids": lost[:20],
        "num_recorded_while_running": len(watcher.final),
        "num_ghosts": len(ghosts),
        "num_no_reason": len(result.no_reason),
        "by_state": result.by_state(),
        "drain_s": round(drain_s, 1),
        "mean_busy_fraction": round(statistics.fmean(samples.busy), 3) if samples.busy else None,
        "rss": _rss_report(samples),
        "redis_at_end": redis_keys,
        "redis_mib": {
            "first": round(redis_mib[0], 1),
            "peak": round(max(redis_mib), 1),
            "last": round(redis_mib[-1], 1),
        }
        if redis_mib
        else None,
        "redis_mib_by_minute": by_minute,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0 if out["num_lost"] == 0 and out["num_ghosts"] == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=1200.0)
    parser.add_argument("--rate-rps", type=float, default=14.0)
    parser.add_argument("--train-sps", type=float, default=7.0)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--fault-every-s", type=float, default=60.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--finished-task-ttl-s",
        type=float,
        default=300.0,
        help="the scheduler's finished_task_ttl_s (0 = its default, 24 h)",
    )
    parser.add_argument("--json", type=Path)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
