"""Drives a `NodeEngine` in real time: the executor's plan → execute → update loop.

The engine (pure) says which stage runs what for how long; an
`ExecutorBackend` (services/executor/backends/) executes it (the emulated
backend sleeps for the profiled duration, scaled; the torch backend runs the
real stage); when it returns, the engine is told and answers with the next
work and the outcomes. Outcomes go, in order, to an `OutcomeSink` (Redis in
the service, a list in tests) through one writer task, which batches whatever
has accumulated into one call.

Engine time is "profile seconds": wall time since start divided by
`time_scale`, so a scaled run keeps every engine rule (T_max waits, batching
windows) in the profile's units.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from lemix.engine import BlockingDone, NodeEngine, Outcome, StageStart, TokensEmitted
from lemix.types import Task
from services.executor.backends.base import ExecutorBackend, RequestsFailed

log = structlog.get_logger(__name__)

# How long stop() waits for the outcome writer beyond the drain timeout.
_WRITER_STOP_S = 2.0
# A placement (`note_placed`) waits this long at most for a write carrying
# an outcome of its task; a write of its own goes out after that. Usually the
# task's first outcome (its first token, one iteration later) takes it
# along: no round trip, and no read of the task's hash, of its own.
PLACED_WRITE_DELAY_S = 0.05


@dataclass(frozen=True, slots=True)
class Placed:
    """The node took a task (`NodeDriver.note_placed`): a sink that records
    placements writes its placed state with its next write."""

    task_id: str
    t: float  # epoch seconds it was taken


SinkItem = Outcome | Placed


def _task_ids_of(outcome: Outcome) -> tuple[str, ...]:
    if isinstance(outcome, TokensEmitted):
        return outcome.task_ids
    if isinstance(outcome, BlockingDone):
        return ()
    return (outcome.task_id,)


class OutcomeSink(Protocol):
    """Receives outcomes in engine order, and the placements noted (`Placed`)
    before the task's first outcome; one call may carry many."""

    async def write(self, batch: list[tuple[float, SinkItem]]) -> None: ...


