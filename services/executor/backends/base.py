"""`ExecutorBackend`: what executes a node engine's decisions, emulated or real.

The node engine (pure, `lemix.engine`) decides which stage runs what and for
how long; a backend carries it out. `NodeDriver` calls `execute` per stage
item, `ExecutorNode` calls the task hooks (`on_dispatch`, `forget`), weight
syncs and profiling, and the Redis sink reads token ids and end fields. Every
backend implements every method, so none of them asks which backend it holds;
what the emulated one lacks is a no-op or an empty answer, and the two
behaviours that really differ are said by `is_emulated` and `produces_tokens`.

Implementations: `EmulatedBackend` (backends/emulated.py: the profile's
timing, no model) and `TorchBackend` (backends/torch.py: a real staged model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from lemix.engine import NodeEngine, StageStart
from lemix.infra.store.model_limits import ModelLimits
from lemix.outputs import TokenLogprob
from lemix.types import Task, TaskPayload
from services.executor.convert import MeasureResult, MeasureSpec, SyncDirection


class RequestsFailed(Exception):  # noqa: N818 - it is an outcome, not a misuse
    """A backend could not run these requests (they end Failed, `reason`).

    `stopped` are requests of the same item that ended normally (end of
    sequence): one bad request must not take its batch-mates down with it.
    """

    def __init__(self, task_ids: Sequence[str], reason: str, stopped: Sequence[str] = ()) -> None:
        super().__init__(reason)
        self.task_ids = tuple(task_ids)
        self.reason = reason
        self.stopped = tuple(stopped)


class ExecutorBackend(Protocol):
    """Executes one node's stage work and keeps whatever per-task state that needs."""

    @property
    def is_emulated(self) -> bool:
        """True when a stage item takes exactly its profiled duration (no model
        runs): the driver then tells the engine the item ended at its profiled
        end, not when the wall-clock wake-up came (timer overshoot, ~0.5 ms a
        wake-up, would otherwise add up over every stage of every decode step)."""
        ...

    @property
    def produces_tokens(self) -> bool:
        """True when `output_ids` are real token ids, to be written with each
        token message (the emulated backend generates counts, not tokens)."""
        ...

    def bind(self, engine: NodeEngine) -> None:
        """Attach to the engine whose decisions this backend will execute
        (once, before any other call). Raises ValueError when they disagree
        (e.g. the profile's stage count is not the model's)."""
        ...

    def on_dispatch(self, task: Task, payload: TaskPayload) -> None:
        """Prepare a task the node is accepting, before the engine sees it.
        Raises `InvalidArgument` when this backend cannot run it."""
        ...

    def forget(self, task_id: str) -> None:
        """The node no longer holds `task_id`: free whatever was kept for it."""
        ...

    async def execute(self, start: StageStart, expected_wall_s: float) -> Sequence[str] | None:
        """Run one stage item; return the ids of requests that ended early
        (end of sequence), or None.

        `expected_wall_s` is how long the engine predicts it takes, in wall
        seconds from now (its profiled duration, time-scaled, less any delay
        in starting it): the emulated backend takes exactly that, a real one
        takes what it takes. Raises `RequestsFailed` for requests it could not
        run; any other exception is logged and counted by the driver.
        """
        ...

    def output_ids(self, task_id: str) -> Sequence[int]:
        """The token ids generated so far for a held inference task (empty
        when `produces_tokens` is False)."""
        ...

    def output_logprobs(self, task_id: str) -> Sequence[TokenLogprob]:
        """One per id of `output_ids` when the task asked for logprobs
        (`TaskPayload.top_logprobs`); empty otherwise."""
        ...

    def prompt_logprobs(self, task_id: str) -> Sequence[TokenLogprob]:
        """One per prompt token from the second on, once prefilled, when the
        task asked for them (`TaskPayload.prompt_logprobs`); empty otherwise."""
        ...

    def end_fields(self, task_id: str) -> dict[str, str | float]:
        """Extra fields for a finished task's ``end`` message and state hash
        (finish reason, inference or training loss); empty when none."""
        ...

    def prepare_sync(
        self, tag: str, direction: SyncDirection, location: str, sources: Sequence[str] = ()
    ) -> None:
        """The engine's next ``block`` items tagged `tag` save or load the
        weights at `location`, or (AVERAGE) add the mean of the saves under
        `sources` minus this node's own save at `location`. Raises
        `InvalidArgument` when the backend needs a location and has none; the
        emulated backend moves no bytes."""
        ...

    async def measure(self, spec: MeasureSpec) -> MeasureResult:
        """`spec.num_repeats` latency samples of one phase on one stage, and
        its peak memory (`spec.stage` is in range). Raises `Unavailable` when
        the node must be idle to measure and is not."""
        ...

    def used_bytes(self) -> list[int]:
        """Memory each stage really holds, measured (empty: nothing measured)."""
        ...

    def model_limits(self) -> ModelLimits | None:
        """The model's vocabulary and positions, published with every heartbeat
        so the gateway refuses what the model cannot run (None: no model)."""
        ...

    def close(self) -> None:
        """Release threads and devices; called once, after the node stopped."""
        ...
