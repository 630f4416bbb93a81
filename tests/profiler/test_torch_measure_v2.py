"""Engine v2 shapes measured on a real torch stage (services.executor.torch_measure):
prefill chunks after a cached past, and a training pass run as layer-group slices."""

from __future__ import annotations

import pytest
import torch

from lemix.model.presets import ModelSpec, build_model
from lemix.model.staged import StagedModel
from services.executor.torch_measure import (
    _MEASURE_KEY,
    _inputs,
    _packed,
    layer_groups,
    measure_chunk,
    measure_training_slices,
    sliced_training_pass,
)


@pytest.fixture(scope="module")
def staged() -> StagedModel:
    # small-llama: 8 layers, 4 per stage, so a stage can run as 2 or 4 slices.
    return StagedModel(build_model(ModelSpec("small-llama", vocab_size=512, seed=3)), 2)


def test_layer_groups_are_contiguous_and_cover_the_stage() -> None:
    assert layer_groups(range(4, 8), 2) == [range(4, 6), range(6, 8)]
    assert layer_groups(range(0, 5), 3) == [range(0, 2), range(2, 4), range(4, 5)]
    with pytest.raises(ValueError):
        layer_groups(range(0, 2), 3)


@pytest.mark.parametrize("stage_index", [0, 1])
def test_a_sliced_pass_computes_what_the_stage_computes(
    staged: StagedModel, stage_index: int
) -> None:
    """Same output as `Stage.forward`, and the same weight gradients whether
    the pass runs whole or as 4 slices: the timing compares like with like."""
    stage = staged.stages[stage_index]
    x = _inputs(stage, 2 * 8, torch.Generator().manual_seed(0))
    positions, segments = _packed(2, 8)
    with torch.no_grad():
        expected = stage.forward(x, positions, segments)
    grads = []
    for k in (1, 4):
        stage.modules.zero_grad(set_to_none=True)
        inputs = x.detach().clone() if x.is_floating_point() else x
        sliced = sliced_training_pass(staged, stage_index, inputs, 2, 8, k)
        for run in (*sliced.forwards, *sliced.backwards):
            run()
        torch.testing.assert_close(sliced.group_outputs[-1].detach(), expected)
        grads.append([p.grad.clone() for p in stage.parameters() if p.grad is not None])
    stage.modules.zero_grad(set_to_none=True)
    assert len(grads[0]) == len(grads[1]) == len(stage.parameters())
    for whole, sliced_grad in zip(*grads, strict=True):
        torch.testing.assert_close(whole, sliced_grad, rtol=1e-4, atol=1e-6)


def test_measure_chunk_times_a_chunk_after_a_cached_past(staged: StagedModel) -> None:
    stage = staged.stages[1]
    samples = measure_chunk(staged, 1, 16, 64, 3)
    assert len(samples) == 3 and all(s > 0 for s in samples)
    assert len(measure_chunk(staged, 0, 16, 0, 1)) == 1  # a first chunk: no past
    assert not stage.kv.has(f"{_MEASURE_KEY}chunk")  # its KV is freed


def test_measure_training_slices_reports_whole_and_sliced(staged: StagedModel) -> None:
    timing = measure_training_slices(staged, 0, 1, 8, 4, 1)
    assert timing.num_slices == 4
    assert timing.forward_whole_s > 0 and timing.forward_sliced_s > 0
    assert timing.backward_whole_s > 0 and timing.backward_sliced_s > 0
    assert timing.forward_overhead_s == pytest.approx(
        (timing.forward_sliced_s - timing.forward_whole_s) / 3
    )
    with pytest.raises(ValueError):
        measure_training_slices(staged, 0, 1, 8, 1, 1)
