"""The staged model on a CUDA GPU computes what the unsplit HF model computes there.

The CPU checks of `test_staged.py`, on `cuda:0`: prefill logits, KV-cached
decode and pipeline-backward gradients against the unsplit model on the same
GPU. Two stages run on cuda:0 and cuda:1 when there are two GPUs, else both on
cuda:0 (the one-GPU node `scripts/gpu_check.sh` profiles). float32 checks
disable TF32 so the tolerances can stay near the CPU ones (GPU kernels still
reduce in another order than the HF path, hence 1e-4 rather than 1e-5); one
bfloat16 check uses bf16-sized tolerances.

This module is skipped without a GPU (the one GPU-only skip in the suite);
`scripts/gpu_check.sh` runs it on the device machine.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from lemix.model.presets import ModelSpec, build_model
from lemix.model.staged import Segment, StagedModel
from lemix.model.training import PipelineTrainer, Sample, TrainingConfig

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it)"
)

FAMILIES = ["tiny-llama", "tiny-gpt2"]
VOCAB = 300


@pytest.fixture(autouse=True)
def _no_tf32() -> Iterator[None]:
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _devices(num_stages: int) -> list[str]:
    count = torch.cuda.device_count()
    return [f"cuda:{s % count}" if count >= num_stages else "cuda:0" for s in range(num_stages)]


def _model(name: str, dtype: str = "float32", seed: int = 1) -> torch.nn.Module:
    return build_model(ModelSpec(name, vocab_size=VOCAB, seed=seed, dtype=dtype))


def _ids(n: int, offset: int = 5) -> list[int]:
    return [(offset + 7 * i) % VOCAB for i in range(n)]


def _reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    model = model.to("cuda:0")
    with torch.no_grad():
        return model(torch.tensor([ids], device="cuda:0")).logits[0].float().cpu()


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("num_stages", [1, 2])
def test_prefill_logits_equal_unsplit_on_cuda(name: str, num_stages: int) -> None:
    model = _model(name)
    expected = _reference_logits(copy.deepcopy(model), _ids(37))
    staged = StagedModel(model, num_stages, _devices(num_stages))
    assert all(stage.device.type == "cuda" for stage in staged.stages)
    torch.testing.assert_close(staged.logits(_ids(37)), expected, rtol=1e-4, atol=1e-4)


def test_prefill_logits_close_to_unsplit_in_bf16() -> None:
    model = _model("tiny-llama", dtype="bfloat16")
    ids = _ids(37)
    expected = _reference_logits(copy.deepcopy(model), ids)
    got = StagedModel(model, 2, _devices(2)).logits(ids)
    # bf16 has an 8-bit mantissa: a few ulps of the logits' scale, not 1e-5.
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"greedy tokens agree at only {agree:.0%} of positions"


@pytest.mark.parametrize("name", FAMILIES)
def test_kv_cached_decode_equals_unsplit_on_cuda(name: str) -> None:
    model = _model(name)
    ids = _ids(30)
    expected = _reference_logits(copy.deepcopy(model), ids)
    staged = StagedModel(model, 2, _devices(2))
    for stage in staged.stages:
        stage.kv.allocate("r", len(ids))
    rows = []
    with torch.no_grad():
        x: torch.Tensor = torch.tensor(ids[:12])
        for stage in staged.stages:
            x = stage.forward(x, torch.arange(12), [Segment(0, 12, "r", 12)])
        rows.append(x[0].cpu())
        for t in range(12, len(ids)):
            x = torch.tensor([ids[t]])
            for stage in staged.stages:
                x = stage.forward(x.to(stage.device), torch.tensor([t]), [Segment(0, 1, "r", 1)])
            rows.append(x[0].cpu())
    torch.testing.assert_close(torch.cat(rows), expected, rtol=1e-4, atol=1e-4)
    assert all(stage.kv.get("r").length == len(ids) for stage in staged.stages)
    assert all(stage.kv.get("r").keys[0].is_cuda for stage in staged.stages)


def test_packed_ragged_batch_equals_each_alone_on_cuda() -> None:
    staged = StagedModel(_model("tiny-llama"), 2, _devices(2))
    a, b = _ids(9), _ids(21, offset=11)
    alone = [staged.logits(a), staged.logits(b)]
    with torch.no_grad():
        x: torch.Tensor = torch.tensor(a + b)
        positions = torch.tensor(list(range(9)) + list(range(21)))
        for stage in staged.stages:
            x = stage.forward(x.to(stage.device), positions, [Segment(0, 9), Segment(9, 30)])
    x = x.cpu()
    torch.testing.assert_close(x[0, :9], alone[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x[0, 9:], alone[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_staged_backward_gradients_equal_monolithic_on_cuda(name: str) -> None:
    model = _model(name)
    mono = copy.deepcopy(model).to("cuda:0")
    ids = _ids(24)
    num_ref = 8
    logits = mono(torch.tensor([ids], device="cuda:0")).logits[0]
    target = torch.tensor(ids[-num_ref:], device="cuda:0")
    F.cross_entropy(logits[-num_ref - 1 : -1], target).backward()
    expected = {name_: p.grad.cpu() for name_, p in mono.named_parameters()}

    staged = StagedModel(model, 2, _devices(2))
    trainer = PipelineTrainer(staged, TrainingConfig(max_grad_norm=0))
    names = {id(p): n for n, p in model.named_parameters()}
    trainer.forward(0, "t", [Sample(tuple(ids), num_ref)])
    trainer.forward(1, "t")
    trainer.backward(1, "t")
    trainer.backward(0, "t")
    captured: dict[str, torch.Tensor] = {}
    for stage in staged.stages:  # the gradients wait there until the optimizer steps
        for p in stage.parameters():
            assert p.grad is not None and p.grad.is_cuda
            captured[names[id(p)]] = p.grad.cpu()
    assert set(captured) == set(expected)
    for key, grad in expected.items():
        torch.testing.assert_close(captured[key], grad, rtol=1e-3, atol=1e-5, msg=key)
