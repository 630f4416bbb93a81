"""Prefill chunks with a cached past: the chunk model, its default and its fit
(lemix.latency, lemix.latency_fit)."""

from __future__ import annotations

import itertools

import pytest

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
)
from lemix.latency_fit import fit_chunk_points, fit_quality_summary, fit_stage_points

FORWARD = QuadCoeffs(a=2e-3, b=4e-5, c=3e-9)
DECODE = DecodeCoeffs(d0=5e-3, d1=1e-5, d2=2e-7)
NEW = (16, 32, 64, 128, 256, 512)
PAST = (0, 128, 512, 1024, 1536)


def test_chunk_coeffs_by_hand() -> None:
    chunk = ChunkCoeffs(a=1.0, b=2.0, c=3.0, e=4.0, f=5.0)
    # 1 + 2·10 + 3·100 + 4·10·7 + 5·7 = 1 + 20 + 300 + 280 + 35
    assert chunk(10, 7) == 636.0
    assert chunk(10, 0) == 1.0 + 20 + 300


def test_derived_chunk_is_a_forward_without_a_past() -> None:
    model = AffineQuadraticLatencyModel((FORWARD,), (FORWARD,), (DECODE,))
    for n in NEW:
        assert model.chunk_forward_s(0, n, 0) == pytest.approx(model.forward_s(0, 1, n))


@pytest.mark.parametrize(("n", "p"), [(16, 4000), (256, 256), (512, 1536)])
def test_derived_chunk_conserves_work_and_reads_the_past_kv(n: int, p: int) -> None:
    """A prompt of p + n tokens as a chunk of p and a chunk of n costs one more
    fixed cost than in one pass, plus the past's KV read at the decode rate."""
    model = AffineQuadraticLatencyModel((FORWARD,), (FORWARD,), (DECODE,))
    one_pass = model.forward_s(0, 1, p + n)
    chunked = model.forward_s(0, 1, p) + model.chunk_forward_s(0, n, p)
    assert chunked == pytest.approx(one_pass + FORWARD.a + DECODE.d2 * p)
    # The past makes a chunk dearer than a prompt of its length, and more so the longer it is.
    assert model.chunk_forward_s(0, n, p) > model.forward_s(0, 1, n)
    assert model.chunk_forward_s(0, n, 2 * p) > model.chunk_forward_s(0, n, p)


def test_measured_chunk_coefficients_replace_the_default() -> None:
    measured = ChunkCoeffs(a=1e-3, b=1e-5, c=0.0, e=1e-8, f=1e-6)
    model = AffineQuadraticLatencyModel((FORWARD,), (FORWARD,), (DECODE,), chunk=(measured,))
    assert model.chunk_coeffs(0) == measured
    assert model.chunk_forward_s(0, 100, 1000) == pytest.approx(measured(100, 1000))
    assert AffineQuadraticLatencyModel((FORWARD,), (FORWARD,), (DECODE,)).chunk_coeffs(
        0
    ) == ChunkCoeffs.derived(FORWARD, DECODE)


def test_chunk_list_needs_one_entry_per_stage() -> None:
    with pytest.raises(ValueError, match="chunk"):
        AffineQuadraticLatencyModel(
            (FORWARD,) * 2,
            (FORWARD,) * 2,
            (DECODE,) * 2,
            chunk=(ChunkCoeffs.derived(FORWARD, DECODE),),
        )


def test_paper_chunk_is_the_difference_of_two_prompts() -> None:
    paper = PaperLatencyModel((2e-8,), (4e-8,))
    # η·((p + n)² − p²) = 2e-8 · (300² − 200²) = 2e-8 · 50,000 = 1e-3
    assert paper.chunk_forward_s(0, 100, 200) == pytest.approx(1e-3)
    assert paper.chunk_forward_s(0, 100, 0) == pytest.approx(paper.forward_s(0, 1, 100))


def test_fit_chunk_recovers_known_coefficients() -> None:
    truth = ChunkCoeffs(a=3e-3, b=2e-5, c=4e-9, e=6e-9, f=3e-7)
    points = [ChunkPoint(n, p, truth(n, p)) for n, p in itertools.product(NEW, PAST)]
    fitted = fit_chunk(points)
    for n, p in itertools.product((24, 300), (64, 1200)):  # off the grid
        assert fitted(n, p) == pytest.approx(truth(n, p), rel=1e-6)
    with pytest.raises(ValueError, match="5 points"):
        fit_chunk(points[:4])


def test_fit_chunk_points_scores_ours_paper_and_derived_on_held_out_points() -> None:
    # Truth has a past term the derived default underestimates (e = 4·c, not 2·c).
    truth = ChunkCoeffs(FORWARD.a, FORWARD.b, FORWARD.c, 4 * FORWARD.c, 1e-6)
    points = [ChunkPoint(n, p, truth(n, p)) for n, p in itertools.product(NEW, PAST)]
    derived = ChunkCoeffs.derived(FORWARD, DECODE)
    coeffs, quality = fit_chunk_points(points, 1e-8, derived, 0.25, seed=0)
    assert set(quality) == {"paper", "ours", "derived"}
    assert quality["ours"]["num_holdout_points"] == 8  # round(30 · 0.25)
    assert quality["ours"]["num_fit_points"] == 22
    assert quality["ours"]["r2"] == pytest.approx(1.0, abs=1e-9)
    assert quality["ours"]["mape"] < 1e-6
    assert quality["derived"]["mape"] > 0.01  # misses the larger past terms
    assert quality["paper"]["mape"] > quality["derived"]["mape"]
    assert coeffs(100, 1000) == pytest.approx(truth(100, 1000), rel=1e-6)


def test_stage_fit_reports_chunk_only_where_measured() -> None:
    fwd = [PhasePoint(c, n, FORWARD(c, n)) for c in (1, 2, 4) for n in (16, 64, 256)]
    dec = [DecodePoint(c, s, DECODE(c, s)) for c in (1, 2, 4) for s in (256, 1024, 4096)]
    chunk = [
        ChunkPoint(n, p, FORWARD(1, n) + 1e-8 * n * p) for n, p in itertools.product(NEW, PAST)
    ]
    without = fit_stage_points(fwd, fwd, dec, 0.25, 0)
    with_chunk = fit_stage_points(fwd, fwd, dec, 0.25, 0, chunk)
    assert without.chunk is None and "chunk" not in without.quality
    assert with_chunk.chunk is not None and "chunk" in with_chunk.quality
    summary = fit_quality_summary([with_chunk, with_chunk], 0.25, 0)
    assert len(summary["chunk"]["derived"]) == 2
    # A profile with one stage measured and one not has no chunk phase at all.
    assert "chunk" not in fit_quality_summary([with_chunk, without], 0.25, 0)
