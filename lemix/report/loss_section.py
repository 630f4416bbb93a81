"""The report's inference-loss section, rendered from the loss study's results.

The study (`benchmarks/inference_loss.py`: live torch executors on the
project-pretrained model, LeMix vs SEPARATE per sync interval K, over seeds)
takes ~40 minutes on 2 cores, beyond `make report`'s budget, so the report
does not run it: `make report-loss` does, into `runs/bench/inference_loss/`,
and every report renders what such runs left (`find_studies`): the loss
ratio LeMix / SEPARATE vs K with 95% CIs (a table and a PNG), LeMix with
replica sync when the study ran it, and each seed's loss over time.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STUDY_GLOB = "inference_loss*/inference_loss.json"
STUDY_COMMAND = "make report-loss"


def find_studies(root: Path) -> list[Path]:
    """The loss studies' summary files under `root` (e.g. runs/bench), sorted."""
    return sorted(root.glob(STUDY_GLOB)) if root.is_dir() else []


def _fmt(stat: dict[str, Any] | None, digits: int = 3) -> str:
    if not stat or stat.get("mean") is None:
        return "–"
    half = stat.get("ci95_half")
    ci = "–" if half is None or half != half else f"{half:.{digits}f}"  # NaN: one seed
    return f"{stat['mean']:.{digits}f} ± {ci}"


def study_table(summary: dict[str, Any]) -> list[str]:
    """Markdown rows: LeMix, LeMix with replica sync, SEPARATE per K."""
    lemix = summary["lemix"]
    lines = [
        "| run | loss (nats/token) | reference accuracy | SLO attainment "
        "| loss ratio LeMix / this | 2nd half | accuracy LeMix − this |",
        "|---|---|---|---|---|---|---|",
        f"| LeMix | {_fmt(lemix['loss']['all'])} | {_fmt(lemix['accuracy']['all'], 4)} "
        f"| {_fmt(lemix['slo_attainment'])} | | | |",
    ]
    synced = summary.get("lemix_replica_sync")
    if synced is not None:
        # Stored as synced / plain; the column is LeMix / this, so invert the mean only.
        lines.append(
            f"| LeMix + replica sync every {summary.get('replica_sync_every_tasks')} "
            f"| {_fmt(synced['loss']['all'])} | {_fmt(synced['accuracy']['all'], 4)} "
            f"| {_fmt(synced['slo_attainment'])} "
            f"| (this / LeMix: {_fmt(synced['loss_ratio_vs_lemix']['all'])}) "
            f"| ({_fmt(synced['loss_ratio_vs_lemix']['second_half'])}) "
            f"| (this − LeMix: {_fmt(synced['accuracy_diff_vs_lemix']['all'], 4)}) |"
        )
    for k in summary.get("sync_every_list", []):
        sep = summary["separate"][str(k)]
        lines.append(
            f"| SEPARATE K={k} | {_fmt(sep['loss']['all'])} | {_fmt(sep['accuracy']['all'], 4)} "
            f"| {_fmt(sep['slo_attainment'])} | {_fmt(sep['loss_ratio']['all'])} "
            f"| {_fmt(sep['loss_ratio']['second_half'])} "
            f"| {_fmt(sep['accuracy_diff']['all'], 4)} |"
        )
    return lines


def plot_ratio_vs_k(studies: Sequence[tuple[str, dict[str, Any]]], path: Path) -> Path | None:
    """Loss ratio LeMix / SEPARATE vs K (95% CI bars), one line per study."""
    from lemix.report.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for name, summary in studies:
        ks = [k for k in summary.get("sync_every_list", [])]
        stats = [summary["separate"][str(k)]["loss_ratio"]["all"] for k in ks]
        kept = [(k, s) for k, s in zip(ks, stats, strict=True) if s.get("mean") is not None]
        if not kept:
            continue
        ax.errorbar(
            [k for k, _ in kept],
            [s["mean"] for _, s in kept],
            yerr=[0.0 if s["ci95_half"] != s["ci95_half"] else s["ci95_half"] for _, s in kept],
            fmt="o-",
            capsize=3,
            label=name,
        )
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("SEPARATE's sync interval K (training tasks)")
    ax.set_ylabel("inference loss ratio LeMix / SEPARATE")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("below 1: LeMix serves a lower loss; mean over seeds, 95% CI", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def loss_section(paths: Sequence[Path], out_dir: Path) -> tuple[list[str], list[Path]]:
    """The section's markdown lines and the PNGs it wrote or copied into `out_dir`/loss."""
    lines = ["", "## Inference loss on a real model (live, torch executors)", ""]
    if not paths:
        lines.append(
            "No loss study found (`runs/bench/inference_loss*/inference_loss.json`). It runs "
            f"live torch executors for ~40 min on 2 cores, beyond this report's budget: run "
            f"`{STUDY_COMMAND}` (after `make pretrain`), then re-render with "
            "`lemix report --from-runs`."
        )
        return lines, []
    loss_dir = out_dir / "loss"
    loss_dir.mkdir(parents=True, exist_ok=True)
    studies = [(p.parent.name, json.loads(p.read_text())) for p in paths]
    pngs: list[Path] = []
    ratio_png = plot_ratio_vs_k(studies, loss_dir / "loss_ratio_vs_k.png")
    lines.append(
        f"Rendered from {len(studies)} study result(s) of `benchmarks/inference_loss.py` "
        f"(`{STUDY_COMMAND}`); not re-run by this report."
    )
    if ratio_png is not None:
        pngs.append(ratio_png)
        lines += ["", "![loss ratio vs K](loss/loss_ratio_vs_k.png)"]
    for (name, summary), path in zip(studies, paths, strict=True):
        seeds = [row["seed"] for row in summary.get("seeds", [])]
        lines += [
            "",
            f"### `{path}`",
            "",
            f"init `{summary.get('init')}`, data `{summary.get('data')}`, "
            f"{summary.get('duration_s')} s windows, seeds {seeds}; paired by seed, "
            "Student-t 95% CIs.",
            "",
            *study_table(summary),
        ]
        for seed in seeds:
            source = path.parent / f"seed{seed}" / "inference_loss.png"
            if source.is_file():
                target = loss_dir / f"{name}_seed{seed}.png"
                shutil.copyfile(source, target)
                pngs.append(target)
                lines += ["", f"![loss over time, seed {seed}](loss/{target.name})"]
    return lines, pngs
