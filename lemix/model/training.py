"""Pipeline training on the serving weights: stage-by-stage forward and backward.

A training task is one or more samples (token ids = query + reference; the
loss is the mean cross-entropy on reference tokens only). Forward on stage s
keeps that stage's graph; its output crosses to stage s+1 detached (a new
leaf there), so each stage has its own graph on its own device. Backward runs
from the last stage: ``loss.backward()`` there, then each earlier stage
``output.backward(grad of the next stage's input)`` — a real pipeline.

Each stage steps its own AdamW once per task (as PipeDream and 1F1B schedules
do per micro-batch), clipping that stage's gradient norm; a global-norm clip
would need every stage's gradients before any stage steps. The step is its
own call, `optimizer_step`, after the stage's backward has handed its input
gradient on (the engine's OPTIMIZER item), so the previous stage's backward
does not wait for it; until then the stage holds that one task's gradients
(the engine runs a stage's step before any other backward there, and
`backward` refuses to mix two tasks' gradients). Weight stashing
(`lemix.model.stash`) keeps in-flight backwards exact.

Slices (the engine's `TrainingSlice`, see "Training slices" in
`lemix.engine_groups`): a pass given as ``part=(index, count)`` runs only
layer group `index` of `count` equal groups of the stage's layers (the
embedding belongs to group 0, the head and loss to group count - 1), so the
stage can serve inference iterations between slices. A sliced forward keeps
one graph piece per *unit* (the embedding, each layer, the head), each unit's
input a leaf requiring grad, so a backward can run in slices of any count,
not only the forward's (the engine sizes each from its own duration):
backward slice i backpropagates group i's units from the gradient group
i + 1 left. An optimizer step in slices clips the whole stage's gradient norm
in its first slice (the backward is complete by then) and steps group i's
parameters in slice i (the units' parameters are disjoint), so the gradients
and the updated weights equal the unsliced ones. The stash copies a group's
weights only for other tasks' live graphs that saved them, never for the same
task's later slices (they use other groups' weights). Inference between
optimizer slices sees the groups stepped so far.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lemix.model.families import Family
from lemix.model.staged import Segment, Stage, StagedModel
from lemix.model.stash import Recording, WeightStash


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
    recording: Recording


@dataclass(frozen=True)
class _Unit:
    """A piece of a stage a sliced pass cuts its graph at."""

    layers: range  # model-wide layer indices (empty for the embedding / head)
    embed: bool = False
    head: bool = False  # the head and the loss


@dataclass
class _SlicedPass:
    """One task's training pass on one stage, run in slices: a graph per unit."""

    stage_input: torch.Tensor  # ids on stage 0; a leaf requiring grad elsewhere
    pieces: list[_Graph | None] = field(default_factory=list)  # per unit done forward
    num_pending: int = 0  # units (a prefix) not backpropagated yet
    grad: torch.Tensor | None = None  # grad of unit `num_pending`'s input


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