class NodeDriver:
    """Runs one node's engine against a backend (bound to the engine here) and a sink."""

    def __init__(
        self,
        engine: NodeEngine,
        backend: ExecutorBackend,
        sink: OutcomeSink,
        *,
        time_scale: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        backend.bind(engine)
        self.engine = engine
        self.backend = backend
        self.sink = sink
        self.time_scale = time_scale
        self._clock = clock
        self._t0 = clock()
        self._pending: list[tuple[float, SinkItem]] = []
        self._placed_flush: asyncio.TimerHandle | None = None  # `note_placed`'s write
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._stage_tasks: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._is_stopping = False
        self._last_s = 0.0
        self.num_errors = 0
        self._stage_since: dict[int, float] = {}  # stage -> clock() when its work began

    def _tick(self, at_s: float | None = None) -> float:
        """Engine time for the next engine call: `at_s` (or the clock), never
        earlier than a time the engine has already been given."""
        self._last_s = max(self._last_s, self.now_s() if at_s is None else at_s)
        return self._last_s

    def now_s(self) -> float:
        return (self._clock() - self._t0) / self.time_scale

    async def start(self) -> None:
        name = f"node{self.engine.node_id}-outcomes"
        self._writer = asyncio.create_task(self._write_loop(), name=name)

    async def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Stop taking work; wait for running stage work and pending outputs."""
        self._is_stopping = True
        if self._timer is not None:
            self._timer.cancel()
        if self._stage_tasks:
            await asyncio.wait(self._stage_tasks, timeout=drain_timeout_s)
        for task in self._stage_tasks:
            task.cancel()
        self._wake.set()
        if self._writer is not None:
            # The writer leaves by itself once nothing is pending; it is cancelled
            # only if that takes too long (the sink is down). Never cancel-then-
            # await a task doing Redis I/O: on Python 3.11, redis-py's internal
            # `asyncio.wait_for` can swallow the cancellation, and the await hangs.
            await asyncio.wait({self._writer}, timeout=max(drain_timeout_s, _WRITER_STOP_S))
            if not self._writer.done():
                self._writer.cancel()
                await asyncio.wait({self._writer}, timeout=_WRITER_STOP_S)
                return  # it may still be mid-write: a second writer would interleave
        await self._flush()  # outcomes of calls (cancel) that came after the writer left

    # ------------------------------------------------------------ inputs

    def add_task(self, task: Task) -> None:
        if self._is_stopping:
            raise RuntimeError("executor is stopping")
        now_s = self._tick()
        starts, outcomes = self.engine.add_task(task, now_s)
        self._after(starts, outcomes, now_s)

    def note_placed(self, task_id: str, t: float) -> None:
        """Have the sink record that this node took `task_id` (at epoch `t`),
        with the next write of outcomes, or on its own after
        `PLACED_WRITE_DELAY_S`. Call before `add_task`: the placement then
        precedes the task's outcomes."""
        self._pending.append((self.now_s(), Placed(task_id, t)))
        if self._placed_flush is None and not self._is_stopping:
            loop = asyncio.get_running_loop()
            self._placed_flush = loop.call_later(PLACED_WRITE_DELAY_S, self._wake.set)

    def cancel(self, task_id: str, reason: str = "") -> bool:
        now_s = self._tick()
        is_found, starts, outcomes = self.engine.cancel(task_id, now_s, reason)
        self._after(starts, outcomes, now_s)
        return is_found

    def add_blocking(
        self, tag: str, durations_s: tuple[float, ...], apply_updates: int | None
    ) -> None:
        now_s = self._tick()
        starts = self.engine.add_blocking(tag, durations_s, apply_updates, now_s)
        self._after(starts, [], now_s)

    # ------------------------------------------------------------ loop

    def _after(self, starts: list[StageStart], outcomes: list[Outcome], at_s: float) -> None:
        for start in starts:
            task = asyncio.create_task(self._run_stage(start, at_s))
            self._stage_tasks.add(task)
            task.add_done_callback(self._stage_tasks.discard)
        if outcomes:
            now_s = self.now_s()
            self._pending.extend((now_s, o) for o in outcomes)
            self._wake.set()
        self._arm_timer()

    def longest_running_stage_s(self) -> float:
        """Wall seconds the longest-running stage item has been running (0: none)."""
        if not self._stage_since:
            return 0.0
        return self._clock() - min(self._stage_since.values())

    async def _run_stage(self, start: StageStart, start_at_s: float) -> None:
        self._stage_since[start.stage] = self._clock()
        try:
            await self._run_stage_work(start, start_at_s)
        finally:
            self._stage_since.pop(start.stage, None)

    async def _run_stage_work(self, start: StageStart, start_at_s: float) -> None:
        end_s = start_at_s + start.duration_s  # the profiled end, in engine time
        try:
            stopped = await self.backend.execute(
                start, max(end_s - self.now_s(), 0.0) * self.time_scale
            )
            if stopped:
                self.engine.stop_requests(stopped)
        except asyncio.CancelledError:
            raise
        except RequestsFailed as exc:
            self.num_errors += 1
            self.engine.fail_requests(exc.task_ids, exc.reason)
            if exc.stopped:
                self.engine.stop_requests(exc.stopped)
        except Exception:  # a backend failure must not wedge the node: log, count, go on
            self.num_errors += 1
            log.exception(
                "stage_failed", node=self.engine.node_id, stage=start.stage, kind=start.kind
            )
        # Emulated work ends at its profiled end (`ExecutorBackend.is_emulated`);
        # real work when it returned.
        done_at_s = self._tick(end_s if self.backend.is_emulated else None)
        starts, outcomes = self.engine.on_stage_done(start.stage, done_at_s)
        self._after(starts, outcomes, done_at_s)

    def _arm_timer(self) -> None:
        deadline = self.engine.next_timer_s()
        if deadline is None or deadline == self._timer_at or self._is_stopping:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        delay_s = max(deadline - self.now_s(), 0.0) * self.time_scale
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        now_s = self._tick()
        starts, outcomes = self.engine.on_timer(now_s)
        self._after(starts, outcomes, now_s)

    def _held_placements(
        self, pending: list[tuple[float, SinkItem]]
    ) -> tuple[list[tuple[float, SinkItem]], list[tuple[float, SinkItem]]]:
        """Split `pending` into what this write takes and the placements it
        holds back: those whose task has no outcome in it yet, noted less than
        `PLACED_WRITE_DELAY_S` ago (the timer is armed for the first of them)."""
        if self._is_stopping or not any(isinstance(item, Placed) for _, item in pending):
            return pending, []
        with_outcomes = {
            task_id
            for _, item in pending
            if not isinstance(item, Placed)
            for task_id in _task_ids_of(item)
        }
        now_s = self.now_s()
        due_after_s = PLACED_WRITE_DELAY_S / self.time_scale  # engine seconds
        taken: list[tuple[float, SinkItem]] = []
        held: list[tuple[float, SinkItem]] = []
        for noted_s, item in pending:
            if (
                isinstance(item, Placed)
                and item.task_id not in with_outcomes
                and now_s - noted_s < due_after_s
            ):
                held.append((noted_s, item))
            else:
                taken.append((noted_s, item))
        if held:
            wait_s = (held[0][0] + due_after_s - now_s) * self.time_scale
            loop = asyncio.get_running_loop()
            self._placed_flush = loop.call_later(max(wait_s, 0.0), self._wake.set)
        return taken, held

    async def _write_loop(self) -> None:
        while not (self._is_stopping and not self._pending):
            await self._wake.wait()
            self._wake.clear()
            await self._flush()

    async def _flush(self) -> None:
        if self._placed_flush is not None:
            self._placed_flush.cancel()
            self._placed_flush = None
        batch, self._pending = self._held_placements(self._pending)
        if not batch:
            return
        try:
            await self.sink.write(batch)
        except Exception:
            # Outputs must not vanish: put them back and retry on the next wake.
            self._pending = batch + self._pending
            self.num_errors += 1
            log.exception("sink_write_failed", node=self.engine.node_id, size=len(batch))
            await asyncio.sleep(0.05)
            self._wake.set()
