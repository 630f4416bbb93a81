"""Pretraining a small model on the packaged ShareGPT text, cached by config.

The inference-loss study (`benchmarks/inference_loss.py`) fine-tunes a model
live while it serves; starting from random weights measures how fast noise
turns into bigram statistics, not what the paper measures. `ensure_pretrained`
gives it a model that already speaks the corpus: a preset (`presets.PRESETS`)
trained as a plain causal LM on (prompt, reply) text of ShareGPT conversations
for a bounded number of steps, then saved as a Hugging Face checkpoint
directory that `presets.build_model` (and so every executor's ``--model``)
loads as it is.

Cache layout, ``<cache_root>/pretrain-<hash>/``: ``config.json`` and
``model.safetensors`` (``save_pretrained``), ``tokenizer.json`` (a copy of the
tokenizer it was trained with, for the record) and `META_FILE` (the config,
the tokenizer spec executors must load, the loss curve). The hash covers the
config, the corpus id and `FORMAT_VERSION`, so the same config finds the same
directory and a finished directory is reused without training.

The text skips the first `corpus.DEFAULT_PAIR_CONVERSATIONS` conversations:
the demo's ShareGPT (query, reference) pairs come from those, so they are
never in the pretraining data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lemix.model.presets import PRESETS, ModelSpec, build_model

FORMAT_VERSION = 1  # bump when the data pipeline or the loop changes what a config means
META_FILE = "pretrain.json"
CACHE_PREFIX = "pretrain-"


@dataclass(frozen=True)
class PretrainConfig:
    """What to pretrain and for how long. Every field is part of the cache key."""

    model: str = "tiny-llama"  # a `presets.PRESETS` name
    tokenizer: str = "bpe:8192"  # a `lemix.model.tokenizer.load_tokenizer` spec
    # 200 steps of 1,024 tokens: 20 minutes on two busy shared cores (~6 s a
    # step), held-out loss 9.04 (uniform over 8k tokens) -> 6.40 nats/token.
    num_steps: int = 200
    batch_size: int = 8  # sequences per step
    seq_len: int = 128  # tokens per sequence (documents packed, EOS between)
    learning_rate: float = 3e-3  # peak; linear warmup, then cosine to 10%
    warmup_steps: int = 10
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    num_eval_sequences: int = 16  # held out from training, scored every eval_every steps
    eval_every: int = 25
    seed: int = 0  # weight init and data order

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"model must be a preset ({', '.join(sorted(PRESETS))})")
        for name in ("num_steps", "batch_size", "seq_len", "num_eval_sequences", "eval_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.learning_rate <= 0 or self.warmup_steps < 0 or self.max_grad_norm < 0:
            raise ValueError("learning_rate must be > 0, warmup_steps and max_grad_norm >= 0")


def config_hash(config: PretrainConfig, corpus_id: str) -> str:
    """12 hex digits naming (config, corpus, format): the cache key."""
    key = {"config": dataclasses.asdict(config), "corpus": corpus_id, "format": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def cache_path(config: PretrainConfig, corpus_id: str, cache_root: Path) -> Path:
    """The checkpoint directory of `config` under `cache_root`."""
    return cache_root / f"{CACHE_PREFIX}{config_hash(config, corpus_id)}"


def default_cache_root() -> Path:
    """``runs/cache`` beside the trained tokenizers (`tokenizer.default_cache_dir`)."""
    from lemix.model.tokenizer import default_cache_dir

    return default_cache_dir().parent


def is_complete(path: Path) -> bool:
    """Whether `path` holds a finished checkpoint (the meta file is written last)."""
    return (path / META_FILE).is_file() and (path / "config.json").is_file()


def read_meta(path: Path) -> dict[str, Any]:
    """The `META_FILE` of a checkpoint directory: config, tokenizer spec, curve."""
    meta: dict[str, Any] = json.loads((path / META_FILE).read_text())
    return meta


def sharegpt_pretrain_texts(
    skip_conversations: int | None = None, num_conversations: int = 6_000
) -> tuple[str, Callable[[], Iterable[str]]]:
    """(corpus id, texts) for pretraining: one text per ShareGPT (prompt, reply)
    pair, prompt then reply as a fine-tuning sample joins them, from the
    `num_conversations` conversations after the first `skip_conversations`
    (default: those the demo's pairs come from)."""
    from lemix.workload.corpus import (
        DEFAULT_PAIR_CONVERSATIONS,
        default_corpus_id,
        default_corpus_path,
    )
    from lemix.workload.sharegpt import conversation_pairs, iter_sharegpt_conversations

    skip = DEFAULT_PAIR_CONVERSATIONS if skip_conversations is None else skip_conversations
    stop = skip + num_conversations

    def texts() -> Iterable[str]:
        with default_corpus_path() as path:
            for conv in islice(iter_sharegpt_conversations(path), skip, stop):
                for prompt, reply in conversation_pairs(conv):
                    yield prompt + reply

    return f"{default_corpus_id(stop)}-pairs-from-{skip}", texts


def pack_sequences(
    docs: Iterable[list[int]], eos_id: int, seq_len: int, num_sequences: int
) -> np.ndarray:
    """[num_sequences, seq_len] int64: documents back to back, EOS after each,
    cut into rows; raises ValueError when the documents run out first."""
    need = num_sequences * seq_len
    stream: list[int] = []
    for ids in docs:
        stream.extend(ids)
        stream.append(eos_id)
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise ValueError(
            f"the corpus has {len(stream)} tokens; {num_sequences} x {seq_len} = {need} needed"
        )
    return np.asarray(stream[:need], dtype=np.int64).reshape(num_sequences, seq_len)


def lr_at(step: int, config: PretrainConfig) -> float:
    """Linear warmup to the peak, then cosine decay to 10% of it at the last step."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    span = max(1, config.num_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.learning_rate * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _mean_loss(model: Any, rows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) of `rows` [N, T], no gradient."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            total += float(model(input_ids=batch, labels=batch).loss) * len(batch)
    model.train()
    return total / len(rows)


def pretrain(
    config: PretrainConfig,
    texts: Callable[[], Iterable[str]],
    out_dir: Path,
    *,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train `config.model` from its seeded init on `texts()` and save it in
    `out_dir` (created); returns the meta written to `META_FILE`."""
    from lemix.model.tokenizer import BPETokenizer, load_tokenizer

    tokenizer = load_tokenizer(config.tokenizer)
    if tokenizer.is_emulated:
        raise ValueError("pretraining needs a real tokenizer, not 'approx'")
    bos, pad = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "pad_id", None)
    spec = ModelSpec(
        name=config.model,
        vocab_size=int(getattr(tokenizer, "vocab_size", 0)),
        seed=config.seed,
        eos_id=tokenizer.eos_id,
        bos_id=bos if bos is not None else tokenizer.eos_id,
        pad_id=pad if pad is not None else tokenizer.eos_id,
    )
    num_rows = config.num_eval_sequences + config.num_steps * config.batch_size
    data = pack_sequences(
        (tokenizer.encode(text) for text in texts()), tokenizer.eos_id, config.seq_len, num_rows
    )
    # Shuffled once, seeded: neighbouring rows come from one conversation.
    data = data[np.random.default_rng(config.seed).permutation(num_rows)]
    rows = torch.from_numpy(data)  # [num_rows, seq_len]
    eval_rows, train_rows = rows[: config.num_eval_sequences], rows[config.num_eval_sequences :]

    model = build_model(spec)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.learning_rate,
        betas=(0.9, 0.95),
        weight_decay=config.weight_decay,
    )
    train_losses: list[float] = []
    eval_losses: list[tuple[int, float]] = [(0, _mean_loss(model, eval_rows, config.batch_size))]
    started_s = time.monotonic()
    for step in range(config.num_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        batch = train_rows[step * config.batch_size : (step + 1) * config.batch_size]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        train_losses.append(loss.item())
        if (step + 1) % config.eval_every == 0 or step + 1 == config.num_steps:
            eval_losses.append((step + 1, _mean_loss(model, eval_rows, config.batch_size)))
            if log is not None:
                log(
                    f"step {step + 1}/{config.num_steps}: train loss {train_losses[-1]:.3f}, "
                    f"held-out loss {eval_losses[-1][1]:.3f} "
                    f"({time.monotonic() - started_s:.0f} s)"
                )
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if isinstance(tokenizer, BPETokenizer):
        tokenizer.save(out_dir / "tokenizer.json")
    meta = {
        "config": dataclasses.asdict(config),
        "tokenizer": config.tokenizer,  # the spec executors must load beside it
        "num_train_tokens": int(train_rows.numel()),
        "train_losses": train_losses,
        "eval_losses": eval_losses,
        "train_s": time.monotonic() - started_s,
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def ensure_pretrained(
    config: PretrainConfig,
    *,
    cache_root: Path | None = None,
    corpus: tuple[str, Callable[[], Iterable[str]]] | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """The cached checkpoint directory of `config`, pretraining it first when
    absent. `corpus` is (corpus id, texts); default `sharegpt_pretrain_texts()`.

    Trains into a temporary sibling and renames it, so a crash or a concurrent
    run never leaves a half-written directory under the final name.
    """
    corpus_id, texts = corpus if corpus is not None else sharegpt_pretrain_texts()
    path = cache_path(config, corpus_id, cache_root or default_cache_root())
    if is_complete(path):
        if log is not None:
            log(f"reusing the pretrained checkpoint {path}")
        return path
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pretrain(config, texts, tmp, log=log)
    if is_complete(path):  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    return path
