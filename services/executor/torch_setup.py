"""Building a node's torch backend: model, tokenizer ids, stages, devices, profile.

`TorchBackendConfig` says which model and how to run it; `build_torch_node`
loads the tokenizer (for the vocabulary and special ids), builds or loads the
model, splits it into the profile's S stages on their devices, and returns
the backend plus the profile with its memory figures replaced by the real
model's (weights, optimizer state, KV bytes per token; capacity from the GPU
or, on a CPU, the configured budget), so the engine's memory ledger books
exactly what the KV store allocates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lemix.model.device_memory import device_total_bytes
from lemix.model.presets import ModelSpec, build_model
from lemix.model.runner import InferenceRunner
from lemix.model.staged import StagedModel
from lemix.model.training import PipelineTrainer, TrainingConfig
from lemix.profile import Profile
from services.executor.backends.torch import TorchBackend, set_torch_threads

DEFAULT_CPU_BUDGET_BYTES = 4 << 30  # per stage, when there is no GPU to ask
# AdamW keeps two moments per parameter, plus the gradient: 3 copies.
_TRAINING_STATE_COPIES = 3


@dataclass(frozen=True)
class TorchBackendConfig:
    model: str = "tiny-llama"  # a preset name or a local checkpoint directory
    tokenizer: str = "bpe:8192"  # spec for lemix.model.tokenizer.load_tokenizer
    tokenizer_cache_dir: Path | None = None
    devices: str = ""  # comma-separated per stage; "" = cuda:0..S-1 if present, else cpu
    dtype: str = ""  # "" = bfloat16 on GPU, float32 on CPU
    seed: int = 0  # preset weight init: the same on every node, so replicas start equal
    learning_rate: float = 1e-3
    max_grad_norm: float = 1.0
    memory_budget_bytes: int = 0  # per stage on CPU (0 = DEFAULT_CPU_BUDGET_BYTES)
    num_threads: int = 0  # torch intra-op threads (0 = torch's default)

    def __post_init__(self) -> None:
        if self.memory_budget_bytes < 0:
            raise ValueError("memory_budget_bytes must be >= 0")
        if self.num_threads < 0:
            raise ValueError("num_threads must be >= 0")
        TrainingConfig(learning_rate=self.learning_rate, max_grad_norm=self.max_grad_norm)

    def stage_devices(self, num_stages: int) -> list[str]:
        if self.devices:
            devices = [d.strip() for d in self.devices.split(",") if d.strip()]
            if len(devices) != num_stages:
                raise ValueError(f"devices lists {len(devices)} devices for {num_stages} stages")
            return devices
        if torch.cuda.is_available() and torch.cuda.device_count() >= num_stages:
            return [f"cuda:{i}" for i in range(num_stages)]
        return ["cpu"] * num_stages


def build_torch_node(
    config: TorchBackendConfig,
    profile: Profile,
    *,
    on_training_loss: Callable[[float], None] | None = None,
    on_inference_loss: Callable[[float], None] | None = None,
) -> tuple[TorchBackend, Profile]:
    """The backend and the profile its engine must use (memory from the model)."""
    from lemix.model.tokenizer import load_tokenizer

    set_torch_threads(config.num_threads)
    tokenizer = load_tokenizer(config.tokenizer, cache_dir=config.tokenizer_cache_dir)
    if tokenizer.is_emulated:
        raise ValueError("the torch backend needs a real tokenizer, not 'approx'")
    devices = config.stage_devices(profile.num_stages)
    dtype = config.dtype or ("bfloat16" if devices[0].startswith("cuda") else "float32")
    bos = getattr(tokenizer, "bos_id", None)
    pad = getattr(tokenizer, "pad_id", None)
    spec = ModelSpec(
        name=config.model,
        vocab_size=int(getattr(tokenizer, "vocab_size", 0)),
        seed=config.seed,
        dtype=dtype,
        eos_id=tokenizer.eos_id,
        bos_id=bos if bos is not None else tokenizer.eos_id,
        pad_id=pad if pad is not None else tokenizer.eos_id,
    )
    staged = StagedModel(build_model(spec), profile.num_stages, devices)
    runner = InferenceRunner(staged, tokenizer.eos_id)
    trainer = PipelineTrainer(
        staged,
        TrainingConfig(learning_rate=config.learning_rate, max_grad_norm=config.max_grad_norm),
    )
    backend = TorchBackend(
        staged,
        runner,
        trainer,
        on_training_loss=on_training_loss,
        on_inference_loss=on_inference_loss,
        num_threads=config.num_threads,
    )
    return backend, model_profile(profile, staged, devices, config.memory_budget_bytes)


def model_profile(
    profile: Profile, staged: StagedModel, devices: list[str], budget_bytes: int
) -> Profile:
    """`profile` with memory figures of the real model on these devices."""
    if devices[0].startswith("cuda"):
        capacity = min(device_total_bytes(torch.device(d)) or 0 for d in devices)
    else:
        capacity = budget_bytes or DEFAULT_CPU_BUDGET_BYTES
    weights = tuple(staged.weight_bytes())
    memory = dataclasses.replace(
        profile.memory,
        capacity_bytes=int(capacity),
        weight_bytes=weights,
        training_state_bytes=tuple(_TRAINING_STATE_COPIES * w for w in weights),
        kv_bytes_per_token=tuple(staged.kv_bytes_per_token()),
    )
    hf_model: Any = staged.model
    model = dict(
        profile.model,
        staged_from=hf_model.config.model_type,
        num_layers=staged.family.num_layers,
        hidden_size=staged.family.hidden_size,
    )
    return dataclasses.replace(profile, memory=memory, model=model)
