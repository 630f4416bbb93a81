"""Restart recovery: rebuild the planner and the core's task table from the event log.

The planner is pure, so replaying every recorded input into a fresh planner
built from the same config reproduces its state exactly (the same mechanism
the parity test checks). The core's table of live tasks follows from the same
events: a task is live from its last ``submit`` until a ``finished`` input or
a ``Rejection`` output for it.

The log opens every run with a ``start`` marker carrying the planner config;
a restart with a different config would replay into a different planner and
diverge silently, so it is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lemix.planner.base import PlannerConfig
from lemix.planner.planner import Planner
from lemix.planner.recording import Event, replay, task_from_event
from lemix.types import Task

START_MARKER = "start"  # an event key; replay and recorded_decision_keys skip it


def start_event(config: PlannerConfig, policy: str, wall_t: float) -> Event:
    """The marker the service records first in each run."""
    return {START_MARKER: {"policy": policy, "planner_config": asdict(config), "t": wall_t}}


@dataclass
class Recovered:
    """What a restarted scheduler takes over from its predecessor."""

    tasks: list[Task] = field(default_factory=list)  # placed or deferred, not finished
    num_placed: int = 0
    num_rejected: int = 0
    num_events: int = 0
    num_runs: int = 0  # start markers seen (earlier runs of the scheduler)


def check_config(events: Iterable[Event], config: PlannerConfig, policy: str) -> None:
    """Raise `ValueError` if the last run recorded a different policy or config."""
    last: dict[str, Any] | None = None
    for event in events:
        marker = event.get(START_MARKER)
        if marker is not None:
            last = marker
    if last is None:
        return
    want_config = asdict(config)
    have_config = last.get("planner_config") or {}
    diff = sorted(k for k, v in want_config.items() if have_config.get(k) != v)
    if last.get("policy") != policy:
        diff.insert(0, "policy")
    if diff:
        have = {k: last.get("policy") if k == "policy" else have_config.get(k) for k in diff}
        raise ValueError(
            "the event log in this namespace was recorded by a scheduler with a different "
            f"planner setup ({', '.join(diff)}: recorded {have}); restart with the same "
            "settings, or use a fresh namespace")


def recover(events: Sequence[Event], planner: Planner) -> Recovered:
    """Replay `events` into the fresh `planner`; return the live tasks and counters."""
    replay(events, planner)
    live: dict[str, Task] = {}
    result = Recovered(num_events=len(events))
    for event in events:
        kind = event.get("input")
        if kind == "submit":
            task = task_from_event(event["task"])
            live[task.task_id] = task
        elif kind == "finished":
            live.pop(str(event["task_id"]), None)
        elif START_MARKER in event:
            result.num_runs += 1
        out = event.get("output")
        if out is None:
            continue
        if out["type"] == "Placement":
            result.num_placed += 1
        elif out["type"] == "Rejection":
            result.num_rejected += 1
            live.pop(str(out["task_id"]), None)
    result.tasks = list(live.values())
    return result
