"""lemix.model.tokenizer: trained and cached BPE, HF directories, specs, streaming text."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

from lemix.model import tokenizer as tokenizer_module
from lemix.model.tokenizer import (
    BPE_BOS_ID,
    BPE_EOS_ID,
    BPE_PAD_ID,
    BPE_SPECIAL_TOKENS,
    BPE_UNK_ID,
    TOKENIZER_FILE,
    BPETokenizer,
    HFTokenizer,
    bpe_cache_path,
    corpus_fingerprint,
    default_cache_dir,
    detokenize_new,
    load_tokenizer,
    train_bpe,
)
from lemix.tokenizer import ApproxTokenizer, encode_prompt

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "Crème brûlée, naïve café, jalapeño piñata — déjà vu.",
    "日本語のテキストも大丈夫です。東京は大きな都市です。",
    "Emoji too: 🎉🚀🙂 and Ελληνικά, русский текст, عربى.",
    "def f(x):\n    return x * 2  # code with indentation\n",
] * 20
VOCAB_SIZE = 320  # small: multibyte characters stay split across tokens
MULTIBYTE_TEXT = "Crème brûlée 日本語 🎉🚀 — déjà vu, русский"


def _train(cache_dir: Path, texts: list[str] = CORPUS) -> BPETokenizer:
    return train_bpe(
        lambda: texts,
        vocab_size=VOCAB_SIZE,
        corpus_id=corpus_fingerprint(texts),
        cache_dir=cache_dir,
    )


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> BPETokenizer:
    return _train(tmp_path_factory.mktemp("tokenizers"))


def test_bpe_round_trips_any_text(bpe: BPETokenizer) -> None:
    for text in [*CORPUS[:6], MULTIBYTE_TEXT, "unseen: ẞ ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", " lead/trail spaces  ", ""]:
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
        assert all(0 <= i < bpe.vocab_size for i in ids)
    assert not bpe.is_emulated and bpe.vocab_size == VOCAB_SIZE


def test_bpe_special_ids_are_fixed(bpe: BPETokenizer) -> None:
    assert (bpe.bos_id, bpe.eos_id, bpe.pad_id) == (BPE_BOS_ID, BPE_EOS_ID, BPE_PAD_ID)
    assert (BPE_BOS_ID, BPE_EOS_ID, BPE_PAD_ID, BPE_UNK_ID) == (0, 1, 2, 3)
    assert BPE_SPECIAL_TOKENS == ("<s>", "</s>", "<pad>", "<unk>")
    assert bpe.decode([BPE_BOS_ID, *bpe.encode("hi"), BPE_EOS_ID]) == "hi"  # specials: no text
    assert min(bpe.encode(" ".join(CORPUS))) > BPE_UNK_ID  # text never encodes to a special


def test_training_is_deterministic_and_cached(tmp_path: Path) -> None:
    first = _train(tmp_path / "a")
    second = _train(tmp_path / "b")  # trained again, elsewhere
    files = [bpe_cache_path(tmp_path / d, corpus_fingerprint(CORPUS), VOCAB_SIZE) for d in "ab"]
    assert files[0].name == TOKENIZER_FILE
    assert files[0].read_bytes() == files[1].read_bytes()
    assert first.encode(MULTIBYTE_TEXT) == second.encode(MULTIBYTE_TEXT)

    def must_not_train() -> Iterable[str]:
        raise AssertionError("a cached tokenizer must not be retrained")

    cached = train_bpe(
        must_not_train,
        vocab_size=VOCAB_SIZE,
        corpus_id=corpus_fingerprint(CORPUS),
        cache_dir=tmp_path / "a",
    )
    assert cached.encode(MULTIBYTE_TEXT) == first.encode(MULTIBYTE_TEXT)


def test_cache_key_separates_corpus_and_vocab_size(tmp_path: Path) -> None:
    fp = corpus_fingerprint(CORPUS)
    assert corpus_fingerprint(CORPUS) == fp
    assert corpus_fingerprint([*CORPUS, "more"]) != fp
    assert corpus_fingerprint(["ab"]) != corpus_fingerprint(["a", "b"])
    assert bpe_cache_path(tmp_path, fp, 300) != bpe_cache_path(tmp_path, fp, 301)
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(lambda: CORPUS, vocab_size=100, corpus_id=fp, cache_dir=tmp_path)


def test_default_cache_is_writable_outside_a_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In this checkout: runs/cache/tokenizers (git-ignored).
    assert default_cache_dir({}).parts[-3:] == ("runs", "cache", "tokenizers")
    # Installed (no pyproject.toml beside the package): the user's cache, never
    # site-packages, which a container's non-root user cannot write.
    monkeypatch.setattr(tokenizer_module, "_CHECKOUT_ROOT", tmp_path / "site-packages")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    xdg = tmp_path / "xdg"
    assert default_cache_dir({"XDG_CACHE_HOME": str(xdg)}) == xdg / "lemix" / "tokenizers"
    home_cache = tmp_path / "home" / ".cache" / "lemix" / "tokenizers"
    assert default_cache_dir({}) == home_cache
    assert default_cache_dir({"XDG_CACHE_HOME": "relative"}) == home_cache  # XDG: ignored


def _trained_file(cache_dir: Path) -> Path:
    _train(cache_dir)
    return bpe_cache_path(cache_dir, corpus_fingerprint(CORPUS), VOCAB_SIZE)


def test_load_tokenizer_specs(bpe: BPETokenizer, tmp_path: Path) -> None:
    assert isinstance(load_tokenizer("approx"), ApproxTokenizer)
    by_file = load_tokenizer(str(_trained_file(tmp_path)))
    assert isinstance(by_file, BPETokenizer)
    assert by_file.encode(MULTIBYTE_TEXT) == bpe.encode(MULTIBYTE_TEXT)
    for spec in ["nope", "bpe:many", str(tmp_path / "missing")]:
        with pytest.raises(ValueError, match="expected"):
            load_tokenizer(spec)


def test_load_tokenizer_from_a_model_directory(bpe: BPETokenizer, tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(_trained_file(tmp_path)),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    hf.save_pretrained(tmp_path / "model")
    loaded = load_tokenizer(str(tmp_path / "model"))
    assert isinstance(loaded, HFTokenizer) and not loaded.is_emulated
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (0, 1, 2)
    assert loaded.vocab_size == VOCAB_SIZE
    ids = loaded.encode(MULTIBYTE_TEXT)
    assert ids == bpe.encode(MULTIBYTE_TEXT) and loaded.decode(ids) == MULTIBYTE_TEXT
    assert encode_prompt(loaded, "hi") == [0, *loaded.encode("hi")]  # BOS first
    pieces, num_sent = [], 0
    for end in range(1, len(ids) + 1):
        piece, num_sent = detokenize_new(loaded, ids[:end], num_sent)
        pieces.append(piece)
    assert "".join(pieces) == MULTIBYTE_TEXT


def test_encode_prompt_adds_bos_only_for_real_tokenizers(bpe: BPETokenizer) -> None:
    assert encode_prompt(bpe, "hello") == [BPE_BOS_ID, *bpe.encode("hello")]
    approx = ApproxTokenizer()
    assert encode_prompt(approx, "hello world") == approx.encode("hello world")


def _stream(bpe: BPETokenizer, ids: list[int], step: int) -> list[str]:
    """Feed `ids` `step` at a time as the gateway would; the text of each call."""
    pieces, num_sent = [], 0
    for end in range(step, len(ids) + step, step):
        piece, num_sent = detokenize_new(bpe, ids[:end], num_sent, is_final=end >= len(ids))
        pieces.append(piece)
    return pieces


@pytest.mark.parametrize("step", [1, 2, 3])
def test_streaming_detokenization_never_splits_a_character(bpe: BPETokenizer, step: int) -> None:
    ids = [*bpe.encode(MULTIBYTE_TEXT), BPE_EOS_ID]
    assert any("\ufffd" in bpe.decode([i]) for i in ids)  # the test exercises split characters
    pieces = _stream(bpe, ids, step)
    assert "".join(pieces) == MULTIBYTE_TEXT
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces or step > 1  # something was held back at step 1


def test_streaming_flushes_an_unfinished_character_at_the_end(bpe: BPETokenizer) -> None:
    ids = bpe.encode("🎉")
    assert len(ids) > 1
    assert detokenize_new(bpe, ids[:1], 0) == ("", 0)  # held back
    text, num_sent = detokenize_new(bpe, ids[:1], 0, is_final=True)
    assert text.endswith("\ufffd") and num_sent == 1
    assert detokenize_new(bpe, ids, 0) == ("🎉", len(ids))
    assert detokenize_new(bpe, ids, len(ids)) == ("", len(ids))
