"""profiler.fit: exact recovery from noise-free points, memory cross-check, errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
from known_profile import (
    ACTIVATION_BYTES_PER_TOKEN,
    GRID,
    KV_BYTES_PER_TOKEN,
    STATIC_BYTES,
    TRUE_OURS,
    true_profile,
)

from lemix.latency import DecodePoint, PhasePoint
from lemix.profile import Profile
from lemix.report.metrics import format_table
from profiler.fit import (
    FIT_TABLE_COLUMNS,
    FitConfig,
    MemoryPoint,
    StageMeasurements,
    fit_profile,
    fit_quality_rows,
    measure_memory,
)


def exact_measurements(stage: int, *, with_memory: bool = True) -> StageMeasurements:
    """What a noise-free executor running `TRUE_OURS` reports for `GRID`."""
    phase = GRID.phase_points()
    decode = GRID.decode_points()
    return StageMeasurements(
        forward=tuple(PhasePoint(c, n, TRUE_OURS.forward_s(stage, c, n)) for c, n in phase),
        backward=tuple(PhasePoint(c, n, TRUE_OURS.backward_s(stage, c, n)) for c, n in phase),
        decode=tuple(DecodePoint(c, s, TRUE_OURS.decode_step_s(stage, c, s)) for c, s in decode),
        training_memory=tuple(
            MemoryPoint(c * n, STATIC_BYTES + ACTIVATION_BYTES_PER_TOKEN * c * n) for c, n in phase
        )
        if with_memory
        else (),
        decode_memory=tuple(
            MemoryPoint(s, STATIC_BYTES + KV_BYTES_PER_TOKEN * s) for _, s in decode
        )
        if with_memory
        else (),
    )


def test_noise_free_points_recover_every_coefficient() -> None:
    base = true_profile()
    result = fit_profile([exact_measurements(0), exact_measurements(1)], base, "fitted")
    ours = result.profile.ours
    for stage in range(2):
        for fitted, true in (
            (ours.forward[stage], TRUE_OURS.forward[stage]),
            (ours.backward[stage], TRUE_OURS.backward[stage]),
            (ours.decode[stage], TRUE_OURS.decode[stage]),
        ):
            for got, want in zip(
                dataclasses.astuple(fitted), dataclasses.astuple(true), strict=True
            ):
                assert got == pytest.approx(want, rel=1e-6)
    quality = result.profile.fit_quality
    assert quality["holdout_fraction"] == 0.25 and quality["seed"] == 0
    for phase in ("forward", "backward", "decode"):
        for stage in range(2):
            ours_q = quality[phase]["ours"][stage]
            assert ours_q["r2"] == pytest.approx(1.0, abs=1e-9)
            assert ours_q["mape"] == pytest.approx(0.0, abs=1e-9)
            # η·C·ℓ² has no constant or linear term: it cannot follow these points.
            assert quality[phase]["paper"][stage]["r2"] < 0.9
            assert quality[phase]["paper"][stage]["mape"] > 0.1
    assert quality["forward"]["ours"][0]["num_fit_points"] == 15
    assert quality["forward"]["ours"][0]["num_holdout_points"] == 5


def test_memory_transfer_and_optimizer_come_from_the_base_profile() -> None:
    base = true_profile(name="the-executors-own")
    result = fit_profile(
        [exact_measurements(0), exact_measurements(1)],
        base,
        "fitted",
        provenance="by hand",
        hardware={"executor_address": "h:1"},
    )
    profile = result.profile
    assert profile.name == "fitted" and profile.num_stages == 2
    assert profile.memory == base.memory
    assert profile.transfer == base.transfer
    assert profile.optimizer_step_s == base.optimizer_step_s == (0.03, 0.04)
    assert profile.provenance == "by hand"
    assert profile.hardware == {"executor_address": "h:1", "base_profile": "the-executors-own"}
    # The profile round-trips through its JSON schema.
    assert Profile.from_json_dict(json.loads(json.dumps(profile.to_json_dict()))) == profile


def test_peak_memory_lines_are_checked_against_the_base() -> None:
    measured = measure_memory(exact_measurements(0))
    assert (
        measured.static_bytes,
        measured.activation_bytes_per_token,
        measured.kv_bytes_per_token,
    ) == (STATIC_BYTES, ACTIVATION_BYTES_PER_TOKEN, KV_BYTES_PER_TOKEN)
    base = true_profile()
    report = fit_profile([exact_measurements(0), exact_measurements(1)], base, "x").report
    assert [s["is_consistent"] for s in report["memory_check"]] == [True, True]
    assert report["fit_quality"]["decode"]["ours"][0]["r2"] == pytest.approx(1.0)
    json.dumps(report)  # JSON-ready

    # A base profile for another model: kept as is, but flagged.
    other = dataclasses.replace(
        base, memory=dataclasses.replace(base.memory, kv_bytes_per_token=(4, 4))
    )
    result = fit_profile([exact_measurements(0), exact_measurements(1)], other, "x")
    assert result.profile.memory.kv_bytes_per_token == (4, 4)
    check = result.report["memory_check"][0]
    assert check["is_consistent"] is False
    assert check["measured"]["kv_bytes_per_token"] == KV_BYTES_PER_TOKEN
    assert check["base"]["kv_bytes_per_token"] == 4

    # A backend that reports no peak memory: nothing measured, nothing claimed.
    blind = fit_profile([exact_measurements(s, with_memory=False) for s in range(2)], base, "x")
    assert blind.measured_memory[0].static_bytes is None
    assert blind.report["memory_check"][0]["is_consistent"] is None


def test_fit_errors_name_the_problem() -> None:
    base = true_profile()
    with pytest.raises(ValueError, match="measured 1 stage.*has 2"):
        fit_profile([exact_measurements(0)], base, "x")
    with pytest.raises(ValueError, match="name"):
        fit_profile([exact_measurements(0), exact_measurements(1)], base, "")
    tiny = dataclasses.replace(exact_measurements(1), forward=exact_measurements(1).forward[:2])
    with pytest.raises(ValueError, match="stage 1: .*at least 3 points"):
        fit_profile([exact_measurements(0), tiny], base, "x")
    with pytest.raises(ValueError, match="holdout_fraction"):
        FitConfig(holdout_fraction=1.0)


def test_fit_table_has_one_row_per_stage_and_phase() -> None:
    profile = fit_profile(
        [exact_measurements(0), exact_measurements(1)], true_profile(), "x"
    ).profile
    rows = fit_quality_rows(profile)
    assert [(r["stage"], r["phase"]) for r in rows] == [
        (s, p) for s in range(2) for p in ("forward", "backward", "decode")
    ]
    table = format_table(rows, FIT_TABLE_COLUMNS)
    assert "paper R²" in table and "ours MAPE %" in table and "15/5" in table
