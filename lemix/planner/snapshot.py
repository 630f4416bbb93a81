"""The planner's state as plain JSON-able data, both ways (`Planner.snapshot/restore`).

A snapshot holds every piece of planner state that can change a future
decision: per node the predicted trace (forward ends, backward windows), the
length statistics, the held requests and training with their running sums,
the recent training load; the intake and deferred queues; which node holds
which task; the recent arrivals behind the request-rate estimate; the running
means of inference lengths; the aged-release token bucket; the down nodes;
the counters; and the policy's own state (round-robin counters). Derived
values (the memory threshold, estimator caches keyed by a view's `version`)
are rebuilt, not stored.

Restoring a snapshot into a fresh planner built from the same config and
policy, then feeding both the same inputs, gives identical decisions
(tests/planner/test_snapshot.py checks it field by field). Floats survive
JSON exactly (`repr`); the only non-finite value, an empty node's ``-inf``
forward end, is written as ``None`` so the text stays strict JSON.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any

from lemix.planner.base import PlannerConfig
from lemix.planner.trace import NodeView, OutstandingRequest, TrainWindow
from lemix.types import Task, TaskKind

SNAPSHOT_VERSION = 1
State = dict[str, Any]


class SnapshotMismatch(ValueError):
    """The snapshot was taken from a planner with another setup or format."""


def config_fingerprint(config: PlannerConfig, policy_name: str) -> str:
    """What a snapshot must agree with to be restored: the planner config and
    the policy's name (they fix the state's shape and meaning)."""
    text = json.dumps(
        {"config": asdict(config), "policy": policy_name}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_snapshot(snapshot: Mapping[str, Any], config: PlannerConfig, policy_name: str) -> None:
    """Raise `SnapshotMismatch` unless `snapshot` fits a planner of this setup."""
    version = snapshot.get("version")
    if version != SNAPSHOT_VERSION:
        raise SnapshotMismatch(
            f"planner snapshot format {version!r} is not the supported {SNAPSHOT_VERSION}"
        )
    if snapshot.get("fingerprint") != config_fingerprint(config, policy_name):
        have = snapshot.get("config") or {}
        diff = sorted(k for k, v in asdict(config).items() if have.get(k) != v)
        if snapshot.get("policy") != policy_name:
            diff.insert(0, "policy")
        raise SnapshotMismatch(
            f"the planner snapshot was taken with another setup ({', '.join(diff) or '?'} "
            "differ); restore it into a planner built with the same config and policy"
        )


# ------------------------------------------------------------------ values


def float_to_state(value: float) -> float | None:
    """A float as strict JSON: -inf (an empty node's forward end) as None."""
    if value == -math.inf:
        return None
    if not math.isfinite(value):
        raise ValueError(f"cannot snapshot the non-finite value {value!r}")
    return value


def float_from_state(value: float | None) -> float:
    return -math.inf if value is None else float(value)


def task_to_state(task: Task) -> State:
    return {
        "task_id": task.task_id,
        "kind": task.kind.value,
        "arrival_s": task.arrival_s,
        "num_prompt_tokens": task.num_prompt_tokens,
        "max_output_tokens": task.max_output_tokens,
        "batch_size": task.batch_size,
        "seq": task.seq,
    }


def task_from_state(state: Mapping[str, Any]) -> Task:
    return Task(
        task_id=str(state["task_id"]),
        kind=TaskKind(state["kind"]),
        arrival_s=float(state["arrival_s"]),
        num_prompt_tokens=int(state["num_prompt_tokens"]),
        max_output_tokens=int(state["max_output_tokens"]),
        batch_size=int(state["batch_size"]),
        seq=int(state["seq"]),
    )


def _floats(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def window_to_state(window: TrainWindow) -> State:
    return {
        "task_id": window.task_id,
        "backward_begin_s": list(window.backward_begin_s),
        "backward_end_s": list(window.backward_end_s),
        "backward_s": list(window.backward_s),
    }


def window_from_state(state: Mapping[str, Any]) -> TrainWindow:
    return TrainWindow(
        str(state["task_id"]),
        _floats(state["backward_begin_s"]),
        _floats(state["backward_end_s"]),
        _floats(state["backward_s"]),
    )


# ------------------------------------------------------------------ node views


def view_to_state(view: NodeView) -> State:
    """Every field of a `NodeView` but its estimator cache (rebuilt on demand:
    its entries are keyed by `version`, which is kept) and
    `sum_training_tokens` (a sum over `training_tasks`)."""
    return {
        "node_id": view.node_id,
        "num_stages": view.num_stages,
        "forward_end_s": [float_to_state(x) for x in view.forward_end_s],
        "windows": [window_to_state(w) for w in view.windows],
        "last_arrival_s": view.last_arrival_s,
        "num_lengths": view.num_lengths,
        "length_mean": view.length_mean,
        "length_m2": view.length_m2,
        # [prompt, max output] per held request, in insertion order
        "requests": {
            t: [r.num_prompt_tokens, r.max_output_tokens] for t, r in view.requests.items()
        },
        "training_tasks": dict(view.training_tasks),
        "training_work_s": dict(view.training_work_s),
        "sum_training_work_s": view.sum_training_work_s,
        "recent_training": [[placed_s, work_s] for placed_s, work_s in view.recent_training],
        "recent_training_work_s": view.recent_training_work_s,
        "version": view.version,
        "num_placed": view.num_placed,
        "num_training_updates": view.num_training_updates,
        "sum_request_prompt_tokens": view.sum_request_prompt_tokens,
        "sum_request_output_tokens": view.sum_request_output_tokens,
        "max_request_output_tokens": view.max_request_output_tokens,
    }


def view_from_state(state: Mapping[str, Any]) -> NodeView:
    last_arrival = state["last_arrival_s"]
    training_tasks = {str(t): int(n) for t, n in state["training_tasks"].items()}
    return NodeView(
        node_id=int(state["node_id"]),
        num_stages=int(state["num_stages"]),
        forward_end_s=[float_from_state(x) for x in state["forward_end_s"]],
        windows=[window_from_state(w) for w in state["windows"]],
        last_arrival_s=None if last_arrival is None else float(last_arrival),
        num_lengths=int(state["num_lengths"]),
        length_mean=float(state["length_mean"]),
        length_m2=float(state["length_m2"]),
        requests={
            str(t): OutstandingRequest(int(p), int(o)) for t, (p, o) in state["requests"].items()
        },
        training_tasks=training_tasks,
        sum_training_tokens=sum(training_tasks.values()),  # derived, not stored
        training_work_s={str(t): float(w) for t, w in state["training_work_s"].items()},
        sum_training_work_s=float(state["sum_training_work_s"]),
        recent_training=deque((float(p), float(w)) for p, w in state["recent_training"]),
        recent_training_work_s=float(state["recent_training_work_s"]),
        version=int(state["version"]),
        num_placed=int(state["num_placed"]),
        num_training_updates=int(state["num_training_updates"]),
        sum_request_prompt_tokens=int(state["sum_request_prompt_tokens"]),
        sum_request_output_tokens=int(state["sum_request_output_tokens"]),
        max_request_output_tokens=int(state["max_request_output_tokens"]),
    )
