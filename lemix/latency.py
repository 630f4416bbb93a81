"""Stage latency models: the paper's `η·C·ℓ²` and our affine-quadratic + decode model.

Every model answers three questions for one pipeline stage: how long a forward
over a batch takes, how long its backward takes, and how long one decode step
of a running batch takes. Times are seconds; `batch_size` is C (sequences),
`num_tokens` is ℓ (padded tokens per sequence), `sum_context_tokens` is the KV
length summed over the decode batch.

A prefill chunk (engine v2's chunked prefill) is one sequence's n new tokens
run after p tokens of it are already in the KV cache: `chunk_forward_s(stage,
n, p)`. Besides what a prompt of n tokens costs, it attends over the p cached
tokens (n·p query-key pairs) and reads their KV. With p = 0 it is a forward of
one sequence of n tokens.

Fitting is ordinary least squares on measured points; `fit_report` gives R² and
MAPE on held-out points so a profile always says how good it is.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

T = TypeVar("T")


class LatencyModel(Protocol):
    """Per-stage latency prediction. Implementations are pure and cheap."""

    # Read-only members: the frozen dataclasses below implement them, and a
    # plain `name: str` would demand a settable attribute (mypy rejects them).
    @property
    def name(self) -> str: ...

    @property
    def num_stages(self) -> int: ...

    def forward_s(self, stage: int, batch_size: int, num_tokens: int) -> float: ...

    def backward_s(self, stage: int, batch_size: int, num_tokens: int) -> float: ...

    def decode_step_s(self, stage: int, batch_size: int, sum_context_tokens: int) -> float: ...

    def chunk_forward_s(self, stage: int, num_new_tokens: int, num_past_tokens: int) -> float: ...


@dataclass(frozen=True)
class PaperLatencyModel:
    """The paper's form: Δ_F = η_F·C·ℓ², Δ_B = η_B·C·ℓ² per stage.

    The paper has no decode model; a decode step is a forward with ℓ = 1
    (one new token per sequence), which is what the form implies.
    """

    eta_forward: tuple[float, ...]  # s per (sequence · token²), one per stage
    eta_backward: tuple[float, ...]
    name: str = "paper"

    def __post_init__(self) -> None:
        if len(self.eta_forward) != len(self.eta_backward) or not self.eta_forward:
            raise ValueError("eta_forward and eta_backward need one value per stage")

    @property
    def num_stages(self) -> int:
        return len(self.eta_forward)

    def forward_s(self, stage: int, batch_size: int, num_tokens: int) -> float:
        return self.eta_forward[stage] * batch_size * num_tokens * num_tokens

    def backward_s(self, stage: int, batch_size: int, num_tokens: int) -> float:
        return self.eta_backward[stage] * batch_size * num_tokens * num_tokens

    def decode_step_s(self, stage: int, batch_size: int, sum_context_tokens: int) -> float:
        return self.eta_forward[stage] * batch_size

    def chunk_forward_s(self, stage: int, num_new_tokens: int, num_past_tokens: int) -> float:
        # Work conservation: the chunk is what a prompt of p + n tokens costs
        # beyond one of p tokens, η·((p + n)² − p²) = η·(n² + 2·n·p).
        n, p = num_new_tokens, num_past_tokens
        return self.eta_forward[stage] * (n * n + 2 * n * p)


@dataclass(frozen=True)
class QuadCoeffs:
    """Δ = a + b·C·ℓ + c·C·ℓ² (seconds)."""

    a: float
    b: float
    c: float

    def __call__(self, batch_size: int, num_tokens: int) -> float:
        work = batch_size * num_tokens
        return self.a + self.b * work + self.c * work * num_tokens


@dataclass(frozen=True)
class DecodeCoeffs:
    """Δ_dec = d0 + d1·C + d2·Σcontext (seconds); decode is memory-bound."""

    d0: float
    d1: float
    d2: float

    def __call__(self, batch_size: int, sum_context_tokens: int) -> float:
        return self.d0 + self.d1 * batch_size + self.d2 * sum_context_tokens


@dataclass(frozen=True)
class ChunkCoeffs:
    """Δ_chunk = a + b·n + c·n² + e·n·p + f·p (seconds) for n new tokens of one
    sequence after p cached ones: a forward of n tokens (a, b, c), attention of
    the new tokens over the past (e) and reading the past's KV (f)."""

    a: float
    b: float
    c: float
    e: float
    f: float

    def __call__(self, num_new_tokens: int, num_past_tokens: int) -> float:
        n, p = num_new_tokens, num_past_tokens
        return self.a + self.b * n + self.c * n * n + self.e * n * p + self.f * p

    @classmethod
    def derived(cls, forward: QuadCoeffs, decode: DecodeCoeffs) -> ChunkCoeffs:
        """The default where a profile has no measured chunk model.

        (a, b, c) are the forward's at C = 1. e = 2·c is work conservation: a
        prompt of p + n tokens in one pass has c·(p + n)² of quadratic cost,
        c·p² of it the first p tokens', so the n later ones add c·(n² + 2·n·p);
        chunking then costs only an extra fixed a per chunk. f = d2: the past's
        KV is read once, at what a decode step pays per context token.
        """
        return cls(forward.a, forward.b, forward.c, 2.0 * forward.c, decode.d2)


