"""Baselines: SEPARATE (static and dynamic split), MIX-RR, MIX-LUF, and the
capped co-located baselines.

The plain baselines never run Algorithm 1 (`needs_prediction = False`) and
never defer; the planner still does their accounting, so they are judged by
the same rules. `Capped` gives a baseline LeMix's training admission control
(the planner's deferral of training that would make the next inference miss
its SLO, with aging) and keeps the baseline's own node order: comparing
`mix-rr-capped` with `lemix` isolates what LeMix's placement score is worth.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lemix.planner.base import PolicyContext, Ranked
from lemix.planner.trace import NodeView, Prediction
from lemix.types import Task


def _rotate(candidates: Sequence[int], counter: int) -> list[Ranked]:
    """Round-robin order starting at `counter` (scores descend with position)."""
    num = len(candidates)
    if num == 0:
        return []
    start = counter % num
    order = list(candidates[start:]) + list(candidates[:start])
    return [Ranked(node_id, float(num - i)) for i, node_id in enumerate(order)]


@dataclass
class MixRoundRobinPolicy:
    """Co-located; node = arrival index mod N (the paper's NAIVEMIX / MIX-RR)."""

    name: str = "mix-rr"
    needs_prediction: bool = False
    _counter: int = 0

    def rank(
        self,
        task: Task,
        views: Sequence[NodeView],
        predictions: Mapping[int, Prediction],
        context: PolicyContext,
    ) -> list[Ranked]:
        ranked = _rotate([v.node_id for v in views], self._counter)
        self._counter += 1
        return ranked

    def serving_nodes(self, num_nodes: int, context: PolicyContext) -> tuple[int, ...]:
        return tuple(range(num_nodes))

    def training_nodes(self, num_nodes: int, context: PolicyContext) -> tuple[int, ...] | None:
        return None  # co-located: the planner's training nodes

    def snapshot_state(self) -> dict[str, Any]:
        return {"counter": self._counter}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        self._counter = int(state["counter"])


@dataclass
class MixLeastUtilizedPolicy:
    """Co-located; the node with the least memory in use first (the prototype's LUF).

    Memory use comes from the planner's own accounting (KV reserved by held
    requests, activations of held training tasks), ties broken by fewer held
    tasks, then node id.
    """

    name: str = "mix-luf"
    needs_prediction: bool = False

    def rank(
        self,
        task: Task,
        views: Sequence[NodeView],
        predictions: Mapping[int, Prediction],
        context: PolicyContext,
    ) -> list[Ranked]:
        used = context.memory_used_fraction
        order = sorted(
            views, key=lambda v: (used.get(v.node_id, 0.0), v.num_outstanding, v.node_id)
        )
        return [Ranked(v.node_id, -used.get(v.node_id, 0.0)) for v in order]

    def serving_nodes(self, num_nodes: int, context: PolicyContext) -> tuple[int, ...]:
        return tuple(range(num_nodes))

    def training_nodes(self, num_nodes: int, context: PolicyContext) -> tuple[int, ...] | None:
        return None  # co-located: the planner's training nodes

    def snapshot_state(self) -> dict[str, Any]:
        return {}  # stateless: it ranks by the planner's accounting

    def restore_state(self, state: Mapping[str, Any]) -> None:
        pass


@dataclass
class SeparatePolicy:
    """Dedicated training and serving nodes, round-robin inside each group.

    Static split (the prototype's): train = max(1, round(N·r)) nodes, the last
    ones; serving = the rest (at least 1). At r = 0 (no training offered) every
    node serves and none keeps training state; a training task that comes
    anyway is refused (INVALID_ARGUMENT) rather than parked on a serving
    node. Dynamic: the serving share grows with the estimated request rate,
    ceil(N·λ/λ_full) clamped to [1, N−1].
    Weights flow from training to serving nodes every K training tasks (the
    planner emits the syncs).
    """

    name: str = "separate"
    is_dynamic: bool = False
    needs_prediction: bool = False
    _counters: dict[str, int] = field(default_factory=lambda: {"serve": 0, "train": 0})

    def _num_serving(self, num_nodes: int, context: PolicyContext) -> int:
        if num_nodes == 1:
            return 1
        if not self.is_dynamic and context.config.train_rate == 0.0:
            return num_nodes
        if self.is_dynamic:
            share = context.request_rate_rps / context.config.dynamic_full_rate_rps
            return min(max(math.ceil(num_nodes * share), 1), num_nodes - 1)
        num_train = max(1, round(num_nodes * context.config.train_rate))
        return max(1, num_nodes - num_train)

    def serving_nodes(self, num_nodes: int, context: PolicyContext) -> tuple[int, ...]:
        return tuple(range(self._num_serving(num_nodes, context)))

    def training_nodes(self, num_nodes: int, context: PolicyContext) -> tuple[int, ...]:
        num_serving = self._num_serving(num_nodes, context)
        if not self.is_dynamic and context.config.train_rate == 0.0:
            return ()
        if num_nodes == 1:
            return (0,)
        return tuple(range(num_serving, num_nodes))

    def rank(
        self,
        task: Task,
        views: Sequence[NodeView],
        predictions: Mapping[int, Prediction],
        context: PolicyContext,
    ) -> list[Ranked]:
        num_nodes = len(views)
        if task.is_training:
            group, key = self.training_nodes(num_nodes, context), "train"
        else:
            group, key = self.serving_nodes(num_nodes, context), "serve"
        ranked = _rotate(list(group), self._counters[key])
        self._counters[key] += 1
        return ranked

    def snapshot_state(self) -> dict[str, Any]:
        return {"counters": dict(self._counters)}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        self._counters = {str(k): int(v) for k, v in state["counters"].items()}


@dataclass
class Capped:
    """`inner`'s node order, with predictions attached so the planner's
    training deferral judges each candidate (the same mechanism, the same
    candidates checked, as LeMix's)."""

    inner: MixRoundRobinPolicy | MixLeastUtilizedPolicy
    needs_prediction: bool = True

    @property
    def name(self) -> str:
        return f"{self.inner.name}-capped"

    def rank(
        self,
        task: Task,
        views: Sequence[NodeView],
        predictions: Mapping[int, Prediction],
        context: PolicyContext,
    ) -> list[Ranked]:
        ranked = self.inner.rank(task, views, predictions, context)
        return [replace(r, prediction=predictions.get(r.node_id)) for r in ranked]

    def serving_nodes(self, num_nodes: int, context: PolicyContext) -> tuple[int, ...]:
        return self.inner.serving_nodes(num_nodes, context)

    def training_nodes(self, num_nodes: int, context: PolicyContext) -> tuple[int, ...] | None:
        return self.inner.training_nodes(num_nodes, context)

    def snapshot_state(self) -> dict[str, Any]:
        return self.inner.snapshot_state()

    def restore_state(self, state: Mapping[str, Any]) -> None:
        self.inner.restore_state(state)
