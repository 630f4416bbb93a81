"""Measurements -> a fitted `Profile`: pure, no I/O, no clocks.

The profiler measures, per pipeline stage, forward and backward latency on a
(C, ℓ) grid and decode-step latency on a (C, Σctx) grid, plus the peak memory
of each measurement. This module fits both latency models of `lemix.latency`
to those points with exactly the code that derives the shipped roofline
profiles (`lemix.roofline.fit_stage_points`), scores each on held-out points,
and assembles a `Profile`.

What is measured and what is not. Latency is measured, so `paper`, `ours` and
`fit_quality` come from the measurements. Memory figures, transfer rates and
the optimizer step are NOT measured by this grid: they are copied from a base
profile (on the emulated backend, the profile the executor itself runs). The
peak memory the executor reports is used only as a cross-check: a straight
line through (tokens held, peak bytes) gives each stage's static bytes and its
per-token activation and KV bytes, and `fit_report` says whether they match
the base profile's (they do not when the base describes another model/GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lemix.latency import DecodePoint, PhasePoint
from lemix.latency_fit import fit_quality_summary, fit_stage_points, latency_models
from lemix.profile import Profile

PHASES = ("forward", "backward", "decode", "chunk")  # chunk: only where measured
MODELS = ("paper", "ours")


@dataclass(frozen=True)
class FitConfig:
    """How measured points are split and scored."""

    holdout_fraction: float = 0.25  # share of points held out for R²/MAPE
    seed: int = 0  # seeds the held-out split

    def __post_init__(self) -> None:
        if not 0.0 < self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in (0, 1), got {self.holdout_fraction}")


@dataclass(frozen=True)
class MemoryPoint:
    """Peak memory of one measurement, against the tokens of state it held."""

    num_tokens: int  # forward/backward: C·ℓ activation tokens; decode: Σctx KV tokens
    peak_bytes: int  # on the measured stage's GPU


@dataclass(frozen=True)
class StageMeasurements:
    """Everything measured on one stage (latencies are medians over repeats)."""

    forward: tuple[PhasePoint, ...]
    backward: tuple[PhasePoint, ...]
    decode: tuple[DecodePoint, ...]
    training_memory: tuple[MemoryPoint, ...] = ()  # forward/backward peaks
    decode_memory: tuple[MemoryPoint, ...] = ()


@dataclass(frozen=True)
class MeasuredMemory:
    """A stage's memory figures as read off its peak-memory line (bytes)."""

    static_bytes: int | None  # weights + training state; None: not enough points
    activation_bytes_per_token: int | None
    kv_bytes_per_token: int | None


@dataclass(frozen=True)
class FitResult:
    """A fitted profile and the report that goes with it."""

    profile: Profile
    measured_memory: tuple[MeasuredMemory, ...]
    report: dict[str, Any]  # JSON-ready, see `fit_report`


def fit_profile(
    measurements: Sequence[StageMeasurements],
    base: Profile,
    name: str,
    config: FitConfig | None = None,
    *,
    provenance: str = "",
    hardware: dict[str, Any] | None = None,
) -> FitResult:
    """Fit the paper's model and ours to one node's measurements.

    `measurements` has one entry per stage, stage 0 first, and must match
    `base.num_stages`. Latency models and `fit_quality` come from the
    measurements; `optimizer_step_s`, `memory`, `transfer` and `model` are
    copied from `base` (see the module docstring). Raises `ValueError` when a
    stage has too few points to fit or the stage count differs from `base`.
    """
    config = config or FitConfig()
    if not name:
        raise ValueError("a profile needs a name")
    if len(measurements) != base.num_stages:
        raise ValueError(
            f"measured {len(measurements)} stage(s) but base profile {base.name!r} has "
            f"{base.num_stages}; pass the base profile the executor runs"
        )
    fits = []
    for stage, m in enumerate(measurements):
        try:
            fits.append(
                fit_stage_points(
                    m.forward, m.backward, m.decode, config.holdout_fraction, config.seed
                )
            )
        except ValueError as exc:
            raise ValueError(f"stage {stage}: {exc}; measure a larger grid") from exc
    paper, ours = latency_models(fits)
    profile = Profile(
        name=name,
        num_stages=base.num_stages,
        paper=paper,
        ours=ours,
        optimizer_step_s=base.optimizer_step_s,
        memory=base.memory,
        transfer=base.transfer,
        model=dict(base.model),
        hardware={**(hardware or {}), "base_profile": base.name},
        fit_quality=fit_quality_summary(fits, config.holdout_fraction, config.seed),
        provenance=provenance,
    )
    memory = tuple(measure_memory(m) for m in measurements)
    return FitResult(profile, memory, fit_report(profile, memory, base))


