"""Model specs: a named config preset (seeded random init) or a local checkpoint.

Nothing is ever fetched from a hub: a spec is a preset name below or a local
directory `from_pretrained` can read (``local_files_only=True``).

Presets are shapes, not weights. The tiny ones make CPU runs (tests, `make
demo`) take seconds; ``llama-1b`` is TinyLlama-1.1B's shape (22 layers,
hidden 2048, GQA 32/4) for GPU profiling.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
    },
    "small-llama": {
        "model_type": "llama",
        "hidden_size": 384,
        "intermediate_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
    },
    "tiny-gpt2": {
        "model_type": "gpt2",
        "n_embd": 128,
        "n_layer": 4,
        "n_head": 4,
        "n_positions": 2048,
    },
    "llama-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
    },
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSpec:
    """Which model to build or load, and how."""

    name: str = "tiny-llama"  # a PRESETS key or a local checkpoint directory
    vocab_size: int = 0  # presets only: the tokenizer's vocabulary (0 = 8192)
    seed: int = 0  # presets only: weight init
    dtype: str = "float32"
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0, got {self.vocab_size}")
        if not self.is_preset and not Path(self.name).is_dir():
            raise ValueError(
                f"model {self.name!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
                "local directory with a Hugging Face checkpoint (nothing is downloaded)"
            )

    @property
    def is_preset(self) -> bool:
        return self.name in PRESETS

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def build_model(spec: ModelSpec) -> Any:
    """The HF causal LM for `spec`, in eval mode, on CPU, in `spec.dtype`."""
    import transformers

    if spec.is_preset:
        fields: dict[str, Any] = dict(PRESETS[spec.name])
        model_type = fields.pop("model_type")
        vocab_size = spec.vocab_size or 8192
        special: dict[str, Any] = {
            "bos_token_id": spec.bos_id,
            "eos_token_id": spec.eos_id,
            "pad_token_id": spec.pad_id,
        }
        if model_type == "gpt2":
            # No dropout: serving and training see the same function, and the
            # staged forward equals the HF forward in train mode too.
            config: Any = transformers.GPT2Config(
                vocab_size=vocab_size,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                tie_word_embeddings=False,
                **special,
                **fields,
            )
            cls: Any = transformers.GPT2LMHeadModel
        else:
            config = transformers.LlamaConfig(
                vocab_size=vocab_size, tie_word_embeddings=False, **special, **fields
            )
            cls = transformers.LlamaForCausalLM
        torch.manual_seed(spec.seed)
        model = cls(config)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec.name, local_files_only=True, torch_dtype=spec.torch_dtype
        )
    model = model.to(spec.torch_dtype)
    _untie_head(model)
    model.eval()
    return model


def _untie_head(model: Any) -> None:
    """Give the LM head its own weight when it shares the embedding's.

    Pipeline stages own disjoint parameters (the embedding lives on the first
    stage, the head on the last). Megatron keeps two copies and all-reduces
    their gradients; we keep two copies that start equal and train apart.
    """
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    if head is not None and embed is not None and head.weight is embed.weight:
        head.weight = nn.Parameter(embed.weight.detach().clone())
        model.config.tie_word_embeddings = False
