"""The engine charges a later prefill chunk its attention over the earlier
chunks' KV (`LatencyModel.chunk_forward_s`); first chunks cost a forward."""

from __future__ import annotations

import dataclasses

import pytest
from factories import make_profile, make_request
from test_engine import EngineDriver
from test_engine_v2 import iterations, make_engine

from lemix.engine import FirstToken
from lemix.latency import ChunkCoeffs

approx = pytest.approx


def test_later_chunks_pay_for_their_past() -> None:
    base = make_profile(forward_a_s=0.01)  # forward 0.01 + 0.001·ℓ per stage
    # Chunk: the forward's a and b, plus e·n·p and f·p over the cached past.
    chunk = ChunkCoeffs(a=0.01, b=0.001, c=0.0, e=1e-6, f=1e-4)
    ours = dataclasses.replace(base.ours, chunk=(chunk, chunk))
    profile = dataclasses.replace(base, ours=ours)
    engine = make_engine(profile, prefill_token_budget=64)
    driver = EngineDriver(engine)
    driver.add(make_request("r", 0.0, 200, 1))
    driver.run()
    spans = [s.work.prefill_spans for _, s in iterations(driver)]  # type: ignore[attr-defined]
    assert spans == [((0, 64),), ((64, 64),), ((128, 64),), ((192, 8),)]
    durations = [s.duration_s for _, s in iterations(driver)]
    assert durations == [
        approx(0.01 + 0.064),  # first chunk: a forward of 64 tokens
        approx(0.074 + 1e-6 * 64 * 64 + 1e-4 * 64),  # 0.084496
        approx(0.074 + 1e-6 * 64 * 128 + 1e-4 * 128),  # 0.094992
        approx(0.018 + 1e-6 * 8 * 192 + 1e-4 * 192),  # 0.038736
    ]
    # Two stages, one after another, each iteration: 2 · 0.292224 s.
    assert driver.of(FirstToken) == [(approx(2 * 0.292224), FirstToken("r", 0))]


def test_the_same_prompt_unchunked_costs_one_forward() -> None:
    base = make_profile(forward_a_s=0.01)
    chunk = ChunkCoeffs(a=0.01, b=0.001, c=0.0, e=1e-6, f=1e-4)
    profile = dataclasses.replace(base, ours=dataclasses.replace(base.ours, chunk=(chunk, chunk)))
    driver = EngineDriver(make_engine(profile))  # no budget: v1, one chunk
    driver.add(make_request("r", 0.0, 200, 1))
    driver.run()
    assert [s.duration_s for _, s in iterations(driver)] == [approx(0.21)]
