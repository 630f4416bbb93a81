"""The emulated backend: the profile's timing, no model.

A stage item sleeps its predicted duration (the engine's ground-truth
latency, noise included); no tokens are made, only counted. Measure returns
samples of that ground truth, so a profiler fitting them recovers the profile
the node was given. Everything a real model would keep per task is a no-op.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from lemix.engine import NodeEngine, StageStart
from lemix.infra.store.model_limits import ModelLimits
from lemix.outputs import TokenLogprob
from lemix.types import Task, TaskPayload
from services.executor.convert import MeasurePhase, MeasureResult, MeasureSpec, SyncDirection


class EmulatedBackend:
    """`ExecutorBackend` from the profile: sleeps stand in for the stages."""

    def __init__(self) -> None:
        self._engine: NodeEngine | None = None

    @property
    def is_emulated(self) -> bool:
        return True

    @property
    def produces_tokens(self) -> bool:
        return False

    def bind(self, engine: NodeEngine) -> None:
        self._engine = engine

    def on_dispatch(self, task: Task, payload: TaskPayload) -> None:
        return None  # token ids are not needed: every task can run

    def forget(self, task_id: str) -> None:
        return None

    async def execute(self, start: StageStart, expected_wall_s: float) -> Sequence[str] | None:
        await asyncio.sleep(max(expected_wall_s, 0.0))
        return None

    def output_ids(self, task_id: str) -> Sequence[int]:
        return ()

    def output_logprobs(self, task_id: str) -> Sequence[TokenLogprob]:
        return ()

    def prompt_logprobs(self, task_id: str) -> Sequence[TokenLogprob]:
        return ()

    def end_fields(self, task_id: str) -> dict[str, str | float]:
        return {}

    def prepare_sync(
        self, tag: str, direction: SyncDirection, location: str, sources: Sequence[str] = ()
    ) -> None:
        return None  # the stages are only occupied for the transfer time

    async def measure(self, spec: MeasureSpec) -> MeasureResult:
        """Samples of the engine's ground-truth latency, and the profile's memory."""
        if self._engine is None:
            raise RuntimeError("the emulated backend is not bound to an engine")
        truth, stage, memory = self._engine.truth, spec.stage, self._engine.profile.memory
        if spec.phase is MeasurePhase.FORWARD:
            samples = [
                truth.forward_s(stage, spec.batch_size, spec.num_tokens)
                for _ in range(spec.num_repeats)
            ]
        elif spec.phase is MeasurePhase.BACKWARD:
            samples = [
                truth.backward_s(stage, spec.batch_size, spec.num_tokens)
                for _ in range(spec.num_repeats)
            ]
        else:
            samples = [
                truth.decode_step_s(stage, spec.batch_size, spec.sum_context_tokens)
                for _ in range(spec.num_repeats)
            ]
        if spec.phase is MeasurePhase.DECODE:
            dynamic = memory.kv_bytes_per_token[stage] * spec.sum_context_tokens
        else:
            dynamic = memory.activation_bytes_per_token[stage] * spec.batch_size * spec.num_tokens
        return MeasureResult(tuple(samples), memory.static_bytes(stage) + dynamic)

    def used_bytes(self) -> list[int]:
        return []  # nothing measured: the engine's ledger is the only figure

    def model_limits(self) -> ModelLimits | None:
        return None  # no model: any token id, any length the context allows

    def close(self) -> None:
        return None
