"""Measuring a real stage for the profiler: forward, backward, decode latency and memory.

Inputs are random token ids (stage 0) or random hidden states (later stages)
of the requested shape, packed as `batch_size` sequences of `num_tokens`
each, exactly as the runner packs a prefill. Timing brackets the work with
``torch.cuda.synchronize`` on a GPU. Memory: on a GPU the allocator's peak
over the run; on a CPU the stage's weights plus what the work holds — for
forward/backward the bytes autograd saves for the backward (the activation
memory a training task keeps between its forward and backward), for decode the
KV cache bytes. Each call runs one warm-up that is not reported.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lemix.model.staged import Segment, Stage, StagedModel
from services.executor.convert import MeasurePhase, MeasureResult, MeasureSpec

_MEASURE_KEY = "__measure__"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(stage: Stage, num_tokens: int, generator: torch.Generator) -> torch.Tensor:
    vocab = stage.family.vocab_size
    if stage.is_first:
        return torch.randint(0, vocab, (num_tokens,), generator=generator)
    hidden = torch.randn((1, num_tokens, stage.family.hidden_size), generator=generator)
    return hidden.to(stage.device, next(stage.modules.parameters()).dtype)


def _packed(batch_size: int, num_tokens: int) -> tuple[torch.Tensor, list[Segment]]:
    positions = torch.arange(num_tokens).repeat(batch_size)
    segments = [Segment(i * num_tokens, (i + 1) * num_tokens) for i in range(batch_size)]
    return positions, segments


def _saved_bytes(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Run `fn` with grad; return its output and the bytes autograd saved."""
    total = 0
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if (
            isinstance(t, torch.nn.Parameter)
            or t._base is not None
            and isinstance(t._base, torch.nn.Parameter)
        ):
            return t  # weights are static memory, counted apart
        # By base address, without wrapping the storage in a Python object
        # from inside a hook (see lemix.model.stash).
        ptr = int(t.data_ptr() - t.storage_offset() * t.element_size())
        if ptr not in seen:
            seen.add(ptr)
            total += t.numel() * t.element_size()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def measure_stage(staged: StagedModel, spec: MeasureSpec) -> MeasureResult:
    """`spec.num_repeats` timings of one phase on one stage."""
    stage = staged.stages[spec.stage]
    device = stage.device
    weight_bytes = staged.weight_bytes()[spec.stage]
    generator = torch.Generator().manual_seed(spec.stage * 7919 + spec.num_tokens)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if spec.phase is MeasurePhase.DECODE:
        samples, dynamic = _measure_decode(stage, spec, generator)
    else:
        samples, dynamic = _measure_pass(stage, spec, generator)
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
    else:
        peak = weight_bytes + dynamic
    return MeasureResult(tuple(samples), peak)


def _measure_pass(
    stage: Stage, spec: MeasureSpec, generator: torch.Generator
) -> tuple[list[float], int]:
    positions, segments = _packed(spec.batch_size, spec.num_tokens)
    is_backward = spec.phase is MeasurePhase.BACKWARD
    samples: list[float] = []
    saved = 0
    for i in range(spec.num_repeats + 1):  # the first run warms up
        x = _inputs(stage, spec.batch_size * spec.num_tokens, generator)

        def run(x: torch.Tensor = x) -> torch.Tensor:
            return stage.forward(x, positions, segments)

        if x.is_floating_point():
            x.requires_grad_(is_backward)
        if is_backward:
            out, saved = _saved_bytes(run)
            grad = torch.randn(out.shape, generator=generator).to(out.device, out.dtype)
            _sync(stage.device)
            t0 = time.perf_counter()
            out.backward(grad)
            _sync(stage.device)
            elapsed = time.perf_counter() - t0
            stage.modules.zero_grad(set_to_none=True)
        else:
            _sync(stage.device)
            t0 = time.perf_counter()
            with torch.no_grad():
                stage.forward(x, positions, segments)
            _sync(stage.device)
            elapsed = time.perf_counter() - t0
            if i == 0:
                _, saved = _saved_bytes(run)
        if i > 0:
            samples.append(elapsed)
    return samples, saved


