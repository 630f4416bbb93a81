"""Per-architecture forward code over a Hugging Face model's own modules.

The executor runs a model as *packed ragged* batches: every token of every
request in one iteration sits in one sequence ``x [1, N, hidden]`` (a prefill
contributes its prompt, a decode step one token), each with its own position.
Projections, norms and MLPs run once over all N tokens; attention runs per
request against that request's own KV cache, through the `attend` callback
the stage runner supplies. That is how vLLM/SGLang batch without padding, and
it needs per-layer control the HF ``forward`` does not give, so the layer
bodies below call the HF submodules (same weights, same numerics) in the
order HF does. Tests check the logits against the unsplit HF model. CPU
inference on Llama runs Q/K/V and gate/up as one matmul each over
concatenated weights (`LlamaFamily._layer_forward_fused`, bit-identical).

A `Family` knows one architecture: the embedding (first stage), the decoder
layers, and the head (last stage). Supported: Llama-family
(`LlamaForCausalLM`: RMSNorm, RoPE, GQA, SwiGLU; also Mistral/Qwen2-shaped
configs that load as Llama) and GPT-2 (`GPT2LMHeadModel`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

# attend(index of the layer within the model, q [1, h, N, d], k_new [1, kvh, N, d],
#        v_new [1, kvh, N, d]) -> attention output [1, N, h*d]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# [q; k; v] weight and bias (None: no biases), [gate; up] weight and bias.
_Fused = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


class Family(Protocol):
    """One architecture's stage pieces, over a loaded HF model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int

    def embed_modules(self) -> list[nn.Module]:
        """Modules the first stage owns besides its layers."""
        ...

    def head_modules(self) -> list[nn.Module]:
        """Modules the last stage owns besides its layers."""
        ...

    def layer(self, index: int) -> nn.Module:
        """Decoder layer `index` (0-based over the whole model)."""
        ...

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids, positions [N] (long) -> x [1, N, hidden]."""
        ...

    def layer_forward(
        self, index: int, x: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """x [1, N, hidden] through layer `index` -> [1, N, hidden]."""
        ...

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, N, hidden] -> logits [1, N, vocab] (float32)."""
        ...


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaFamily:
    """`LlamaForCausalLM` (and configs of the same shape)."""

    def __init__(self, model: Any) -> None:  # an HF causal LM: attribute-typed at runtime
        config = model.config
        self.model: Any = model
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.max_positions = config.max_position_embeddings
        self._layers: Any = model.model.layers
        self._rotary: Any = model.model.rotary_emb
        # (positions, dtype, cos, sin) of the latest forward: every layer of a
        # forward shares its positions tensor, so RoPE is computed once per
        # forward, as HF does, not once per layer. One tuple, swapped whole,
        # since the stages of a node run on their own threads.
        self._rope_memo: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        # Layer index -> (source modules, their parameters' (data_ptr, _version),
        # fused weights): see `_fused_weights`. A derived copy, for CPU inference
        # only: it holds the q/k/v/gate/up weights a second time (~85% of a
        # Llama layer's bytes), which `StagedModel.weight_bytes` does not count;
        # on an accelerator that would be device memory the ledger does not book.
        self._fused: dict[int, tuple[tuple[Any, ...], tuple[tuple[int, int], ...], _Fused]] = {}

    def embed_modules(self) -> list[nn.Module]:
        return [self.model.model.embed_tokens]

    def head_modules(self) -> list[nn.Module]:
        return [self.model.model.norm, self.model.lm_head]

    def layer(self, index: int) -> nn.Module:
        return self._layers[index]

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)[None]

    def layer_forward(
        self, index: int, x: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        if not torch.is_grad_enabled() and x.device.type == "cpu":
            return self._layer_forward_fused(index, x, positions, attend)
        layer = self._layers[index]
        attn = layer.self_attn
        n = x.shape[1]
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(1, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(1, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(1, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self._rope(h, positions)  # [1, 1, N, d] each
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        x = x + attn.o_proj(attend(index, q, k, v))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _layer_forward_fused(
        self, index: int, x: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """`layer_forward` for inference on a CPU: the same values, in fewer ops.

        Q, K and V come from one matmul over their concatenated weights, gate
        and up from another (`_fused_weights`); RoPE rotates the Q and K heads
        of that one output together. Each output element is the same dot
        product in the same order as in the separate projections (the
        concatenation only adds output columns), and RoPE is elementwise, so
        the values are bit-identical (a test checks it) with 3 fewer matmuls and
        half the RoPE ops per layer: a decode step of a small model on a CPU
        spends much of its time in per-op overhead.
        """
        layer = self._layers[index]
        attn = layer.self_attn
        qkv_weight, qkv_bias, gate_up_weight, gate_up_bias = self._fused_weights(index)
        n, heads, kv_heads, d = x.shape[1], self.num_heads, self.num_kv_heads, self.head_dim
        h = layer.input_layernorm(x)
        qkv = F.linear(h, qkv_weight, qkv_bias).view(1, n, heads + 2 * kv_heads, d)
        cos, sin = self._rope_rows(h, positions)  # [1, N, 1, d] each
        qk = qkv[:, :, : heads + kv_heads]
        qk = qk * cos + _rotate_half(qk) * sin  # [1, N, h + kvh, d]
        q = qk[:, :, :heads].transpose(1, 2)
        k = qk[:, :, heads:].transpose(1, 2)
        v = qkv[:, :, heads + kv_heads :].transpose(1, 2)
        x = x + attn.o_proj(attend(index, q, k, v))
        h = layer.post_attention_layernorm(x)
        gate, up = F.linear(h, gate_up_weight, gate_up_bias).chunk(2, dim=-1)
        return x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)

    def _fused_weights(self, index: int) -> _Fused:
        """Layer `index`'s concatenated [q; k; v] and [gate; up] weights (and
        biases), made on first use and again whenever a source parameter
        changed: training steps update the weights in place (a new `_version`)
        or replace their storage (a new `data_ptr`)."""
        cached = self._fused.get(index)
        if cached is None:
            layer = self._layers[index]
            attn, mlp = layer.self_attn, layer.mlp
            sources = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
        else:
            sources = cached[0]
        # `_parameters` rather than attribute access: nn.Module's __getattr__
        # would cost more than the check (this runs per layer per forward).
        params = [p for m in sources for p in m._parameters.values() if p is not None]
        stamp = tuple((p.data_ptr(), p._version) for p in params)
        if cached is not None and cached[1] == stamp:
            return cached[2]

        def cat(modules: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
            weight = torch.cat([m.weight.detach() for m in modules])
            has_bias = [m.bias is not None for m in modules]
            if not any(has_bias):
                return weight, None
            biases = [
                m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
                for m in modules
            ]
            return weight, torch.cat(biases)

        fused = (*cat(sources[:3]), *cat(sources[3:]))
        self._fused[index] = (sources, stamp, fused)
        return fused

    def _rope_rows(
        self, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as [1, N, 1, d]: for q/k laid out [1, N, heads, d]."""
        cos, sin = self._rope(h, positions)
        return cos.transpose(1, 2), sin.transpose(1, 2)

    def _rope(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memo = self._rope_memo
        if memo is not None and memo[0] is positions and memo[1] == h.dtype:
            return memo[2], memo[3]
        cos, sin = self._rotary(h, positions[None])  # [1, N, d] each
        cos, sin = cos[:, None], sin[:, None]
        self._rope_memo = (positions, h.dtype, cos, sin)
        return cos, sin

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(x)).float()


class GPT2Family:
    """`GPT2LMHeadModel`."""

    def __init__(self, model: Any) -> None:  # an HF causal LM: attribute-typed at runtime
        config = model.config
        self.model: Any = model
        self.num_layers = config.n_layer
        self.num_heads = config.n_head
        self.num_kv_heads = config.n_head
        self.hidden_size = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.vocab_size = config.vocab_size
        self.max_positions = config.n_positions
        self._blocks: Any = model.transformer.h

    def embed_modules(self) -> list[nn.Module]:
        return [self.model.transformer.wte, self.model.transformer.wpe]

    def head_modules(self) -> list[nn.Module]:
        return [self.model.transformer.ln_f, self.model.lm_head]

    def layer(self, index: int) -> nn.Module:
        return self._blocks[index]

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t = self.model.transformer
        return (t.wte(ids) + t.wpe(positions))[None]

    def layer_forward(
        self, index: int, x: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        block = self._blocks[index]
        n = x.shape[1]
        q, k, v = block.attn.c_attn(block.ln_1(x)).split(self.hidden_size, dim=2)
        shape = (1, n, self.num_heads, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        x = x + block.attn.c_proj(attend(index, q, k, v))
        return x + block.mlp(block.ln_2(x))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        t = self.model.transformer
        return self.model.lm_head(t.ln_f(x)).float()


def attention_scale(model: Any, index: int, head_dim: int) -> float:
    """The softmax scale HF uses for layer `index`."""
    config = model.config
    if getattr(config, "model_type", "") == "gpt2":
        scale = head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(index + 1)
        return scale
    return head_dim**-0.5


def family_for(model: Any) -> Family:
    """The `Family` of a loaded HF causal LM; ValueError for unsupported ones."""
    model_type = getattr(model.config, "model_type", "")
    if model_type in ("llama", "mistral", "qwen2") and hasattr(model, "model"):
        return LlamaFamily(model)
    if model_type == "gpt2":
        return GPT2Family(model)
    raise ValueError(
        f"model type {model_type!r} is not supported by the staged runner; supported: "
        "llama (and llama-shaped mistral/qwen2 configs), gpt2"
    )
