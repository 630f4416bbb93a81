"""Restart recovery and event-log compaction.

The planner is pure, so replaying every recorded input into a fresh planner
built from the same config reproduces its state exactly (the same mechanism
the parity test checks). The core's table of live tasks follows from the same
events: a task is live from its last ``submit`` until a ``finished`` input or
a ``Rejection`` output for it (`LogTally` folds that, with the counters).

Compaction keeps restarts bounded in time: every `snapshot_every_events`
events, `SnapshottingSink` records a ``snapshot`` event (the planner's
`Planner.snapshot()` and the tally) into the log, and once it is stored the
sink trims every entry before it. Recovery restores the LAST snapshot and
replays only the events after it. The snapshot is taken inside the sink call,
synchronously, between two planner inputs: nothing can run in between, so it
is exactly the state after every input recorded before it (inputs are
recorded before the planner applies them, outputs after).

The log opens every run with a ``start`` marker carrying the planner config
(a snapshot carries the latest one); a restart with a different config would
replay into a different planner and diverge silently, so it is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lemix.infra.store.codec import Entry
from lemix.planner.base import PlannerConfig
from lemix.planner.planner import Planner
from lemix.planner.recording import Event, replay, task_from_event
from lemix.planner.snapshot import task_from_state, task_to_state
from lemix.types import Task
from services.scheduler.codec import event_has_key, events_from_entries

START_MARKER = "start"  # an event key; replay and recorded_decision_keys skip it
SNAPSHOT_MARKER = "snapshot"  # likewise


def start_event(config: PlannerConfig, policy: str, wall_t: float) -> Event:
    """The marker the service records first in each run."""
    return {START_MARKER: {"policy": policy, "planner_config": asdict(config), "t": wall_t}}


@dataclass
class LogTally:
    """What the log says besides the planner's state, folded event by event."""

    live: dict[str, Task] = field(default_factory=dict)  # placed or deferred, not finished
    num_placed: int = 0  # Placement outputs
    num_rejected: int = 0  # Rejection outputs
    num_runs: int = 0  # start markers (runs of the scheduler)
    last_start: dict[str, Any] | None = None  # the latest start marker's body

    def apply(self, event: Event) -> None:
        kind = event.get("input")
        if kind == "submit":
            task = task_from_event(event["task"])
            self.live[task.task_id] = task
        elif kind == "finished":
            self.live.pop(str(event["task_id"]), None)
        elif START_MARKER in event:
            self.num_runs += 1
            self.last_start = event[START_MARKER]
        out = event.get("output")
        if out is None:
            return
        if out["type"] == "Placement":
            self.num_placed += 1
        elif out["type"] == "Rejection":
            self.num_rejected += 1
            self.live.pop(str(out["task_id"]), None)

    def to_state(self) -> dict[str, Any]:
        return {
            "live": [task_to_state(t) for t in self.live.values()],
            "num_placed": self.num_placed,
            "num_rejected": self.num_rejected,
            "num_runs": self.num_runs,
            "last_start": self.last_start,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> LogTally:
        live = [task_from_state(t) for t in state["live"]]
        return cls(
            live={t.task_id: t for t in live},
            num_placed=int(state["num_placed"]),
            num_rejected=int(state["num_rejected"]),
            num_runs=int(state["num_runs"]),
            last_start=state.get("last_start"),
        )


def snapshot_event(planner: Planner, tally: LogTally, wall_t: float) -> Event:
    """The compaction record: all a restart needs from the log before it."""
    return {SNAPSHOT_MARKER: {"planner": planner.snapshot(), "log": tally.to_state(), "t": wall_t}}


class SnapshottingSink:
    """The planner's sink in the service: tallies every event and passes it to
    `sink`; once `snapshot_every_events` events (0: never) went by since the
    last snapshot, records a new one first (module docstring)."""

    def __init__(
        self,
        sink: Callable[[Event], None],
        planner: Planner,
        tally: LogTally,
        *,
        snapshot_every_events: int,
        wall_clock: Callable[[], float],
        num_events_since_snapshot: int = 0,
    ) -> None:
        if snapshot_every_events < 0:
            raise ValueError(f"snapshot_every_events must be >= 0, got {snapshot_every_events}")
        self._sink = sink
        self._planner = planner
        self.tally = tally
        self.snapshot_every_events = snapshot_every_events
        self._wall_clock = wall_clock
        self.num_events_since_snapshot = num_events_since_snapshot
        self.num_events = 0  # passed on by this sink (snapshots not counted)
        self.num_snapshots = 0

    def __call__(self, event: Event) -> None:
        if 0 < self.snapshot_every_events <= self.num_events_since_snapshot:
            self.record_snapshot()
        self.tally.apply(event)
        self._sink(event)
        self.num_events_since_snapshot += 1
        self.num_events += 1

    def record_snapshot(self) -> None:
        """Record a snapshot now (call only between planner inputs)."""
        self._sink(snapshot_event(self._planner, self.tally, self._wall_clock()))
        self.num_events_since_snapshot = 0
        self.num_snapshots += 1


@dataclass
class Recovered:
    """What a restarted scheduler takes over from its predecessor."""

    tasks: list[Task] = field(default_factory=list)  # placed or deferred, not finished
    num_placed: int = 0
    num_rejected: int = 0
    num_events: int = 0  # events replayed (after the snapshot, if any)
    num_runs: int = 0  # start markers seen (earlier runs of the scheduler)
    is_from_snapshot: bool = False
    tally: LogTally = field(default_factory=LogTally)


def events_to_recover(entries: Sequence[Entry]) -> list[Event]:
    """The stored log from its last snapshot on, decoded (the entries before
    it are not even parsed: a trim may have failed and left them)."""
    start = 0
    for i in range(len(entries) - 1, -1, -1):
        if event_has_key(entries[i][1], SNAPSHOT_MARKER):
            start = i
            break
    return events_from_entries(entries[start:])


def _last_snapshot(events: Sequence[Event]) -> int | None:
    for i in range(len(events) - 1, -1, -1):
        if SNAPSHOT_MARKER in events[i]:
            return i
    return None


def check_config(events: Iterable[Event], config: PlannerConfig, policy: str) -> None:
    """Raise `ValueError` if the last run recorded a different policy or config."""
    last: dict[str, Any] | None = None
    for event in events:
        marker = event.get(START_MARKER)
        if marker is None and SNAPSHOT_MARKER in event:
            marker = event[SNAPSHOT_MARKER]["log"].get("last_start")
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
            "settings, or use a fresh namespace"
        )


def recover(events: Sequence[Event], planner: Planner) -> Recovered:
    """Restore the fresh `planner` from the last snapshot in `events` (if any)
    and replay the events after it; return the live tasks and counters."""
    tally = LogTally()
    index = _last_snapshot(events)
    if index is not None:
        snapshot = events[index][SNAPSHOT_MARKER]
        planner.restore(snapshot["planner"])
        tally = LogTally.from_state(snapshot["log"])
        events = events[index + 1 :]
    replay(events, planner)
    for event in events:
        tally.apply(event)
    return Recovered(
        tasks=list(tally.live.values()),
        num_placed=tally.num_placed,
        num_rejected=tally.num_rejected,
        num_events=len(events),
        num_runs=tally.num_runs,
        is_from_snapshot=index is not None,
        tally=tally,
    )