def measure_memory(stage: StageMeasurements) -> MeasuredMemory:
    """Static and per-token bytes from a straight line through the peaks.

    Training peaks give static + activation/token; decode peaks give static +
    KV/token. The static figure is the training line's (the decode line's
    when training has too few distinct points). A backend that reports no
    peak memory (all zeros) gives None everywhere.
    """
    act = _line(stage.training_memory)
    kv = _line(stage.decode_memory)
    static = act[0] if act is not None else (kv[0] if kv is not None else None)
    return MeasuredMemory(
        static_bytes=static,
        activation_bytes_per_token=act[1] if act is not None else None,
        kv_bytes_per_token=kv[1] if kv is not None else None,
    )


def _line(points: Sequence[MemoryPoint]) -> tuple[int, int] | None:
    """(intercept, slope) of peak bytes against tokens, rounded to whole bytes."""
    if len({p.num_tokens for p in points}) < 2 or not any(p.peak_bytes for p in points):
        return None
    import numpy as np  # local, as in lemix.latency: keeps the import light

    x = np.asarray([p.num_tokens for p in points], dtype=float)
    y = np.asarray([p.peak_bytes for p in points], dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    return int(round(float(intercept))), int(round(float(slope)))


def fit_report(profile: Profile, memory: Sequence[MeasuredMemory], base: Profile) -> dict[str, Any]:
    """JSON-ready report: fit quality per phase, model and stage, and the memory check."""
    stages: list[dict[str, Any]] = []
    for stage, measured in enumerate(memory):
        expected = MeasuredMemory(
            static_bytes=base.memory.static_bytes(stage),
            activation_bytes_per_token=base.memory.activation_bytes_per_token[stage],
            kv_bytes_per_token=base.memory.kv_bytes_per_token[stage],
        )
        stages.append(
            {
                "stage": stage,
                "measured": asdict(measured),
                "base": asdict(expected),
                "is_consistent": _is_consistent(measured, expected),
            }
        )
    return {
        "name": profile.name,
        "num_stages": profile.num_stages,
        "base_profile": base.name,
        "fit_quality": profile.fit_quality,
        "memory_check": stages,
    }


def _is_consistent(measured: MeasuredMemory, expected: MeasuredMemory) -> bool | None:
    """Within 1% (or 1 B) of the base on every figure measured; None: nothing measured."""
    pairs = [
        (m, e)
        for m, e in zip(asdict(measured).values(), asdict(expected).values(), strict=True)
        if m is not None
    ]
    if not pairs:
        return None
    return all(abs(m - e) <= max(1, 0.01 * abs(e)) for m, e in pairs)


def fit_quality_rows(profile: Profile) -> list[dict[str, Any]]:
    """One row per (stage, phase): held-out R² and MAPE of the paper's model and ours."""
    rows: list[dict[str, Any]] = []
    quality = profile.fit_quality
    for stage in range(profile.num_stages):
        for phase in PHASES:
            if phase not in quality:
                continue
            paper = quality[phase]["paper"][stage]
            ours = quality[phase]["ours"][stage]
            rows.append(
                {
                    "stage": stage,
                    "phase": phase,
                    "paper_r2": paper["r2"],
                    "paper_mape_pct": 100.0 * paper["mape"],
                    "ours_r2": ours["r2"],
                    "ours_mape_pct": 100.0 * ours["mape"],
                    "points": f"{ours['num_fit_points']}/{ours['num_holdout_points']}",
                }
            )
    return rows


FIT_TABLE_COLUMNS: list[tuple[str, str]] = [
    ("stage", "stage"),
    ("phase", "phase"),
    ("paper_r2", "paper R²"),
    ("paper_mape_pct", "paper MAPE %"),
    ("ours_r2", "ours R²"),
    ("ours_mape_pct", "ours MAPE %"),
    ("points", "fit/held-out"),
]
