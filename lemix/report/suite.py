"""`lemix report`: every simulated figure and table of the results, regenerated.

One `ReportConfig` says what runs; `run_report` runs it and writes
`index.md`, the PNGs and each section's runs.json into one directory:
- per workload (Poisson conversation, long-prompt, and the Azure trace when a
  path is given) and per request rate (light, near saturation, overloaded):
  the Pareto frontier of goodput vs in-window training (`lemix.report.pareto`),
  each policy swept over the offered train rate, and the policies that defer
  training also over their admission threshold (`slo_headroom`) and over
  homed training (`--training-nodes auto`, per-node or cluster-wide admission);
- throughput (requests/s, output tokens/s, training samples/s: separate
  columns, never summed), SLO attainment and goodput vs request rate and vs
  train rate, read off the same runs of the first workload (Poisson
  conversation in the presets);
- the ablations on the first workload at its middle rate.
Verdicts are computed from the data, never written by hand. The caller (the
CLI) gives the date and command that head the page, so this module reads no
clock.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lemix.profile import Profile
from lemix.report.compare import SweepConfig, aggregate, run_sweep, write_json
from lemix.report.pareto import ParetoPoint, Verdict, frontier, placement_of, points_from_runs
from lemix.report.pareto import verdict as frontier_verdict
from lemix.report.plots import plot_pareto, plot_sweeps
from lemix.sim.run import SimRunConfig
from lemix.workload import LONG_PROMPT_MAX_TOTAL_TOKENS, WorkloadConfig

REFERENCE = "lemix"
PARETO_POLICIES = ("separate", "mix-rr", "mix-luf", "mix-rr-capped", "mix-luf-capped", REFERENCE)
# The policies whose planner defers training by predicted slack: their
# admission threshold is a knob an operator has, so it is swept too.
ADMISSION_POLICIES = ("mix-rr-capped", "mix-luf-capped", REFERENCE)
# lemix-paper is the prototype's prefill-only latency estimator.
ABLATION_POLICIES = (
    REFERENCE,
    "lemix-nolc",
    "lemix-noprofile",
    "lemix-paper",
    "lemix-nomem",
    "lemix-nodeprio",
)
LOAD_LABELS = ("light", "near saturation", "overloaded")
# Segments of the trace: seed k replays slice k mod N, time-scaled to the rate.
TRACE_SEGMENTS = 20
# (metric, label) of the sweep figures: each throughput on its own panel.
SWEEP_PANELS: tuple[tuple[str, str], ...] = (
    ("slo_attainment", "SLO attainment"),
    ("goodput_rps", "goodput (req/s meeting SLO)"),
    ("throughput_requests_s", "requests/s completed"),
    ("throughput_tokens_s", "output tokens/s"),
    ("training_samples_s_window", "training samples/s in window"),
)


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload of the report and its three request rates."""

    slug: str  # directory name
    title: str
    base: WorkloadConfig  # rate, train rate, seed (and segment) are swept
    rates: tuple[float, ...]  # light, near saturation, overloaded (req/s)
    cli_flags: str  # the `lemix compare` flags that build `base`


@dataclass(frozen=True)
class ReportConfig:
    """What a report runs. `full_config` / `quick_config` are the presets."""

    workloads: tuple[WorkloadSpec, ...]
    seeds: tuple[int, ...]
    train_rates: tuple[float, ...]  # the Pareto knob of every policy
    # Extra admission thresholds (beside the default), at `headroom_train_rates`.
    headroom_values: tuple[float, ...]
    headroom_train_rates: tuple[float, ...]
    ablation_train_rates: tuple[float, ...]
    # Homed training (`--training-nodes auto`: SEPARATE's training nodes, the
    # rest only serve) under each admission scope, at these train rates (those
    # where auto leaves serving-only nodes), for the admission policies.
    homed_train_rates: tuple[float, ...] = ()
    homed_admissions: tuple[str, ...] = ("node", "cluster")
    template: SimRunConfig = field(
        default_factory=lambda: SimRunConfig(measure_decision_latency=False)
    )
    # The `lemix compare` flags that give `template`'s engine ("" = the default,
    # engine v2), so the page's reproduce commands run the same engine.
    engine_flags: str = ""
    num_workers: int | None = None

    def __post_init__(self) -> None:
        if len(self.seeds) < 2:
            raise ValueError("a report needs >= 2 seeds: verdicts rest on CIs")
        if list(self.seeds) != list(range(self.seeds[0], self.seeds[0] + len(self.seeds))):
            raise ValueError(f"seeds must be consecutive (as `compare --seeds`), got {self.seeds}")
        if not self.workloads:
            raise ValueError("a report needs at least one workload")
        default = self.template.slo_headroom
        if default in self.headroom_values:
            raise ValueError(f"headroom {default} is the default, already run")


def poisson_workload(duration_s: float, rates: tuple[float, ...]) -> WorkloadSpec:
    base = WorkloadConfig(source="poisson", request_rate=rates[0], duration_s=duration_s)
    return WorkloadSpec("conversation", "Poisson, conversation lengths", base, rates, "")


