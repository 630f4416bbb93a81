"""The simulator: real planner + per-node engines, advanced in virtual time.

Execution times come from the profile's latency model (optionally with seeded
multiplicative noise, so predictions are not perfect); the planner predicts
with whatever its policy's estimator uses. Every task ends completed, rejected
or failed with a reason; anything left when the drain limit passes is failed
with that reason and counted, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from lemix.engine import (
    BlockingDone,
    Failed,
    Finished,
    FirstToken,
    NodeEngine,
    Outcome,
    Requeued,
    StageStart,
)
from lemix.planner.planner import Planner
from lemix.profile import Profile
from lemix.sim.events import (
    Arrival,
    EngineTimer,
    Event,
    PlannerWake,
    StageDone,
    SyncArrive,
)
from lemix.types import (
    Decision,
    Deferral,
    Placement,
    Rejection,
    ReplicaAverage,
    Task,
    TaskKind,
    TaskRecord,
    TaskStatus,
    WeightSync,
)


@dataclass
class SimResult:
    records: list[TaskRecord]
    makespan_s: float
    utilization: float
    decision_latency_us: list[float]
    node_active_spans_s: list[float]
    num_deferrals: int
    num_weight_syncs: int
    num_offloads: int
    num_events: int
    num_replica_averages: int = 0
    decisions: list[Decision] = field(default_factory=list)


class Simulator:
    def __init__(
        self,
        planner: Planner,
        engines: Sequence[NodeEngine],
        tasks: Sequence[Task],
        profile: Profile,
        *,
        drain_limit_s: float = 600.0,
        measure_decision_latency: bool = True,
        keep_decisions: bool = False,
        intake_delay_s: float = 0.0,
        output_delay_s: float = 0.0,
    ) -> None:
        if intake_delay_s < 0 or output_delay_s < 0:
            raise ValueError("the control plane's delays must be >= 0")
        self.planner = planner
        # The control plane (gateway, Redis, scheduler intake; executor to
        # gateway), as fixed delays: a task reaches the planner
        # `intake_delay_s` after its arrival (the live intake stamps its
        # arrival then, too), and a client sees an inference task's first
        # token and its end `output_delay_s` after the engine produced them.
        # Both 0: no control plane, the simulator as before.
        self.intake_delay_s = intake_delay_s
        self.output_delay_s = output_delay_s
        self.engines = list(engines)
        self.profile = profile
        self.drain_limit_s = drain_limit_s
        self.measure = measure_decision_latency
        self.keep_decisions = keep_decisions
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0
        seen = tasks
        if intake_delay_s > 0:
            seen = [dataclasses.replace(t, arrival_s=t.arrival_s + intake_delay_s) for t in tasks]
        self._tasks = {t.task_id: t for t in seen}
        self.records = {
            t.task_id: TaskRecord(
                t.task_id,
                t.kind,
                t.arrival_s,
                t.num_prompt_tokens,
                t.max_output_tokens,
                t.batch_size,
            )
            for t in tasks
        }
        self._wake_at: float | None = None
        self._timer_at: list[float | None] = [None] * len(self.engines)
        self._first_busy: list[float | None] = [None] * len(self.engines)
        self._last_busy = [0.0] * len(self.engines)
        self._syncs: dict[str, WeightSync] = {}
        self.num_replica_averages = 0
        # Replica averages in flight: tag -> (the decision, saves not done yet).
        self._averages: dict[str, tuple[ReplicaAverage, int]] = {}
        self.total_updates = 0
        self.decision_latency_us: list[float] = []
        self.decisions: list[Decision] = []
        self.num_events = 0
        self._end_s = (max((t.arrival_s for t in tasks), default=0.0)) + drain_limit_s
        for task in seen:
            self.schedule(task.arrival_s, Arrival(task))

    # ------------------------------------------------------------ loop

    def schedule(self, at_s: float, event: Event) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at_s, event.kind, self._seq, event))

    def run(self) -> SimResult:
        now_s = 0.0
        while self._heap:
            at_s, _, _, event = heapq.heappop(self._heap)
            if at_s > self._end_s:
                break
            now_s = at_s
            self.num_events += 1
            event.handle(self, now_s)
        return self._result(now_s)

    # ------------------------------------------------------------ handlers

    def on_arrival(self, task: Task, now_s: float) -> None:
        self.planner.submit(task, now_s)
        self.run_planner(now_s)

    def run_planner(self, now_s: float) -> None:
        decisions = self._plan(now_s)
        # A call places a bounded amount of training (`is_release_pending`);
        # the scheduler calls again at once, letting other coroutines run in
        # between. Here nothing else happens in between: the same decisions
        # as one unbounded call.
        while self.planner.is_release_pending:
            decisions += self._plan(now_s)
        self.apply(decisions, now_s)
        wake = self.planner.next_wakeup_s()
        if wake is not None and wake > now_s and wake != self._wake_at:
            self._wake_at = wake
            self.schedule(wake, PlannerWake())

    def _plan(self, now_s: float) -> list[Decision]:
        if not self.measure:
            return self.planner.plan(now_s)
        t0 = time.perf_counter()
        decisions = self.planner.plan(now_s)
        elapsed_us = (time.perf_counter() - t0) * 1e6
        num_placed = sum(isinstance(d, Placement) for d in decisions)
        if num_placed:
            self.decision_latency_us.extend([elapsed_us / num_placed] * num_placed)
        return decisions

    def apply(self, decisions: Sequence[Decision], now_s: float) -> None:
        for decision in decisions:
            if self.keep_decisions:
                self.decisions.append(decision)
            if isinstance(decision, Placement):
                record = self.records[decision.task_id]
                record.node_id = decision.node_id
                record.placed_s = now_s
                record.predicted_response_s = decision.predicted_response_s
                engine = self.engines[decision.node_id]
                starts, outcomes = engine.add_task(self._tasks[decision.task_id], now_s)
                self._after_engine(decision.node_id, starts, outcomes, now_s)
            elif isinstance(decision, Rejection):
                self._end(decision.task_id, TaskStatus.REJECTED, decision.reason, now_s)
            elif isinstance(decision, WeightSync):
                self._begin_sync(decision, now_s)
            elif isinstance(decision, ReplicaAverage):
                self._begin_average(decision, now_s)
            elif isinstance(decision, Deferral):
                pass  # the planner keeps it; aging guarantees a later placement

    def on_stage_done(self, node_id: int, stage: int, now_s: float) -> None:
        self._last_busy[node_id] = now_s
        starts, outcomes = self.engines[node_id].on_stage_done(stage, now_s)
        self._after_engine(node_id, starts, outcomes, now_s)

    def on_engine_timer(self, node_id: int, now_s: float) -> None:
        self._timer_at[node_id] = None
        starts, outcomes = self.engines[node_id].on_timer(now_s)
        self._after_engine(node_id, starts, outcomes, now_s)

    def _after_engine(
        self, node_id: int, starts: list[StageStart], outcomes: list[Outcome], now_s: float
    ) -> None:
        for start in starts:
            if self._first_busy[node_id] is None:
                self._first_busy[node_id] = now_s
            self.schedule(now_s + start.duration_s, StageDone(node_id, start.stage))
        needs_plan = False
        for outcome in outcomes:
            needs_plan |= self._on_outcome(node_id, outcome, now_s)
        timer = self.engines[node_id].next_timer_s()
        if timer is not None and timer > now_s and timer != self._timer_at[node_id]:
            self._timer_at[node_id] = timer
            self.schedule(timer, EngineTimer(node_id))
        if needs_plan:
            self.run_planner(now_s)

    def _on_outcome(self, node_id: int, outcome: Outcome, now_s: float) -> bool:
        """Record one outcome; True when the planner should re-plan."""
        if isinstance(outcome, FirstToken):
            record = self.records[outcome.task_id]
            record.first_token_s = now_s + self.output_delay_s
            record.serving_staleness_updates = self.total_updates - outcome.weight_updates
            return False
        if isinstance(outcome, Finished):
            record = self.records[outcome.task_id]
            record.num_output_tokens = outcome.num_output_tokens
            self._end(outcome.task_id, TaskStatus.COMPLETED, "", now_s)
            if record.kind.value == "training":
                self.total_updates += 1
            self.apply(self.planner.on_task_finished(outcome.task_id, now_s), now_s)
            return self.planner.num_deferred > 0
        if isinstance(outcome, Failed):
            self._end(outcome.task_id, TaskStatus.FAILED, outcome.reason, now_s)
            self.planner.on_task_finished(outcome.task_id, now_s, is_success=False)
            return self.planner.num_deferred > 0
        if isinstance(outcome, Requeued):
            self.planner.on_task_finished(outcome.task_id, now_s, is_success=False)
            self.planner.submit(self._tasks[outcome.task_id], now_s)
            return True
        if isinstance(outcome, BlockingDone):
            self._on_blocking_done(outcome.tag, now_s)
        return False

    # ------------------------------------------------------------ weight sync

    def _begin_sync(self, sync: WeightSync, now_s: float) -> None:
        tag = f"sync-{len(self._syncs)}"
        self._syncs[tag] = sync
        link = self.profile.transfer.host_link_bytes_s
        save = tuple(b / link for b in self.profile.memory.weight_bytes)
        starts = self.engines[sync.source_node_id].add_blocking(f"save:{tag}", save, None, now_s)
        self._after_engine(sync.source_node_id, starts, [], now_s)

    def _on_blocking_done(self, tag: str, now_s: float) -> None:
        phase, sync_tag = tag.split(":", 1)
        if phase == "save":
            self.schedule(now_s + self.profile.weight_sync_s(), SyncArrive(sync_tag))
        elif phase == "asave":
            self._on_average_saved(sync_tag, now_s)

    def _begin_average(self, average: ReplicaAverage, now_s: float) -> None:
        """Replica sync, charged like a weight sync and phased like the live
        one: every participant saves its weights (its stages blocked for the
        host-link copy); once all have, the replicas cross the network (a
        ring all-reduce moves 2(n-1)/n of the model per node; the stages keep
        working meanwhile); then every participant loads the mean (blocked
        again)."""
        self.num_replica_averages += 1
        tag = f"avg-{average.round}"
        self._averages[tag] = (average, len(average.node_ids))
        link = self.profile.transfer.host_link_bytes_s
        save = tuple(b / link for b in self.profile.memory.weight_bytes)
        for node_id in average.node_ids:
            starts = self.engines[node_id].add_blocking(f"asave:{tag}", save, None, now_s)
            self._after_engine(node_id, starts, [], now_s)

    def _on_average_saved(self, tag: str, now_s: float) -> None:
        average, num_left = self._averages[tag]
        self._averages[tag] = (average, num_left - 1)
        if num_left > 1:
            return
        n = len(average.node_ids)
        exchange_s = 2.0 * (n - 1) / n * self.profile.weight_sync_s()
        self.schedule(now_s + exchange_s, SyncArrive(tag))

    def on_sync_arrive(self, tag: str, now_s: float) -> None:
        link = self.profile.transfer.host_link_bytes_s
        load = tuple(b / link for b in self.profile.memory.weight_bytes)
        if tag in self._averages:
            average, _ = self._averages.pop(tag)
            for node_id in average.node_ids:
                starts = self.engines[node_id].add_blocking(f"aload:{tag}", load, None, now_s)
                self._after_engine(node_id, starts, [], now_s)
            return
        sync = self._syncs[tag]
        for node_id in sync.target_node_ids:
            engine = self.engines[node_id]
            starts = engine.add_blocking(f"load:{tag}", load, sync.num_training_updates, now_s)
            self._after_engine(node_id, starts, [], now_s)

    # ------------------------------------------------------------ results

    def _end(self, task_id: str, status: TaskStatus, reason: str, now_s: float) -> None:
        record = self.records[task_id]
        if record.status is not None:
            raise RuntimeError(f"task {task_id} ended twice ({record.status} then {status})")
        record.status = status
        record.reason = reason
        is_inference = record.kind is TaskKind.INFERENCE
        record.finish_s = now_s + (self.output_delay_s if is_inference else 0.0)

    def _result(self, now_s: float) -> SimResult:
        for record in self.records.values():
            if record.status is None:
                record.status = TaskStatus.FAILED
                record.reason = (
                    f"unfinished when the run ended (drain limit {self.drain_limit_s:g} s)"
                )
        finish_times = [r.finish_s for r in self.records.values() if r.finish_s is not None]
        makespan_s = max(finish_times, default=0.0)
        num_stage_slots = len(self.engines) * self.profile.num_stages
        busy_s = sum(sum(e.busy_s) for e in self.engines)
        spans = [
            (last - first) if first is not None else 0.0
            for first, last in zip(self._first_busy, self._last_busy, strict=True)
        ]
        return SimResult(
            records=list(self.records.values()),
            makespan_s=makespan_s,
            utilization=busy_s / (num_stage_slots * makespan_s) if makespan_s > 0 else 0.0,
            decision_latency_us=self.decision_latency_us,
            node_active_spans_s=spans,
            num_deferrals=self.planner.num_deferrals,
            num_weight_syncs=len(self._syncs),
            num_offloads=sum(e.num_offloads for e in self.engines),
            num_replica_averages=self.num_replica_averages,
            num_events=self.num_events,
            decisions=self.decisions,
        )
