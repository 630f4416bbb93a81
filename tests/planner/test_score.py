"""The node score: IP, LC and f, checked against hand-computed values."""

from __future__ import annotations

import pytest

from lemix.planner.score import (
    idleness_profit,
    length_consistency,
    length_consistency_normalized,
    normalized_score,
    paper_score,
)

approx = pytest.approx


# ------------------------------------------------------------------------- IP


def test_idleness_profit_above_the_floor() -> None:
    # II = 1.2 s over S = 2 stages, Δa = 0.1 s: −max(0.6 − 0.1, 0.2) = −0.5
    assert idleness_profit(1.2, 2, 0.1, 0.2) == approx(-0.5)


def test_idleness_profit_is_floored_at_minus_tau() -> None:
    # II/S − Δa = 0.1 − 0.0 = 0.1 < τ = 0.2 → −0.2
    assert idleness_profit(0.4, 4, 0.0, 0.2) == approx(-0.2)
    # A long arrival gap discounts all the idleness: 0.5 − 3.0 < τ → −τ
    assert idleness_profit(1.0, 2, 3.0, 0.2) == approx(-0.2)
    # No idleness at all still gives −τ, never 0.
    assert idleness_profit(0.0, 2, 0.0, 0.15) == approx(-0.15)


def test_idleness_profit_exactly_at_the_floor() -> None:
    assert idleness_profit(0.6, 2, 0.1, 0.2) == approx(-0.2)


# ------------------------------------------------------------------------- LC


def test_length_consistency_is_the_gaussian_density() -> None:
    # z = (120 − 100)/20 = 1: e^{−1/2} / (20·√(2π)) = 0.6065306597 / 50.1325654926
    assert length_consistency(120, 100, 20) == approx(0.01209853622595717, rel=1e-12)
    # At the mean: 1 / (20·√(2π))
    assert length_consistency(100, 100, 20) == approx(0.019947114020071637, rel=1e-12)
    # z = −2 with σ = 10: e^{−2} / (10·√(2π))
    assert length_consistency(80, 100, 10) == approx(0.005399096651318806, rel=1e-12)


def test_length_consistency_is_zero_without_spread() -> None:
    assert length_consistency(100, 100, 0.0) == 0.0
    assert length_consistency(5, 100, 0.0) == 0.0
    assert length_consistency_normalized(100, 100, 0.0) == 0.0


def test_normalized_length_consistency_is_one_at_the_mean() -> None:
    assert length_consistency_normalized(100, 100, 20) == 1.0
    assert length_consistency_normalized(120, 100, 20) == approx(0.6065306597126334)
    assert length_consistency_normalized(80, 100, 20) == approx(0.6065306597126334)


# -------------------------------------------------------------------------- f


def test_paper_score_by_hand() -> None:
    # (IP + λ2·LC)/(λ1·R) = (−0.5 + 0.05·0.02)/(0.15·2.0) = −0.499/0.3
    assert paper_score(-0.5, 0.02, 2.0, 0.15, 0.05) == approx(-0.499 / 0.3)
    # LC large enough to make the numerator positive: (−0.2 + 0.05·10)/(0.15·1) = 2.0
    assert paper_score(-0.2, 10.0, 1.0, 0.15, 0.05) == approx(2.0)


def test_paper_score_guards_zero_response() -> None:
    assert paper_score(-0.2, 0.0, 0.0, 0.15, 0.05) == approx(-0.2 / (0.15 * 1e-9))


def test_paper_form_prefers_the_slower_node_when_ip_is_negative() -> None:
    """The documented sign issue: with IP < 0 a larger R gives a higher f."""
    ip = idleness_profit(0.0, 2, 0.0, 0.2)  # −τ: both nodes add no idleness
    fast = paper_score(ip, 0.0, 1.0, 0.15, 0.05)  # −0.2/0.15 = −1.333…
    slow = paper_score(ip, 0.0, 2.0, 0.15, 0.05)  # −0.2/0.30 = −0.666…
    assert fast == approx(-4.0 / 3.0)
    assert slow == approx(-2.0 / 3.0)
    assert slow > fast  # the paper form ranks the slower node first


def test_normalized_score_by_hand() -> None:
    # IP/τ − λ1·R/τ_R + λ2·LC_norm = −0.5/0.2 − 1.0·2.0/4.0 + 0.05·0.5 = −2.5 − 0.5 + 0.025
    assert normalized_score(-0.5, 0.5, 2.0, 0.2, 4.0, 1.0, 0.05) == approx(-2.975)
    # At the floor IP/τ = −1
    assert normalized_score(-0.2, 0.0, 0.0, 0.2, 4.0, 1.0, 0.05) == approx(-1.0)


def test_normalized_form_ranks_lower_response_higher() -> None:
    ip = idleness_profit(0.0, 2, 0.0, 0.2)
    fast = normalized_score(ip, 0.0, 1.0, 0.2, 5.0, 0.15, 0.05)  # −1 − 0.03
    slow = normalized_score(ip, 0.0, 2.0, 0.2, 5.0, 0.15, 0.05)  # −1 − 0.06
    assert fast == approx(-1.03)
    assert slow == approx(-1.06)
    assert fast > slow


def test_normalized_form_rewards_length_consistency_and_penalizes_idleness() -> None:
    base = normalized_score(-0.2, 0.0, 1.0, 0.2, 5.0, 0.15, 0.05)
    assert normalized_score(-0.2, 1.0, 1.0, 0.2, 5.0, 0.15, 0.05) == approx(base + 0.05)
    assert normalized_score(-0.4, 0.0, 1.0, 0.2, 5.0, 0.15, 0.05) == approx(base - 1.0)
