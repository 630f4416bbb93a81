"""Derive a `Profile` from a transformer's shapes and public hardware figures.

No GPU is measured here. A roofline (Williams et al., CACM 2009) says a kernel
takes the longer of its compute time and its memory time. We apply it to one
pipeline stage of a Llama-style decoder and then treat the roofline's values on
a (C, ℓ) grid as synthetic measurements, fitting both latency models of
`lemix.latency` to them exactly as the profiler fits real ones. The held-out
R²/MAPE in `Profile.fit_quality` therefore says how well each model's *form*
can follow a roofline, not how well it follows a real GPU.

Counting conventions (choices, stated once):
- FLOPs of a matmul over T tokens with P weights: 2·P·T. The embedding table is
  a lookup (no FLOPs, only C·ℓ rows read); the LM head is a matmul.
- Attention FLOPs per layer: 2·C·ℓ²·d for QKᵀ plus 2·C·ℓ²·d for AV, d = heads ×
  head_dim. We count the full square, as MFU accounting does (PaLM, Chowdhery
  et al. 2022, app. B); a causal kernel skips about half, but also runs below
  GEMM efficiency, and the term is ≤ 5% of the total at ℓ = 1,024 for 7B.
- Backward = 2 × forward FLOPs (input- and weight-gradient GEMMs; no
  recomputation). Its memory floor reads the weights and writes the gradients.
- Prefill and training forwards are one "forward" (logits for every token).
- A prefill chunk of n tokens after p cached ones is a forward of n tokens plus
  2·n·p attention pairs over the past (the full-square convention applied to
  the new-past block; see `StageRoofline.chunk_forward_s`) and a read of the
  past's KV.
- Activation hand-off between stages (C·ℓ·h·2 bytes over NVLink) is ignored.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from lemix.latency import ChunkPoint, DecodePoint, PhasePoint
from lemix.latency_fit import (
    StageFit,
    fit_quality_summary,
    fit_stage_points,
    latency_models,
)
from lemix.memory import MemoryConfig, NodeMemory
from lemix.profile import MemoryProfile, Profile, TransferProfile, save_profile

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class ModelShape:
    """Decoder shapes as in a Hugging Face `config.json` (Llama: no biases, untied head)."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    dtype_bytes: int = 2  # bf16

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv  # q, o: h×h; k, v: h×kv (GQA-aware)
        mlp = 3 * h * self.intermediate_size  # gate, up, down (SwiGLU)
        return attention + mlp + 2 * h  # + two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size  # also the LM head's size

    @property
    def total_params(self) -> int:
        head = self.embedding_params + self.hidden_size  # LM head + final norm
        return self.num_layers * self.layer_params + self.embedding_params + head


# Shapes from the models' Hugging Face config.json files (meta-llama/Llama-2-*-hf).
LLAMA2_7B = ModelShape("llama2-7b", 32, 4096, 11008, 32, 32, 32000)
LLAMA2_13B = ModelShape("llama2-13b", 40, 5120, 13824, 40, 40, 32000)


@dataclass(frozen=True)
class Hardware:
    """Public per-GPU figures (datasheets) plus the node's links."""

    name: str
    peak_flops_s: float  # dense BF16 tensor-core FLOP/s (no sparsity)
    hbm_bytes_s: float  # peak HBM bandwidth
    memory_bytes: int  # GPU memory as the driver reports it
    host_link_bytes_s: float  # PCIe x16 per direction, theoretical


# NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e (SXM4 80GB);
# nvidia-smi reports 81,920 MiB. Host link PCIe Gen4 x16: 16 GT/s × 16 lanes ×
# 128/130 encoding / 8 = 31.5 GB/s per direction.
A100_SXM4_80GB = Hardware("A100-SXM4-80GB", 312e12, 2.039e12, 81920 * MIB, 31.5e9)
# NVIDIA A100 datasheet, the 40 GB SXM4 part: the same 312 TFLOP/s dense BF16,
# 1,555 GB/s HBM2; nvidia-smi reports 40,960 MiB. Same PCIe Gen4 host link.
A100_SXM4_40GB = Hardware("A100-SXM4-40GB", 312e12, 1.555e12, 40960 * MIB, 31.5e9)
# NVIDIA H100 datasheet (SXM5): 989 TFLOP/s dense BF16, 3.35 TB/s HBM3;
# nvidia-smi reports 81,559 MiB. Host link PCIe Gen5 x16: 63.0 GB/s per direction.
H100_SXM5_80GB = Hardware("H100-SXM5-80GB", 989e12, 3.35e12, 81559 * MIB, 63.0e9)


@dataclass(frozen=True)
class Assumptions:
    """Assumptions and accounting conventions (not specs); all stored in the profile."""

    # Model FLOPs utilization of forward/backward passes. PaLM (Chowdhery et al.
    # 2022) reports 46.2% MFU; Korthikanti et al. 2022 54.2% (530B, 2240 A100s).
    mfu: float = 0.5
    # Achieved fraction of peak HBM bandwidth for weight/KV streaming (decode
    # GEMVs, AdamW). Assumption: 0.7 (streaming kernels reach ~0.8-0.9; GEMV less).
    hbm_efficiency: float = 0.7
    # Fixed cost per kernel: launch latency seen from the host, ~5 µs.
    kernel_launch_s: float = 5e-6
    # Kernels per decoder layer in a fused serving engine: 2 RMSNorm, QKV GEMM,
    # rotary, attention, O GEMM, gate-up GEMM, SiLU·mul, down GEMM, 2 residual adds,
    # plus one spare = 12. A backward launches about twice as many.
    kernels_per_layer: int = 12
    # Achieved fraction of the PCIe link for pinned-memory copies (~25 GB/s on Gen4).
    host_link_efficiency: float = 0.8
    # Inter-node link for weight sync: one 100 Gb/s NIC per node = 12.5 GB/s.
    inter_node_bytes_s: float = 100e9 / 8
    # Host RAM per node set aside for offloaded KV.
    host_capacity_bytes: int = 256 * GIB
    # Mixed-precision AdamW: bf16 grads (2) + fp32 m (4) + v (4) + master (4).
    training_state_bytes_per_param: int = 14
    # AdamW step reads master, m, v (fp32) and the bf16 grad, writes master, m, v
    # and the bf16 serving copy: 14 read + 14 written.
    adamw_bytes_touched_per_param: int = 28
    # Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    # Transformer Models": 34·s·b·h + 5·a·s²·b bytes per layer (16-bit).
    # With flash attention the 5·a·s² score term is never stored: 34·h per token.
    # (Derived for a 4h GELU MLP; used as is for Llama's SwiGLU.)
    activation_bytes_per_hidden_per_layer: int = 34
    # Same paper, output layer: the loss keeps fp32 logits, 4·v bytes per token.
    logit_bytes_per_vocab: int = 4


@dataclass(frozen=True)
class StageShape:
    """What one pipeline stage holds."""

    num_layers: int
    has_embedding: bool  # stage 0: token embedding table (lookup)
    has_lm_head: bool  # last stage: final norm + LM head


def split_stages(model: ModelShape, num_stages: int) -> list[StageShape]:
    """Layers as even as possible; leftovers go to the earliest stages."""
    if not 1 <= num_stages <= model.num_layers:
        raise ValueError(f"num_stages must be in [1, {model.num_layers}], got {num_stages}")
    base, extra = divmod(model.num_layers, num_stages)
    return [
        StageShape(base + (1 if s < extra else 0), s == 0, s == num_stages - 1)
        for s in range(num_stages)
    ]


def stage_params(model: ModelShape, stage: StageShape) -> int:
    """All parameters a stage stores."""
    return stage_matmul_params(model, stage) + (
        model.embedding_params if stage.has_embedding else 0
    )


def stage_matmul_params(model: ModelShape, stage: StageShape) -> int:
    """Parameters every token touches (all but the embedding lookup table)."""
    head = model.embedding_params + model.hidden_size if stage.has_lm_head else 0
    return stage.num_layers * model.layer_params + head


