"""Replica sync: keep co-located training replicas in step by periodic averaging.

Co-located, every node trains its own replica on the samples placed on it and
serves from it, so the replicas drift apart and each sees only part of the
data. Every M completed training tasks (`PlannerConfig.replica_sync_every_tasks`)
the planner emits `ReplicaAverage` over the live nodes that train; executors
then replace their weights by the element-wise mean of the replicas (local SGD
/ periodic model averaging).

Why averaging every M tasks rather than a gradient all-reduce every step: an
all-reduce makes every training step wait for the slowest node's backward, and
each node's backward is interleaved with its serving (LeMix places training
where it fits between inference), so one node's inference burst would stall
every node's pipeline and with it their serving. Averaging costs one weight
exchange per M tasks, runs as a blocking item like SEPARATE's weight sync, and
leaves the nodes' schedules independent in between. The optimizer state
(Adam's moments) stays local: averaging it would double the exchange for a
small gain at these M.

Pure, like the rest of the planner: the counter and round live in the
planner's snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lemix.types import ReplicaAverage


@dataclass(slots=True)
class ReplicaSyncClock:
    """Counts completed training tasks; every `every_tasks` of them, an average."""

    every_tasks: int | None  # M; None = off
    num_done_since: int = 0  # completed training tasks since the last average
    num_rounds: int = 0  # averages emitted so far

    def on_training_done(self, trainer_ids: Iterable[int]) -> ReplicaAverage | None:
        """One more training task completed; `trainer_ids` are the live nodes
        that train now. An average when M is reached and >= 2 nodes train
        (one replica has nothing to agree with: the count restarts anyway)."""
        if not self.every_tasks:
            return None
        self.num_done_since += 1
        if self.num_done_since < self.every_tasks:
            return None
        self.num_done_since = 0
        nodes = tuple(sorted(set(trainer_ids)))
        if len(nodes) < 2:
            return None
        self.num_rounds += 1
        return ReplicaAverage(nodes, self.num_rounds)

    def snapshot_state(self) -> dict[str, Any]:
        return {"num_done_since": self.num_done_since, "num_rounds": self.num_rounds}

    def restore_state(self, state: Mapping[str, Any] | None) -> None:
        """Take over `snapshot_state()`; None (a snapshot from before replica
        sync existed) starts from zero."""
        state = state or {}
        self.num_done_since = int(state.get("num_done_since", 0))
        self.num_rounds = int(state.get("num_rounds", 0))
