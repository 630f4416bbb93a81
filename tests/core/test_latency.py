"""Latency models and their fitting (lemix.latency)."""

from __future__ import annotations

import math
import random

import pytest

from lemix.latency import (
    AffineQuadraticLatencyModel,
    DecodeCoeffs,
    DecodePoint,
    PaperLatencyModel,
    PhasePoint,
    QuadCoeffs,
    fit_decode,
    fit_paper_eta,
    fit_quad,
    fit_quality,
    split_holdout,
)

BATCHES = (1, 2, 4, 8)
LENGTHS = (16, 64, 256, 1024, 4096)


def _phase_points(fn) -> list[PhasePoint]:
    return [PhasePoint(c, n, fn(c, n)) for c in BATCHES for n in LENGTHS]


# ------------------------------------------------------------------ evaluation


def test_paper_model_is_eta_c_l_squared() -> None:
    model = PaperLatencyModel(eta_forward=(2e-8, 3e-8), eta_backward=(5e-8, 7e-8))
    assert model.num_stages == 2
    assert model.forward_s(1, 4, 100) == pytest.approx(3e-8 * 4 * 100 * 100)  # 1.2e-3
    assert model.forward_s(1, 4, 100) == pytest.approx(1.2e-3)
    assert model.backward_s(0, 2, 50) == pytest.approx(5e-8 * 2 * 2500)  # 2.5e-4
    # No decode model in the paper: a decode step is a forward with ℓ = 1.
    assert model.decode_step_s(0, 5, 99_999) == pytest.approx(1e-7)


def test_paper_model_needs_one_eta_per_stage() -> None:
    with pytest.raises(ValueError):
        PaperLatencyModel(eta_forward=(1e-8,), eta_backward=(1e-8, 1e-8))
    with pytest.raises(ValueError):
        PaperLatencyModel(eta_forward=(), eta_backward=())


def test_affine_quadratic_model_by_hand() -> None:
    quad = QuadCoeffs(a=1.0, b=2.0, c=3.0)
    assert quad(2, 10) == 1.0 + 2.0 * 20 + 3.0 * 200  # 641
    dec = DecodeCoeffs(d0=0.5, d1=0.25, d2=0.001)
    assert dec(4, 1000) == pytest.approx(0.5 + 1.0 + 1.0)
    model = AffineQuadraticLatencyModel((quad,), (QuadCoeffs(0, 0, 1),), (dec,))
    assert model.num_stages == 1
    assert model.forward_s(0, 2, 10) == 641
    assert model.backward_s(0, 3, 5) == 75
    assert model.decode_step_s(0, 4, 1000) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        AffineQuadraticLatencyModel((quad,), (quad, quad), (dec,))


# ------------------------------------------------------------------ fitting


def test_fit_paper_eta_recovers_eta_from_exact_points() -> None:
    eta = 2.5e-8
    points = _phase_points(lambda c, n: eta * c * n * n)
    assert fit_paper_eta(points) == pytest.approx(eta, rel=1e-9)


def test_fit_quad_recovers_coefficients_from_exact_points() -> None:
    true = QuadCoeffs(a=1e-3, b=2e-5, c=3e-9)
    coeffs = fit_quad(_phase_points(true))
    assert coeffs.a == pytest.approx(1e-3, rel=1e-6)
    assert coeffs.b == pytest.approx(2e-5, rel=1e-6)
    assert coeffs.c == pytest.approx(3e-9, rel=1e-6)


def test_fit_decode_recovers_coefficients_from_exact_points() -> None:
    true = DecodeCoeffs(d0=5e-3, d1=4e-5, d2=2e-7)
    points = [
        DecodePoint(c, c * ctx, true(c, c * ctx))
        for c in (1, 2, 8, 32)
        for ctx in (100, 1000, 4000)
    ]
    coeffs = fit_decode(points)
    assert coeffs.d0 == pytest.approx(5e-3, rel=1e-6)
    assert coeffs.d1 == pytest.approx(4e-5, rel=1e-6)
    assert coeffs.d2 == pytest.approx(2e-7, rel=1e-6)


