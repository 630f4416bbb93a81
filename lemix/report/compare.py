"""Many simulations on identical workloads: the fairness-preserving comparison.

For one workload point (request rate, train rate, seed) the task list is built
once and handed unchanged to every policy, and the SLO is computed once from
that workload and the profile (`compute_slo`), so every policy is judged
against the same threshold. Repetitions use different seeds. A worker process
runs one whole workload point (all policies), so only small frozen configs
cross the process boundary; results are sorted, so they do not depend on how
the pool scheduled the work.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from lemix.planner.registry import get_spec
from lemix.profile import Profile
from lemix.report.metrics import format_table, mean_ci95
from lemix.sim.run import SimRunConfig, run_simulation
from lemix.slo import compute_slo
from lemix.types import Task
from lemix.workload import Workload, WorkloadConfig, WorkloadData, build_workload
from lemix.workload.poisson import load_workload_data

# (summary name, dotted path into a run object) for every aggregated metric.
AGG_METRICS: tuple[tuple[str, str], ...] = (
    ("slo_attainment", "slo_attainment"),
    ("goodput_rps", "goodput_rps"),
    ("throughput_tasks_s", "throughput_tasks_s"),
    ("throughput_tokens_s", "throughput_tokens_s"),
    ("throughput_requests_s", "throughput_requests_s"),
    ("ttft_p50_s", "ttft_s.p50"),
    ("ttft_p99_s", "ttft_s.p99"),
    ("tbt_p50_s", "tbt_s.p50"),
    ("training_samples_s", "training_samples_s"),
    ("training_samples_s_window", "training_samples_s_window"),
    ("training_backlog_end", "training_backlog_end"),
    ("num_failed", "num_failed"),
    ("num_failed_kv_memory", "num_failed_kv_memory"),
    ("num_kv_offloads", "num_kv_offloads"),
    ("serving_staleness_updates", "serving_staleness_updates"),
    ("utilization", "utilization"),
    ("throughput_tasks_s_paper", "throughput_tasks_s_paper"),
)
TABLE_COLUMNS: list[tuple[str, str]] = [
    ("policy", "policy"),
    ("request_rate", "rps"),
    ("train_rate", "train"),
    ("num_seeds", "n"),
    ("slo_attainment", "SLO att."),
    ("goodput_rps", "goodput/s"),
    ("throughput_tasks_s", "tasks/s"),
    ("throughput_tokens_s", "tokens/s"),
    ("ttft_p50_s", "TTFT p50 s"),
    ("ttft_p99_s", "TTFT p99 s"),
    ("tbt_p50_s", "TBT p50 s"),
    ("training_samples_s", "train smp/s"),
    ("training_samples_s_window", "in-window smp/s"),
    ("num_failed", "failed"),
    ("serving_staleness_updates", "staleness"),
]


@dataclass(frozen=True)
class SweepConfig:
    """Which policies, workload points and seeds a comparison runs.

    Points: with `is_grid`, every (request rate × train rate); otherwise two
    one-dimensional sweeps, request rates at `fixed_train_rate` and train rates
    at `fixed_request_rate` (the middle of each list when not given). The
    fixed values also choose the slices the plots show.
    """

    policies: tuple[str, ...]
    request_rates: tuple[float, ...]
    train_rates: tuple[float, ...]
    seeds: tuple[int, ...]
    fixed_request_rate: float | None = None
    fixed_train_rate: float | None = None
    is_grid: bool = False

    def __post_init__(self) -> None:
        for name, values in (
            ("policies", self.policies),
            ("request_rates", self.request_rates),
            ("train_rates", self.train_rates),
            ("seeds", self.seeds),
        ):
            if not values:
                raise ValueError(f"{name} must not be empty")
            if len(set(values)) != len(values):
                raise ValueError(f"{name} has duplicates: {list(values)}")
        for policy in self.policies:
            get_spec(policy)  # ValueError listing the known policies
        if any(r <= 0 for r in self.request_rates):
            raise ValueError("request rates must be > 0")
        if any(not 0.0 <= r < 1.0 for r in self.train_rates):
            raise ValueError("train rates must be in [0, 1)")
        if any(s < 0 for s in self.seeds):
            raise ValueError("seeds must be >= 0")

    @property
    def request_rate_slice(self) -> float:
        """The request rate of the train-rate sweep (and its plot)."""
        if self.fixed_request_rate is not None:
            return self.fixed_request_rate
        return statistics.median_low(sorted(self.request_rates))

    @property
    def train_rate_slice(self) -> float:
        """The train rate of the request-rate sweep (and its plot)."""
        if self.fixed_train_rate is not None:
            return self.fixed_train_rate
        return statistics.median_low(sorted(self.train_rates))

    def points(self) -> list[tuple[float, float]]:
        """Sorted, distinct (request_rate, train_rate) workload points."""
        if self.is_grid:
            pts = {(r, t) for r in self.request_rates for t in self.train_rates}
        else:
            pts = {(r, self.train_rate_slice) for r in self.request_rates}
            pts |= {(self.request_rate_slice, t) for t in self.train_rates}
        return sorted(pts)


@dataclass(frozen=True)
class _PointJob:
    """One workload point: everything a worker needs, small and picklable."""

    policies: tuple[str, ...]
    workload: WorkloadConfig
    template: SimRunConfig
    profile: Profile


def run_compare(
    policies: Sequence[str],
    request_rates: Sequence[float],
    train_rates: Sequence[float],
    seeds: Sequence[int],
    workload: WorkloadConfig,
    template: SimRunConfig,
    profile: Profile,
    *,
    fixed_request_rate: float | None = None,
    fixed_train_rate: float | None = None,
    is_grid: bool = False,
    num_workers: int | None = None,
) -> list[dict[str, Any]]:
    """Run every policy on every (point, seed); return run objects, sorted.

    `workload` and `template` give everything but the swept fields (request
    rate, train rate, seed; policy). Runs come back ordered by (request_rate,
    train_rate, seed, position of the policy in `policies`).
    """
    sweep = SweepConfig(
        tuple(policies),
        tuple(request_rates),
        tuple(train_rates),
        tuple(seeds),
        fixed_request_rate,
        fixed_train_rate,
        is_grid,
    )
    return run_sweep(sweep, workload, template, profile, num_workers=num_workers)


def run_sweep(
    sweep: SweepConfig,
    workload: WorkloadConfig,
    template: SimRunConfig,
    profile: Profile,
    *,
    num_workers: int | None = None,
) -> list[dict[str, Any]]:
    """`run_compare` for a validated SweepConfig."""
    jobs = [
        _PointJob(
            sweep.policies,
            # With trace segments, seed k replays segment k mod N: repetitions
            # then differ in their arrivals, not only in their noise.
            replace(
                workload,
                request_rate=rate,
                train_rate=train,
                seed=seed,
                segment=seed % workload.num_segments,
            ),
            template,
            profile,
        )
        for rate, train in sweep.points()
        for seed in sweep.seeds
    ]
    # Largest first, so the last job to finish is a short one.
    jobs.sort(key=lambda j: -j.workload.request_rate / (1.0 - j.workload.train_rate))
    workers = min(num_workers or min(2, os.cpu_count() or 1), len(jobs))
    if workers <= 1:
        batches = [_run_point(job) for job in jobs]
    else:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            batches = pool.map(_run_point, jobs, chunksize=1)
    order = {name: i for i, name in enumerate(sweep.policies)}
    runs = [run for batch in batches for run in batch]
    runs.sort(key=lambda r: (r["request_rate"], r["train_rate"], r["seed"], order[r["policy"]]))
    return runs


def _run_point(job: _PointJob) -> list[dict[str, Any]]:
    """Build the point's workload once, compute its SLO once, run every policy on it."""
    wl = _build(job.workload)
    slo = compute_slo(job.profile, wl.tasks, job.template.slo)
    fingerprint = workload_fingerprint(wl.tasks)
    runs = []
    for policy in job.policies:
        config = replace(
            job.template, policy=policy, seed=job.workload.seed, train_rate=job.workload.train_rate
        )
        metrics, _ = run_simulation(
            config,
            job.profile,
            wl.tasks,
            request_rate=job.workload.request_rate,
            duration_s=wl.duration_s,
            slo=slo,
        )
        metrics["workload_sha256"] = fingerprint
        runs.append(metrics)
    return runs


