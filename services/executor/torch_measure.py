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

import time
from collections.abc import Callable

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
