"""One node's S stage workers: a ready queue per stage and the item each stage
runs now.

`lemix.engine.NodeEngine` decides what work exists and which stage it goes to
next; this module decides which ready item a free stage runs and for how long.
Work on a stage is non-preemptive. The next item is picked by priority
(blocking ops, then inference iterations, then training optimizer steps, then
backwards, then forwards, then arrival order) or, with `stage_order="fifo"`,
blocking ops and optimizer steps first and then plain arrival order. An
optimizer step goes before any backward on its stage so that the next task's
gradients never mix with the ones it has not applied yet (`lemix.engine`: the
step runs after the backward has handed its gradient on). With a
`max_training_slice_s`, a
training pass on a stage runs in slices (`lemix.engine_groups.num_slices`), and
each slice goes back into the queue after it ends, so higher-priority work that
became ready meanwhile runs between slices.

`training_order="forward-first"` swaps the two passes: a ready forward goes
before a ready backward (optimizer steps still go before both). With only S
tasks in flight and inference taking the stages at random times, a stage that
runs a backward (and then its step) while the next task's forward waits in
its queue leaves the stage after it idle for both; running the forward first
hands that stage work while this one does the backward. On the A100 7B
profile (10 req/s, train rate 0.5, 3 seeds) the stages idled 90–112 stage-s
in the window with S tasks in flight, against 125–137 backward-first
(docs/results.md, part (c), 2026-12-04). It keeps no more activations: a
task holds its activation memory from admission to its last step either way.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from lemix.engine_groups import num_slices, slice_s
from lemix.engine_outputs import StageStart, TrainingSlice, WorkKind

_TRAINING_KINDS = (WorkKind.FORWARD, WorkKind.BACKWARD, WorkKind.OPTIMIZER)
PRIO_BLOCKING, PRIO_ITERATION, PRIO_OPTIMIZER, PRIO_BACKWARD, PRIO_FORWARD = range(5)


@dataclass(slots=True)
class WorkItem:
    """One piece of work passing through the stages (an iteration, a training
    task's forward or backward, or one stage's share of a blocking op)."""

    prio: int
    seq: int  # arrival order: the tie-breaker within a priority
    durations_s: tuple[float, ...]  # per stage
    kind: WorkKind
    payload: object = None
    # Training slices on the stage the item is on (count 0: not started there).
    slice_index: int = 0
    slice_count: int = 0

    @property
    def has_more_slices(self) -> bool:
        """A training pass with slices left to run on its current stage."""
        return self.slice_index + 1 < self.slice_count


class StageQueues:
    """The ready queues and running items of one node's stages."""

    def __init__(
        self,
        num_stages: int,
        stage_order: str,
        max_training_slice_s: float | None,
        training_order: str = "backward-first",
    ) -> None:
        self._stage_order = stage_order
        self._is_forward_first = training_order == "forward-first"
        self._max_training_slice_s = max_training_slice_s
        self._ready: list[list[tuple[int, int, WorkItem]]] = [[] for _ in range(num_stages)]
        self._current: list[WorkItem | None] = [None] * num_stages
        self._seq = 0
        self.busy_s = [0.0] * num_stages  # per stage, the work started on it so far

    @property
    def is_idle(self) -> bool:
        """No stage is running anything."""
        return all(c is None for c in self._current)

    def new_item(
        self, prio: int, durations_s: tuple[float, ...], kind: WorkKind, payload: object
    ) -> WorkItem:
        """An item of priority `prio` (a `PRIO_*`), next in arrival order."""
        self._seq += 1
        if self._stage_order == "fifo" and prio != PRIO_BLOCKING:
            # An optimizer step still goes first: right after its backward.
            prio = PRIO_BLOCKING if prio == PRIO_OPTIMIZER else PRIO_ITERATION
        elif self._is_forward_first and prio in (PRIO_BACKWARD, PRIO_FORWARD):
            prio = PRIO_BACKWARD + PRIO_FORWARD - prio  # the two swap places
        return WorkItem(prio, self._seq, durations_s, kind, payload)

    def enqueue(self, item: WorkItem, stage: int) -> list[StageStart]:
        """Make `item` ready on `stage`, which it has not started on; start it
        there if the stage is free."""
        item.slice_count = 0
        heapq.heappush(self._ready[stage], (item.prio, item.seq, item))
        return self.start_if_idle(stage)

    def requeue_next_slice(self, item: WorkItem, stage: int) -> None:
        """Put `item`, whose slice on `stage` just ended, back in that stage's
        queue for its next slice, so anything of a higher priority that became
        ready goes first."""
        item.slice_index += 1
        heapq.heappush(self._ready[stage], (item.prio, item.seq, item))

    def finish(self, stage: int) -> WorkItem | None:
        """Free `stage`; the item it was running (None: it ran nothing)."""
        item = self._current[stage]
        self._current[stage] = None
        return item

    def start_if_idle(self, stage: int) -> list[StageStart]:
        """Start the first ready item on `stage` if the stage is free."""
        if self._current[stage] is not None or not self._ready[stage]:
            return []
        _, _, item = heapq.heappop(self._ready[stage])
        self._current[stage] = item
        duration_s = item.durations_s[stage]
        work = item.payload
        max_slice_s = self._max_training_slice_s
        if max_slice_s is not None and item.kind in _TRAINING_KINDS:
            if item.slice_count == 0:  # the first slice on this stage
                item.slice_index, item.slice_count = 0, num_slices(duration_s, max_slice_s)
            duration_s = slice_s(duration_s, item.slice_index, item.slice_count)
            work = TrainingSlice(item.payload, item.slice_index, item.slice_count)  # type: ignore[arg-type]
        self.busy_s[stage] += duration_s
        return [StageStart(stage, duration_s, item.kind, work)]