def unit_group(num_units: int, num_layers: int, has_embed: bool, index: int, count: int) -> range:
    """Units of layer group `index` of `count` on a stage (units in order: the
    embedding if `has_embed`, its `num_layers` layers, the head if any).

    Layers split as evenly as possible; with more groups than layers some hold
    none (an empty slice). The embedding belongs to group 0, the head to the last.
    """
    if not 0 <= index < count:
        raise ValueError(f"slice index must be in [0, {count}), got {index}")
    offset = 1 if has_embed else 0
    start = 0 if index == 0 else offset + index * num_layers // count
    stop = num_units if index == count - 1 else offset + (index + 1) * num_layers // count
    return range(start, stop)


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
        self.num_steps = [0] * staged.num_stages  # completed optimizer steps per stage
        # Stage -> the task whose gradients it holds, not yet stepped.
        self._unapplied: dict[int, str] = {}
        self._units = [_stage_units(stage) for stage in staged.stages]
        self._unit_params = [
            _unit_params(staged.family, stage, units)
            for stage, units in zip(staged.stages, self._units, strict=True)
        ]
        self._graphs: dict[tuple[str, int], _Graph] = {}
        self._sliced: dict[tuple[str, int], _SlicedPass] = {}
        self._packed: dict[str, _Packed] = {}
        self._grads: dict[tuple[str, int], torch.Tensor] = {}  # grad of stage s's input
        self._losses: dict[str, float] = {}
        self._lock = threading.Lock()

    def forward(
        self,
        stage_index: int,
        key: str,
        samples: Sequence[Sample] = (),
        part: tuple[int, int] | None = None,
    ) -> None:
        """Training forward of task `key` on one stage (samples on stage 0):
        the whole stage, or with `part` = (index, count) its layer group
        `index` of `count` (groups in order 0..count-1; samples with group 0)."""
        stage = self.staged.stages[stage_index]
        if part is not None:
            self._forward_slice(stage_index, key, samples, *part)
            return
        if stage.is_first:
            packed = pack_samples(samples)
            with self._lock:
                self._packed[key] = packed
            inputs = packed.ids
        else:
            packed = self._packed[key]
            prev = self._stage_output(key, stage_index - 1)
            inputs = prev.detach().to(stage.device).requires_grad_(True)
        stash = self.stashes[stage_index]
        with torch.enable_grad(), stash.recording() as recording:
            output = stage.forward(inputs, packed.positions, packed.segments)
            if stage.is_last:
                output = _loss(output, packed)
        with self._lock:
            self._graphs[(key, stage_index)] = _Graph(inputs, output, recording)
            if stage.is_last:
                self._losses[key] = float(output.detach())

    def backward(self, stage_index: int, key: str, part: tuple[int, int] | None = None) -> None:
        """Backward of task `key` on one stage (gradients only; the step is
        `optimizer_step`'s): the whole stage, or with `part` = (index, count)
        its layer group `index` of `count` (groups in order count-1..0)."""
        self._hold_gradients(stage_index, key)
        with self._lock:
            graph = self._graphs.pop((key, stage_index), None)
        if graph is None:
            index, count = part if part is not None else (0, 1)
            self._backward_slice(stage_index, key, index, count)
            return
        if part is not None and part[1] != 1:
            raise RuntimeError(
                f"task {key!r}: a backward in {part[1]} slices needs a sliced forward "
                f"on stage {stage_index}"
            )
        stage = self.staged.stages[stage_index]
        with self._lock:
            grad = None if stage.is_last else self._grads.pop((key, stage_index + 1))
        if grad is None:
            graph.output.backward()
        else:
            graph.output.backward(grad.to(stage.device))
        stash = self.stashes[stage_index]
        stash.on_backward_done(graph.recording)
        if not stage.is_first:
            with self._lock:
                grad_in = graph.inputs.grad
                if grad_in is None:
                    raise RuntimeError(f"stage {stage_index} input of {key!r} got no gradient")
                self._grads[(key, stage_index)] = grad_in

    def optimizer_step(
        self, stage_index: int, key: str, part: tuple[int, int] | None = None
    ) -> float | None:
        """Optimizer step of task `key` on one stage, after its backward: the
        whole stage, or with `part` = (index, count) layer group `index` of
        `count` (groups in order 0..count-1; the first clips the stage's norm).

        Returns the task's loss once stage 0 has stepped (the task is complete)."""
        with self._lock:
            holder = self._unapplied.get(stage_index)
        if holder != key:
            raise RuntimeError(
                f"stage {stage_index} holds the gradients of {holder!r}, not {key!r}"
            )
        stage = self.staged.stages[stage_index]
        index, count = part if part is not None else (0, 1)
        if index == 0 and self.config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(stage.parameters(), self.config.max_grad_norm)
        units = self._units[stage_index]
        group = unit_group(len(units), len(stage.layers), stage.is_first, index, count)
        params = [p for u in group for p in self._unit_params[stage_index][u]]
        if params:
            self._step(stage_index, params)
        if index < count - 1:
            return None
        with self._lock:
            del self._unapplied[stage_index]
        return self._on_stage_done(stage_index, key)

    def _hold_gradients(self, stage_index: int, key: str) -> None:
        """Record that `stage_index` now accumulates `key`'s gradients."""
        with self._lock:
            holder = self._unapplied.setdefault(stage_index, key)
        if holder != key:
            raise RuntimeError(
                f"stage {stage_index}: backward of {key!r} before the optimizer step of "
                f"{holder!r} (their gradients would mix)"
            )

    def discard(self, key: str) -> None:
        """Drop every trace of task `key` (requeued or failed mid-pipeline)."""
        with self._lock:
            for s in range(self.staged.num_stages):
                graph = self._graphs.pop((key, s), None)
                if graph is not None:
                    self.stashes[s].on_backward_done(graph.recording)
                sliced = self._sliced.pop((key, s), None)
                if sliced is not None:
                    for piece in sliced.pieces:
                        if piece is not None:  # not backpropagated yet
                            self.stashes[s].on_backward_done(piece.recording)
                self._grads.pop((key, s), None)
                if self._unapplied.get(s) == key:  # its gradients would leak into the next step
                    del self._unapplied[s]
                    self.optimizers[s].zero_grad(set_to_none=True)
            self._packed.pop(key, None)
            self._losses.pop(key, None)

    def _step(self, stage_index: int, params: list[torch.nn.Parameter]) -> None:
        """Step `params` of the stage (the others' gradients wait for their turn)."""
        wanted = {id(p) for p in params}
        waiting = [
            (p, p.grad)
            for p in self.staged.stages[stage_index].parameters()
            if id(p) not in wanted and p.grad is not None
        ]
        for p, _ in waiting:
            p.grad = None  # AdamW steps every parameter that has a gradient
        try:
            self.stashes[stage_index].before_step(params)
            self.optimizers[stage_index].step()
        finally:
            for p, grad in waiting:
                p.grad = grad
        for p in params:
            p.grad = None

    def _on_stage_done(self, stage_index: int, key: str) -> float | None:
        self.num_steps[stage_index] += 1
        if not self.staged.stages[stage_index].is_first:
            return None
        with self._lock:
            self._packed.pop(key, None)
            return self._losses.pop(key, None)

    def _stage_output(self, key: str, stage_index: int) -> torch.Tensor:
        """Output of a finished training forward on `stage_index`."""
        with self._lock:
            graph = self._graphs.get((key, stage_index))
            if graph is not None:
                return graph.output
            sliced = self._sliced[(key, stage_index)]
        last = sliced.pieces[-1] if sliced.pieces else None
        if last is None or len(sliced.pieces) != len(self._units[stage_index]):
            raise RuntimeError(f"stage {stage_index} forward of {key!r} is not finished")
        return last.output

    def _forward_slice(
        self, stage_index: int, key: str, samples: Sequence[Sample], index: int, count: int
    ) -> None:
        stage = self.staged.stages[stage_index]
        units = self._units[stage_index]
        group = unit_group(len(units), len(stage.layers), stage.is_first, index, count)
        with self._lock:
            state = self._sliced.get((key, stage_index))
        if state is None:
            if index != 0:
                raise RuntimeError(f"task {key!r}: forward slice {index} before slice 0")
            if stage.is_first:
                packed = pack_samples(samples)
                with self._lock:
                    self._packed[key] = packed
                stage_input = packed.ids
            else:
                prev = self._stage_output(key, stage_index - 1)
                stage_input = prev.detach().to(stage.device).requires_grad_(True)
            state = _SlicedPass(stage_input)
            with self._lock:
                self._sliced[(key, stage_index)] = state
        if group.start != len(state.pieces):
            raise RuntimeError(
                f"task {key!r}: forward slice {index}/{count} on stage {stage_index} out of order"
            )
        packed = self._packed[key]
        stash = self.stashes[stage_index]
        for u in group:
            prev_piece = state.pieces[u - 1] if u else None
            # Each unit's input is a leaf, so a backward slice can start at any unit.
            inputs = (
                prev_piece.output.detach().requires_grad_(True)
                if prev_piece is not None
                else state.stage_input
            )
            unit = units[u]
            with torch.enable_grad(), stash.recording() as recording:
                output = stage.forward_part(
                    inputs,
                    packed.positions,
                    packed.segments,
                    unit.layers,
                    embed=unit.embed,
                    head=unit.head,
                )
                if unit.head:
                    output = _loss(output, packed)
            state.pieces.append(_Graph(inputs, output, recording))
            if unit.head:
                with self._lock:
                    self._losses[key] = float(output.detach())
        state.num_pending = len(state.pieces)

    def _backward_slice(self, stage_index: int, key: str, index: int, count: int) -> None:
        stage = self.staged.stages[stage_index]
        units = self._units[stage_index]
        group = unit_group(len(units), len(stage.layers), stage.is_first, index, count)
        with self._lock:
            state = self._sliced[(key, stage_index)]
        if len(state.pieces) != len(units) or group.stop != state.num_pending:
            raise RuntimeError(
                f"task {key!r}: backward slice {index}/{count} on stage {stage_index} out of order"
            )
        if state.num_pending == len(units) and not stage.is_last:
            with self._lock:
                state.grad = self._grads.pop((key, stage_index + 1))
        stash = self.stashes[stage_index]
        for u in reversed(group):
            piece = state.pieces[u]
            assert piece is not None  # backpropagated units are dropped, the rest kept
            if units[u].head:
                piece.output.backward()
            else:
                if state.grad is None:
                    raise RuntimeError(f"stage {stage_index} unit {u} of {key!r}: no gradient")
                piece.output.backward(state.grad.to(piece.output.device))
            stash.on_backward_done(piece.recording)
            state.grad = piece.inputs.grad if piece.inputs.requires_grad else None
            state.pieces[u] = None  # frees the unit's activations
        state.num_pending = group.start
        if index > 0:  # group 0 may be empty (a non-first stage with fewer layers than groups)
            return
        with self._lock:
            del self._sliced[(key, stage_index)]
            if not stage.is_first:
                if state.grad is None:
                    raise RuntimeError(f"stage {stage_index} input of {key!r} got no gradient")
                self._grads[(key, stage_index)] = state.grad

    def loss(self, samples: Sequence[Sample]) -> float:
        """Mean reference-token loss of `samples` with the current weights (no grad)."""
        packed = pack_samples(samples)
        with torch.no_grad():
            x: torch.Tensor = packed.ids
            for stage in self.staged.stages:
                x = stage.forward(x, packed.positions, packed.segments)
            return float(_loss(x, packed))


