"""What `lemix.engine.NodeEngine` answers its driver with: `StageStart`s (run
this stage for this long, and what runs there) and outcomes (a task's first
token, its end, a requeue, a blocking op's end, streamed tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from lemix.types import Task


class WorkKind(StrEnum):
    """What a stage runs: a backend that executes work for real dispatches on it."""

    ITERATION = "iter"  # one inference iteration (prefill and/or decode)
    FORWARD = "fwd"  # a training task's forward
    BACKWARD = "bwd"  # a training task's backward (gradients only)
    OPTIMIZER = "opt"  # a training task's optimizer step on one stage, after its backward
    BLOCKING = "block"  # a node-wide blocking op (e.g. a weight sync)
    NONE = ""  # nothing to execute: wait out the duration


@dataclass(frozen=True, slots=True)
class StageStart:
    """Run `stage` for `duration_s` (predicted by the engine's latency model).

    `kind` and `work` say what runs, for backends that execute it for real
    instead of waiting out the duration: an `Iteration` (ITERATION), the
    training `Task` (FORWARD/BACKWARD/OPTIMIZER; a `TrainingSlice` of it when
    `max_training_slice_s` is set), or a blocking op's tag.
    """

    stage: int
    duration_s: float
    kind: WorkKind = WorkKind.NONE
    work: object = None


@dataclass(frozen=True, slots=True)
class TrainingSlice:
    """Slice `index` of `count` of a training forward, backward or optimizer
    step on one stage: its `index`-th layer group of `count` equal ones."""

    task: Task
    index: int
    count: int


@dataclass(frozen=True, slots=True)
class FirstToken:
    task_id: str
    weight_updates: int  # updates visible in the weights that served it


@dataclass(frozen=True, slots=True)
class Finished:
    task_id: str
    num_output_tokens: int  # 0 for training


@dataclass(frozen=True, slots=True)
class Failed:
    task_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Requeued:
    """A training task handed back to the planner (never dropped)."""

    task_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class BlockingDone:
    tag: str


@dataclass(frozen=True, slots=True)
class TokensEmitted:
    """One iteration's decode tokens (only with `EngineConfig.emit_tokens`)."""

    task_ids: tuple[str, ...]
    num_generated: tuple[int, ...]  # per task, tokens so far including this one


Outcome = FirstToken | Finished | Failed | Requeued | BlockingDone | TokensEmitted
