"""The inference fast paths compute exactly what the plain paths do.

`LlamaFamily` runs CPU inference through fused [q; k; v] and [gate; up]
matmuls (`_layer_forward_fused`), and decode attention reads caches spaced
at one stride as a view of the pool instead of gathering them
(`lemix.model.attention._uniform_stride`). Both must give bit-identical
values, and the fused weights must follow training updates.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lemix.model.attention as attention
from lemix.model.presets import ModelSpec, build_model
from lemix.model.staged import Segment, StagedModel

VOCAB = 300


def _staged(num_stages: int = 1) -> StagedModel:
    return StagedModel(build_model(ModelSpec("tiny-llama", vocab_size=VOCAB, seed=3)), num_stages)


def _run(staged: StagedModel, ids: list[int], *, inference: bool) -> torch.Tensor:
    """Logits [1, N, vocab] of one cache-less sequence; inference mode or grad mode."""
    segments = [Segment(0, len(ids))]
    x: torch.Tensor = torch.tensor(ids)
    with torch.inference_mode(inference):
        for stage in staged.stages:
            x = stage.forward(x, torch.arange(len(ids)), segments)
    return x.detach().clone()


@pytest.mark.parametrize("num_tokens", [1, 3, 4, 8, 33, 300])
def test_fused_inference_is_bit_identical_to_the_module_path(num_tokens: int) -> None:
    staged = _staged(2)
    ids = [(7 * i) % (VOCAB - 3) + 3 for i in range(num_tokens)]
    fused = _run(staged, ids, inference=True)
    plain = _run(staged, ids, inference=False)  # grad enabled: HF's modules, unfused
    assert getattr(staged.family, "_fused", None)  # the fused path ran
    assert torch.equal(fused, plain)


def test_fused_weights_follow_in_place_updates_and_replaced_storage() -> None:
    staged = _staged()
    ids = [5, 9, 11, 40, 2]
    before = _run(staged, ids, inference=True)
    layer: Any = staged.family.layer(1)  # an HF LlamaDecoderLayer
    with torch.no_grad():  # as an optimizer step: in place, a new _version
        layer.self_attn.k_proj.weight.mul_(1.5)
        layer.mlp.up_proj.weight.add_(0.01)
    after = _run(staged, ids, inference=True)
    assert not torch.equal(after, before)
    assert torch.equal(after, _run(staged, ids, inference=False))
    # A new storage (`.data =`, a load) is noticed too.
    layer.self_attn.v_proj.weight.data = layer.self_attn.v_proj.weight.data * 0.5
    assert torch.equal(_run(staged, ids, inference=True), _run(staged, ids, inference=False))


PROMPTS = {"a": [3, 4, 5], "b": [6, 7, 8, 9, 10, 11, 12], "c": [13, 14, 15, 16, 17]}


def _decode_logits(
    monkeypatch: pytest.MonkeyPatch,
    *,
    gather: bool,
    prompts: dict[str, list[int]] = PROMPTS,
) -> list[torch.Tensor]:
    """Three requests of one capacity (so their caches are evenly spaced),
    prefilled, then decoded together for three steps."""
    if gather:
        monkeypatch.setattr(attention, "_uniform_stride", lambda *args: None)
    staged = _staged(2)
    for stage in staged.stages:
        for key in prompts:
            stage.kv.allocate(key, 12)
    outputs = []
    with torch.inference_mode():
        steps = [[(k, p, 0) for k, p in prompts.items()]]
        steps += [[(k, [20 + s], len(p) + s) for k, p in prompts.items()] for s in range(3)]
        for chunks in steps:
            ids: list[int] = []
            positions: list[int] = []
            segments = []
            for key, new_ids, first in chunks:
                segments.append(Segment(len(ids), len(ids) + len(new_ids), key, len(new_ids)))
                ids.extend(new_ids)
                positions.extend(range(first, first + len(new_ids)))
            x: torch.Tensor = torch.tensor(ids)
            for stage in staged.stages:
                x = stage.forward(x, torch.tensor(positions), segments)
            outputs.append(x.clone())
    return outputs


def test_strided_decode_reads_equal_the_gathered_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    strides: list[int | None] = []
    real = attention._uniform_stride

    def spy(bases: list[int], max_len: int, num_slots: int) -> int | None:
        strides.append(real(bases, max_len, num_slots))
        return strides[-1]

    monkeypatch.setattr(attention, "_uniform_stride", spy)
    strided = _decode_logits(monkeypatch, gather=False)
    assert strides and all(s == 12 for s in strides)  # every decode step read a view
    gathered = _decode_logits(monkeypatch, gather=True)
    for got, want in zip(strided, gathered, strict=True):
        assert torch.equal(got, want)


def test_uniform_stride_only_for_evenly_spaced_caches_inside_the_pool() -> None:
    assert attention._uniform_stride([0, 12, 24], 5, 36) == 12
    assert attention._uniform_stride([7], 5, 12) == 5  # one cache: its own window
    assert attention._uniform_stride([0, 12, 30], 5, 48) is None  # uneven
    assert attention._uniform_stride([24, 12, 0], 5, 36) is None  # descending
    assert attention._uniform_stride([0, 12, 24], 13, 36) is None  # last window past the pool


def test_decodes_of_one_length_skip_the_mask_bit_identically(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts = {key: [3 + i, 9 + i, 20 + i, 4 + i] for i, key in enumerate("abc")}
    maskless = _decode_logits(monkeypatch, gather=False, prompts=prompts)
    sdpa = attention.F.scaled_dot_product_attention
    num_maskless: list[int] = []

    def with_zero_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
        if kw.get("attn_mask") is None and not kw.get("is_causal"):
            num_maskless.append(1)  # a decode group's call: give it the all-zero mask
            kw["attn_mask"] = q.new_zeros(q.shape[0], 1, 1, k.shape[2])
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", with_zero_mask)
    masked = _decode_logits(monkeypatch, gather=False, prompts=prompts)
    assert len(num_maskless) == 3 * 4  # 3 steps x 2 stages x 2 layers of tiny-llama
    for got, want in zip(maskless, masked, strict=True):
        assert torch.equal(got, want)
