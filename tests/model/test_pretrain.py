"""The pretraining cache: keyed by config, reused, loadable as a model checkpoint."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lemix.model.presets import ModelSpec, build_model
from lemix.model.pretrain import (
    PretrainConfig,
    cache_path,
    ensure_pretrained,
    lr_at,
    pack_sequences,
    read_meta,
)
from lemix.model.tokenizer import BPE_EOS_ID, train_bpe

TEXTS = [f"the cat {i % 7} sat on mat {i % 11} while {i} dogs ran over hills" for i in range(60)]
CORPUS_ID = "test-corpus"


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("tok")
    train_bpe(lambda: TEXTS, vocab_size=300, corpus_id=CORPUS_ID, cache_dir=cache)
    return next(cache.rglob("tokenizer.json"))


def _config(tokenizer_file: Path, **overrides: int) -> PretrainConfig:
    fields = dict(
        num_steps=3, batch_size=2, seq_len=16, num_eval_sequences=2, eval_every=1, warmup_steps=1
    )
    fields.update(overrides)
    return PretrainConfig(tokenizer=str(tokenizer_file), **fields)  # type: ignore[arg-type]


class _CountingTexts:
    def __init__(self) -> None:
        self.num_calls = 0

    def __call__(self) -> Iterable[str]:
        self.num_calls += 1
        return iter(TEXTS)


def test_same_config_same_path_and_any_change_another(tokenizer_file: Path) -> None:
    root = Path("/cache")
    config = _config(tokenizer_file)
    assert cache_path(config, CORPUS_ID, root) == cache_path(
        _config(tokenizer_file), CORPUS_ID, root
    )
    assert cache_path(config, CORPUS_ID, root).name.startswith("pretrain-")
    assert cache_path(_config(tokenizer_file, num_steps=4), CORPUS_ID, root) != cache_path(
        config, CORPUS_ID, root
    )
    assert cache_path(config, "other-corpus", root) != cache_path(config, CORPUS_ID, root)


def test_second_run_reuses_the_cache_and_the_checkpoint_loads_equal(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    config = _config(tokenizer_file)
    texts = _CountingTexts()
    path = ensure_pretrained(config, cache_root=tmp_path, corpus=(CORPUS_ID, texts))
    assert texts.num_calls == 1
    assert ensure_pretrained(config, cache_root=tmp_path, corpus=(CORPUS_ID, texts)) == path
    assert texts.num_calls == 1  # not trained again
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind

    meta = read_meta(path)
    assert meta["tokenizer"] == str(tokenizer_file)
    assert len(meta["train_losses"]) == 3
    assert [step for step, _ in meta["eval_losses"]] == [0, 1, 2, 3]
    assert (path / "tokenizer.json").is_file()

    saved = load_file(str(path / "model.safetensors"))
    loaded = build_model(ModelSpec(name=str(path))).state_dict()
    assert set(saved) <= set(loaded)
    assert all(torch.equal(saved[name], loaded[name]) for name in saved)
    # Training moved the weights away from the preset's seeded init.
    init = build_model(ModelSpec("tiny-llama", vocab_size=300, seed=config.seed, eos_id=1))
    name = "model.embed_tokens.weight"
    assert not torch.equal(init.state_dict()[name], loaded[name])


def test_pack_sequences_packs_with_eos_and_refuses_a_short_corpus() -> None:
    rows = pack_sequences([[5, 6], [7]], BPE_EOS_ID, seq_len=2, num_sequences=2)
    assert rows.tolist() == [[5, 6], [BPE_EOS_ID, 7]]
    with pytest.raises(ValueError, match="tokens"):
        pack_sequences([[5, 6]], BPE_EOS_ID, seq_len=4, num_sequences=2)


def test_lr_warms_up_then_decays_to_a_tenth() -> None:
    config = PretrainConfig(num_steps=100, warmup_steps=10, learning_rate=1.0)
    assert lr_at(0, config) == pytest.approx(0.1)
    assert lr_at(9, config) == pytest.approx(1.0)
    assert lr_at(10, config) == pytest.approx(1.0)
    assert lr_at(100, config) == pytest.approx(0.1)
    assert lr_at(55, config) < lr_at(20, config)


def test_config_rejects_non_presets_and_empty_sizes() -> None:
    with pytest.raises(ValueError, match="preset"):
        PretrainConfig(model="/some/dir")
    with pytest.raises(ValueError, match="num_steps"):
        PretrainConfig(num_steps=0)