def test_fits_refuse_too_few_points() -> None:
    with pytest.raises(ValueError):
        fit_paper_eta([])
    with pytest.raises(ValueError):
        fit_quad([PhasePoint(1, 10, 1.0), PhasePoint(2, 10, 2.0)])
    with pytest.raises(ValueError):
        fit_decode([DecodePoint(1, 10, 1.0)])


def test_fit_quad_on_noisy_points_is_close_and_scores_well() -> None:
    rng = random.Random(7)
    true = QuadCoeffs(a=2e-3, b=4e-5, c=2.5e-9)
    noisy = [
        PhasePoint(p.batch_size, p.num_tokens, p.latency_s * (1 + rng.uniform(-0.03, 0.03)))
        for p in _phase_points(true)
    ]
    fit_pts, held = split_holdout(noisy, 0.25, seed=1)
    coeffs = fit_quad(fit_pts)
    assert coeffs.b == pytest.approx(true.b, rel=0.1)
    quality = fit_quality(
        [coeffs(p.batch_size, p.num_tokens) for p in held],
        [p.latency_s for p in held],
        len(fit_pts),
    )
    assert quality.r2 > 0.99
    assert 0 < quality.mape < 0.05
    assert (quality.num_fit_points, quality.num_holdout_points) == (15, 5)


# ------------------------------------------------------------------ fit quality


def test_fit_quality_is_perfect_on_exact_data() -> None:
    q = fit_quality([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], num_fit=10)
    assert (q.r2, q.mape, q.num_fit_points, q.num_holdout_points) == (1.0, 0.0, 10, 3)


def test_fit_quality_by_hand() -> None:
    # residuals 0.1, 0, -0.3 -> SS_res 0.10; mean 2 -> SS_tot 2.0; R² = 0.95
    # MAPE = (0.1/1 + 0/2 + 0.3/3) / 3 = 0.0667
    q = fit_quality([1.1, 2.0, 2.7], [1.0, 2.0, 3.0], num_fit=4)
    assert q.r2 == pytest.approx(0.95)
    assert q.mape == pytest.approx(0.2 / 3)


def test_fit_quality_of_a_bad_model_is_negative_r2() -> None:
    q = fit_quality([10.0, 10.0, 10.0], [1.0, 2.0, 3.0], num_fit=1)
    assert q.r2 < 0
    assert q.mape == pytest.approx((9 / 1 + 8 / 2 + 7 / 3) / 3)


def test_fit_quality_without_holdout_is_nan() -> None:
    q = fit_quality([], [], num_fit=5)
    assert math.isnan(q.r2) and math.isnan(q.mape)
    assert q.num_holdout_points == 0


# ------------------------------------------------------------------ holdout split


def test_split_holdout_is_deterministic_disjoint_and_complete() -> None:
    items = list(range(20))
    fit_a, held_a = split_holdout(items, 0.25, seed=3)
    fit_b, held_b = split_holdout(items, 0.25, seed=3)
    assert (fit_a, held_a) == (fit_b, held_b)
    assert len(held_a) == 5 and len(fit_a) == 15
    assert not set(fit_a) & set(held_a)
    assert sorted(fit_a + held_a) == items
    assert items == list(range(20))  # the input is not shuffled in place


def test_split_holdout_depends_on_seed() -> None:
    items = list(range(50))
    held_by_seed = {tuple(split_holdout(items, 0.2, seed=s)[1]) for s in range(5)}
    assert len(held_by_seed) > 1


def test_split_holdout_keeps_at_least_one_and_checks_fraction() -> None:
    fit, held = split_holdout([1, 2, 3], 0.01, seed=0)
    assert len(held) == 1 and len(fit) == 2
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError):
            split_holdout([1, 2, 3], bad, seed=0)
