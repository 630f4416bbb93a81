"""Simulator events: small classes ordered by (time, kind, seq) for determinism.

Each `handle` gets the simulator and acts through its methods; new events are
pushed with `sim.schedule`. Kind breaks ties at equal times: work that finishes
frees resources before new arrivals are placed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lemix.types import Task

if TYPE_CHECKING:
    from lemix.sim.simulator import Simulator

KIND_STAGE_DONE, KIND_TIMER, KIND_SYNC, KIND_ARRIVAL, KIND_WAKE = 0, 1, 2, 3, 4


@dataclass(slots=True)
class StageDone:
    node_id: int
    stage: int
    kind: int = KIND_STAGE_DONE

    def handle(self, sim: Simulator, now_s: float) -> None:
        sim.on_stage_done(self.node_id, self.stage, now_s)


@dataclass(slots=True)
class EngineTimer:
    node_id: int
    kind: int = KIND_TIMER

    def handle(self, sim: Simulator, now_s: float) -> None:
        sim.on_engine_timer(self.node_id, now_s)


@dataclass(slots=True)
class SyncArrive:
    """Weights finished crossing the network; targets now load them."""

    tag: str
    kind: int = KIND_SYNC

    def handle(self, sim: Simulator, now_s: float) -> None:
        sim.on_sync_arrive(self.tag, now_s)


@dataclass(slots=True)
class Arrival:
    task: Task
    kind: int = KIND_ARRIVAL

    def handle(self, sim: Simulator, now_s: float) -> None:
        sim.on_arrival(self.task, now_s)


@dataclass(slots=True)
class PlannerWake:
    """Aging deadline of a deferred training task."""

    kind: int = KIND_WAKE

    def handle(self, sim: Simulator, now_s: float) -> None:
        sim.run_planner(now_s)


Event = StageDone | EngineTimer | SyncArrive | Arrival | PlannerWake
