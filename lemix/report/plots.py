"""PNG plots of a comparison: one line per policy, 95% CI error bars.

matplotlib is imported inside the plotting function (Agg backend), so
importing lemix never needs a display or pays matplotlib's import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
) -> list[Path]:
    """Write vs_request_rate.png (at `train_rate`) and vs_train_rate.png (at
    `request_rate`) from `aggregate` rows; return the paths written."""
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
        ),
        _plot(
            at_rate,
            policies,
            "train_rate",
            "train rate (fraction of tasks)",
            f"request rate {request_rate:g} req/s",
            out_dir / "vs_train_rate.png",
        ),
    ]


def _plot(
    rows: Sequence[dict[str, Any]],
    policies: Sequence[str],
    x_key: str,
    x_label: str,
    title: str,
    path: Path,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), squeeze=False)
    for ax, (metric, label) in zip(axes[0], PANELS, strict=True):
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
