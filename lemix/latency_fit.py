"""Fitting both latency models to one stage's points, scored on held-out points.

The same code fits the roofline's synthetic points (`lemix.roofline`) and the
profiler's measurements (`profiler.fit`, `scripts/profile_torch.py`), so a
shipped profile and a measured one are fitted and scored alike. Pure: numbers
in, coefficients and `FitQuality` dicts out.

Every phase is split once (seeded), fitted on the rest and scored on the
held-out points; the coefficients returned are the ones scored. Chunk points
are optional: without them the profile keeps the derived chunk model
(`ChunkCoeffs.derived`), and with them its quality is reported next to the
derived model's on the same held-out points, so a profile says what measuring
the chunk cost bought.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lemix.latency import (
    AffineQuadraticLatencyModel,
    ChunkCoeffs,
    ChunkPoint,
    DecodeCoeffs,
    DecodePoint,
    PaperLatencyModel,
    PhasePoint,
    QuadCoeffs,
    fit_chunk,
    fit_decode,
    fit_paper_eta,
    fit_quad,
    fit_quality,
    split_holdout,
)

PHASES = ("forward", "backward", "decode", "chunk")


@dataclass(frozen=True)
class StageFit:
    """Both models fitted on one stage, and their held-out quality."""

    eta_forward: float
    eta_backward: float
    forward: QuadCoeffs
    backward: QuadCoeffs
    decode: DecodeCoeffs
    # phase -> "paper"|"ours" (chunk also "derived") -> FitQuality as a dict
    quality: dict[str, dict[str, dict[str, Any]]]
    chunk: ChunkCoeffs | None = None  # None: no chunk points, the model derives it


def _score(
    measured: list[float], num_fit: int, **predicted: list[float]
) -> dict[str, dict[str, Any]]:
    return {k: asdict(fit_quality(v, measured, num_fit)) for k, v in predicted.items()}


def _fit_phase(
    points: Sequence[PhasePoint], holdout_fraction: float, seed: int
) -> tuple[float, QuadCoeffs, dict[str, dict[str, Any]]]:
    """Fit η and (a, b, c) on one split; score both on the held-out rest."""
    fit_pts, held = split_holdout(points, holdout_fraction, seed)
    eta, quad = fit_paper_eta(fit_pts), fit_quad(fit_pts)
    paper = [eta * p.batch_size * p.num_tokens**2 for p in held]
    ours = [quad(p.batch_size, p.num_tokens) for p in held]
    return eta, quad, _score([p.latency_s for p in held], len(fit_pts), paper=paper, ours=ours)


def fit_chunk_points(
    points: Sequence[ChunkPoint],
    eta_forward: float,
    derived: ChunkCoeffs,
    holdout_fraction: float,
    seed: int,
) -> tuple[ChunkCoeffs, dict[str, dict[str, Any]]]:
    """Fit (a, b, c, e, f) to chunk points; score it, the paper's η·(n² + 2·n·p)
    and the `derived` default on the held-out ones."""
    fit_pts, held = split_holdout(points, holdout_fraction, seed)
    coeffs = fit_chunk(fit_pts)
    paper_model = PaperLatencyModel((eta_forward,), (eta_forward,))
    measured = [p.latency_s for p in held]
    quality = _score(
        measured,
        len(fit_pts),
        paper=[paper_model.chunk_forward_s(0, p.num_new_tokens, p.num_past_tokens) for p in held],
        ours=[coeffs(p.num_new_tokens, p.num_past_tokens) for p in held],
        derived=[derived(p.num_new_tokens, p.num_past_tokens) for p in held],
    )
    return coeffs, quality


def fit_stage_points(
    forward: Sequence[PhasePoint],
    backward: Sequence[PhasePoint],
    decode: Sequence[DecodePoint],
    holdout_fraction: float,
    seed: int,
    chunk: Sequence[ChunkPoint] = (),
) -> StageFit:
    """Fit both models to one stage's points (synthetic or measured) and score
    each on a held-out `holdout_fraction` of them (split seeded with `seed`).

    The returned coefficients are the ones fitted on the non-held-out points,
    so the quality figures describe exactly what a profile stores. `chunk`
    empty: no chunk model is fitted (the profile derives one).
    """
    eta_f, quad_f, q_f = _fit_phase(forward, holdout_fraction, seed)
    eta_b, quad_b, q_b = _fit_phase(backward, holdout_fraction, seed)
    dec_fit, held = split_holdout(decode, holdout_fraction, seed)
    coeffs = fit_decode(dec_fit)
    # The paper has no decode model; its form implies a forward with ℓ = 1: η_F·C.
    q_d = _score(
        [p.latency_s for p in held],
        len(dec_fit),
        paper=[eta_f * p.batch_size for p in held],
        ours=[coeffs(p.batch_size, p.sum_context_tokens) for p in held],
    )
    quality = {"forward": q_f, "backward": q_b, "decode": q_d}
    chunk_coeffs = None
    if chunk:
        derived = ChunkCoeffs.derived(quad_f, coeffs)
        chunk_coeffs, quality["chunk"] = fit_chunk_points(
            chunk, eta_f, derived, holdout_fraction, seed
        )
    return StageFit(eta_f, eta_b, quad_f, quad_b, coeffs, quality, chunk_coeffs)


def latency_models(
    fits: Sequence[StageFit],
) -> tuple[PaperLatencyModel, AffineQuadraticLatencyModel]:
    """The paper's and our per-stage models from one `StageFit` per stage."""
    paper = PaperLatencyModel(
        tuple(f.eta_forward for f in fits), tuple(f.eta_backward for f in fits)
    )
    chunks = [f.chunk for f in fits]
    ours = AffineQuadraticLatencyModel(
        tuple(f.forward for f in fits),
        tuple(f.backward for f in fits),
        tuple(f.decode for f in fits),
        # All stages measured or none: a profile's chunk list is per stage or absent.
        chunk=tuple(c for c in chunks if c is not None) if None not in chunks else (),
    )
    return paper, ours


def fit_quality_summary(
    fits: Sequence[StageFit], holdout_fraction: float, seed: int
) -> dict[str, Any]:
    """`Profile.fit_quality`: phase -> model -> [S] of FitQuality dicts (phases
    fitted on every stage only)."""
    quality: dict[str, Any] = {"holdout_fraction": holdout_fraction, "seed": seed}
    for phase in PHASES:
        if not all(phase in f.quality for f in fits):
            continue
        models = fits[0].quality[phase]
        quality[phase] = {k: [f.quality[phase][k] for f in fits] for k in models}
    return quality
