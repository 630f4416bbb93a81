"""Reliability: the faults of issue 12's table, redone, every task judged by id.

Each row starts a fresh supervised stack (`lemix.stack.launcher.Stack`: real
processes, embedded redis-server with AOF, real gRPC; the shipped A100 profile
at --time-scale, 2 emulated nodes) with the PRODUCTION detection defaults
(5 s heartbeat TTL, 15 s stream leases, 10 s Redis-outage grace), runs a
client load, injects the fault, then reads every task id the client caused
through the gateway (GetTask) and the stack's own non-final list
(AuditTasks). Columns:

  acked   task ids the stack acknowledged (found by GetTask)
  final   of those, in a final state; lost = acked - final
  ghosts  non-final tasks AuditTasks still lists at the end
  no_reason  ended failed/rejected/cancelled without a "STATUS: ..." reason
  settle_s   from the fault to every id final

    .venv/bin/python benchmarks/faults.py --json runs/bench/faults.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from lemix.harness.faults import Load, account, audit_clean, fault_stack, wait_ready
from lemix.stack.launcher import Stack


@dataclass
class Row:
    fault: str
    num_acked: int
    num_final: int
    num_lost: int
    num_ghosts: int
    num_no_reason: int
    settle_s: float
    by_state: dict[str, int]
    lost_ids: list[str]


Fault = Callable[[Stack, Load], Awaitable[None]]


async def _kill_after(
    stack: Stack,
    name: str,
    delay_s: float,
    sig: int = signal.SIGKILL,
    resume_after_s: float | None = None,
) -> None:
    await asyncio.sleep(delay_s)
    stack.kill(name, sig)
    if resume_after_s is not None:
        await asyncio.sleep(resume_after_s)
        stack.kill(name, signal.SIGCONT)


async def big_train(stack: Stack, load: Load) -> None:
    await load.train(10_000, per_call=10_000, deadline_s=300)


async def executor_kill(stack: Stack, load: Load) -> None:
    killer = asyncio.create_task(_kill_after(stack, "executor-0", 1.0))
    await load.train(300, per_call=300)
    await killer


async def scheduler_kill(stack: Stack, load: Load) -> None:
    await _mixed_with(stack, load, _kill_after(stack, "scheduler", 2.0))


async def redis_kill(stack: Stack, load: Load) -> None:
    await _mixed_with(stack, load, _kill_after(stack, "redis", 2.0))


async def executor_stop(stack: Stack, load: Load) -> None:
    await _mixed_with(
        stack, load, _kill_after(stack, "executor-0", 2.0, signal.SIGSTOP, resume_after_s=20.0)
    )


async def gateway_kill(stack: Stack, load: Load) -> None:
    await _mixed_with(stack, load, _kill_after(stack, "gateway", 2.0))


async def _mixed_with(stack: Stack, load: Load, fault: Awaitable[None]) -> None:
    """Paced inference and training around `fault`, as `lemix replay` would."""
    await asyncio.gather(fault, load.generate_paced(100, 0.05), load.train(300, per_call=25))


FAULTS: dict[str, Fault] = {
    "one Train call of 10,000 samples": big_train,
    "executor SIGKILL 1 s into a 300-sample Train": executor_kill,
    "scheduler SIGKILL + supervised restart": scheduler_kill,
    "redis-server SIGKILL + AOF restart": redis_kill,
    "executor SIGSTOP 20 s": executor_stop,
    "gateway SIGKILL with streams in flight": gateway_kill,
}


async def run_row(name: str, fault: Fault, time_scale: float, tmp: Path) -> Row:
    env = {"LEMIX_MAX_TRAIN_SAMPLES": "10000"}
    async with fault_stack(tmp, time_scale=time_scale, extra_env=env, is_fast=False) as (
        stack,
        stub,
    ):
        await wait_ready(stub)
        load = Load(stub)
        await fault(stack, load)
        fault_end_s = time.monotonic()
        await load.finish_streams(timeout_s=600)
        result = await account(stub, load, timeout_s=600)
        settle_s = time.monotonic() - fault_end_s
        ghosts = await audit_clean(stub)
    found = [i for i, info in result.states.items() if info is not None]
    return Row(
        name,
        len(found),
        len(found) - len(result.lost),
        len(result.lost),
        len(ghosts),
        len(result.no_reason),
        round(settle_s, 1),
        result.by_state(),
        result.lost[:20],
    )


def _table(rows: list[Row]) -> str:
    head = f"| {'fault':46} | acked | lost | ghosts | no reason | settle s | final states |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        states = ", ".join(
            f"{k.removeprefix('TASK_STATE_').lower()} {v}" for k, v in sorted(r.by_state.items())
        )
        lines.append(
            f"| {r.fault:46} | {r.num_acked:5} | {r.num_lost:4} | {r.num_ghosts:6} | "
            f"{r.num_no_reason:9} | {r.settle_s:8} | {states} |"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    rows = []
    for name, fault in FAULTS.items():
        if args.only and args.only not in name:
            continue
        with tempfile.TemporaryDirectory(prefix="lemix-faults-") as tmp:
            row = await run_row(name, fault, args.time_scale, Path(tmp))
        print(
            f"{name}: acked {row.num_acked} lost {row.num_lost} ghosts {row.num_ghosts}",
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    print(_table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "time_scale": args.time_scale,
                    "machine": f"{platform.machine()} {platform.system()}",
                    "rows": [asdict(r) for r in rows],
                },
                indent=2,
            )
        )
    return (
        0
        if all(r.num_lost == 0 and r.num_ghosts == 0 and r.num_no_reason == 0 for r in rows)
        else 1
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--only", default="", help="run the rows whose name contains this")
    parser.add_argument("--json", type=Path)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