def kv_bytes_per_token(model: ModelShape, stage: StageShape) -> int:
    """K and V for every layer of the stage: 2·layers·kv_heads·head_dim·dtype."""
    kv_dim = model.num_key_value_heads * model.head_dim
    return 2 * stage.num_layers * kv_dim * model.dtype_bytes


def activation_bytes_per_token(model: ModelShape, stage: StageShape, asm: Assumptions) -> int:
    """Bytes a training forward saves for its backward, per (sequence · token)."""
    per_layer = asm.activation_bytes_per_hidden_per_layer * model.hidden_size
    logits = asm.logit_bytes_per_vocab * model.vocab_size if stage.has_lm_head else 0
    return stage.num_layers * per_layer + logits


# ------------------------------------------------------------------ roofline


@dataclass(frozen=True)
class StageRoofline:
    """Roofline times (seconds) of one stage on one GPU."""

    model: ModelShape
    stage: StageShape
    hardware: Hardware
    asm: Assumptions

    def _time_s(self, flops: float, nbytes: float, num_kernels: int) -> float:
        compute_s = flops / (self.hardware.peak_flops_s * self.asm.mfu)
        memory_s = nbytes / (self.hardware.hbm_bytes_s * self.asm.hbm_efficiency)
        return max(compute_s, memory_s) + num_kernels * self.asm.kernel_launch_s

    @property
    def _weight_bytes_read(self) -> int:
        return stage_matmul_params(self.model, self.stage) * self.model.dtype_bytes

    @property
    def _num_kernels(self) -> int:
        return self.asm.kernels_per_layer * self.stage.num_layers

    def _attention_flops(self, num_query_tokens: int, num_key_tokens: int) -> float:
        """QKᵀ and AV: 2·2·layers·d per (query, key) pair, full square (see top)."""
        attn_dim = self.model.num_attention_heads * self.model.head_dim
        return 4.0 * self.stage.num_layers * attn_dim * num_query_tokens * num_key_tokens

    def forward_flops(self, batch_size: int, num_tokens: int) -> float:
        linear = 2.0 * stage_matmul_params(self.model, self.stage) * batch_size * num_tokens
        return linear + self._attention_flops(batch_size * num_tokens, num_tokens)

    def forward_s(self, batch_size: int, num_tokens: int) -> float:
        flops = self.forward_flops(batch_size, num_tokens)
        return self._time_s(flops, self._weight_bytes_read, self._num_kernels)

    def backward_s(self, batch_size: int, num_tokens: int) -> float:
        flops = 2.0 * self.forward_flops(batch_size, num_tokens)
        return self._time_s(flops, 2 * self._weight_bytes_read, 2 * self._num_kernels)

    def decode_step_s(self, batch_size: int, sum_context_tokens: int) -> float:
        """One new token per sequence; each attends to its own context (Σ over the batch)."""
        linear = 2.0 * stage_matmul_params(self.model, self.stage) * batch_size
        flops = linear + self._attention_flops(1, sum_context_tokens)
        kv_read = kv_bytes_per_token(self.model, self.stage) * sum_context_tokens
        return self._time_s(flops, self._weight_bytes_read + kv_read, self._num_kernels)

    def chunk_forward_s(self, num_new_tokens: int, num_past_tokens: int) -> float:
        """n new tokens of one sequence after p cached: the forward of n tokens,
        plus attention of the new tokens over the past, plus reading the past's KV.

        Attention pairs counted as the forward counts them (see top): the full
        n × n square for the new tokens, and twice the n·p new-past pairs, since
        the full-square convention charges a causal kernel 2 pair-costs per pair
        it computes. So a prompt of p + n tokens costs as much attention in one
        pass as in a chunk of p and one of n (work conservation).
        """
        n, p = num_new_tokens, num_past_tokens
        linear = 2.0 * stage_matmul_params(self.model, self.stage) * n
        flops = linear + self._attention_flops(n, n + 2 * p)
        kv_read = kv_bytes_per_token(self.model, self.stage) * p
        return self._time_s(flops, self._weight_bytes_read + kv_read, self._num_kernels)

    def optimizer_step_s(self) -> float:
        params = stage_params(self.model, self.stage)
        nbytes = params * self.asm.adamw_bytes_touched_per_param
        return nbytes / (self.hardware.hbm_bytes_s * self.asm.hbm_efficiency)


