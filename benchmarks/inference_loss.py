"""Inference loss of co-located LeMix vs SEPARATE on a real model, over seeds.

Each seed runs `lemix.cli.torch_demo` live (torch executors, tiny Llama, CPU) for
both policies on the same workload: inference requests whose prompt and
reference come from an eval split of HH-RLHF (query, reference) pairs and
training samples from the rest. SEPARATE syncs weights every K = 100 training
tasks, the paper's cap. Reports per seed the mean inference loss over all
requests and over the second half of the run, and the LeMix / SEPARATE ratio
with a 95% confidence interval across seeds (Student t).

    .venv/bin/python benchmarks/inference_loss.py --hh ../shared/data/hh-rlhf-test.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lemix.cli.torch_demo import (  # noqa: E402
    TorchDemoConfig,
    assign_texts,
    load_pairs,
    loss_series,
    plot_loss,
    poisson_tasks,
    run_policy,
)

_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # two-sided, by degrees of freedom


def mean_ci(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    half = _T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / len(values) ** 0.5
    return mean, half


def main() -> int:
    import asyncio

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hh", type=Path, help="HH-RLHF JSON lines (default: packaged ShareGPT)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--sync-every", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/inference_loss"))
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        config = TorchDemoConfig(
            duration_s=args.duration, seed=seed, sync_every_tasks=args.sync_every
        )
        eval_pairs, train_pairs = load_pairs(config, args.hh)
        tasks = poisson_tasks(config)
        texts = assign_texts(tasks, eval_pairs, train_pairs)
        series = {}
        row: dict[str, Any] = {"seed": seed}
        for policy in config.policies:
            metrics, records = asyncio.run(
                run_policy(config, policy, tasks, texts, args.out / f"seed{seed}")
            )
            points = loss_series(records)
            series[policy] = points
            late = [loss for t, loss in points if t >= args.duration / 2]
            row[policy] = {
                "loss_all": metrics["inference_loss"],
                "loss_second_half": statistics.fmean(late) if late else None,
                "num_completed_inference": metrics["num_completed_inference"],
                "num_completed_training": metrics["num_completed_training"],
                "slo_attainment": metrics["slo_attainment"],
                "num_lost": metrics["num_lost"],
            }
        plot_loss(series, args.out / f"seed{seed}" / "inference_loss.png")
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary: dict[str, Any] = {
        "seeds": rows,
        "sync_every_tasks": args.sync_every,
        "duration_s": args.duration,
        "data": str(args.hh or "sharegpt"),
    }
    print(f"\n{'window':<12} {'lemix':>8} {'separate':>9} {'ratio (95% CI)':>22}")
    for window in ("loss_all", "loss_second_half"):
        ratios = [r["lemix"][window] / r["separate"][window] for r in rows]
        mean, half = mean_ci(ratios)
        lemix = statistics.fmean(r["lemix"][window] for r in rows)
        separate = statistics.fmean(r["separate"][window] for r in rows)
        summary[window] = {
            "lemix": lemix,
            "separate": separate,
            "ratio_mean": mean,
            "ratio_ci95_half": half,
            "ratios": ratios,
        }
        print(f"{window:<12} {lemix:>8.3f} {separate:>9.3f} {mean:>12.3f} ± {half:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "inference_loss.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out / 'inference_loss.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
