"""lemix.engine_stages on its own: which ready item a free stage runs, and how a
training pass is cut into slices (NodeEngine's tests cover them through the engine)."""

from __future__ import annotations

import pytest

from lemix.engine_outputs import StageStart, TrainingSlice, WorkKind
from lemix.engine_stages import (
    PRIO_BACKWARD,
    PRIO_BLOCKING,
    PRIO_FORWARD,
    PRIO_ITERATION,
    PRIO_OPTIMIZER,
    StageQueues,
)

approx = pytest.approx


def _run_order(queues: StageQueues, stage: int) -> list[object]:
    """Payloads in the order `stage` runs them, finishing each in turn."""
    order = []
    while True:
        item = queues.finish(stage)
        if item is not None:
            order.append(item.payload)
        starts = queues.start_if_idle(stage)
        if not starts:
            return order


def test_a_free_stage_runs_by_priority_then_arrival() -> None:
    queues = StageQueues(1, "inference-first", None)
    busy = queues.new_item(PRIO_FORWARD, (1.0,), WorkKind.FORWARD, "running")
    assert queues.enqueue(busy, 0) == [StageStart(0, 1.0, WorkKind.FORWARD, "running")]
    for prio, name in [
        (PRIO_FORWARD, "fwd-1"),
        (PRIO_ITERATION, "iter-1"),
        (PRIO_BACKWARD, "bwd"),
        (PRIO_ITERATION, "iter-2"),
        (PRIO_BLOCKING, "block"),
        (PRIO_FORWARD, "fwd-2"),
    ]:
        assert queues.enqueue(queues.new_item(prio, (1.0,), WorkKind.NONE, name), 0) == []
    assert _run_order(queues, 0) == [
        "running",  # non-preemptive: what runs finishes first
        "block",
        "iter-1",
        "iter-2",
        "bwd",
        "fwd-1",
        "fwd-2",
    ]
    assert queues.is_idle
    assert queues.busy_s == [approx(7.0)]


def test_forward_first_swaps_only_the_two_training_passes() -> None:
    queues = StageQueues(1, "inference-first", None, "forward-first")
    busy = queues.new_item(PRIO_FORWARD, (1.0,), WorkKind.FORWARD, "running")
    queues.enqueue(busy, 0)
    for prio, name in [
        (PRIO_BACKWARD, "bwd-1"),
        (PRIO_FORWARD, "fwd-1"),
        (PRIO_ITERATION, "iter"),
        (PRIO_OPTIMIZER, "opt"),
        (PRIO_BACKWARD, "bwd-2"),
        (PRIO_FORWARD, "fwd-2"),
        (PRIO_BLOCKING, "block"),
    ]:
        queues.enqueue(queues.new_item(prio, (1.0,), WorkKind.NONE, name), 0)
    assert _run_order(queues, 0) == [
        "running",
        "block",
        "iter",
        "opt",  # a step still goes before any backward (and now any forward)
        "fwd-1",
        "fwd-2",
        "bwd-1",
        "bwd-2",
    ]


def test_fifo_keeps_blocking_first_and_the_rest_in_arrival_order() -> None:
    queues = StageQueues(1, "fifo", None)
    queues.enqueue(queues.new_item(PRIO_ITERATION, (1.0,), WorkKind.NONE, "first"), 0)
    for prio, name in [(PRIO_FORWARD, "fwd"), (PRIO_ITERATION, "iter"), (PRIO_BLOCKING, "block")]:
        queues.enqueue(queues.new_item(prio, (1.0,), WorkKind.NONE, name), 0)
    assert _run_order(queues, 0) == ["first", "block", "fwd", "iter"]


def test_a_training_pass_runs_in_slices_and_yields_to_an_iteration_between_them() -> None:
    # 0.25 s of forward on stage 1 with slices of at most 0.1 s: 3 slices.
    queues = StageQueues(2, "inference-first", 0.1)
    forward = queues.new_item(PRIO_FORWARD, (0.5, 0.25), WorkKind.FORWARD, "task")
    (start,) = queues.enqueue(forward, 1)
    assert start.duration_s == approx(0.25 / 3)
    assert start.work == TrainingSlice("task", 0, 3)  # type: ignore[arg-type]
    assert queues.finish(1) is forward and forward.has_more_slices
    queues.requeue_next_slice(forward, 1)
    iteration = queues.new_item(PRIO_ITERATION, (0.01, 0.01), WorkKind.ITERATION, "iter")
    (start,) = queues.enqueue(iteration, 1)  # the stage is free: the iteration goes first
    assert start.kind is WorkKind.ITERATION
    queues.finish(1)
    (start,) = queues.start_if_idle(1)
    assert start.work == TrainingSlice("task", 1, 3)  # type: ignore[arg-type]
    queues.finish(1)
    queues.requeue_next_slice(forward, 1)
    (start,) = queues.start_if_idle(1)
    assert start.work == TrainingSlice("task", 2, 3)  # type: ignore[arg-type]
    assert queues.finish(1) is forward and not forward.has_more_slices
    # On its next stage the pass is sliced afresh (0.5 s: 5 slices).
    (start,) = queues.enqueue(forward, 0)
    assert start.work == TrainingSlice("task", 0, 5)  # type: ignore[arg-type]
    assert queues.busy_s == [approx(0.1), approx(0.25 + 0.01)]
