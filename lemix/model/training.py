"""Pipeline training on the serving weights: stage-by-stage forward and backward.

A training task is one or more samples (token ids = query + reference; the
loss is the mean cross-entropy on reference tokens only). Forward on stage s
keeps that stage's graph; its output crosses to stage s+1 detached (a new
leaf there), so each stage has its own graph on its own device. Backward runs
from the last stage: ``loss.backward()`` there, then each earlier stage
``output.backward(grad of the next stage's input)`` — a real pipeline.

Each stage steps its own AdamW right after its backward (as PipeDream and
1F1B schedules do per micro-batch), clipping that stage's gradient norm; a
global-norm clip would need every stage's gradients before any stage steps.
Weight stashing (`lemix.model.stash`) keeps in-flight backwards exact.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lemix.model.staged import Segment, StagedModel
from lemix.model.stash import WeightStash


@dataclass(frozen=True)
class TrainingConfig:
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0  # per stage; 0 = no clipping

    def __post_init__(self) -> None:
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0, got {self.max_grad_norm}")


@dataclass(frozen=True)
class Sample:
    """One training sequence and how many of its last tokens are the reference."""

    token_ids: tuple[int, ...]
    num_reference_tokens: int

    def __post_init__(self) -> None:
        if len(self.token_ids) < 2:
            raise ValueError("a training sample needs at least 2 tokens")
        if not 0 <= self.num_reference_tokens <= len(self.token_ids):
            raise ValueError("num_reference_tokens out of range")


@dataclass
class _Graph:
    inputs: torch.Tensor  # stage input (ids on stage 0; a leaf requiring grad elsewhere)
    output: torch.Tensor
    epoch: int


@dataclass
class _Packed:
    ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    segments: list[Segment]
    target_index: torch.Tensor  # packed positions whose logits predict a reference token
    targets: torch.Tensor


def pack_samples(samples: Sequence[Sample]) -> _Packed:
    ids: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    index: list[int] = []
    targets: list[int] = []
    for sample in samples:
        start, n = len(ids), len(sample.token_ids)
        ids.extend(sample.token_ids)
        positions.extend(range(n))
        segments.append(Segment(start, start + n))
        # Reference tokens only; with no reference, every next token.
        first = n - sample.num_reference_tokens if sample.num_reference_tokens else 1
        first = max(first, 1)
        index.extend(start + p - 1 for p in range(first, n))
        targets.extend(sample.token_ids[first:])
    return _Packed(
        torch.tensor(ids),
        torch.tensor(positions),
        segments,
        torch.tensor(index, dtype=torch.long),
        torch.tensor(targets),
    )


class PipelineTrainer:
    """Optimizers and in-flight graphs of one node's staged model."""

    def __init__(self, staged: StagedModel, config: TrainingConfig) -> None:
        self.staged = staged
        self.config = config
        self.optimizers = [
            torch.optim.AdamW(
                stage.parameters(),
                lr=config.learning_rate,
                betas=config.betas,
                weight_decay=config.weight_decay,
            )
            for stage in staged.stages
        ]
        self.stashes = [WeightStash(stage.parameters()) for stage in staged.stages]
        self.num_steps = [0] * staged.num_stages
        self._graphs: dict[tuple[str, int], _Graph] = {}
        self._packed: dict[str, _Packed] = {}
        self._grads: dict[tuple[str, int], torch.Tensor] = {}  # grad of stage s's input
        self._losses: dict[str, float] = {}
        self._lock = threading.Lock()

    def forward(self, stage_index: int, key: str, samples: Sequence[Sample] = ()) -> None:
        """Training forward of task `key` on one stage (samples on stage 0)."""
        stage = self.staged.stages[stage_index]
        if stage.is_first:
            packed = pack_samples(samples)
            with self._lock:
                self._packed[key] = packed
            inputs = packed.ids
        else:
            packed = self._packed[key]
            prev = self._graphs[(key, stage_index - 1)].output
            inputs = prev.detach().to(stage.device).requires_grad_(True)
        stash = self.stashes[stage_index]
        with torch.enable_grad(), stash.recording() as epoch:
            output = stage.forward(inputs, packed.positions, packed.segments)
            if stage.is_last:
                logits = output[0, packed.target_index.to(stage.device)]
                output = F.cross_entropy(logits, packed.targets.to(stage.device))
        with self._lock:
            self._graphs[(key, stage_index)] = _Graph(inputs, output, epoch)
            if stage.is_last:
                self._losses[key] = float(output.detach())

    def backward(self, stage_index: int, key: str) -> float | None:
        """Backward + optimizer step of task `key` on one stage.

        Returns the task's loss once stage 0 is done (the task is complete)."""
        stage = self.staged.stages[stage_index]
        with self._lock:
            graph = self._graphs.pop((key, stage_index))
            grad = None if stage.is_last else self._grads.pop((key, stage_index + 1))
        if grad is None:
            graph.output.backward()
        else:
            graph.output.backward(grad.to(stage.device))
        stash = self.stashes[stage_index]
        stash.on_backward_done(graph.epoch)
        if not stage.is_first:
            with self._lock:
                grad_in = graph.inputs.grad
                if grad_in is None:
                    raise RuntimeError(f"stage {stage_index} input of {key!r} got no gradient")
                self._grads[(key, stage_index)] = grad_in
        self._step(stage_index)
        if stage.is_first:
            with self._lock:
                self._packed.pop(key, None)
                return self._losses.pop(key, None)
        return None

    def discard(self, key: str) -> None:
        """Drop every trace of task `key` (requeued or failed mid-pipeline)."""
        with self._lock:
            for s in range(self.staged.num_stages):
                graph = self._graphs.pop((key, s), None)
                if graph is not None:
                    self.stashes[s].on_backward_done(graph.epoch)
                self._grads.pop((key, s), None)
            self._packed.pop(key, None)
            self._losses.pop(key, None)

    def _step(self, stage_index: int) -> None:
        params = self.staged.stages[stage_index].parameters()
        if self.config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        self.stashes[stage_index].before_step()
        self.optimizers[stage_index].step()
        self.optimizers[stage_index].zero_grad(set_to_none=True)
        self.num_steps[stage_index] += 1

    def loss(self, samples: Sequence[Sample]) -> float:
        """Mean reference-token loss of `samples` with the current weights (no grad)."""
        packed = pack_samples(samples)
        with torch.no_grad():
            x: torch.Tensor = packed.ids
            for stage in self.staged.stages:
                x = stage.forward(x, packed.positions, packed.segments)
            logits = x[0, packed.target_index.to(x.device)]
            return float(F.cross_entropy(logits, packed.targets.to(x.device)))
