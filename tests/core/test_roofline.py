"""Roofline-derived profiles (lemix.roofline); expected values computed by hand."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from lemix.profile import default_profile_path, load_profile
from lemix.roofline import (
    A100_SXM4_80GB,
    LLAMA2_7B,
    LLAMA2_13B,
    Assumptions,
    StageRoofline,
    derive_profile,
    feasible_grid,
    main,
    split_stages,
    stage_params,
    summarize,
)

# Llama-2-7B by hand: per layer 4·4096² (q,k,v,o) + 3·4096·11008 (MLP) + 2·4096 (norms)
LAYER_7B = 67_108_864 + 135_266_304 + 8_192  # 202,383,360
EMBED_7B = 32_000 * 4_096  # 131,072,000 (embedding; the LM head has as many)
A100_HBM_ACHIEVED = 2.039e12 * 0.7  # bytes/s: datasheet × assumed efficiency
A100_FLOPS_ACHIEVED = 312e12 * 0.5  # FLOP/s: datasheet × assumed MFU
LAUNCH_16_LAYERS_S = 16 * 12 * 5e-6  # kernels/layer × layers × launch latency


@pytest.fixture(scope="module")
def a100_2stage():
    return derive_profile(LLAMA2_7B, A100_SXM4_80GB, 2)


def _roof(num_stages: int = 2, stage: int = 0) -> StageRoofline:
    st = split_stages(LLAMA2_7B, num_stages)[stage]
    return StageRoofline(LLAMA2_7B, st, A100_SXM4_80GB, Assumptions())


def test_llama2_7b_parameter_count() -> None:
    assert LLAMA2_7B.layer_params == LAYER_7B == 202_383_360
    total = 32 * LAYER_7B + 2 * EMBED_7B + 4_096  # + final norm
    assert LLAMA2_7B.total_params == total == 6_738_415_616
    assert LLAMA2_13B.total_params == pytest.approx(13.0e9, rel=0.01)


def test_stage_split_is_even_with_embedding_first_and_head_last() -> None:
    stages = split_stages(LLAMA2_7B, 2)
    assert [s.num_layers for s in stages] == [16, 16]
    assert [(s.has_embedding, s.has_lm_head) for s in stages] == [(True, False), (False, True)]
    assert [s.num_layers for s in split_stages(LLAMA2_13B, 3)] == [14, 13, 13]
    for bad in (0, 33):
        with pytest.raises(ValueError):
            split_stages(LLAMA2_7B, bad)


def test_stage_params_sum_to_llama2_7b(a100_2stage) -> None:
    per_stage = a100_2stage.model["stage_params"]
    assert per_stage == [16 * LAYER_7B + EMBED_7B, 16 * LAYER_7B + EMBED_7B + 4_096]
    assert sum(per_stage) == pytest.approx(6.74e9, rel=0.01)
    four = [stage_params(LLAMA2_7B, s) for s in split_stages(LLAMA2_7B, 4)]
    assert sum(four) == LLAMA2_7B.total_params


def test_memory_figures_by_hand(a100_2stage) -> None:
    mem = a100_2stage.memory
    assert mem.kv_bytes_per_token == (2 * 16 * 32 * 128 * 2,) * 2 == (262_144, 262_144)
    assert mem.weight_bytes == (
        2 * (16 * LAYER_7B + EMBED_7B),
        2 * (16 * LAYER_7B + EMBED_7B + 4096),
    )
    assert mem.training_state_bytes[0] == 14 * (16 * LAYER_7B + EMBED_7B)  # 2 + 4 + 4 + 4
    # Korthikanti et al.: 34·h per token per layer; fp32 logits 4·v on the last stage
    assert mem.activation_bytes_per_token == (34 * 4096 * 16, 34 * 4096 * 16 + 4 * 32_000)
    assert mem.capacity_bytes == 81_920 * 2**20
    assert mem.host_capacity_bytes == 256 * 2**30
    four = derive_profile(LLAMA2_7B, A100_SXM4_80GB, 4).memory
    assert four.kv_bytes_per_token == (131_072,) * 4


def test_transfer_and_optimizer_by_hand(a100_2stage) -> None:
    assert a100_2stage.transfer.host_link_bytes_s == pytest.approx(31.5e9 * 0.8)  # ~25 GB/s
    assert a100_2stage.transfer.weight_sync_bytes_s == pytest.approx(12.5e9)  # 100 Gb/s
    adamw_bytes = 28 * (16 * LAYER_7B + EMBED_7B)
    assert a100_2stage.optimizer_step_s[0] == pytest.approx(adamw_bytes / A100_HBM_ACHIEVED)
    assert a100_2stage.optimizer_step_s[0] == pytest.approx(0.06610, rel=1e-3)


def test_roofline_times_by_hand() -> None:
    roof = _roof()
    weight_read_s = 2 * 16 * LAYER_7B / A100_HBM_ACHIEVED  # embedding is not streamed
    # decode, batch 1, empty context: memory-bound, 4.54 ms + 0.96 ms launches
    assert roof.decode_step_s(1, 0) == pytest.approx(weight_read_s + LAUNCH_16_LAYERS_S)
    assert roof.decode_step_s(1, 0) == pytest.approx(5.4974e-3, rel=1e-4)
    # with 1,000 tokens of KV: + 1000·262,144 B read
    assert roof.decode_step_s(1, 1000) - roof.decode_step_s(1, 0) == pytest.approx(
        1000 * 262_144 / A100_HBM_ACHIEVED
    )
    # forward, 1×1024: compute-bound; 2·P·T + 4·layers·h·ℓ² FLOPs
    flops = 2 * 16 * LAYER_7B * 1024 + 4 * 16 * 4096 * 1024**2
    assert flops == 6_906_575_847_424
    assert roof.forward_s(1, 1024) == pytest.approx(
        flops / A100_FLOPS_ACHIEVED + LAUNCH_16_LAYERS_S
    )
    # backward: twice the FLOPs and twice the launches
    assert roof.backward_s(2, 512) == pytest.approx(2 * roof.forward_s(2, 512))


def test_forward_is_monotone_in_batch_and_length(a100_2stage) -> None:
    roof = _roof()
    for stage in range(2):
        for c in (1, 2, 4, 8):
            lens = [16, 64, 256, 1024, 2048, 4096]
            roofs = [roof.forward_s(c, n) for n in lens]
            fitted = [a100_2stage.ours.forward_s(stage, c, n) for n in lens]
            assert roofs == sorted(roofs) and fitted == sorted(fitted)
            assert fitted[-1] > fitted[0]
        for n in (128, 1024):
            by_c = [a100_2stage.ours.forward_s(stage, c, n) for c in (1, 2, 4, 8, 16)]
            assert all(b > a for a, b in zip(by_c, by_c[1:], strict=False))
            assert roof.forward_s(16, n) > roof.forward_s(1, n)


def test_decode_step_grows_with_context(a100_2stage) -> None:
    roof = _roof()
    contexts = [0, 1_000, 10_000, 50_000]
    steps = [roof.decode_step_s(8, ctx) for ctx in contexts]
    assert all(b > a for a, b in zip(steps, steps[1:], strict=False))
    fitted = [a100_2stage.ours.decode_step_s(1, 8, ctx) for ctx in contexts]
    assert all(b > a for a, b in zip(fitted, fitted[1:], strict=False))
    # the fit on a memory-bound roofline is exact: d2 = KV bytes / achieved bandwidth
    assert a100_2stage.ours.decode[0].d2 == pytest.approx(262_144 / A100_HBM_ACHIEVED, rel=1e-6)


def test_sanity_orders_of_magnitude(a100_2stage) -> None:
    figures = summarize(a100_2stage)
    assert 0.02 < figures["prefill_1020_s"] < 0.15  # tens of ms to ~100 ms
    assert 0.008 < figures["decode_step_c1_ctx1149_s"] < 0.02  # 10-20 ms over the pipeline
    assert 0.05 < figures["train_1x512_fwd_bwd_s"] < 0.3  # ~100 ms
    # KV room: (0.9·80 GiB − 16 B/param · 3.37e9 params) / 262,144 B per token
    assert figures["kv_capacity_tokens_per_node"] == 89_271


def test_fit_quality_is_recorded_and_ours_beats_paper(a100_2stage) -> None:
    quality = a100_2stage.fit_quality
    assert quality["holdout_fraction"] == 0.25 and quality["seed"] == 0
    for phase in ("forward", "backward", "decode"):
        for stage in range(2):
            paper, ours = quality[phase]["paper"][stage], quality[phase]["ours"][stage]
            assert ours["num_holdout_points"] > 0
            assert ours["r2"] > 0.99 > paper["r2"]
            assert ours["mape"] < 0.1 < paper["mape"]
    assert quality["decode"]["ours"][0]["mape"] < 1e-6


def test_grid_keeps_only_what_fits() -> None:
    assert feasible_grid((1, 2), (10, 20), bytes_per_token=10, free_bytes=200) == [
        (1, 10),
        (1, 20),
        (2, 10),
    ]


def test_too_few_stages_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="use more stages"):
        derive_profile(LLAMA2_13B, A100_SXM4_80GB, 2)  # 6.5e9 params × 16 B > 80 GiB


def _assert_close(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_close(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15), where
    else:
        assert a == b, where


@pytest.mark.parametrize(
    ("preset", "num_stages"),
    [
        ("a100-llama2-7b", 2),
        ("a100-llama2-7b", 4),
        ("h100-llama2-7b", 2),
        ("a100-40gb-llama2-7b", 4),
    ],
)
def test_shipped_profiles_match_the_generator(preset: str, num_stages: int, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    assert main(["--preset", preset, "--stages", str(num_stages), "--out", str(out)]) == 0
    shipped = default_profile_path().parent / f"{preset}-{num_stages}stage.json"
    _assert_close(load_profile(out).to_json_dict(), load_profile(shipped).to_json_dict())


def test_cli_refuses_a_profile_that_cannot_fit(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    assert main(["--preset", "a100-llama2-13b", "--stages", "2", "--out", str(out)]) == 2
    assert not out.exists()


# ------------------------------------------------------------------ prefill chunks


def test_chunk_without_past_is_a_forward_and_the_past_costs_more() -> None:
    roof = _roof()
    for n in (16, 512, 2048):
        assert roof.chunk_forward_s(n, 0) == roof.forward_s(1, n)
        assert roof.chunk_forward_s(n, 1024) > roof.chunk_forward_s(n, 0)


def test_compute_bound_chunks_conserve_the_prompts_work() -> None:
    """At 2,048 + 2,048 tokens the stage is compute-bound: a chunk costs what
    the long prompt costs beyond the short one, plus one more pass's launches."""
    roof = _roof()
    launches_s = Assumptions().kernel_launch_s * Assumptions().kernels_per_layer * 16
    expected = roof.forward_s(1, 4096) - roof.forward_s(1, 2048) + launches_s
    assert roof.chunk_forward_s(2048, 2048) == pytest.approx(expected, rel=1e-12)


def test_memory_bound_chunks_pay_the_past_kv_read() -> None:
    roof = _roof()
    # 16 new tokens: weight + KV read bound. KV: 2·16 layers·4096·2 B = 262,144 B/token.
    extra_s = roof.chunk_forward_s(16, 3072) - roof.chunk_forward_s(16, 0)
    assert extra_s == pytest.approx(262_144 * 3072 / A100_HBM_ACHIEVED, rel=1e-9)


def test_shipped_profiles_fit_the_chunk_roofline(a100_2stage) -> None:
    chunk = a100_2stage.fit_quality["chunk"]
    assert set(chunk) == {"paper", "ours", "derived"}
    for stage in range(a100_2stage.num_stages):
        assert chunk["ours"][stage]["r2"] > 0.95
        assert chunk["ours"][stage]["mape"] < chunk["paper"][stage]["mape"]
    assert len(a100_2stage.ours.chunk) == 2
