"""Scheduler restart time vs tasks processed, with and without event-log compaction.

For each N in --tasks and each mode (compaction off: the whole log is
replayed, as before; on: `snapshot_every_events` = --every), in a fresh
namespace of an embedded Redis:

1. Write the event log a live scheduler would have after processing N tasks:
   a planner built exactly as the service builds it, driven through the
   service's own recording path (RecordingPlanner -> SnapshottingSink ->
   RedisEventSink, so compaction snapshots and trims as it does live) by a
   workload from `lemix.workload` (arrival times as planner time); whenever
   more than --held tasks are placed, the oldest one finishes. The held
   tasks get their state hashes, as the intake writes them.
2. Time the restart: `SchedulerService.start()` until it serves (read the
   log, restore/replay, recover the held tasks, start the loops and gRPC),
   and, separately, the log part alone (read + parse + recover).

    .venv/bin/python benchmarks/scheduler_restart.py --json runs/bench/scheduler_restart.json

Expect: off grows linearly with N; on stays flat once N passes --every events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from lemix.infra.store.client import RedisClientConfig, connect
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.server import EmbeddedRedis
from lemix.infra.store.store import Store
from lemix.infra.store.task_fields import task_to_fields
from lemix.planner.recording import RecordingPlanner
from lemix.planner.registry import build_planner
from lemix.profile import Profile, default_profile_path, load_profile
from lemix.report.metrics import format_table
from lemix.types import Placement, TaskPayload
from lemix.workload import WorkloadConfig, build_workload
from services.scheduler.adapters import RedisEventSink
from services.scheduler.codec import event_to_fields
from services.scheduler.config import SchedulerConfig
from services.scheduler.recovery import (
    LogTally,
    SnapshottingSink,
    check_config,
    events_to_recover,
    recover,
    snapshot_event,
    start_event,
)
from services.scheduler.service import SchedulerService

_FLUSH_EVERY_TASKS = 500  # let the sink drain now and then (it runs on this loop)


def _config(redis_url: str, namespace: str, every: int, num_nodes: int) -> SchedulerConfig:
    return SchedulerConfig(
        redis_url=redis_url,
        namespace=namespace,
        num_nodes=num_nodes,
        port=0,
        metrics_port=-1,
        snapshot_every_events=every,
        read_block_s=0.1,
        shutdown_grace_s=0.1,
        log_level="warning",
    )


def _plan(live: RecordingPlanner, now_s: float) -> list[str]:
    """The ids `live` places now, planning again while a call stops at its
    training cap, as the scheduler does."""
    placed = [d.task_id for d in live.plan(now_s) if isinstance(d, Placement)]
    while live.is_release_pending:
        placed += [d.task_id for d in live.plan(now_s) if isinstance(d, Placement)]
    return placed


async def write_log(
    store: Store,
    config: SchedulerConfig,
    profile: Profile,
    num_tasks: int,
    num_held: int,
    seed: int,
) -> dict[str, Any]:
    """The log of a scheduler that processed `num_tasks` (see the module doc)."""
    planner_config = config.planner_config(profile)
    planner = build_planner(config.policy, planner_config, profile, config.memory)
    sink = RedisEventSink(store)
    recorder = SnapshottingSink(
        sink,
        planner,
        LogTally(),
        snapshot_every_events=config.snapshot_every_events,
        wall_clock=time.time,
    )
    sink.start()
    recorder(start_event(planner_config, config.policy, time.time()))
    live = RecordingPlanner(planner, recorder)
    workload = build_workload(
        WorkloadConfig(
            request_rate=8.0, train_rate=0.3, seed=seed, duration_s=num_tasks / 8.0 * 0.75 + 10.0
        )
    )
    tasks = list(workload.tasks[:num_tasks])
    if len(tasks) < num_tasks:
        raise RuntimeError(f"workload too short: {len(tasks)} < {num_tasks}")
    placed: list[str] = []
    for i, task in enumerate(tasks):
        now_s = task.arrival_s
        live.submit(task, now_s)
        placed += _plan(live, now_s)
        while len(placed) > num_held:
            placed += [
                d.task_id
                for d in live.on_task_finished(placed.pop(0), now_s)
                if isinstance(d, Placement)
            ]
            placed += _plan(live, now_s)
        if i % _FLUSH_EVERY_TASKS == 0:
            await sink.flush()
    await sink.stop()
    # What one snapshot costs the scheduler: taken on its event loop, encoded by the sink.
    started = time.perf_counter()
    event_to_fields(snapshot_event(planner, recorder.tally, time.time()))
    snapshot_ms = 1000 * (time.perf_counter() - started)
    held = list(recorder.tally.live.values())
    await store.set_task_states(
        [(t.task_id, {**task_to_fields(t, TaskPayload()), "status": "placed"}) for t in held]
    )
    return {
        "num_events": recorder.num_events,
        "num_trimmed": sink.num_trimmed_entries,
        "num_snapshots": sink.num_snapshots_stored,
        "snapshot_bytes": sink.last_snapshot_bytes,
        "snapshot_ms": snapshot_ms,
        "num_held": len(held),
    }


async def time_recovery(store: Store, config: SchedulerConfig, profile: Profile) -> float:
    """Read + parse + recover, as `SchedulerService._build_core` does it."""
    started = time.perf_counter()
    planner_config = config.planner_config(profile)
    planner = build_planner(config.policy, planner_config, profile, config.memory)
    events = events_to_recover(await store.read_events())
    check_config(events, planner_config, config.policy)
    recover(events, planner)
    return time.perf_counter() - started


async def time_start(config: SchedulerConfig, profile: Profile) -> float:
    service = SchedulerService(config, profile=profile)
    started = time.perf_counter()
    await service.start()
    elapsed_s = time.perf_counter() - started
    await service.stop(grace_s=0.0)
    return elapsed_s


async def run_one(
    redis: EmbeddedRedis, profile: Profile, num_tasks: int, every: int, args: argparse.Namespace
) -> dict[str, Any]:
    namespace = f"restart{uuid.uuid4().hex[:8]}"
    config = _config(redis.url, namespace, every, args.nodes)
    client = connect(RedisClientConfig(redis.url, max_connections=8, socket_timeout_s=30.0))
    try:
        store = Store(client, RedisKeys(namespace))
        wrote_started = time.perf_counter()
        written = await write_log(store, config, profile, num_tasks, args.held, args.seed)
        write_s = time.perf_counter() - wrote_started
        num_entries = await store.events_length()
        stream_bytes = int(
            await client.memory_usage(RedisKeys(namespace).events_stream, samples=0) or 0
        )  # every node counted
        recover_s = min([await time_recovery(store, config, profile) for _ in range(args.repeat)])
        start_s = min([await time_start(config, profile) for _ in range(args.repeat)])
        await client.delete(*[k async for k in client.scan_iter(f"{namespace}:*")])
    finally:
        await client.aclose()
    return {
        "num_tasks": num_tasks,
        "compaction": "on" if every else "off",
        "snapshot_every_events": every,
        "num_stream_entries": num_entries,
        "stream_mib": stream_bytes / 2**20,
        "num_held": written["num_held"],
        "num_snapshots": written["num_snapshots"],
        "snapshot_kib": written["snapshot_bytes"] / 1024,
        "snapshot_ms": written["snapshot_ms"],
        "num_events": written["num_events"],
        "num_trimmed": written["num_trimmed"],
        "write_s": write_s,
        "recover_s": recover_s,
        "restart_s": start_s,
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    profile = load_profile(Path(args.profile))
    rows = []
    with EmbeddedRedis() as redis:
        for num_tasks in args.tasks:
            for every in (0, args.every):
                row = await run_one(redis, profile, num_tasks, every, args)
                rows.append(row)
                print(
                    f"  N={num_tasks} compaction={row['compaction']}: "
                    f"restart {row['restart_s']:.3f} s",
                    file=sys.stderr,
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tasks",
        type=int,
        nargs="+",
        default=[1000, 4000, 16000],
        help="tasks processed before the restart",
    )
    parser.add_argument(
        "--every",
        type=int,
        default=SchedulerConfig().snapshot_every_events,
        help="snapshot_every_events with compaction on",
    )
    parser.add_argument("--held", type=int, default=64, help="tasks held (placed) at any time")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2, help="timed restarts (best kept)")
    parser.add_argument("--profile", default=str(default_profile_path()))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rows = asyncio.run(run(args))
    print(
        format_table(
            rows,
            [
                ("num_tasks", "tasks"),
                ("compaction", "compaction"),
                ("num_events", "events"),
                ("num_stream_entries", "stream entries"),
                ("stream_mib", "stream MiB"),
                ("num_trimmed", "trimmed"),
                ("snapshot_kib", "snapshot KiB"),
                ("snapshot_ms", "snapshot ms"),
                ("num_held", "held"),
                ("recover_s", "recover s"),
                ("restart_s", "restart s"),
            ],
        )
    )
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "benchmark": "scheduler_restart",
                    "args": vars(args),
                    "python": platform.python_version(),
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