@dataclass(frozen=True)
class AffineQuadraticLatencyModel:
    """Ours: affine-quadratic prefill/forward and backward, a decode-step model and
    a prefill-chunk model (measured, or `ChunkCoeffs.derived` where `chunk` is empty)."""

    forward: tuple[QuadCoeffs, ...]
    backward: tuple[QuadCoeffs, ...]
    decode: tuple[DecodeCoeffs, ...]
    chunk: tuple[ChunkCoeffs, ...] = ()  # () = derived from forward and decode
    name: str = "affine-quadratic"

    def __post_init__(self) -> None:
        if not (len(self.forward) == len(self.backward) == len(self.decode) > 0):
            raise ValueError("forward, backward and decode need one entry per stage")
        if self.chunk and len(self.chunk) != len(self.forward):
            raise ValueError("chunk needs one entry per stage, or none (derived)")

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def forward_s(self, stage: int, batch_size: int, num_tokens: int) -> float:
        return self.forward[stage](batch_size, num_tokens)

    def backward_s(self, stage: int, batch_size: int, num_tokens: int) -> float:
        return self.backward[stage](batch_size, num_tokens)

    def decode_step_s(self, stage: int, batch_size: int, sum_context_tokens: int) -> float:
        return self.decode[stage](batch_size, sum_context_tokens)

    def chunk_coeffs(self, stage: int) -> ChunkCoeffs:
        """The stage's chunk model: measured if the profile has one, else derived."""
        if self.chunk:
            return self.chunk[stage]
        return ChunkCoeffs.derived(self.forward[stage], self.decode[stage])

    def chunk_forward_s(self, stage: int, num_new_tokens: int, num_past_tokens: int) -> float:
        return self.chunk_coeffs(stage)(num_new_tokens, num_past_tokens)


# ------------------------------------------------------------------ fitting


@dataclass(frozen=True)
class PhasePoint:
    """One measured forward/backward: C sequences of ℓ tokens took `latency_s`."""

    batch_size: int
    num_tokens: int
    latency_s: float


@dataclass(frozen=True)
class DecodePoint:
    """One measured decode step over a batch holding `sum_context_tokens` of KV."""

    batch_size: int
    sum_context_tokens: int
    latency_s: float


@dataclass(frozen=True)
class ChunkPoint:
    """One measured prefill chunk: n new tokens of one sequence after p cached ones."""

    num_new_tokens: int
    num_past_tokens: int
    latency_s: float


