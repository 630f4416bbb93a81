"""hh-rlhf JSON lines reader and seeded train/eval split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lemix.workload import iter_hh_pairs, read_hh_pairs, split_pairs
from lemix.workload.hh_jsonl import pair_num_tokens


def write_lines(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "hh.json"
    path.write_text("\n".join(lines) + "\n")
    return path


def row(i: int) -> str:
    return json.dumps({"query": f"q{i} [/INST] ", "reference": f"r{i}"})


def test_reads_pairs_and_skips_blank_lines(tmp_path: Path) -> None:
    path = write_lines(tmp_path, [row(0), "", "   ", row(1), row(2)])
    assert read_hh_pairs(path) == [
        ("q0 [/INST] ", "r0"),
        ("q1 [/INST] ", "r1"),
        ("q2 [/INST] ", "r2"),
    ]
    assert read_hh_pairs(path, limit=2) == read_hh_pairs(path)[:2]
    assert list(iter_hh_pairs(path)) == read_hh_pairs(path)


@pytest.mark.parametrize(
    "bad",
    ['{"query": "x", "reference": ', "[1, 2]", '{"query": "x"}', '{"query": 1, "reference": "y"}'],
)
def test_malformed_line_names_its_number(tmp_path: Path, bad: str) -> None:
    path = write_lines(tmp_path, [row(0), "", bad, row(1)])
    with pytest.raises(ValueError, match=r"hh\.json:3:"):
        read_hh_pairs(path)


def test_split_is_deterministic_disjoint_and_sized() -> None:
    pairs = [(f"q{i}", f"r{i}") for i in range(100)]
    train, evals = split_pairs(pairs, eval_fraction=0.2, seed=5)
    assert (train, evals) == split_pairs(pairs, eval_fraction=0.2, seed=5)
    assert len(evals) == 20 and len(train) == 80
    assert sorted(train + evals) == sorted(pairs)
    assert train == [p for p in pairs if p in train]  # file order kept
    assert split_pairs(pairs, eval_fraction=0.2, seed=6)[1] != evals


def test_split_edges() -> None:
    pairs = [("a", "b"), ("c", "d")]
    assert split_pairs(pairs, eval_fraction=0.0) == (pairs, [])
    assert split_pairs(pairs, eval_fraction=1.0) == ([], pairs)
    with pytest.raises(ValueError):
        split_pairs(pairs, eval_fraction=1.5)


def test_token_estimate_is_ceil_chars_over_four() -> None:
    query, ref = pair_num_tokens([("a" * 8, "b" * 9), ("", "c")])
    assert query.tolist() == [2, 1]  # empty text still counts as one token
    assert ref.tolist() == [3, 1]