# ------------------------------------------------------------------ grids and fits

BATCH_SIZES = (1, 2, 4, 8, 16)
NUM_TOKENS = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # Llama-2 context is 4,096
DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_CONTEXT_TOKENS = (128, 256, 512, 1024, 2048, 4096)  # per sequence
# Prefill chunks: n new tokens of one sequence after p cached, n + p <= 4,096.
CHUNK_NEW_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)
CHUNK_PAST_TOKENS = (0, 256, 512, 1024, 2048, 3072)
MAX_CONTEXT_TOKENS = 4096


def feasible_grid(
    batch_sizes: Sequence[int], lengths: Sequence[int], bytes_per_token: int, free_bytes: int
) -> list[tuple[int, int]]:
    """(C, ℓ) pairs a co-located node could profile: C·ℓ tokens of state must fit."""
    grid = itertools.product(batch_sizes, lengths)
    return [(c, n) for c, n in grid if c * n * bytes_per_token <= free_bytes]


def fit_stage(roof: StageRoofline, free_bytes: int, holdout_fraction: float, seed: int) -> StageFit:
    """Fit the paper's and our models to the roofline on one stage's grids."""
    # Forward/backward: training activations must fit; decode: the batch's KV.
    act = activation_bytes_per_token(roof.model, roof.stage, roof.asm)
    grid = feasible_grid(BATCH_SIZES, NUM_TOKENS, act, free_bytes)
    fwd = [PhasePoint(c, n, roof.forward_s(c, n)) for c, n in grid]
    bwd = [PhasePoint(c, n, roof.backward_s(c, n)) for c, n in grid]
    kv = kv_bytes_per_token(roof.model, roof.stage)
    dec_grid = feasible_grid(DECODE_BATCH_SIZES, DECODE_CONTEXT_TOKENS, kv, free_bytes)
    dec = [DecodePoint(c, c * n, roof.decode_step_s(c, c * n)) for c, n in dec_grid]
    # One sequence's KV (at most 4,096 tokens) always fits beside the static bytes.
    chunk = [
        ChunkPoint(n, p, roof.chunk_forward_s(n, p))
        for n, p in itertools.product(CHUNK_NEW_TOKENS, CHUNK_PAST_TOKENS)
        if n + p <= MAX_CONTEXT_TOKENS
    ]
    return fit_stage_points(fwd, bwd, dec, holdout_fraction, seed, chunk)


# ------------------------------------------------------------------ the profile


def memory_profile(
    model: ModelShape, hw: Hardware, stages: Sequence[StageShape], asm: Assumptions
) -> MemoryProfile:
    """Static (weights, training state) and per-token (KV, activations) bytes per stage."""
    params = [stage_params(model, st) for st in stages]
    return MemoryProfile(
        capacity_bytes=hw.memory_bytes,
        weight_bytes=tuple(p * model.dtype_bytes for p in params),
        training_state_bytes=tuple(p * asm.training_state_bytes_per_param for p in params),
        kv_bytes_per_token=tuple(kv_bytes_per_token(model, st) for st in stages),
        activation_bytes_per_token=tuple(
            activation_bytes_per_token(model, st, asm) for st in stages
        ),
        host_capacity_bytes=asm.host_capacity_bytes,
    )


