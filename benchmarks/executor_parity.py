"""The executor's real-time driver against the simulator, without the control plane.

Runs the simulator on a workload (noise off), then replays each node's
placements, at the simulator's placement times, into that node's `NodeEngine`
driven in real time by the executor's `NodeDriver` with the emulated backend
(in this process: no gateway, scheduler or Redis). Both sides run the same
engine code with the same config, so any per-request TTFT difference is the
live driver's own (asyncio sleeps, hand-offs, clock reads) plus the divergence
a few milliseconds of arrival jitter cause at iteration boundaries (the
simulator alone shows that: `--jitter-ms`).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/executor_parity.py \\
        --nodes 2 --rate 3 --train-rate 0.3 --window-s 20      # engine v2 (default)
    ... --micro-batches 1 --prefill-budget off --train-slice-s off   # v1

The defaults are `lemix demo`'s live part (2 nodes, 3 req/s, 0.3 training
tasks/s, 20 s, the parametric workload, the shipped A100 profile).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys

import numpy as np

from lemix.cli.engine_args import add_engine_args, engine_knobs
from lemix.engine import EngineConfig, Failed, Finished, FirstToken, NodeEngine, Outcome
from lemix.profile import Profile, default_profile_path, load_profile
from lemix.sim.run import SimRunConfig, run_simulation
from lemix.slo import SloConfig, compute_slo
from lemix.types import Task, TaskKind, TaskRecord
from lemix.workload import WorkloadConfig, build_workload
from services.executor.backends import EmulatedBackend
from services.executor.driver import NodeDriver

_IDLE_POLL_S = 0.05


class _FirstTokens:
    """An `OutcomeSink` keeping each request's first-token time (engine s)."""

    def __init__(self) -> None:
        self.first_s: dict[str, float] = {}
        self.num_ended = 0

    async def write(self, batch: list[tuple[float, Outcome]]) -> None:
        for now_s, outcome in batch:
            if isinstance(outcome, FirstToken):
                self.first_s[outcome.task_id] = now_s
            elif isinstance(outcome, Finished | Failed):
                self.num_ended += 1


async def _drive_node(
    node_id: int,
    placements: list[tuple[float, Task]],
    profile: Profile,
    config: EngineConfig,
    time_scale: float,
) -> tuple[dict[str, float], int]:
    """Replay `placements` ((placed_s, task), in order) into a real-time driver;
    the first-token times and the engine's iteration count."""
    engine = NodeEngine(node_id, profile, profile.ours, config)
    sink = _FirstTokens()
    driver = NodeDriver(engine, EmulatedBackend(), sink, time_scale=time_scale)
    await driver.start()
    for placed_s, task in placements:
        wait_s = placed_s - driver.now_s()
        if wait_s > 0:
            await asyncio.sleep(wait_s * time_scale)
        driver.add_task(task)
    while not engine.is_idle:
        await asyncio.sleep(_IDLE_POLL_S)
    await driver.stop()
    return sink.first_s, engine.num_iterations


def _ttft_s(records: list[TaskRecord]) -> dict[str, float]:
    return {
        r.task_id: r.first_token_s - r.arrival_s
        for r in records
        if r.kind is TaskKind.INFERENCE and r.first_token_s is not None
    }


def _pcts(values: list[float]) -> str:
    p50, p90 = np.percentile(values, [50, 90])
    return f"p50 {1e3 * p50:7.1f}  p90 {1e3 * p90:7.1f}  max {1e3 * max(values):7.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rate", type=float, default=3.0, help="inference req/s")
    parser.add_argument("--train-rate", type=float, default=0.3)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--policy", default="lemix")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-scale", type=float, default=1.0, help="wall s per profile s")
    parser.add_argument(
        "--jitter-ms", type=float, default=2.0, help="arrival jitter for the sim-only check"
    )
    add_engine_args(parser)
    args = parser.parse_args(argv)
    profile = load_profile(default_profile_path())
    workload = build_workload(
        WorkloadConfig(
            request_rate=args.rate,
            train_rate=args.train_rate,
            duration_s=args.window_s,
            seed=args.seed,
        )
    )
    tasks = list(workload.tasks)
    slo = compute_slo(profile, tasks, SloConfig())
    sim_config = SimRunConfig(
        policy=args.policy,
        num_nodes=args.nodes,
        seed=args.seed,
        latency_noise_cv=0.0,  # the driver's engines use the profile itself as truth
        train_rate=args.train_rate,
        **engine_knobs(args),
    )

    def simulate(run_tasks: list[Task]) -> list[TaskRecord]:
        _, result = run_simulation(
            sim_config,
            profile,
            run_tasks,
            request_rate=args.rate,
            duration_s=args.window_s,
            slo=slo,
        )
        return result.records

    records = simulate(tasks)
    engine_config = dataclasses.replace(sim_config.engine_config(slo, profile), emit_tokens=True)
    print(
        f"{len(tasks)} tasks, {args.nodes} nodes; engine: micro-batches "
        f"{engine_config.num_micro_batches or 'one per stage'}, prefill budget "
        f"{engine_config.prefill_token_budget}, training slice {engine_config.max_training_slice_s}"
    )
    by_id = {t.task_id: t for t in tasks}
    per_node = [
        sorted(
            (r.placed_s, by_id[r.task_id])
            for r in records
            if r.node_id == node and r.placed_s is not None
        )
        for node in range(args.nodes)
    ]

    async def drive_all() -> list[tuple[dict[str, float], int]]:
        return await asyncio.gather(
            *(
                _drive_node(node, placements, profile, engine_config, args.time_scale)
                for node, placements in enumerate(per_node)
            )
        )

    live = asyncio.run(drive_all())
    sim_ttft = _ttft_s(records)
    arrival = {t.task_id: t.arrival_s for t in tasks}
    live_ttft = {
        task_id: first_s - arrival[task_id]
        for first_s_by_id, _ in live
        for task_id, first_s in first_s_by_id.items()
        if task_id in sim_ttft
    }
    common = sorted(live_ttft)
    print(f"live iterations per node: {[num for _, num in live]}; {len(common)} requests")
    print(f"sim TTFT ms          {_pcts([sim_ttft[k] for k in common])}")
    print(f"live TTFT ms         {_pcts([live_ttft[k] for k in common])}")
    print(f"live - sim ms        {_pcts([live_ttft[k] - sim_ttft[k] for k in common])}")
    rng = np.random.default_rng(args.seed)
    jittered = [
        dataclasses.replace(t, arrival_s=t.arrival_s + rng.uniform(0.0, args.jitter_ms / 1e3))
        for t in tasks
    ]
    jitter_ttft = _ttft_s(simulate(jittered))
    moved = [jitter_ttft[k] - sim_ttft[k] for k in sim_ttft if k in jitter_ttft]
    print(f"sim, arrivals + U(0, {args.jitter_ms:g} ms), minus sim: ms {_pcts(moved)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
