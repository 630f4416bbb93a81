"""Anthropic HH-RLHF as JSON lines of {"query", "reference"} pairs.

Each line: `query` is the dialogue so far (Llama-2-chat format, ending in
"[/INST] "), `reference` the next assistant turn. Training tasks use a pair's
length (query + reference); the inference loss is the serving weights'
cross-entropy on the reference. The file is read line by line, never whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from lemix.workload.base import DEFAULT_CHARS_PER_TOKEN, estimate_num_tokens

Pair = tuple[str, str]  # (query, reference)


def iter_hh_pairs(path: str | Path) -> Iterator[Pair]:
    """Yield (query, reference) per non-blank line.

    Raises ValueError naming the 1-based line number for a line that is not a
    JSON object with string `query` and `reference` fields.
    """
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            yield _parse_line(line, path, line_no)


def _parse_line(line: str, path: str | Path, line_no: int) -> Pair:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{line_no}: malformed JSON: {e.msg}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path}:{line_no}: expected a JSON object")
    query, reference = obj.get("query"), obj.get("reference")
    if not isinstance(query, str) or not isinstance(reference, str):
        raise ValueError(f"{path}:{line_no}: need string fields 'query' and 'reference'")
    return query, reference


def read_hh_pairs(path: str | Path, *, limit: int | None = None) -> list[Pair]:
    """All (query, reference) pairs of the file, or the first `limit` of them."""
    pairs: list[Pair] = []
    for pair in iter_hh_pairs(path):
        if limit is not None and len(pairs) >= limit:
            break
        pairs.append(pair)
    return pairs


def split_pairs(
    pairs: Sequence[Pair], *, eval_fraction: float = 0.1, seed: int = 0
) -> tuple[list[Pair], list[Pair]]:
    """Deterministic seeded (train, eval) split; eval gets round(n·fraction) pairs.

    Both parts keep the file order, so a split is readable and stable.
    """
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    n = len(pairs)
    num_eval = round(n * eval_fraction)
    perm = np.random.default_rng(np.random.SeedSequence([seed])).permutation(n)
    is_eval = np.zeros(n, dtype=bool)
    is_eval[perm[:num_eval]] = True
    train = [p for p, e in zip(pairs, is_eval, strict=True) if not e]
    evals = [p for p, e in zip(pairs, is_eval, strict=True) if e]
    return train, evals


def pair_num_tokens(
    pairs: Sequence[Pair], chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
) -> tuple[np.ndarray, np.ndarray]:
    """Estimated (query tokens, reference tokens) per pair, each >= 1."""
    query = np.array([estimate_num_tokens(q, chars_per_token) for q, _ in pairs], dtype=np.int64)
    ref = np.array([estimate_num_tokens(r, chars_per_token) for _, r in pairs], dtype=np.int64)
    return query, ref