def _measure_decode(
    stage: Stage, spec: MeasureSpec, generator: torch.Generator
) -> tuple[list[float], int]:
    """One decode step of `batch_size` requests holding `sum_context_tokens` in KV."""
    context = max(1, spec.sum_context_tokens // max(spec.batch_size, 1))
    keys = [f"{_MEASURE_KEY}{i}" for i in range(spec.batch_size)]
    for key in keys:
        entry = stage.kv.allocate(key, context + spec.num_repeats + 2)
        for t in (*entry.keys, *entry.values):
            t.normal_(generator=None)
        entry.length = context
    try:
        positions = torch.full((spec.batch_size,), context)
        segments = [Segment(i, i + 1, key, 1) for i, key in enumerate(keys)]
        samples: list[float] = []
        for i in range(spec.num_repeats + 1):
            x = _inputs(stage, spec.batch_size, generator)
            _sync(stage.device)
            t0 = time.perf_counter()
            with torch.no_grad():
                stage.forward(x, positions, segments)
            _sync(stage.device)
            if i > 0:
                samples.append(time.perf_counter() - t0)
            positions = positions + 1
        kv_bytes = stage.kv.bytes_per_token() * spec.sum_context_tokens
        return samples, kv_bytes
    finally:
        for key in keys:
            stage.kv.free(key)


# ------------------------------------------------------------ engine v2 shapes
# Not phases of the Measure RPC (its proto is unchanged): scripts/profile_torch.py
# calls these in process, on the executor's own loaded model, after the RPC grid.


def measure_chunk(
    staged: StagedModel,
    stage_index: int,
    num_new_tokens: int,
    num_past_tokens: int,
    num_repeats: int,
) -> list[float]:
    """`num_repeats` timings (s) of one prefill chunk: n new tokens of one
    sequence appended to a KV cache already holding p tokens (random K/V), the
    path the executor runs for a later chunk of a chunked prefill. p = 0 is a
    first chunk (a plain prompt). One warm-up run is not reported."""
    stage = staged.stages[stage_index]
    generator = torch.Generator().manual_seed(stage_index * 7919 + num_new_tokens)
    key = f"{_MEASURE_KEY}chunk"
    entry = stage.kv.allocate(key, num_past_tokens + num_new_tokens)
    try:
        for t in (*entry.keys, *entry.values):
            t.normal_(generator=None)
        positions = torch.arange(num_past_tokens, num_past_tokens + num_new_tokens)
        segments = [Segment(0, num_new_tokens, key, num_new_tokens)]
        samples: list[float] = []
        for i in range(num_repeats + 1):
            entry.length = num_past_tokens  # the chunk appends; reset it each run
            x = _inputs(stage, num_new_tokens, generator)
            _sync(stage.device)
            t0 = time.perf_counter()
            with torch.no_grad():
                stage.forward(x, positions, segments)
            _sync(stage.device)
            if i > 0:
                samples.append(time.perf_counter() - t0)
        return samples
    finally:
        stage.kv.free(key)


@dataclass(frozen=True)
class SliceTiming:
    """Times (s, aggregated over repeats) of one stage's training pass run whole and as `num_slices`
    layer groups, one after another (what an engine training slice runs)."""

    num_slices: int
    forward_whole_s: float
    forward_sliced_s: float  # sum over the slices
    backward_whole_s: float
    backward_sliced_s: float

    @property
    def forward_overhead_s(self) -> float:
        """Extra time per extra slice: (sliced − whole) / (k − 1)."""
        return (self.forward_sliced_s - self.forward_whole_s) / (self.num_slices - 1)

    @property
    def backward_overhead_s(self) -> float:
        return (self.backward_sliced_s - self.backward_whole_s) / (self.num_slices - 1)


@dataclass(frozen=True)
class SlicedPass:
    """One training pass as slices: run every forward, then every backward, in order."""

    forwards: list[Callable[[], None]]
    backwards: list[Callable[[], None]]
    group_outputs: list[torch.Tensor]  # filled as the forwards run; [-1] is the stage's output


def layer_groups(layers: range, num_groups: int) -> list[range]:
    """`layers` as `num_groups` contiguous groups, earlier groups the larger."""
    if not 1 <= num_groups <= len(layers):
        raise ValueError(f"num_groups must be in [1, {len(layers)}], got {num_groups}")
    base, extra = divmod(len(layers), num_groups)
    groups, start = [], layers.start
    for g in range(num_groups):
        size = base + (1 if g < extra else 0)
        groups.append(range(start, start + size))
        start += size
    return groups


def sliced_training_pass(
    staged: StagedModel,
    stage_index: int,
    inputs: torch.Tensor,
    batch_size: int,
    num_tokens: int,
    num_slices: int,
) -> SlicedPass:
    """The forward and backward of one training pass of a stage as `num_slices`
    runs each: a layer group's forward (the embedding with the first, the head
    with the last) on the detached output of the group before it, and its
    backward on the gradient the group after it handed back (the last group's
    output gradient is all ones). `num_slices` = 1 is the whole pass."""
    stage = staged.stages[stage_index]
    positions, segments = _packed(batch_size, num_tokens)
    groups = layer_groups(stage.layers, num_slices)
    group_in: list[torch.Tensor] = []
    group_out: list[torch.Tensor] = []

    def forward(g: int) -> None:
        x = inputs if g == 0 else group_out[g - 1].detach().requires_grad_(True)
        if x.is_floating_point() and not x.requires_grad:
            x.requires_grad_(True)
        group_in.append(x)
        with torch.enable_grad():
            # The stage's own code for a layer group (what sliced training runs).
            h = stage.forward_part(
                x,
                positions,
                segments,
                groups[g],
                embed=g == 0 and stage.is_first,
                head=g == num_slices - 1 and stage.is_last,
            )
        group_out.append(h)

    def backward(g: int) -> None:
        out = group_out[g]
        grad = torch.ones_like(out) if g == num_slices - 1 else group_in[g + 1].grad
        assert grad is not None  # the group after it ran its backward first
        out.backward(grad)

    return SlicedPass(
        forwards=[functools.partial(forward, g) for g in range(num_slices)],
        backwards=[functools.partial(backward, g) for g in reversed(range(num_slices))],
        group_outputs=group_out,
    )


def measure_training_slices(
    staged: StagedModel,
    stage_index: int,
    batch_size: int,
    num_tokens: int,
    num_slices: int,
    num_repeats: int,
    aggregate: Callable[[Sequence[float]], float] = statistics.median,
) -> SliceTiming:
    """Time one stage's training forward and backward whole and as `num_slices`
    layer groups (same code, one group vs k), `aggregate` (median; min on a
    shared machine) of `num_repeats` runs after a warm-up. The difference per
    extra slice is the slice's fixed overhead."""
    if num_slices < 2:
        raise ValueError("measure at least 2 slices (1 is the whole pass)")
    stage = staged.stages[stage_index]
    generator = torch.Generator().manual_seed(stage_index * 7919 + num_tokens)
    timings: dict[int, tuple[list[float], list[float]]] = {1: ([], []), num_slices: ([], [])}
    for i in range(num_repeats + 1):
        for k in (1, num_slices):
            x = _inputs(stage, batch_size * num_tokens, generator)
            sliced = sliced_training_pass(staged, stage_index, x, batch_size, num_tokens, k)
            for runs, samples in (
                (sliced.forwards, timings[k][0]),
                (sliced.backwards, timings[k][1]),
            ):
                _sync(stage.device)
                t0 = time.perf_counter()
                for run in runs:
                    run()
                _sync(stage.device)
                if i > 0:
                    samples.append(time.perf_counter() - t0)
            stage.modules.zero_grad(set_to_none=True)
    (fw1, bw1), (fwk, bwk) = timings[1], timings[num_slices]
    return SliceTiming(num_slices, aggregate(fw1), aggregate(fwk), aggregate(bw1), aggregate(bwk))
