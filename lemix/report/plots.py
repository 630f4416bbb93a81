"""PNG plots of a comparison: one line per policy, 95% CI error bars.

matplotlib is imported inside the plotting function (Agg backend), so
importing lemix never needs a display or pays matplotlib's import time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lemix.report.pareto import ParetoPoint

# (aggregate name, axis label) of the panels in each figure.
PANELS: tuple[tuple[str, str], ...] = (
    ("slo_attainment", "SLO attainment"),
    ("goodput_rps", "goodput (req/s meeting SLO)"),
    ("throughput_tasks_s", "throughput (tasks/s)"),
)


def plot_sweeps(
    rows: Sequence[dict[str, Any]],
    policies: Sequence[str],
    request_rate: float,
    train_rate: float,
    out_dir: Path,
    panels: Sequence[tuple[str, str]] = PANELS,
) -> list[Path]:
    """Write vs_request_rate.png (at `train_rate`) and vs_train_rate.png (at
    `request_rate`) from `aggregate` rows, one panel per (metric, label) of
    `panels`; return the paths written."""
    at_train = [r for r in rows if r["train_rate"] == train_rate]
    at_rate = [r for r in rows if r["request_rate"] == request_rate]
    return [
        _plot(
            at_train,
            policies,
            "request_rate",
            "request rate (req/s)",
            f"train rate {train_rate:g}",
            out_dir / "vs_request_rate.png",
            panels,
        ),
        _plot(
            at_rate,
            policies,
            "train_rate",
            "train rate (fraction of tasks)",
            f"request rate {request_rate:g} req/s",
            out_dir / "vs_train_rate.png",
            panels,
        ),
    ]


def _plot(
    rows: Sequence[dict[str, Any]],
    policies: Sequence[str],
    x_key: str,
    x_label: str,
    title: str,
    path: Path,
    panels: Sequence[tuple[str, str]],
) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (metric, label) in zip(axes[0], panels, strict=True):
        for policy in policies:
            xs, ys, errs = _series(rows, policy, x_key, metric)
            if xs:
                ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=policy)
        ax.set_xlabel(x_label)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"{title}; mean over seeds, 95% CI")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _series(
    rows: Sequence[dict[str, Any]], policy: str, x_key: str, metric: str
) -> tuple[list[float], list[float], list[float]]:
    """Sorted (x, mean, CI half width) of one policy; undefined means are skipped."""
    points = sorted(
        (r[x_key], r[metric]["mean"], r[metric]["ci95"] or 0.0)
        for r in rows
        if r["policy"] == policy and r[metric]["mean"] is not None
    )
    return [p[0] for p in points], [p[1] for p in points], [p[2] for p in points]


def plot_pareto(
    points: Sequence[ParetoPoint],
    frontiers: Mapping[str, Sequence[ParetoPoint]],
    policies: Sequence[str],
    title: str,
    path: Path,
) -> Path:
    """Every policy's points (95% CI bars in both coordinates) and its frontier
    as a line: goodput vs in-window training throughput."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    for i, policy in enumerate(policies):
        color = f"C{i % 10}"
        mine = [p for p in points if p.policy == policy]
        if not mine:
            continue
        ax.errorbar(
            [p.x.mean for p in mine],
            [p.y.mean for p in mine],
            xerr=[p.x.ci95 for p in mine],
            yerr=[p.y.ci95 for p in mine],
            fmt="o",
            color=color,
            alpha=0.45,
            capsize=2,
        )
        front = frontiers.get(policy, [])
        ax.plot(
            [p.x.mean for p in front],
            [p.y.mean for p in front],
            "-",
            color=color,
            linewidth=2.5 if policy == "lemix" else 1.5,
            label=policy,
        )
    ax.set_xlabel("training samples/s inside the arrival window")
    ax.set_ylabel("goodput (req/s meeting SLO)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(f"{title}\nmean over seeds, 95% CI; lines: each policy's frontier", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
