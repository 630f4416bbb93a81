"""The `torch` backend: a real staged transformers model behind `ExecutorBackend`.

The node engine still decides what runs where and when (the same engine the
simulator and the emulated executor run); this backend executes each
`StageStart` for real on its stage's device:

* ``iter``  — one inference iteration's share on that stage (`InferenceRunner`):
  its decodes and prefill chunks (engine v2's chunked prefill; whole prompts
  without a budget); the last stage samples and reports end-of-sequence stops
  to the engine;
* ``fwd`` / ``bwd`` / ``opt`` — a training task's forward / backward /
  optimizer step on that stage (`PipelineTrainer`), or one slice of it (a
  layer group) when the engine slices training (``train_slice_s``);
  inference iterations run on the stage between slices;
* ``block`` — a weight save or load of that stage's parameters (safetensors).

Each stage has one worker thread, so a stage runs one thing at a time (the
engine's contract) while different stages overlap, as on separate GPUs:
with engine v2's micro-batches, stage 0 may run one micro-batch's iteration
while stage 1 runs another's (the runner keeps them apart, see its docstring).
Before an iteration the backend mirrors the engine's KV offload decisions:
requests the engine swapped out get their KV moved to host memory.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from lemix.engine import NodeEngine, StageStart, TrainingSlice, WorkKind
from lemix.infra.rpc.errors import InvalidArgument, Unavailable
from lemix.infra.store.model_limits import ModelLimits
from lemix.model.device_memory import stage_used_bytes
from lemix.model.runner import GenRequest, InferenceRunner
from lemix.model.staged import StagedModel
from lemix.model.training import PipelineTrainer, Sample
from lemix.outputs import FINISH_LENGTH, TokenLogprob
from lemix.types import Task, TaskPayload
from services.executor import weights
from services.executor.backends.base import RequestsFailed
from services.executor.convert import MeasureResult, MeasureSpec, SyncDirection

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class _SyncJob:
    direction: SyncDirection
    location: str
    sources: tuple[str, ...] = ()  # AVERAGE: the replicas' saves


class TorchBackend:
    """`ExecutorBackend` on a `StagedModel`: runs a node's engine decisions for real."""

    def __init__(
        self,
        staged: StagedModel,
        runner: InferenceRunner,
        trainer: PipelineTrainer,
        *,
        on_training_loss: Callable[[float], None] | None = None,
        on_inference_loss: Callable[[float], None] | None = None,
        num_threads: int = 0,
    ) -> None:
        self.staged = staged
        self.runner = runner
        self.trainer = trainer
        self.engine: NodeEngine | None = None
        # One worker thread per stage. OpenMP's thread count is per calling
        # thread, so each worker sets it itself (0: torch's default).
        self._pools = [
            ThreadPoolExecutor(
                1,
                thread_name_prefix=f"stage{s}",
                initializer=set_torch_threads,
                initargs=(num_threads,),
            )
            for s in range(staged.num_stages)
        ]
        self._samples: dict[str, list[Sample]] = {}
        self._syncs: dict[str, _SyncJob] = {}
        self._on_training_loss = on_training_loss
        self._on_inference_loss = on_inference_loss
        self.num_training_done = 0
        self.last_training_loss: float | None = None
        # Each held training task's loss (set by its stage-0 backward), for its
        # end fields: GetTask reports it (gateway.tasks).
        self._training_losses: dict[str, float] = {}
        self.num_stage_errors = 0
        # Bytes each stage holds, measured by the stage's own thread after each
        # item: reading grads or optimizer state from another thread while a
        # backward accumulates into them is a data race (it corrupted the heap).
        self._used_bytes = staged.weight_bytes()

    @property
    def is_emulated(self) -> bool:
        return False

    @property
    def produces_tokens(self) -> bool:
        return True

    # ------------------------------------------------------------ node hooks

    def bind(self, engine: NodeEngine) -> None:
        if engine.num_stages != self.staged.num_stages:
            raise ValueError(
                f"the profile has {engine.num_stages} stages but the model was "
                f"split into {self.staged.num_stages}"
            )
        self.engine = engine

    def on_dispatch(self, task: Task, payload: TaskPayload) -> None:
        """Prepare a task the node accepted; InvalidArgument when it can't run."""
        if not payload.prompt_token_ids:
            raise InvalidArgument(
                f"task {task.task_id!r} carries no token ids: the torch backend runs a real "
                "model, so the gateway must tokenize with the model's tokenizer"
            )
        vocab = self.staged.vocab_size
        if max(payload.prompt_token_ids + payload.reference_token_ids) >= vocab:
            raise InvalidArgument(
                f"task {task.task_id!r}: token id out of the model's vocabulary of {vocab}"
            )
        if task.is_training:
            try:
                samples = [Sample(ids, num_ref) for ids, num_ref in payload.samples()]
            except ValueError as exc:
                raise InvalidArgument(f"training task {task.task_id!r}: {exc}") from exc
            self._samples[task.task_id] = samples
            return
        try:
            self.runner.admit(
                GenRequest(
                    key=task.task_id,
                    prompt_ids=payload.prompt_token_ids,
                    max_tokens=task.max_output_tokens,
                    reference_ids=payload.reference_token_ids,
                    temperature=payload.temperature,
                    top_p=payload.top_p,
                    seed=payload.seed,
                    ignore_eos=payload.ignore_eos,
                    top_logprobs=payload.top_logprobs,
                    prompt_logprobs=payload.prompt_logprobs,
                    top_k=payload.top_k,
                    min_p=payload.min_p,
                    presence_penalty=payload.presence_penalty,
                    frequency_penalty=payload.frequency_penalty,
                    repetition_penalty=payload.repetition_penalty,
                    min_tokens=payload.min_tokens,
                    stop_token_ids=payload.stop_token_ids,
                )
            )
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc

    def forget(self, task_id: str) -> None:
        """The node no longer holds `task_id`: free its KV / training state."""
        self.runner.release(task_id)
        self._samples.pop(task_id, None)
        self._training_losses.pop(task_id, None)
        self.trainer.discard(task_id)

    def output_ids(self, task_id: str) -> Sequence[int]:
        req = self.runner.requests.get(task_id)
        return req.generated if req is not None else ()

    def output_logprobs(self, task_id: str) -> Sequence[TokenLogprob]:
        req = self.runner.requests.get(task_id)
        return req.logprobs if req is not None else ()

    def prompt_logprobs(self, task_id: str) -> Sequence[TokenLogprob]:
        req = self.runner.requests.get(task_id)
        return req.prompt_logprob_entries if req is not None else ()

    def end_fields(self, task_id: str) -> dict[str, str | float]:
        """Fields for the task's ``end`` message: finish reason, inference loss;
        a training task's loss."""
        loss = self._training_losses.get(task_id)
        if loss is not None:
            return {"training_loss": loss} if math.isfinite(loss) else {}
        req = self.runner.requests.get(task_id)
        if req is None:
            return {}
        fields: dict[str, str | float] = {"finish_reason": req.finish_reason or FINISH_LENGTH}
        if req.inference_loss is not None and math.isfinite(req.inference_loss):
            fields["inference_loss"] = req.inference_loss
        if req.reference_accuracy is not None:
            fields["reference_accuracy"] = req.reference_accuracy
        return fields

    def prepare_sync(
        self, tag: str, direction: SyncDirection, location: str, sources: Sequence[str] = ()
    ) -> None:
        """The next ``block`` items tagged `tag` save/load the weights at
        `location`, or average the saves under `sources` into them."""
        if not location:
            raise InvalidArgument("a weight sync of a real model needs a location")
        self._syncs[tag] = _SyncJob(direction, location, tuple(sources))

    def used_bytes(self) -> list[int]:
        """Memory each stage held after its last item (see `lemix.model.device_memory`)."""
        return list(self._used_bytes)

    def model_limits(self) -> ModelLimits | None:
        return ModelLimits(
            vocab_size=self.staged.vocab_size, max_model_len=self.staged.family.max_positions
        )

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ execution

    async def execute(self, start: StageStart, expected_wall_s: float) -> Sequence[str] | None:
        """Run `start` on its stage's thread; it takes what it takes
        (`expected_wall_s` is the engine's guess, not used here)."""
        self._mirror_offloads()
        fn = self._work(start)
        stage = start.stage

        def job() -> Sequence[str] | None:
            try:
                return fn()
            finally:
                self._used_bytes[stage] = stage_used_bytes(
                    self.staged.stages[stage], self.trainer.optimizers[stage]
                )

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pools[stage], job)

    def _work(self, start: StageStart) -> Callable[[], Sequence[str] | None]:
        stage = start.stage
        if start.kind == WorkKind.ITERATION:
            iteration: Any = start.work
            prefill = [r.task.task_id for r in iteration.prefill]
            decode = [r.task.task_id for r in iteration.decode]
            spans = list(iteration.prefill_spans)  # chunked prefill; () = whole prompts
            # id(): the engine holds the Iteration until its last stage is done,
            # so no two iterations in flight (micro-batches) share one.
            return lambda: self._run_iteration(stage, id(iteration), prefill, decode, spans)
        if start.kind in (WorkKind.FORWARD, WorkKind.BACKWARD, WorkKind.OPTIMIZER):
            # A `TrainingSlice` when the engine slices training (max_training_slice_s).
            # Its index counts slices in the order they run; the trainer's counts
            # layer groups, which a backward runs last to first.
            work: Any = start.work
            task: Task = work.task if isinstance(work, TrainingSlice) else work
            part = None
            if isinstance(work, TrainingSlice):
                group = work.index
                if start.kind == WorkKind.BACKWARD:
                    group = work.count - 1 - work.index
                part = (group, work.count)
            if start.kind == WorkKind.BACKWARD:
                return lambda: self.trainer.backward(stage, task.task_id, part)
            if start.kind == WorkKind.OPTIMIZER:
                return lambda: self._optimizer_step(stage, task.task_id, part)
            samples = self._samples.get(task.task_id, []) if stage == 0 else []
            return lambda: self.trainer.forward(stage, task.task_id, samples, part)
        job = self._syncs.get(str(start.work))
        if job is None:
            raise RuntimeError(f"blocking item {start.work!r} has no weight sync job")
        return lambda: self._sync_stage(stage, job)

    def _run_iteration(
        self,
        stage: int,
        iteration: int,
        prefill: list[str],
        decode: list[str],
        spans: list[tuple[int, int]],
    ) -> Sequence[str]:
        is_last = stage == self.staged.num_stages - 1
        try:
            stopped = self.runner.run_stage(stage, iteration, prefill, decode, prefill_spans=spans)
            # Only the last stage samples, so only its thread takes the failures:
            # with micro-batches another stage's thread runs at the same time.
            failures = self.runner.take_failures() if is_last else {}
            if is_last and self._on_inference_loss is not None:
                for key in prefill:
                    req = self.runner.requests.get(key)
                    if key not in failures and req is not None and req.inference_loss is not None:
                        self._on_inference_loss(req.inference_loss)
        except Exception as exc:
            # The iteration's requests cannot continue: they end Failed (the
            # client gets INTERNAL) rather than complete with tokens never made.
            self.num_stage_errors += 1
            log.exception("torch.iteration_failed", stage=stage)
            raise RequestsFailed(
                [*prefill, *decode], f"INTERNAL: stage {stage} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if failures:
            # Only the requests that failed end Failed; their batch-mates go on.
            self.num_stage_errors += 1
            log.warning("torch.requests_failed", stage=stage, failures=failures)
            # One reason for the lot: two failing differently in one
            # iteration is rare, and each reason is logged above.
            raise RequestsFailed(list(failures), next(iter(failures.values())), stopped=stopped)
        return stopped

    def _optimizer_step(self, stage: int, key: str, part: tuple[int, int] | None) -> None:
        loss = self.trainer.optimizer_step(stage, key, part)
        if stage == 0 and (part is None or part[0] == part[1] - 1):  # the task's last slice
            self.num_training_done += 1
            self._samples.pop(key, None)
            if loss is not None:
                self.last_training_loss = loss
                self._training_losses[key] = loss
                if self._on_training_loss is not None:
                    self._on_training_loss(loss)

    def _sync_stage(self, stage: int, job: _SyncJob) -> None:
        path = Path(job.location) / f"stage{stage}.safetensors"
        if job.direction is SyncDirection.SAVE:
            weights.save_stage(self.staged.stages[stage], path)
            return
        # An in-place change of the weights, like an optimizer step: a training
        # forward still waiting for its backward keeps the weights it saw.
        self.trainer.stashes[stage].before_step()
        if job.direction is SyncDirection.AVERAGE:
            sources = [Path(s) / f"stage{stage}.safetensors" for s in job.sources]
            weights.average_into_stage(self.staged.stages[stage], path, sources)
        else:
            weights.load_stage(self.staged.stages[stage], path)

    def _mirror_offloads(self) -> None:
        engine = self.engine
        if engine is None:
            return
        for req in engine.swapped:
            self.runner.offload(req.task.task_id)

    # ------------------------------------------------------------ profiling

    async def measure(self, spec: MeasureSpec) -> MeasureResult:
        """Time `spec` on its stage's thread (see `services.executor.torch_measure`);
        Unavailable while the node has work (it would share the stage)."""
        from services.executor.torch_measure import measure_stage

        if self.engine is not None and not self.engine.is_idle:
            raise Unavailable(f"node {self.engine.node_id} is busy; profile an idle node")

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pools[spec.stage], lambda: measure_stage(self.staged, spec)
        )


def set_torch_threads(num_threads: int) -> None:
    """Intra-op threads per process (0 = torch's default)."""
    if num_threads > 0:
        torch.set_num_threads(num_threads)
