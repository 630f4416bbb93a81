"""Pareto frontiers of goodput vs in-window training, and verdicts from them.

At one request rate each policy is run at several settings of its training
knob (offered train rate; for the policies that defer training also the
admission threshold `slo_headroom`). Every setting gives one point, the mean
and 95% CI over seeds of x = `training_samples_s_window` (training delivered
inside the arrival window) and y = `goodput_rps` (SLO-meeting requests per
second of window). A policy's frontier is its points that no other of its
points dominates by the means.

Verdicts compare frontiers with the CIs, so noise cannot make a winner:
point a *significantly dominates* b when a is better in one coordinate with
non-overlapping CIs and at least as good in the other, up to `TIE_TOLERANCE`
of b's mean there (two policies offered the same training differ by a few
percent of noise in what they deliver). Overlapping CIs are not enough for the
second coordinate: with 2-3 seeds they span most of the axis. Against each
other policy, `lemix`
- loses where one of that policy's frontier points is above `lemix`'s
  frontier: it significantly dominates a `lemix` frontier point and no `lemix`
  frontier point matches it (is within noise of it or better in both
  coordinates: not significantly worse in either);
- wins where every frontier point of that policy is significantly dominated
  by a `lemix` frontier point that is, in the same sense, above its frontier;
- ties otherwise.
A point with a single seed has no CI (None) and is treated as a CI of zero
width; the report always runs at least two seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lemix.report.metrics import mean_ci95

X_METRIC = "training_samples_s_window"
Y_METRIC = "goodput_rps"

Outcome = Literal["wins", "ties", "loses"]
# "At least as good" in the coordinate that is not significantly better: the
# mean may fall short of the other's by this fraction of it. The capped
# baselines, given the same offered load as lemix, deliver 10.08-10.28
# in-window samples/s (docs/results.md): a spread of 2%.
TIE_TOLERANCE = 0.05


@dataclass(frozen=True)
class Estimate:
    """Mean and 95% CI half width over seeds (`ci95` 0.0 for one seed)."""

    mean: float
    ci95: float

    @property
    def low(self) -> float:
        return self.mean - self.ci95

    @property
    def high(self) -> float:
        return self.mean + self.ci95

    def overlaps(self, other: Estimate) -> bool:
        return self.low <= other.high and other.low <= self.high

    def is_significantly_above(self, other: Estimate) -> bool:
        return self.low > other.high

    def is_at_least(self, other: Estimate) -> bool:
        """Mean at least `other`'s, up to TIE_TOLERANCE of it."""
        return self.mean >= other.mean - TIE_TOLERANCE * abs(other.mean)


@dataclass(frozen=True)
class ParetoPoint:
    """One knob setting of one policy: x = in-window training samples/s, y = goodput req/s."""

    policy: str
    train_rate: float  # offered fraction of tasks that are training
    slo_headroom: float  # admission threshold (inert for policies that never defer)
    x: Estimate
    y: Estimate
    num_seeds: int
    # Where training runs and how it is admitted (`placement_of`): "spread"
    # (every node, per-node admission: the default) or "homed/node",
    # "homed/cluster" (SEPARATE's training nodes only, `--training-nodes auto`).
    placement: str = "spread"

    @property
    def knob(self) -> str:
        knob = f"train {self.train_rate:g}, headroom {self.slo_headroom:g}"
        return knob if self.placement == "spread" else f"{knob}, {self.placement}"


def placement_of(run: dict[str, Any]) -> str:
    """A run's placement label: "spread" unless it trained on fewer nodes
    (`training_nodes` other than "all"; runs older than the key are "spread")."""
    nodes = run.get("training_nodes", "all")
    if nodes == "all":
        return "spread"
    homed = "homed" if nodes == "auto" else f"homed{nodes}"
    return f"{homed}/{run.get('admission', 'node')}"


def points_from_runs(runs: Sequence[dict[str, Any]]) -> list[ParetoPoint]:
    """One point per (policy, train_rate, slo_headroom, placement), over the runs' seeds.

    Runs must all be at one request rate (ValueError otherwise); a run whose
    goodput or window rate is undefined (None) is left out of that point.
    """
    rates = {r["request_rate"] for r in runs}
    if len(rates) > 1:
        raise ValueError(f"a frontier is drawn at one request rate, got {sorted(rates)}")
    groups: dict[tuple[str, float, float, str], list[dict[str, Any]]] = {}
    for run in runs:
        key = (
            run["policy"],
            float(run["train_rate"]),
            float(run["slo_headroom"]),
            placement_of(run),
        )
        groups.setdefault(key, []).append(run)
    points = []
    for (policy, train, headroom, placement), members in sorted(groups.items()):
        pairs = [
            (r[X_METRIC], r[Y_METRIC])
            for r in members
            if r[X_METRIC] is not None and r[Y_METRIC] is not None
        ]
        if not pairs:
            continue
        x = _estimate([p[0] for p in pairs])
        y = _estimate([p[1] for p in pairs])
        points.append(ParetoPoint(policy, train, headroom, x, y, len(pairs), placement))
    return points


def _estimate(values: Sequence[float]) -> Estimate:
    mean, half = mean_ci95(values)
    return Estimate(mean, half or 0.0)


