"""Frontier and verdict rules of lemix.report.pareto on hand-made points."""

from __future__ import annotations

import pytest

from lemix.report.pareto import (
    Estimate,
    ParetoPoint,
    format_points,
    frontier,
    points_from_runs,
    significantly_dominates,
    verdict,
)


def point(
    policy: str, x: float, y: float, ci: float = 0.1, train: float = 0.5, headroom: float = 0.8
) -> ParetoPoint:
    return ParetoPoint(policy, train, headroom, Estimate(x, ci), Estimate(y, ci), 3)


def test_frontier_keeps_the_non_dominated_points_sorted_by_x() -> None:
    a, b, c = point("p", 1, 9, train=0.1), point("p", 5, 7, train=0.5), point("p", 9, 2, train=0.9)
    dominated = point("p", 4, 6, train=0.3)  # b has more of both
    duplicate_x = point("p", 5, 6.5, train=0.6)  # same training as b, less goodput
    assert frontier([c, dominated, a, duplicate_x, b]) == [a, b, c]


def test_equal_points_both_stay_on_the_frontier() -> None:
    a, b = point("p", 3, 3, train=0.3), point("p", 3, 3, train=0.4)
    assert frontier([a, b]) == [a, b]


def test_significant_dominance_needs_non_overlapping_cis() -> None:
    low = point("b", 5, 5, ci=0.5)
    assert significantly_dominates(point("a", 5, 6.2, ci=0.5), low)  # goodput CIs apart
    assert not significantly_dominates(point("a", 5, 5.8, ci=0.5), low)  # overlapping: no
    # More goodput but significantly less training: not a dominance.
    assert not significantly_dominates(point("a", 3, 8, ci=0.5), low)
    # More training, goodput within 5% of b's: a dominance along x.
    assert significantly_dominates(point("a", 7, 4.8, ci=0.5), low)
    # More training but 10% less goodput, even with overlapping CIs: no.
    assert not significantly_dominates(point("a", 7, 4.5, ci=0.5), low)
    assert not significantly_dominates(low, low)


def test_verdict_loses_where_another_frontier_point_is_above() -> None:
    lemix = [point("lemix", 2, 9), point("lemix", 6, 6)]
    other = [point("mix-rr", 2, 9), point("mix-rr", 6, 8)]  # same training, more goodput
    v = verdict(lemix, other)
    assert v.outcome == "loses"
    assert "x=6.00" in v.detail and "mix-rr" in v.detail


def test_verdict_wins_only_when_every_point_is_dominated() -> None:
    lemix = [point("lemix", 2, 10), point("lemix", 6, 8)]
    other = [point("separate", 2, 7), point("separate", 5, 5)]
    assert verdict(lemix, other).outcome == "wins"
    # One of its points within noise of lemix's: no longer a win.
    partial = [*other, point("separate", 6, 7.95)]
    assert verdict(lemix, partial).outcome == "ties"


def test_overlapping_cis_give_a_tie_even_with_better_means() -> None:
    lemix = [point("lemix", 5, 8.0, ci=1.0)]
    other = [point("mix-luf", 5, 8.5, ci=1.0)]
    assert verdict(lemix, other).outcome == "ties"
    assert verdict(other, lemix).outcome == "ties"


def test_points_from_runs_groups_by_knob_with_ci() -> None:
    def run(policy: str, seed: int, x: float, y: float | None) -> dict[str, object]:
        return {
            "policy": policy,
            "seed": seed,
            "request_rate": 10.0,
            "train_rate": 0.5,
            "slo_headroom": 0.8,
            "training_samples_s_window": x,
            "goodput_rps": y,
        }

    runs = [run("lemix", 0, 4.0, 8.0), run("lemix", 1, 6.0, 10.0), run("lemix", 2, 5.0, None)]
    (p,) = points_from_runs(runs)
    assert (p.policy, p.num_seeds, p.x.mean, p.y.mean) == ("lemix", 2, 5.0, 9.0)
    assert p.y.ci95 == pytest.approx(12.706 * 1.0 / 1.0, rel=1e-3)  # t(1) * s / sqrt(2)
    assert "| lemix | 0.5 | 0.8 | spread | 2 |" in format_points([p], [p])
    # Homed runs are their own point, labelled by training nodes and admission.
    homed = [{**r, "training_nodes": "auto", "admission": "cluster"} for r in runs]
    other, spread = points_from_runs([*runs, *homed])  # sorted by placement
    assert (spread.placement, other.placement) == ("spread", "homed/cluster")
    assert other.knob == "train 0.5, headroom 0.8, homed/cluster"
    with pytest.raises(ValueError, match="one request rate"):
        points_from_runs([*runs, {**runs[0], "request_rate": 4.0}])


def test_verdict_needs_points() -> None:
    with pytest.raises(ValueError):
        verdict([], [point("x", 1, 1)])


def test_a_point_lemix_matches_elsewhere_is_not_a_loss() -> None:
    # The other policy's (6, 4) dominates lemix's (2, 4) along x, but lemix's
    # own (6, 3.85) is within noise of it: lemix's frontier is not below it.
    lemix = [point("lemix", 2, 4.0), point("lemix", 6, 3.85)]
    other = [point("mix-rr", 6, 4.0)]
    assert significantly_dominates(other[0], lemix[0])
    assert verdict(lemix, other).outcome == "ties"
    # Without lemix's matching point it is a loss at x=6.
    v = verdict(lemix[:1], other)
    assert v.outcome == "loses" and "x=6.00" in v.detail
