"""Inference loss of co-located LeMix vs SEPARATE on a real model, per K, over seeds.

Each seed runs `lemix.cli.torch_demo` live (torch executors, tiny Llama, CPU)
on one workload: inference requests whose prompt and reference come from an
eval split of HH-RLHF (query, reference) pairs and training samples from the
rest, so the model is fine-tuned live while it serves held-out queries. The
executors start from the pretrained checkpoint (`--init pretrained`, the
default: `make pretrain`, cached) or the preset's random init (`--init random`).

LeMix runs once per seed (it has no K); SEPARATE once per seed and per sync
interval K in `--sync-every-list` (it ships the training half's weights to the
serving half every K training tasks). Per request the executor reports the
inference loss (teacher-forced cross-entropy of the reference, nats/token) and
the reference accuracy (fraction of reference tokens that are the served
model's top-1 choice, teacher-forced). Reports, per K, the LeMix / SEPARATE
loss ratio and the LeMix - SEPARATE accuracy difference, each with a 95%
confidence interval across seeds (Student t), over all requests and over the
second half of the run, plus SLO attainment.

With `--replica-sync-every M`, LeMix also runs once per seed with replica sync
(its training replicas averaged every M training tasks,
`lemix.planner.replica_sync`), reported against plain LeMix on the same seed
(loss ratio synced / plain, accuracy difference synced - plain). An empty
`--sync-every-list ""` skips SEPARATE.

    .venv/bin/python benchmarks/inference_loss.py --hh ../shared/data/hh-rlhf-test.json \\
        --sync-every-list 10,50,200 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lemix.cli.torch_demo import (  # noqa: E402
    Pair,
    TorchDemoConfig,
    accuracy_series,
    assign_texts,
    from_checkpoint,
    load_pairs,
    loss_series,
    plot_loss,
    poisson_tasks,
    pretrained_checkpoint,
    run_policy,
)
from lemix.types import Task, TaskRecord  # noqa: E402

_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # two-sided, by degrees of freedom
WINDOWS = ("all", "second_half")


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% Student-t interval); NaN half-width for one value."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    half = _T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / len(values) ** 0.5
    return mean, half


def _window_means(points: list[tuple[float, float]], duration_s: float) -> dict[str, float | None]:
    late = [value for t, value in points if t >= duration_s / 2]
    return {
        "all": statistics.fmean(v for _, v in points) if points else None,
        "second_half": statistics.fmean(late) if late else None,
    }


def run_summary(
    metrics: dict[str, Any], records: Sequence[TaskRecord], duration_s: float
) -> dict[str, Any]:
    """One live run's numbers for the study: loss and accuracy by window, SLO, counts."""
    return {
        "loss": _window_means(loss_series(records), duration_s),
        "accuracy": _window_means(accuracy_series(records), duration_s),
        "slo_attainment": metrics["slo_attainment"],
        "ttft_p99_s": metrics["ttft_s"]["p99"],
        "num_completed_inference": metrics["num_completed_inference"],
        "num_completed_training": metrics["num_completed_training"],
        "num_failed": metrics.get("num_failed"),
        "num_lost": metrics["num_lost"],
    }


def run_seed(
    base: TorchDemoConfig,
    ks: Sequence[int],
    pairs: tuple[list[Pair], list[Pair]],
    out_dir: Path,
    replica_sync_every: int = 0,
) -> dict[str, Any]:
    """LeMix once (and once with replica sync every M when M > 0) and SEPARATE
    per K on one seed's workload."""
    tasks: list[Task] = poisson_tasks(base)
    texts = assign_texts(tasks, *pairs)
    row: dict[str, Any] = {"seed": base.seed, "separate": {}}
    series: dict[str, list[tuple[float, float]]] = {}
    runs: list[tuple[str, TorchDemoConfig]] = [("lemix", base)]
    if replica_sync_every > 0:
        synced = dataclasses.replace(base, replica_sync_every_tasks=replica_sync_every)
        runs.append((f"lemix-rs{replica_sync_every}", synced))
    runs += [(f"separate-K{k}", dataclasses.replace(base, sync_every_tasks=k)) for k in ks]
    for label, config in runs:
        policy = label.split("-K")[0].split("-rs")[0]
        metrics, records = asyncio.run(run_policy(config, policy, tasks, texts, out_dir / label))
        summary = run_summary(metrics, records, base.duration_s)
        if label == "lemix":
            row["lemix"] = summary
        elif policy == "lemix":
            row["lemix_replica_sync"] = summary
        else:
            row["separate"][str(config.sync_every_tasks)] = summary
        series[label] = loss_series(records)
        print(f"seed {base.seed} {label}: {json.dumps(summary)}", flush=True)
    plot_loss(series, out_dir / "inference_loss.png")
    return row


