"""Record a planner's inputs and decisions; replay them offline.

The live scheduler wraps its planner in `RecordingPlanner`; every input
(`submit`, `on_task_finished`, `plan`, with its `now_s`) and every decision is
appended to a sink (the scheduler's Redis event log). Because the planner is
pure, feeding the same inputs to a fresh planner built from the same config
yields the same decisions: `replay` does that, and the parity test compares.
The events are plain JSON-able dicts, so they cross process boundaries safely.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from lemix.planner.planner import Planner
from lemix.types import (
    Decision,
    Deferral,
    Placement,
    Rejection,
    ReplicaAverage,
    Task,
    TaskKind,
    WeightSync,
)

Event = dict[str, Any]


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _flat_fields(obj: Any) -> dict[str, Any]:
    """A flat dataclass's fields as a dict. Tasks and decisions hold only
    scalars and tuples of ints, so this equals `dataclasses.asdict`, without
    its recursive deep copy (a visible cost per event in the scheduler)."""
    return {name: getattr(obj, name) for name in _field_names(type(obj))}


def task_to_event(task: Task) -> dict[str, Any]:
    event = _flat_fields(task)
    event["kind"] = task.kind.value
    return event


def task_from_event(fields: dict[str, Any]) -> Task:
    return Task(
        task_id=str(fields["task_id"]),
        kind=TaskKind(fields["kind"]),
        arrival_s=float(fields["arrival_s"]),
        num_prompt_tokens=int(fields["num_prompt_tokens"]),
        max_output_tokens=int(fields["max_output_tokens"]),
        batch_size=int(fields["batch_size"]),
        seq=int(fields["seq"]),
    )


def decision_to_event(decision: Decision) -> dict[str, Any]:
    event = _flat_fields(decision)
    event["type"] = type(decision).__name__
    if isinstance(decision, WeightSync):
        event["target_node_ids"] = list(decision.target_node_ids)
    if isinstance(decision, ReplicaAverage):
        event["node_ids"] = list(decision.node_ids)
    return event


def decision_key(decision: Decision) -> tuple[Any, ...]:
    """What parity compares: the decision's type and its choices (not float scores)."""
    if isinstance(decision, Placement):
        return ("Placement", decision.task_id, decision.node_id)
    if isinstance(decision, Deferral | Rejection):
        return (type(decision).__name__, decision.task_id)
    if isinstance(decision, ReplicaAverage):
        return ("ReplicaAverage", tuple(decision.node_ids), decision.round)
    return (
        "WeightSync",
        decision.source_node_id,
        tuple(decision.target_node_ids),
        decision.num_training_updates,
    )


class RecordingPlanner:
    """A planner whose inputs and outputs are all written to `sink`."""

    def __init__(self, planner: Planner, sink: Callable[[Event], None]) -> None:
        self.planner = planner
        self._sink = sink

    def submit(self, task: Task, now_s: float) -> None:
        self._sink({"input": "submit", "now_s": now_s, "task": task_to_event(task)})
        self.planner.submit(task, now_s)

    def on_task_finished(
        self, task_id: str, now_s: float, is_success: bool = True
    ) -> list[Decision]:
        self._sink(
            {"input": "finished", "now_s": now_s, "task_id": task_id, "is_success": is_success}
        )
        decisions = self.planner.on_task_finished(task_id, now_s, is_success)
        self._record(decisions)
        return decisions

    def on_node_health(self, node_id: int, is_healthy: bool, now_s: float) -> None:
        self._sink(
            {"input": "health", "now_s": now_s, "node_id": node_id, "is_healthy": is_healthy}
        )
        self.planner.on_node_health(node_id, is_healthy, now_s)

    def plan(self, now_s: float) -> list[Decision]:
        self._sink({"input": "plan", "now_s": now_s})
        decisions = self.planner.plan(now_s)
        self._record(decisions)
        return decisions

    # Queries change nothing, so they are not recorded.

    def node_of(self, task_id: str) -> int | None:
        return self.planner.node_of(task_id)

    def next_wakeup_s(self) -> float | None:
        return self.planner.next_wakeup_s()

    @property
    def num_deferred(self) -> int:
        return self.planner.num_deferred

    @property
    def is_release_pending(self) -> bool:
        return self.planner.is_release_pending

    def _record(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            self._sink({"output": decision_to_event(decision)})


def replay(events: Iterable[Event], planner: Planner) -> list[Decision]:
    """Feed recorded inputs to `planner`; return every decision it makes, in order."""
    decisions: list[Decision] = []
    for event in events:
        kind = event.get("input")
        if kind == "submit":
            planner.submit(task_from_event(event["task"]), float(event["now_s"]))
        elif kind == "finished":
            decisions += planner.on_task_finished(
                str(event["task_id"]), float(event["now_s"]), bool(event["is_success"])
            )
        elif kind == "health":
            planner.on_node_health(
                int(event["node_id"]), bool(event["is_healthy"]), float(event["now_s"])
            )
        elif kind == "plan":
            decisions += planner.plan(float(event["now_s"]))
    return decisions


def recorded_decision_keys(events: Iterable[Event]) -> list[tuple[Any, ...]]:
    """The decisions a recording says the live planner made, as parity keys."""
    keys: list[tuple[Any, ...]] = []
    for event in events:
        out = event.get("output")
        if out is None:
            continue
        kind = out["type"]
        if kind == "Placement":
            keys.append(("Placement", out["task_id"], int(out["node_id"])))
        elif kind in ("Deferral", "Rejection"):
            keys.append((kind, out["task_id"]))
        elif kind == "ReplicaAverage":
            keys.append((kind, tuple(int(x) for x in out["node_ids"]), int(out["round"])))
        else:
            keys.append(
                (
                    "WeightSync",
                    int(out["source_node_id"]),
                    tuple(int(x) for x in out["target_node_ids"]),
                    int(out["num_training_updates"]),
                )
            )
    return keys