@dataclass(frozen=True)
class FitQuality:
    """Goodness of fit on held-out points (never the points that were fitted)."""

    r2: float
    mape: float  # mean absolute percentage error, as a fraction
    num_fit_points: int
    num_holdout_points: int


def _lstsq(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    import numpy as np  # local: keeps `import lemix.latency` light for the planner

    matrix = np.asarray(rows, dtype=float)
    vector = np.asarray(targets, dtype=float)
    # Relative weighting: latencies span orders of magnitude, and an absolute
    # fit would ignore the short ones that dominate decode and small prompts.
    weights = 1.0 / np.maximum(np.abs(vector), 1e-12)
    solution, *_ = np.linalg.lstsq(matrix * weights[:, None], vector * weights, rcond=None)
    return [float(x) for x in solution]


def fit_paper_eta(points: Sequence[PhasePoint]) -> float:
    """η for Δ = η·C·ℓ² by (relative) least squares."""
    if not points:
        raise ValueError("need at least one point to fit η")
    rows = [[float(p.batch_size * p.num_tokens**2)] for p in points]
    coeffs = _lstsq(rows, [p.latency_s for p in points])
    return coeffs[0]


def fit_quad(points: Sequence[PhasePoint]) -> QuadCoeffs:
    """a, b, c for Δ = a + b·C·ℓ + c·C·ℓ²."""
    if len(points) < 3:
        raise ValueError("need at least 3 points to fit a + b·Cℓ + c·Cℓ²")
    rows = [[1.0, p.batch_size * p.num_tokens, p.batch_size * p.num_tokens**2] for p in points]
    a, b, c = _lstsq(rows, [p.latency_s for p in points])
    return QuadCoeffs(a, b, c)


def fit_decode(points: Sequence[DecodePoint]) -> DecodeCoeffs:
    """d0, d1, d2 for Δ_dec = d0 + d1·C + d2·Σcontext."""
    if len(points) < 3:
        raise ValueError("need at least 3 points to fit a decode model")
    rows = [[1.0, float(p.batch_size), float(p.sum_context_tokens)] for p in points]
    d0, d1, d2 = _lstsq(rows, [p.latency_s for p in points])
    return DecodeCoeffs(d0, d1, d2)


def fit_chunk(points: Sequence[ChunkPoint]) -> ChunkCoeffs:
    """a, b, c, e, f for Δ = a + b·n + c·n² + e·n·p + f·p."""
    if len(points) < 5:
        raise ValueError("need at least 5 points to fit a chunk model")
    rows = [
        [1.0, n, n * n, n * p, p]
        for n, p in ((q.num_new_tokens, q.num_past_tokens) for q in points)
    ]
    a, b, c, e, f = _lstsq(rows, [q.latency_s for q in points])
    return ChunkCoeffs(a, b, c, e, f)


def fit_quality(predicted: Sequence[float], measured: Sequence[float], num_fit: int) -> FitQuality:
    """R² and MAPE of predictions against measurements."""
    if not measured:
        return FitQuality(r2=math.nan, mape=math.nan, num_fit_points=num_fit, num_holdout_points=0)
    mean = sum(measured) / len(measured)
    ss_res = sum((m - p) ** 2 for p, m in zip(predicted, measured, strict=True))
    ss_tot = sum((m - mean) ** 2 for m in measured)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    mape = sum(abs(m - p) / abs(m) for p, m in zip(predicted, measured, strict=True) if m) / len(
        measured
    )
    return FitQuality(r2=r2, mape=mape, num_fit_points=num_fit, num_holdout_points=len(measured))


def split_holdout(
    points: Sequence[T], holdout_fraction: float, seed: int
) -> tuple[list[T], list[T]]:
    """Deterministic train/held-out split (seeded)."""
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError("holdout_fraction must be in (0, 1)")
    shuffled = list(points)
    random.Random(seed).shuffle(shuffled)
    num_holdout = max(1, int(round(len(shuffled) * holdout_fraction)))
    return shuffled[num_holdout:], shuffled[:num_holdout]
