"""The report's loss section renders the loss study's summary JSON."""

from __future__ import annotations

import json
from pathlib import Path

from lemix.report.loss_section import find_studies, loss_section


def _stat(mean: float, half: float) -> dict[str, object]:
    return {"mean": mean, "ci95_half": half, "values": [mean]}


def _run(loss: float) -> dict[str, object]:
    both = {"all": _stat(loss, 0.1), "second_half": _stat(loss, 0.2)}
    return {"loss": both, "accuracy": both, "slo_attainment": _stat(0.9, 0.05)}


def _summary() -> dict[str, object]:
    separate = {
        str(k): {
            **_run(3.0),
            "loss_ratio": {"all": _stat(ratio, 0.02), "second_half": _stat(ratio, 0.03)},
            "accuracy_diff": {"all": _stat(0.01, 0.005), "second_half": _stat(0.0, 0.01)},
        }
        for k, ratio in ((10, 1.02), (200, 0.93))
    }
    return {
        "init": "pretrained",
        "data": "hh.json",
        "duration_s": 60.0,
        "sync_every_list": [10, 200],
        "seeds": [{"seed": 0}],
        "lemix": _run(2.9),
        "separate": separate,
    }


def test_no_study_says_how_to_run_one(tmp_path: Path) -> None:
    lines, pngs = loss_section(find_studies(tmp_path / "bench"), tmp_path / "report")
    assert pngs == []
    assert any("make report-loss" in line for line in lines)


def test_a_study_gives_the_ratio_per_k_and_its_plots(tmp_path: Path) -> None:
    study = tmp_path / "bench" / "inference_loss"
    (study / "seed0").mkdir(parents=True)
    (study / "inference_loss.json").write_text(json.dumps(_summary()))
    (study / "seed0" / "inference_loss.png").write_bytes(b"png")
    paths = find_studies(tmp_path / "bench")
    assert paths == [study / "inference_loss.json"]
    lines, pngs = loss_section(paths, tmp_path / "report")
    text = "\n".join(lines)
    assert "| SEPARATE K=10 | 3.000 ± 0.100 |" in text
    assert "| 1.020 ± 0.020 | 1.020 ± 0.030 |" in text
    assert "| 0.930 ± 0.020 |" in text
    assert {p.name for p in pngs} == {"loss_ratio_vs_k.png", "inference_loss_seed0.png"}
    assert all(p.is_file() for p in pngs)