def _loss(logits: torch.Tensor, packed: _Packed) -> torch.Tensor:
    """Mean cross-entropy of the reference tokens; logits [1, N, vocab]."""
    picked = logits[0, packed.target_index.to(logits.device)]
    return F.cross_entropy(picked, packed.targets.to(logits.device))


def _stage_units(stage: Stage) -> list[_Unit]:
    units = [_Unit(range(0), embed=True)] if stage.is_first else []
    units += [_Unit(range(i, i + 1)) for i in stage.layers]
    if stage.is_last:
        units.append(_Unit(range(0), head=True))
    return units


def _unit_params(
    family: Family, stage: Stage, units: Sequence[_Unit]
) -> list[list[torch.nn.Parameter]]:
    """Each unit's parameters; a slice steps its units' ones, so none may be shared."""
    result: list[list[torch.nn.Parameter]] = []
    seen: set[int] = set()
    for unit in units:
        modules = [family.layer(i) for i in unit.layers]
        if unit.embed:
            modules += family.embed_modules()
        if unit.head:
            modules += family.head_modules()
        params = list(torch.nn.ModuleList(modules).parameters())
        if any(id(p) in seen for p in params):
            raise ValueError("stage units share a parameter (tied weights): untie them first")
        seen.update(id(p) for p in params)
        result.append(params)
    if seen != {id(p) for p in stage.parameters()}:
        raise ValueError(f"stage {stage.index}: its units do not cover its parameters")
    return result