def long_prompt_workload(duration_s: float, rates: tuple[float, ...]) -> WorkloadSpec:
    base = WorkloadConfig(
        source="long-prompt",
        request_rate=rates[0],
        duration_s=duration_s,
        max_total_tokens=LONG_PROMPT_MAX_TOTAL_TOKENS,
    )
    title = "long-prompt/short-output, bursty (Gamma CV 3)"
    return WorkloadSpec("long-prompt", title, base, rates, "--workload long-prompt")


def trace_workload(path: str, duration_s: float, rates: tuple[float, ...]) -> WorkloadSpec:
    base = WorkloadConfig(
        source="trace",
        trace_path=path,
        request_rate=rates[0],
        duration_s=duration_s,
        num_segments=TRACE_SEGMENTS,
    )
    title = f"Azure conversation trace, seed k replays segment k of {TRACE_SEGMENTS}"
    return WorkloadSpec("trace", title, base, rates, f"--trace {path} --segments {TRACE_SEGMENTS}")


# Rates on the shipped 4x2 A100 profile. Conversation: from docs/results.md
# (SLO attainment ~1 at 4, near the knee at 10, collapsing at 16). Long-prompt:
# a probe (lemix, 60 s, train 0.5) gave attainment 0.81 / 0.62 / 0.13 at 1 / 3 / 6.
CONVERSATION_RATES = (4.0, 10.0, 16.0)
LONG_PROMPT_RATES = (1.0, 3.0, 6.0)


def _workloads(duration_s: float, trace_path: str | None) -> tuple[WorkloadSpec, ...]:
    specs = [
        poisson_workload(duration_s, CONVERSATION_RATES),
        long_prompt_workload(duration_s, LONG_PROMPT_RATES),
    ]
    if trace_path is not None:
        specs.append(trace_workload(trace_path, duration_s, CONVERSATION_RATES))
    return tuple(specs)


def full_config(trace_path: str | None, num_workers: int | None = None) -> ReportConfig:
    """`make report`: 3 seeds, 60 s windows (about 20 min on 2 cores with the trace)."""
    return ReportConfig(
        workloads=_workloads(60.0, trace_path),
        seeds=(0, 1, 2),
        train_rates=(0.3, 0.6, 0.9),
        headroom_values=(0.5, 1.0),
        headroom_train_rates=(0.9,),
        ablation_train_rates=(0.5, 0.9),
        homed_train_rates=(0.3, 0.6),
        num_workers=num_workers,
    )


def quick_config(trace_path: str | None, num_workers: int | None = None) -> ReportConfig:
    """`make report-quick` (CI): every section, 2 seeds, 30 s windows, fewer points."""
    return ReportConfig(
        workloads=_workloads(30.0, trace_path),
        seeds=(0, 1),
        train_rates=(0.3, 0.9),
        headroom_values=(0.5,),
        headroom_train_rates=(0.9,),
        ablation_train_rates=(0.9,),
        homed_train_rates=(0.3,),
        num_workers=num_workers,
    )


# ------------------------------------------------------------------ running


@dataclass(frozen=True)
class ParetoCell:
    """One (workload, rate) frontier comparison."""

    workload: WorkloadSpec
    rate: float
    load: str  # light / near saturation / overloaded
    points: list[ParetoPoint]
    frontiers: dict[str, list[ParetoPoint]]
    verdicts: list[Verdict]


Progress = Callable[[str], None]


def run_workload(
    spec: WorkloadSpec, config: ReportConfig, profile: Profile
) -> list[dict[str, Any]]:
    """Every Pareto run of one workload: all policies on the (rate x train) grid
    at the default threshold, then the admission policies at the other thresholds."""
    grid = SweepConfig(PARETO_POLICIES, spec.rates, config.train_rates, config.seeds, is_grid=True)
    runs = run_sweep(grid, spec.base, config.template, profile, num_workers=config.num_workers)
    for headroom in config.headroom_values:
        sweep = SweepConfig(
            ADMISSION_POLICIES,
            spec.rates,
            config.headroom_train_rates,
            config.seeds,
            is_grid=True,
        )
        template = replace(config.template, slo_headroom=headroom)
        runs += run_sweep(sweep, spec.base, template, profile, num_workers=config.num_workers)
    for admission in config.homed_admissions if config.homed_train_rates else ():
        sweep = SweepConfig(
            ADMISSION_POLICIES, spec.rates, config.homed_train_rates, config.seeds, is_grid=True
        )
        template = replace(
            config.template,
            training_nodes="auto",
            is_admission_cluster_wide=admission == "cluster",
        )
        runs += run_sweep(sweep, spec.base, template, profile, num_workers=config.num_workers)
    return runs


