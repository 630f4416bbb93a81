"""ShareGPT streaming parser: pairs, truncated tails, malformed input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lemix.workload import iter_sharegpt_conversations, read_sharegpt_pairs
from lemix.workload.sharegpt import conversation_pairs

CONVS = [
    {
        "id": "a",
        "conversations": [
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
            {"from": "human", "value": "how are you?"},
            {"from": "gpt", "value": 'fine, "thanks" \\ \u00e9'},
        ],
    },
    {
        "id": "b",
        "conversations": [
            {"from": "gpt", "value": "unprompted"},
            {"from": "human", "value": "first"},
            {"from": "human", "value": "second"},
            {"from": "gpt", "value": "answer to second"},
            {"from": "human", "value": "dangling"},
        ],
    },
    {
        "id": "c",
        "conversations": [
            {"from": "human", "value": "x" * 300},
            {"from": "gpt", "value": "y" * 300},
        ],
        "extra": [1, 2.5, True, None, {"k": "v"}],
    },
]
PAIRS_AB = [
    ("hi", "hello"),
    ("how are you?", 'fine, "thanks" \\ \u00e9'),
    ("second", "answer to second"),
]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sharegpt.json"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("chunk_chars", [3, 64, 1 << 16])
def test_full_file_yields_all_pairs(tmp_path: Path, chunk_chars: int) -> None:
    path = write(tmp_path, json.dumps(CONVS, indent=1))
    pairs = read_sharegpt_pairs(path, chunk_chars=chunk_chars)
    assert pairs == [*PAIRS_AB, ("x" * 300, "y" * 300)]
    assert read_sharegpt_pairs(path, max_pairs=2) == PAIRS_AB[:2]


@pytest.mark.parametrize("indent", [None, 2])
def test_truncated_tail_yields_exactly_complete_conversations(
    tmp_path: Path, indent: int | None
) -> None:
    text = json.dumps(CONVS, indent=indent, ensure_ascii=False)
    third = text.rindex("{", 0, text.index('"id": "c"'))  # where "c" starts
    end_third = len(text.rstrip().rstrip("]").rstrip())
    for cut in range(third - 2, end_third):  # every cut from just before "c" to its end
        path = write(tmp_path, text[:cut])
        ids = [c["id"] for c in iter_sharegpt_conversations(path, chunk_chars=17)]
        assert ids == ["a", "b"], cut
        assert read_sharegpt_pairs(path, chunk_chars=17) == PAIRS_AB
    # Cut right after the closing brace of "c": all three are complete.
    path = write(tmp_path, text[:end_third])
    assert [c["id"] for c in iter_sharegpt_conversations(path)] == ["a", "b", "c"]


def test_empty_array_and_empty_file_cut(tmp_path: Path) -> None:
    assert read_sharegpt_pairs(write(tmp_path, "[]")) == []
    assert read_sharegpt_pairs(write(tmp_path, " [ ")) == []


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"id": "a"}', "top-level JSON array"),
        ("[1, 2]", "not an object"),
        ('[{"id": "a", "conversations": []}, {"id": oops}, {"id": "c"}]', "malformed"),
    ],
)
def test_bad_files_raise(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        list(iter_sharegpt_conversations(write(tmp_path, text)))


def test_conversation_pairs_ignores_bad_turns() -> None:
    conv = {
        "conversations": [
            {"from": "user", "value": "q"},
            {"from": "assistant", "value": "a"},
            {"from": "human", "value": ""},
            {"from": "gpt", "value": "empty prompt"},
            "not a turn",
            {"from": "human", "value": 3},
            {"from": "gpt", "value": "x"},
        ]
    }
    assert conversation_pairs(conv) == [("q", "a")]
    assert conversation_pairs({"id": "no turns"}) == []