def _stat(values: Iterable[float | None]) -> dict[str, Any]:
    """Mean and 95% CI half-width of the values that are not None."""
    kept = [v for v in values if v is not None]
    if not kept:
        return {"mean": None, "ci95_half": None, "values": []}
    mean, half = mean_ci(kept)
    return {"mean": mean, "ci95_half": half, "values": kept}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _across(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One policy's `run_summary`s over seeds: loss, accuracy, SLO with CIs."""
    return {
        "loss": {w: _stat(r["loss"][w] for r in runs) for w in WINDOWS},
        "accuracy": {w: _stat(r["accuracy"][w] for r in runs) for w in WINDOWS},
        "slo_attainment": _stat(r["slo_attainment"] for r in runs),
    }


def aggregate(rows: Sequence[dict[str, Any]], ks: Sequence[int]) -> dict[str, Any]:
    """Per K and window: the loss ratio LeMix / SEPARATE and the accuracy
    difference LeMix - SEPARATE, paired by seed, with 95% CIs."""
    lemix_runs = [r["lemix"] for r in rows]
    out: dict[str, Any] = {"lemix": _across(lemix_runs), "separate": {}}
    if all("lemix_replica_sync" in r for r in rows) and rows:
        synced_runs = [r["lemix_replica_sync"] for r in rows]
        pairs = list(zip(synced_runs, lemix_runs, strict=True))
        out["lemix_replica_sync"] = {
            **_across(synced_runs),
            "loss_ratio_vs_lemix": {
                w: _stat(_ratio(a["loss"][w], b["loss"][w]) for a, b in pairs) for w in WINDOWS
            },
            "accuracy_diff_vs_lemix": {
                w: _stat(_diff(a["accuracy"][w], b["accuracy"][w]) for a, b in pairs)
                for w in WINDOWS
            },
        }
    for k in ks:
        separate_runs = [r["separate"][str(k)] for r in rows]
        pairs = list(zip(lemix_runs, separate_runs, strict=True))
        out["separate"][str(k)] = {
            **_across(separate_runs),
            "loss_ratio": {
                w: _stat(_ratio(a["loss"][w], b["loss"][w]) for a, b in pairs) for w in WINDOWS
            },
            "accuracy_diff": {
                w: _stat(_diff(a["accuracy"][w], b["accuracy"][w]) for a, b in pairs)
                for w in WINDOWS
            },
        }
    return out


def _fmt(stat: dict[str, Any], digits: int = 3) -> str:
    if stat["mean"] is None:
        return "n/a"
    return f"{stat['mean']:.{digits}f} ± {stat['ci95_half']:.{digits}f}"


def print_table(summary: dict[str, Any], ks: Sequence[int]) -> None:
    lemix = summary["lemix"]
    print(
        f"\nLeMix: loss {_fmt(lemix['loss']['all'])}, accuracy {_fmt(lemix['accuracy']['all'])}, "
        f"SLO {_fmt(lemix['slo_attainment'])}"
    )
    synced = summary.get("lemix_replica_sync")
    if synced is not None:
        print(
            f"LeMix + replica sync: loss {_fmt(synced['loss']['all'])}, accuracy "
            f"{_fmt(synced['accuracy']['all'])}, SLO {_fmt(synced['slo_attainment'])}; "
            f"loss ratio vs LeMix {_fmt(synced['loss_ratio_vs_lemix']['all'])} (2nd half "
            f"{_fmt(synced['loss_ratio_vs_lemix']['second_half'])}), accuracy diff "
            f"{_fmt(synced['accuracy_diff_vs_lemix']['all'], 4)}"
        )
    header = ("K", "SEP loss", "ratio all", "ratio 2nd half", "acc diff all", "SEP SLO")
    print(
        f"{header[0]:>4} {header[1]:>16} {header[2]:>16} {header[3]:>16} {header[4]:>18} "
        f"{header[5]:>16}"
    )
    for k in ks:
        sep = summary["separate"][str(k)]
        print(
            f"{k:>4} {_fmt(sep['loss']['all']):>16} {_fmt(sep['loss_ratio']['all']):>16} "
            f"{_fmt(sep['loss_ratio']['second_half']):>16} "
            f"{_fmt(sep['accuracy_diff']['all'], 4):>18} {_fmt(sep['slo_attainment']):>16}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hh", type=Path, help="HH-RLHF JSON lines (default: packaged ShareGPT)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--duration", type=float, default=60.0, help="arrival window (s)")
    parser.add_argument(
        "--sync-every-list", default="10,25,50,100,200", help="SEPARATE's K values, comma-separated"
    )
    parser.add_argument(
        "--replica-sync-every",
        type=int,
        default=0,
        metavar="M",
        help="also run LeMix with its replicas averaged every M training tasks (0 = off)",
    )
    parser.add_argument("--init", choices=("pretrained", "random"), default="pretrained")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/inference_loss"))
    args = parser.parse_args()
    ks = [int(k) for k in args.sync_every_list.split(",") if k.strip()]
    checkpoint = pretrained_checkpoint() if args.init == "pretrained" else None
    rows: list[dict[str, Any]] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        config = TorchDemoConfig(duration_s=args.duration, seed=seed)
        if checkpoint is not None:
            config = from_checkpoint(config, checkpoint)
        pairs = load_pairs(config, args.hh)
        out_dir = args.out / f"seed{seed}"
        rows.append(run_seed(config, ks, pairs, out_dir, args.replica_sync_every))
    summary = {
        "init": args.init,
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "sync_every_list": ks,
        "replica_sync_every_tasks": args.replica_sync_every,
        "duration_s": args.duration,
        "data": str(args.hh or "sharegpt"),
        "seeds": rows,
        **aggregate(rows, ks),
    }
    print_table(summary, ks)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "inference_loss.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out / 'inference_loss.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