def pareto_cells(spec: WorkloadSpec, runs: Sequence[dict[str, Any]]) -> list[ParetoCell]:
    """Points, frontiers and verdicts (lemix vs each other policy) per rate."""
    cells = []
    for rate, load in zip(spec.rates, LOAD_LABELS, strict=False):
        points = points_from_runs([r for r in runs if r["request_rate"] == rate])
        frontiers = {
            policy: frontier([p for p in points if p.policy == policy])
            for policy in PARETO_POLICIES
        }
        verdicts = [
            frontier_verdict(frontiers[REFERENCE], frontiers[policy])
            for policy in PARETO_POLICIES
            if policy != REFERENCE and frontiers[policy] and frontiers[REFERENCE]
        ]
        cells.append(ParetoCell(spec, rate, load, points, frontiers, verdicts))
    return cells


# ------------------------------------------------------------------ writing


@dataclass(frozen=True)
class ReportResult:
    index_path: Path
    png_paths: list[Path]
    cells: list[ParetoCell]


def run_report(
    config: ReportConfig,
    profile: Profile,
    out_dir: Path,
    *,
    command: str,
    date: str,
    notes: Sequence[str] = (),
    progress: Progress = lambda _: None,
    runs_from: Path | None = None,
    loss_root: Path | None = None,
) -> ReportResult:
    """Run every section and write `out_dir`/index.md and the PNGs.

    `command` and `date` head the page (the caller knows them); `notes` are
    printed lines that go into it too (e.g. a skipped trace). With
    `runs_from`, nothing is simulated: each section's runs are read from the
    runs.json files an earlier report wrote there (to re-render the page).
    `loss_root`: where to look for the live loss study's results (rendered,
    not run: `lemix.report.loss_section`); None leaves the section out.
    """
    from lemix.report.loss_section import find_studies, loss_section
    from lemix.report.suite_write import write_index

    out_dir.mkdir(parents=True, exist_ok=True)
    pngs: list[Path] = []
    loss_lines: list[str] = []
    if loss_root is not None:
        loss_lines, loss_pngs = loss_section(find_studies(loss_root), out_dir)
        pngs += loss_pngs
    cells: list[ParetoCell] = []
    sweep_rows: list[dict[str, Any]] = []
    ablation_rows: list[dict[str, Any]] = []

    def write(is_complete: bool) -> Path:
        # Rewritten after every section, so a run cut short still leaves a
        # page with what it finished (and says so).
        partial = [] if is_complete else ["PARTIAL: the report was still running."]
        return write_index(
            out_dir / "index.md",
            config,
            cells=cells,
            sweep_rows=sweep_rows,
            ablation_rows=ablation_rows,
            profile_name=profile.name,
            command=command,
            date=date,
            notes=[*notes, *partial],
            loss_lines=loss_lines,
        )

    for spec in config.workloads:
        progress(f"pareto: {spec.title} at {', '.join(f'{r:g}' for r in spec.rates)} req/s")
        if runs_from is None:
            runs = run_workload(spec, config, profile)
        else:
            runs = json.loads((runs_from / spec.slug / "runs.json").read_text())
        wl_dir = out_dir / spec.slug
        wl_dir.mkdir(exist_ok=True)
        write_json(wl_dir / "runs.json", runs)
        for cell in pareto_cells(spec, runs):
            title = f"{spec.title}: {cell.rate:g} req/s ({cell.load})"
            path = wl_dir / f"pareto_{cell.rate:g}rps.png"
            pngs.append(plot_pareto(cell.points, cell.frontiers, PARETO_POLICIES, title, path))
            cells.append(cell)
        if spec is config.workloads[0]:  # the sweeps and the ablations use the first
            default_runs = [
                r
                for r in runs
                if r["slo_headroom"] == config.template.slo_headroom and placement_of(r) == "spread"
            ]
            sweep_rows = aggregate(default_runs, PARETO_POLICIES)
            pngs += plot_sweeps(
                sweep_rows,
                PARETO_POLICIES,
                spec.rates[len(spec.rates) // 2],
                _middle(config.train_rates),
                wl_dir,
                SWEEP_PANELS,
            )
            write(is_complete=False)
            progress(f"ablations: {spec.title}")
            ablation_rows = run_ablations(config, profile, out_dir, runs_from)
        write(is_complete=False)
    index = write(is_complete=True)
    return ReportResult(index, pngs, cells)


def run_ablations(
    config: ReportConfig, profile: Profile, out_dir: Path, runs_from: Path | None = None
) -> list[dict[str, Any]]:
    spec = config.workloads[0]
    rate = spec.rates[len(spec.rates) // 2]
    sweep = SweepConfig(
        ABLATION_POLICIES, (rate,), config.ablation_train_rates, config.seeds, is_grid=True
    )
    if runs_from is None:
        runs = run_sweep(sweep, spec.base, config.template, profile, num_workers=config.num_workers)
    else:
        runs = json.loads((runs_from / "ablations" / "runs.json").read_text())
    (out_dir / "ablations").mkdir(exist_ok=True)
    write_json(out_dir / "ablations" / "runs.json", runs)
    return aggregate(runs, ABLATION_POLICIES)


def _middle(values: Sequence[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]