def _build(config: WorkloadConfig) -> Workload:
    # The files depend on neither the swept fields nor the seed: read them once per process.
    files = replace(config, request_rate=1.0, train_rate=0.0, seed=0)
    return build_workload(config, _workload_data(files))


@lru_cache(maxsize=2)
def _workload_data(files: WorkloadConfig) -> WorkloadData:
    return load_workload_data(files)


def workload_fingerprint(tasks: Sequence[Task]) -> str:
    """SHA-256 of the task list (ids, kinds, arrivals, lengths): equal ⇔ same workload."""
    digest = hashlib.sha256()
    for t in tasks:
        digest.update(
            f"{t.task_id},{t.kind.value},{t.arrival_s!r},{t.num_prompt_tokens},"
            f"{t.max_output_tokens},{t.batch_size};".encode()
        )
    return digest.hexdigest()


# ------------------------------------------------------------------ aggregation


def aggregate(runs: Sequence[dict[str, Any]], policies: Sequence[str]) -> list[dict[str, Any]]:
    """Mean and 95% CI half width per (policy, request_rate, train_rate) over seeds.

    Each metric becomes {"mean", "ci95", "n"}; n counts the seeds where the
    metric was defined (None values, e.g. no completed request, are left out).
    """
    groups: dict[tuple[str, float, float], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["policy"], run["request_rate"], run["train_rate"]), []).append(run)
    order = {name: i for i, name in enumerate(policies)}
    rows = []
    for (policy, rate, train), members in sorted(
        groups.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0][1], kv[0][2])
    ):
        row: dict[str, Any] = {
            "policy": policy,
            "request_rate": rate,
            "train_rate": train,
            "num_seeds": len(members),
            "seeds": sorted(r["seed"] for r in members),
        }
        for name, path in AGG_METRICS:
            row[name] = _mean_ci([_lookup(r, path) for r in members])
        rows.append(row)
    return rows


