"""The markdown of `lemix report` (runs/report/index.md), from results only.

Every verdict and number on the page is computed from the runs; the only
prose is fixed text that explains the rules. Split from `lemix.report.suite`
(which runs the sections) so each file stays small.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lemix.report.pareto import ParetoPoint, format_points
from lemix.sim.run import engine_name

if TYPE_CHECKING:
    from lemix.report.suite import ParetoCell, ReportConfig, WorkloadSpec

# (aggregate key, header, format) of the throughput/SLO sweep tables: each
# throughput in its own column, never summed.
SWEEP_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("throughput_requests_s", "requests/s", ".2f"),
    ("throughput_tokens_s", "output tokens/s", ".0f"),
    ("training_samples_s_window", "training samples/s in window", ".2f"),
    ("training_backlog_end", "training backlog at window end", ".0f"),
    ("slo_attainment", "SLO attainment", ".3f"),
    ("goodput_rps", "goodput (req/s)", ".2f"),
    ("num_failed", "failed", ".1f"),
)
ABLATION_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("slo_attainment", "SLO attainment", ".3f"),
    ("goodput_rps", "goodput (req/s)", ".2f"),
    ("training_samples_s_window", "training samples/s in window", ".2f"),
    ("ttft_p99_s", "TTFT p99 (s)", ".2f"),
    ("tbt_p50_s", "TBT p50 (s)", ".3f"),
    ("num_failed", "failed", ".1f"),
)
ABLATION_NOTES = {
    "lemix-nolc": "without length consistency",
    "lemix-noprofile": "without the profile (prototype default η)",
    "lemix-paper": "prototype's score and prefill-only latency estimator",
    "lemix-nomem": "without memory awareness",
    "lemix-nodeprio": "without deprioritization (no training admission control)",
}
FRONTIER_RULE = (
    "x = training samples/s finished inside the arrival window, y = goodput "
    "(requests meeting the SLO per second of window); one point per knob setting "
    "(offered train rate; for `lemix` and the `-capped` baselines also the admission "
    "threshold `--slo-headroom` and homed training, `--training-nodes auto` with "
    "`--admission node` or `cluster`: training only on the nodes SEPARATE would train "
    "on, the others serve only), mean ± 95% CI over seeds. A policy's frontier is its "
    "points no other of its points beats in both means. Point a *significantly "
    "dominates* b when it is better in one coordinate with non-overlapping CIs and at "
    "least as good in the other (mean within 5% of b's or above). `lemix` **loses** "
    "to a policy where one of that policy's frontier points is above `lemix`'s frontier "
    "(it significantly dominates a `lemix` frontier point and no `lemix` frontier point "
    "is within noise of it, i.e. not significantly worse in either coordinate), **wins** "
    "where every frontier point of that policy is significantly dominated by a `lemix` "
    "point above that policy's frontier in the same sense, and **ties** otherwise."
)


def write_index(
    path: Path,
    config: ReportConfig,
    *,
    cells: Sequence[ParetoCell],
    sweep_rows: Sequence[dict[str, Any]],
    ablation_rows: Sequence[dict[str, Any]],
    profile_name: str,
    command: str,
    date: str,
    notes: Sequence[str],
    loss_lines: Sequence[str] = (),
) -> Path:
    """Write the whole page; return its path. `loss_lines`: the rendered loss
    section (`lemix.report.loss_section`)."""
    from lemix.report.suite import ABLATION_POLICIES, PARETO_POLICIES

    seeds = config.seeds
    duration_s = config.workloads[0].base.duration_s
    lines = [
        "# LeMix report (simulated)",
        "",
        f"Generated {date} by `{command}`: profile `{profile_name}`, "
        f"{config.template.num_nodes} nodes, {len(seeds)} seeds ({seeds[0]}..{seeds[-1]}), "
        f"{duration_s:g} s arrival windows, {engine_name(config.template)}. Every number is "
        "the mean ± 95% CI "
        "half width over seeds (Student t); one SLO per workload, shared by all policies.",
        "",
        *(f"> {note}" for note in notes),
        "",
        "## Verdicts: `lemix`'s Pareto frontier against each policy's",
        "",
        FRONTIER_RULE,
        "",
        *verdict_summary(cells, [p for p in PARETO_POLICIES if p != "lemix"]),
        "",
        "## Pareto frontiers",
    ]
    for spec in dict.fromkeys(c.workload for c in cells):
        lines += ["", f"### {spec.title}", "", "Reproduce with:", ""]
        lines += [f"    {cmd}" for cmd in pareto_commands(spec, config)]
        for cell in (c for c in cells if c.workload == spec):
            front = [p for f in cell.frontiers.values() for p in f]
            lines += [
                "",
                f"#### {cell.rate:g} req/s ({cell.load})",
                "",
                f"![pareto]({spec.slug}/pareto_{cell.rate:g}rps.png)",
                "",
                format_points(cell.points, front),
                "",
                *(f"- vs `{v.policy}`: **{v.outcome}**. {v.detail}." for v in cell.verdicts),
                "",
                "Mean goodput of `lemix` minus each policy's at the same knob setting "
                "(offered train rate, threshold), min / max over the settings both ran; "
                "means only, read with the CIs above:",
                "",
                *_gap_lines(cell.points),
            ]
    if sweep_rows:
        conv = config.workloads[0]
        mid_rate = conv.rates[len(conv.rates) // 2]
        mid_train = sorted(config.train_rates)[(len(config.train_rates) - 1) // 2]
        lines += [
            "",
            "## Throughput, SLO attainment and goodput vs request rate and vs train rate",
            "",
            f"The {conv.title} runs above at the default threshold (same command). "
            "Requests/s and output tokens/s divide by the makespan (drain included); "
            "training is read inside the window. Never summed.",
            "",
            f"![vs request rate]({conv.slug}/vs_request_rate.png)",
            f"![vs train rate]({conv.slug}/vs_train_rate.png)",
            "",
            f"At train rate {mid_train:g}:",
            "",
            format_rows(
                [r for r in sweep_rows if r["train_rate"] == mid_train],
                "request_rate",
                "request rate",
                SWEEP_COLUMNS,
            ),
            "",
            f"At {mid_rate:g} req/s:",
            "",
            format_rows(
                [r for r in sweep_rows if r["request_rate"] == mid_rate],
                "train_rate",
                "train rate",
                SWEEP_COLUMNS,
            ),
        ]
    if ablation_rows:
        conv = config.workloads[0]
        rate = conv.rates[len(conv.rates) // 2]
        trains = ",".join(f"{t:g}" for t in config.ablation_train_rates)
        command = _compare(ABLATION_POLICIES, (rate,), trains, config, conv.cli_flags, "ablations")
        lines += [
            "",
            f"## Ablations ({conv.title}, {rate:g} req/s)",
            "",
            *(f"- `{name}`: {text}" for name, text in ABLATION_NOTES.items()),
            "",
            "Reproduce with:",
            "",
            f"    {command}",
            "",
            format_rows(ablation_rows, "train_rate", "train rate", ABLATION_COLUMNS),
        ]
    lines += list(loss_lines)
    lines += [
        "",
        "## Not in this report",
        "",
        f"- Only one engine ({engine_name(config.template)}; the default since 2026-12-02, "
        "v1 before: benchmarks/engine_v2.py compares them) and the shipped profile; "
        "memory never binds on it, so `lemix-nomem` is expected to match `lemix`. "
        "The memory-bound workloads "
        "(`--workload long-output`, `chat`) are measured with `lemix compare` in "
        "docs/results.md.",
        "",
    ]
    path.write_text("\n".join(lines))
    return path


def _gap_lines(points: Sequence[ParetoPoint]) -> list[str]:
    by_knob = {(p.policy, p.train_rate, p.slo_headroom, p.placement): p for p in points}
    lines = []
    for policy in dict.fromkeys(p.policy for p in points):
        if policy == "lemix":
            continue
        gaps = [
            (ref.y.mean - p.y.mean, ref.x.mean - p.x.mean)
            for (name, train, headroom, placement), p in by_knob.items()
            if name == policy
            and (ref := by_knob.get(("lemix", train, headroom, placement))) is not None
        ]
        if gaps:
            dy = [g[0] for g in gaps]
            dx = [g[1] for g in gaps]
            lines.append(
                f"- `{policy}`: goodput {min(dy):+.2f} / {max(dy):+.2f} req/s, in-window "
                f"training {min(dx):+.2f} / {max(dx):+.2f} samples/s ({len(gaps)} settings)"
            )
    return lines


def verdict_summary(cells: Sequence[ParetoCell], others: Sequence[str]) -> list[str]:
    """A markdown table, one row per (workload, rate), one column per policy, and a count."""
    lines = [
        "| workload | req/s | load | " + " | ".join(f"vs {p}" for p in others) + " |",
        "|---|---|---|" + "---|" * len(others),
    ]
    counts: Counter[str] = Counter()
    for cell in cells:
        by_policy = {v.policy: v.outcome for v in cell.verdicts}
        counts.update(by_policy.values())
        outcomes = " | ".join(by_policy.get(p, "n/a") for p in others)
        lines.append(f"| {cell.workload.slug} | {cell.rate:g} | {cell.load} | {outcomes} |")
    total = ", ".join(f"{counts[k]} {k}" for k in ("wins", "ties", "loses"))
    return [*lines, "", f"In all: {total} (lemix's side)."]


def format_rows(
    rows: Sequence[dict[str, Any]],
    key: str,
    header: str,
    columns: Sequence[tuple[str, str, str]],
) -> str:
    """`aggregate` rows as a markdown table: policy, `key`, then "mean ± CI" columns."""
    lines = [
        f"| policy | {header} | n | " + " | ".join(h for _, h, _ in columns) + " |",
        "|---|---|---|" + "---|" * len(columns),
    ]
    for row in sorted(rows, key=lambda r: r[key]):
        cells = [_cell(row[name], fmt) for name, _, fmt in columns]
        lines.append(
            f"| {row['policy']} | {row[key]:g} | {row['num_seeds']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def _cell(agg: dict[str, Any], fmt: str) -> str:
    if agg["mean"] is None:
        return "–"
    ci = "–" if agg["ci95"] is None else format(agg["ci95"], fmt)
    return f"{format(agg['mean'], fmt)} ± {ci}"


def pareto_commands(spec: WorkloadSpec, config: ReportConfig) -> list[str]:
    """The `lemix compare` commands that give the same runs as one workload's section."""
    from lemix.report.suite import ADMISSION_POLICIES, PARETO_POLICIES

    trains = ",".join(f"{t:g}" for t in config.train_rates)
    commands = [_compare(PARETO_POLICIES, spec.rates, trains, config, spec.cli_flags, spec.slug)]
    h_trains = ",".join(f"{t:g}" for t in config.headroom_train_rates)
    for headroom in config.headroom_values:
        flags = f"{spec.cli_flags} --slo-headroom {headroom:g}".strip()
        out = f"{spec.slug}-h{headroom:g}"
        commands.append(_compare(ADMISSION_POLICIES, spec.rates, h_trains, config, flags, out))
    homed_trains = ",".join(f"{t:g}" for t in config.homed_train_rates)
    for admission in config.homed_admissions:
        flags = f"{spec.cli_flags} --training-nodes auto --admission {admission}".strip()
        out = f"{spec.slug}-homed-{admission}"
        commands.append(_compare(ADMISSION_POLICIES, spec.rates, homed_trains, config, flags, out))
    return commands


def _compare(
    policies: Sequence[str],
    rates: Sequence[float],
    train_rates: str,
    config: ReportConfig,
    flags: str,
    out: str,
) -> str:
    seeds = config.seeds
    rate_list = ",".join(f"{r:g}" for r in rates)
    return (
        f"python -m lemix.cli compare --policies {','.join(policies)} --rates {rate_list} "
        f"--train-rates {train_rates} --grid --seeds {len(seeds)} --seed {seeds[0]} "
        f"--duration {config.workloads[0].base.duration_s:g} --deterministic "
        f"{flags + ' ' if flags else ''}"
        f"{config.engine_flags + ' ' if config.engine_flags else ''}--out runs/compare/{out}"
    )