def frontier(points: Sequence[ParetoPoint]) -> list[ParetoPoint]:
    """The points (of one policy) no other of them dominates by the means
    (>= in both coordinates, > in one), sorted by x."""

    def dominated(p: ParetoPoint) -> bool:
        return any(
            q.x.mean >= p.x.mean
            and q.y.mean >= p.y.mean
            and (q.x.mean > p.x.mean or q.y.mean > p.y.mean)
            for q in points
        )

    return sorted((p for p in points if not dominated(p)), key=lambda p: (p.x.mean, p.y.mean))


def significantly_dominates(a: ParetoPoint, b: ParetoPoint) -> bool:
    """a is better than b in one coordinate with non-overlapping CIs and at
    least as good (up to TIE_TOLERANCE) in the other."""
    return (a.y.is_significantly_above(b.y) and a.x.is_at_least(b.x)) or (
        a.x.is_significantly_above(b.x) and a.y.is_at_least(b.y)
    )


@dataclass(frozen=True)
class Verdict:
    """`reference` (lemix) against `policy`, read off the two frontiers."""

    reference: str
    policy: str
    outcome: Outcome
    detail: str  # the numbers behind the outcome, one sentence


def matches(a: ParetoPoint, b: ParetoPoint) -> bool:
    """a is not significantly worse than b in either coordinate (within noise or better)."""
    return not b.x.is_significantly_above(a.x) and not b.y.is_significantly_above(a.y)


def beats_frontier(q: ParetoPoint, front: Sequence[ParetoPoint]) -> list[ParetoPoint]:
    """The points of `front` that q significantly dominates, or [] when some
    point of `front` matches q (q is then not above that frontier as a whole)."""
    if any(matches(p, q) for p in front):
        return []
    return [p for p in front if significantly_dominates(q, p)]


def verdict(reference: Sequence[ParetoPoint], other: Sequence[ParetoPoint]) -> Verdict:
    """Compare two frontiers (see the module docstring for the rule)."""
    if not reference or not other:
        raise ValueError("both frontiers need at least one point")
    ref_name, name = reference[0].policy, other[0].policy
    losses = [(q, p) for q in other for p in beats_frontier(q, reference)]
    if losses:
        # Each winning point against the best lemix point it beats (the
        # closest call for it); of those, the one with the largest goodput gap.
        closest = [
            max((qp for qp in losses if qp[0] == q), key=lambda qp: qp[1].y.mean)
            for q in dict.fromkeys(q for q, _ in losses)
        ]
        q, p = max(closest, key=lambda qp: qp[0].y.mean - qp[1].y.mean)
        xs = ", ".join(sorted({f"{q.x.mean:.2f}" for q, _ in losses}))
        detail = (
            f"{ref_name} loses at x={xs} samples/s: {name} ({q.knob}) gives "
            f"{_pair(q)} vs {ref_name} ({p.knob}) {_pair(p)}"
        )
        return Verdict(ref_name, name, "loses", detail)
    # lemix points above the other frontier, and the other's points they dominate.
    wins = [(p, q) for p in reference for q in beats_frontier(p, other)]
    beaten = {q for _, q in wins}
    if len(beaten) == len(other):
        # Each of its points against the lemix point that beats it by the most
        # goodput; the smallest such margin is quoted (the closest call).
        pairs = [max((pq for pq in wins if pq[1] == q), key=lambda pq: pq[0].y.mean) for q in other]
        p, q = min(pairs, key=lambda pq: pq[0].y.mean - pq[1].y.mean)
        detail = (
            f"{ref_name} is above all {len(other)} frontier points of {name}; "
            f"closest: {ref_name} ({p.knob}) {_pair(p)} vs {name} ({q.knob}) {_pair(q)}"
        )
        return Verdict(ref_name, name, "wins", detail)
    detail = (
        f"within noise: {ref_name} is above {len(beaten)} of {name}'s "
        f"{len(other)} frontier points, {name} above none of {ref_name}'s {len(reference)}"
    )
    return Verdict(ref_name, name, "ties", detail)


def _goodput(p: ParetoPoint) -> float:
    return p.y.mean


def _pair(p: ParetoPoint) -> str:
    return (
        f"{p.y.mean:.2f} ± {p.y.ci95:.2f} req/s goodput at "
        f"{p.x.mean:.2f} ± {p.x.ci95:.2f} training samples/s"
    )


def format_points(points: Sequence[ParetoPoint], frontier_points: Sequence[ParetoPoint]) -> str:
    """A markdown table of every point, frontier points marked."""
    on_frontier = set(frontier_points)
    lines = [
        "| policy | train rate | headroom | placement | n | in-window training (samples/s) "
        "| goodput (req/s) | frontier |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p.policy} | {p.train_rate:g} | {p.slo_headroom:g} | {p.placement} "
            f"| {p.num_seeds} "
            f"| {p.x.mean:.2f} ± {p.x.ci95:.2f} | {p.y.mean:.2f} ± {p.y.ci95:.2f} "
            f"| {'yes' if p in on_frontier else ''} |"
        )
    return "\n".join(lines)
