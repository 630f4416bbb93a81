"""Split a traced `sim_vs_live.py` run's per-request TTFT into hops, against the simulator.

Run sim_vs_live with the hop tracer loaded into every process (the benchmark's
own client too: the launcher passes the environment on), then this on its
trace directory with the same workload and engine flags:

    mkdir -p /tmp/hops && LEMIX_HOP_TRACE_DIR=/tmp/hops \\
      PYTHONPATH=$PWD/benchmarks/hop_trace:$PWD .venv/bin/python benchmarks/sim_vs_live.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/hop_split.py /tmp/hops

Each inference request's first token, in epoch s on the one host clock:
client send (the replay's scheduled arrival) -> client call starts ->
gateway Generate -> admitted (`OutputStream`) -> the gateway's intake write
(its lease and reader wake in the same round trip) -> intake loop -> Dispatch
sent -> executor Dispatch (alone or in a DispatchMany)
-> engine admit -> sink write of the first token -> gateway reader delivers
-> response built -> client gets it. The simulator's queueing (arrival to
placement) and engine time (placement to first token) are shown beside the
live ones (the simulator runs without the control-plane delay).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import numpy as np

from benchmarks.sim_vs_live import DEFAULT_TRACE, make_workload
from lemix.cli.engine_args import add_engine_args, engine_knobs
from lemix.profile import default_profile_path, load_profile
from lemix.sim.run import SimRunConfig, run_simulation
from lemix.slo import SloConfig, compute_slo
from lemix.types import TaskKind

# trace label -> point name (the first occurrence per task counts)
POINTS = {
    "_generate>": "client_call",
    "GatewayServicer.Generate": "gw_handler",
    "OutputStream.__init__": "gw_admitted",
    "GatewayCore._submit>": "gw_submit",
    "Placing._dispatch>": "dispatch_sent",
    "ExecutorServicer._dispatch>": "exec_dispatch",
    "NodeDriver.add_task": "engine_admit",
    "Follower.deliver": "gw_delivered",
    "OutputStream.on_message": "gw_response",
}
ORDER = (
    "client_send",
    "client_call",
    "gw_handler",
    "gw_admitted",
    "gw_submit",
    "intake",
    "dispatch_sent",
    "exec_dispatch",
    "engine_admit",
    "sink_write",
    "gw_delivered",
    "gw_response",
    "client_first",
)


def read_points(trace_dir: Path) -> dict[str, dict[str, float]]:
    """task id -> point -> epoch s."""
    points: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for path in trace_dir.glob("*.log"):
        for line in path.read_text().splitlines():
            stamp, _, label, *rest = line.split(" ", 3)
            detail, t = (rest[0] if rest else ""), float(stamp)
            if label == "settle":  # the client's own times
                task_id, send, *first = detail.split(" ")
                points[task_id]["client_send"] = float(send)
                if first and first[0]:
                    points[task_id]["client_first"] = float(first[0])
            elif label == "SchedulerService._handle_intake>":
                for task_id in detail.split(","):
                    points[task_id].setdefault("intake", t)
            elif label == "RedisOutcomeSink.write>":
                for item in detail.split(","):
                    kind, _, task_id = item.partition(":")
                    if kind == "FirstToken":
                        points[task_id].setdefault("sink_write", t)
            elif label in POINTS and detail:
                points[detail.split(" ")[0]].setdefault(POINTS[label], t)
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--rate", type=float, default=5.5)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--train-rate", type=float, default=0.1)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--policy", default="lemix")
    parser.add_argument("--noise-cv", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    profile = load_profile(default_profile_path())
    wl, _ = make_workload(args)
    slo = compute_slo(profile, wl.tasks, SloConfig())
    config = SimRunConfig(
        policy=args.policy,
        num_nodes=args.nodes,
        seed=args.seed,
        latency_noise_cv=args.noise_cv,
        train_rate=args.train_rate,
        **engine_knobs(args),
    )
    _, result = run_simulation(
        config, profile, wl.tasks, request_rate=args.rate, duration_s=wl.duration_s, slo=slo
    )
    sim = {
        r.task_id: r
        for r in result.records
        if r.kind is TaskKind.INFERENCE and r.first_token_s is not None and r.placed_s is not None
    }
    hops: dict[str, list[float]] = collections.defaultdict(list)
    num = 0
    for task_id, p in read_points(Path(args.trace_dir)).items():
        s = sim.get(task_id.partition("-")[2])
        if s is None or any(name not in p for name in ORDER):
            continue
        assert s.placed_s is not None and s.first_token_s is not None  # `sim` keeps only those
        num += 1
        for a, b in zip(ORDER, ORDER[1:], strict=False):
            hops[f"{a} -> {b}"].append(p[b] - p[a])
        hops["live: client_call -> gw_submit (gateway)"].append(p["gw_submit"] - p["client_call"])
        hops["live: gw_submit -> dispatch_sent (scheduler)"].append(
            p["dispatch_sent"] - p["gw_submit"]
        )
        hops["live: client_send -> dispatch_sent"].append(p["dispatch_sent"] - p["client_send"])
        hops["sim: arrival -> placed"].append(s.placed_s - s.arrival_s)
        hops["live: engine_admit -> sink_write"].append(p["sink_write"] - p["engine_admit"])
        hops["sim: placed -> first token"].append(s.first_token_s - s.placed_s)
        hops["live: sink_write -> client_first"].append(p["client_first"] - p["sink_write"])
        hops["live TTFT"].append(p["client_first"] - p["client_send"])
        hops["sim TTFT"].append(s.first_token_s - s.arrival_s)
    print(f"{num} inference requests with every point; ms:")
    print(f"{'hop':44s} {'p10':>8s} {'p50':>8s} {'p90':>8s} {'mean':>8s}")
    for name, values in hops.items():
        v = 1e3 * np.array(values)
        p10, p50, p90 = np.percentile(v, [10, 50, 90])
        print(f"{name:44s} {p10:8.1f} {p50:8.1f} {p90:8.1f} {v.mean():8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