def _mean_ci(values: Sequence[float | None]) -> dict[str, float | int | None]:
    present = [float(v) for v in values if v is not None]
    if not present:
        return {"mean": None, "ci95": None, "n": 0}
    mean, half = mean_ci95(present)
    return {"mean": mean, "ci95": half, "n": len(present)}


def _lookup(run: dict[str, Any], path: str) -> Any:
    value: Any = run
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def format_summary(rows: Sequence[dict[str, Any]]) -> str:
    """The console table: each metric as "mean ± 95% CI half width"."""
    cells = []
    for row in rows:
        cell = {k: row[k] for k in ("policy", "request_rate", "train_rate", "num_seeds")}
        for name, _ in AGG_METRICS:
            agg = row[name]
            cell[name] = None if agg["mean"] is None else (agg["mean"], agg["ci95"])
        cells.append(cell)
    return format_table(cells, TABLE_COLUMNS)


# ------------------------------------------------------------------ outputs


@dataclass(frozen=True)
class CompareReport:
    table: str
    runs_path: Path
    summary_path: Path
    plot_paths: list[Path]


def write_report(
    out_dir: str | Path,
    runs: Sequence[dict[str, Any]],
    sweep: SweepConfig,
    extra: dict[str, Any] | None = None,
) -> CompareReport:
    """Write runs.json, summary.json and the PNG plots into `out_dir`."""
    from lemix.report.plots import plot_sweeps

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = aggregate(runs, sweep.policies)
    runs_path = write_json(out / "runs.json", list(runs))
    summary = {
        "policies": list(sweep.policies),
        "points": [list(p) for p in sweep.points()],
        "seeds": list(sweep.seeds),
        "request_rate_slice": sweep.request_rate_slice,
        "train_rate_slice": sweep.train_rate_slice,
        "slo_note": "one SLO per workload (rate, train rate, seed), shared by all policies",
        **(extra or {}),
        "aggregates": rows,
    }
    summary_path = write_json(out / "summary.json", summary)
    plots = plot_sweeps(rows, sweep.policies, sweep.request_rate_slice, sweep.train_rate_slice, out)
    return CompareReport(format_summary(rows), runs_path, summary_path, plots)


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
