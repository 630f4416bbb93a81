"""Batched attention of a mixed iteration equals each request run alone."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from lemix.model.presets import ModelSpec, build_model
from lemix.model.staged import Segment, StagedModel

FAMILIES = ["tiny-llama", "tiny-gpt2"]  # GQA (4 heads over 2 KV heads) and plain MHA
VOCAB = 300


def _staged(name: str) -> StagedModel:
    return StagedModel(build_model(ModelSpec(name, vocab_size=VOCAB, seed=2)), 2)


def _ids(n: int, offset: int) -> list[int]:
    return [(offset + 13 * i) % (VOCAB - 3) + 3 for i in range(n)]


@torch.no_grad()
def _forward(
    staged: StagedModel, chunks: Sequence[tuple[str | None, list[int], int, int]]
) -> list[torch.Tensor]:
    """One iteration: per request (cache key, its new ids, first position,
    num_cached). Returns each request's logits rows [n, vocab]."""
    ids: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    for key, new_ids, first, num_cached in chunks:
        start = len(ids)
        ids.extend(new_ids)
        positions.extend(range(first, first + len(new_ids)))
        segments.append(Segment(start, len(ids), key, num_cached))
    x: torch.Tensor = torch.tensor(ids)
    for stage in staged.stages:
        x = stage.forward(x, torch.tensor(positions), segments)
    return [x[0, s.start : s.end] for s in segments]


def _allocate(staged: StagedModel, key: str, capacity: int) -> None:
    for stage in staged.stages:
        stage.kv.allocate(key, capacity)


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prefill_equals_unchunked(name: str) -> None:
    staged = _staged(name)
    prompt = _ids(30, 1)
    expected = staged.logits(prompt)
    _allocate(staged, "r", 30)
    rows, done = [], 0
    for size in (10, 12, 8):
        chunk = prompt[done : done + size]
        rows += _forward(staged, [("r", chunk, done, size)])
        done += size
    torch.testing.assert_close(torch.cat(rows), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_mixed_iteration_equals_each_request_alone(name: str) -> None:
    """Prefills, a second chunk after a cached past, a scored prompt (only part
    of it cached), a cache-less sample and decodes of different lengths, all in
    one packed iteration, in an order that interleaves the kinds."""
    staged = _staged(name)
    prompts = {
        key: _ids(n, i)
        for i, (key, n) in enumerate(
            [("long", 40), ("short", 5), ("chunk", 19), ("fresh", 11), ("scored", 9), ("one", 1)]
        )
    }
    for key, prompt in prompts.items():
        _allocate(staged, key, len(prompt) + 4)
    # Earlier iterations fill the pasts: whole prompts of the decoders, the
    # first chunk of "chunk".
    past = {"long": 39, "short": 4, "chunk": 12}
    _forward(staged, [(k, prompts[k][:n], 0, n) for k, n in past.items()])
    sample = _ids(7, 50)
    rows = _forward(
        staged,
        [
            ("long", prompts["long"][39:], 39, 1),  # decode after 39
            ("fresh", prompts["fresh"], 0, 11),  # whole prefill
            ("short", prompts["short"][4:], 4, 1),  # decode after 4
            ("chunk", prompts["chunk"][12:], 12, 7),  # chunk 2 after a cached past
            (None, sample, 0, 0),  # a training sample: no cache
            ("scored", prompts["scored"], 0, 6),  # prompt + reference: 6 cached
            ("one", prompts["one"], 0, 1),  # one-token prompt: a decode-shaped prefill
        ],
    )
    alone = {key: staged.logits(prompt) for key, prompt in prompts.items()}
    expected = [
        alone["long"][39:],
        alone["fresh"],
        alone["short"][4:],
        alone["chunk"][12:],
        staged.logits(sample),
        alone["scored"],
        alone["one"],
    ]
    for got, want in zip(rows, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    lengths = {"long": 40, "short": 5, "chunk": 19, "fresh": 11, "scored": 6, "one": 1}
    for stage in staged.stages:
        assert {k: stage.kv.get(k).length for k in lengths} == lengths
    # The scored request's cache holds its first 6 positions: a decode of
    # token 6 after them sees what the full prompt saw there.
    (row,) = _forward(staged, [("scored", prompts["scored"][6:7], 6, 1)])
    torch.testing.assert_close(row, alone["scored"][6:7], rtol=1e-5, atol=1e-5)


def test_decodes_of_different_lengths_batched_equal_alone_over_steps() -> None:
    staged = _staged("tiny-llama")
    seqs = {"a": _ids(20, 3), "b": _ids(20, 4), "c": _ids(20, 5)}
    starts = {"a": 2, "b": 9, "c": 15}
    for key in seqs:
        _allocate(staged, key, 20)
    _forward(staged, [(k, seqs[k][:n], 0, n) for k, n in starts.items()])
    got: dict[str, list[torch.Tensor]] = {k: [] for k in seqs}
    for step in range(5):
        chunks = [(k, [seqs[k][n + step]], n + step, 1) for k, n in starts.items()]
        for (key, *_), row in zip(chunks, _forward(staged, chunks), strict=True):
            got[key].append(row)
    for key, n in starts.items():
        want = staged.logits(seqs[key][: n + 5])[n:]
        torch.testing.assert_close(torch.cat(got[key]), want, rtol=1e-5, atol=1e-5)


def test_a_write_past_the_capacity_is_refused_not_spilled_into_a_neighbour() -> None:
    staged = _staged("tiny-llama")
    _allocate(staged, "small", 4)
    _allocate(staged, "next", 4)
    _forward(staged, [("next", _ids(4, 1), 0, 4)])
    before = [t.clone() for t in staged.stages[0].kv.get("next").keys]
    with pytest.raises(ValueError, match="capacity 4"):
        _forward(staged, [("small", _ids(5, 2), 0, 5)])
    after = staged.stages[0].kv.get("next").keys
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