def derive_profile(
    model: ModelShape,
    hw: Hardware,
    num_stages: int,
    asm: Assumptions | None = None,
    name: str | None = None,
    holdout_fraction: float = 0.25,
    seed: int = 0,
    provenance: str = "derived by lemix.roofline (roofline model, no measurement)",
) -> Profile:
    """Roofline → synthetic grid → fitted `Profile` (paper and ours) with fit quality."""
    asm = asm or Assumptions()
    stages = split_stages(model, num_stages)
    memory = memory_profile(model, hw, stages, asm)
    roofs = [StageRoofline(model, st, hw, asm) for st in stages]
    fits: list[StageFit] = []
    for idx, roof in enumerate(roofs):
        free = hw.memory_bytes - memory.static_bytes(idx)
        if free <= 0:
            raise ValueError(
                f"{model.name} on {num_stages} stage(s) of {hw.name}: stage {idx} needs "
                f"{memory.static_bytes(idx)} B for weights + training state, more than "
                f"{hw.memory_bytes} B; use more stages"
            )
        fits.append(fit_stage(roof, free, holdout_fraction, seed))
    paper, ours = latency_models(fits)
    return Profile(
        name=name or f"{hw.name.split('-')[0].lower()}-{model.name}-{num_stages}stage",
        num_stages=num_stages,
        paper=paper,
        ours=ours,
        optimizer_step_s=tuple(r.optimizer_step_s() for r in roofs),
        memory=memory,
        transfer=TransferProfile(
            host_link_bytes_s=hw.host_link_bytes_s * asm.host_link_efficiency,
            weight_sync_bytes_s=asm.inter_node_bytes_s,
        ),
        model={
            **asdict(model),
            "total_params": model.total_params,
            "stage_layers": [st.num_layers for st in stages],
            "stage_params": [stage_params(model, st) for st in stages],
        },
        hardware={**asdict(hw), "assumptions": asdict(asm)},
        fit_quality=fit_quality_summary(fits, holdout_fraction, seed),
        provenance=provenance,
    )


PRESETS: dict[str, tuple[ModelShape, Hardware]] = {
    "a100-llama2-7b": (LLAMA2_7B, A100_SXM4_80GB),
    "a100-llama2-13b": (LLAMA2_13B, A100_SXM4_80GB),
    # Memory-bound: KV room is what limits a node (issue 10's third point).
    "a100-40gb-llama2-7b": (LLAMA2_7B, A100_SXM4_40GB),
    "h100-llama2-7b": (LLAMA2_7B, H100_SXM5_80GB),
}


def summarize(profile: Profile) -> dict[str, float]:
    """Sanity figures: what a reader checks first."""
    ours = profile.ours
    stages = range(profile.num_stages)
    node = NodeMemory(profile.memory, MemoryConfig())
    kv_tokens = min(
        node.dynamic_capacity_bytes(s) // profile.memory.kv_bytes_per_token[s] for s in stages
    )
    return {
        "prefill_1020_s": profile.standalone_prefill_s(1020),
        "decode_step_c1_ctx1149_s": profile.standalone_decode_step_s(1020 + 129),
        "train_1x512_fwd_bwd_s": sum(
            ours.forward_s(s, 1, 512) + ours.backward_s(s, 1, 512) for s in stages
        ),
        "optimizer_step_max_s": max(profile.optimizer_step_s),
        "kv_capacity_tokens_per_node": float(kv_tokens),
        "weight_sync_s": profile.weight_sync_s(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lemix.roofline", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the profile JSON here")
    parser.add_argument("--holdout-fraction", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model, hw = PRESETS[args.preset]
    command = f"python -m lemix.roofline --preset {args.preset} --stages {args.stages}"
    if args.holdout_fraction != 0.25 or args.seed != 0:
        command += f" --holdout-fraction {args.holdout_fraction} --seed {args.seed}"
    try:
        profile = derive_profile(
            model,
            hw,
            args.stages,
            name=f"{args.preset}-{args.stages}stage",
            holdout_fraction=args.holdout_fraction,
            seed=args.seed,
            provenance=f"derived by lemix.roofline (roofline, no measurement): {command}",
        )
        summary = summarize(profile)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for key, value in summary.items():
        print(f"{key:32s} {value:.6g}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_profile(profile, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
