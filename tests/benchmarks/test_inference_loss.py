"""benchmarks/inference_loss.py's aggregation: ratios and differences paired by seed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "inference_loss.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("inference_loss_bench", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(loss: float, accuracy: float | None, slo: float = 1.0) -> dict[str, Any]:
    return {
        "loss": {"all": loss, "second_half": loss - 1.0},
        "accuracy": {"all": accuracy, "second_half": accuracy},
        "slo_attainment": slo,
    }


def test_ratios_and_differences_are_paired_by_seed_with_t_intervals() -> None:
    bench = _load()
    rows = [
        {"seed": 0, "lemix": _run(6.0, 0.10), "separate": {"10": _run(5.0, 0.20)}},
        {"seed": 1, "lemix": _run(4.0, 0.30), "separate": {"10": _run(5.0, 0.20)}},
    ]
    separate = bench.aggregate(rows, [10])["separate"]["10"]
    ratio = separate["loss_ratio"]["all"]
    assert ratio["values"] == pytest.approx([1.2, 0.8])
    # Two seeds: t(0.975, 1 dof) = 12.706, stdev of (1.2, 0.8) = 0.2828.
    assert ratio["mean"] == pytest.approx(1.0)
    assert ratio["ci95_half"] == pytest.approx(12.706 * 0.28284 / 2**0.5, rel=1e-4)
    assert separate["loss_ratio"]["second_half"]["values"] == pytest.approx([1.25, 0.75])
    assert separate["accuracy_diff"]["all"]["values"] == pytest.approx([-0.1, 0.1])


def test_a_run_without_accuracy_is_left_out_not_counted_as_zero() -> None:
    bench = _load()
    rows = [
        {"seed": 0, "lemix": _run(6.0, None), "separate": {"50": _run(6.0, 0.2)}},
        {"seed": 1, "lemix": _run(6.0, 0.3), "separate": {"50": _run(6.0, 0.2)}},
    ]
    out = bench.aggregate(rows, [50])
    assert out["lemix"]["accuracy"]["all"]["values"] == [0.3]
    assert out["separate"]["50"]["accuracy_diff"]["all"]["values"] == pytest.approx([0.1])


def test_replica_sync_runs_are_paired_with_plain_lemix_of_their_seed() -> None:
    bench = _load()
    rows = [
        {"seed": 0, "lemix": _run(6.0, 0.10), "lemix_replica_sync": _run(5.4, 0.15)},
        {"seed": 1, "lemix": _run(4.0, 0.30), "lemix_replica_sync": _run(4.0, 0.30)},
    ]
    synced = bench.aggregate(rows, [])["lemix_replica_sync"]
    assert synced["loss_ratio_vs_lemix"]["all"]["values"] == pytest.approx([0.9, 1.0])
    assert synced["accuracy_diff_vs_lemix"]["all"]["values"] == pytest.approx([0.05, 0.0])
    plain = [{"seed": 0, "lemix": _run(6.0, 0.1), "separate": {}}]
    assert "lemix_replica_sync" not in bench.aggregate(plain, [])
