"""The engine charges a later prefill chunk its attention over the earlier
chunks' KV (`LatencyModel.chunk_forward_s`); first chunks cost a forward."""

from __future__ import annotations

import dataclasses

import pytest
from factories import make_profile, make_request
from test_engine import EngineDriver
from test_engine_v2 import iterations, make_engine

from lemix.engine import FirstToken, NodeEngine
from lemix.latency import ChunkCoeffs, LatencyModel

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
    # The budget is time: 64 fresh tokens take 0.074 s. A later chunk takes
    # the most tokens that fit in it after its past: 0.0164 + 0.001064·n ≤
    # 0.074 gives 54 after 64 cached, 0.0218 + 0.001118·n gives 46 after 118;
    # the last 36 after 164 cost 0.068304 s.
    assert spans == [((0, 64),), ((64, 54),), ((118, 46),), ((164, 36),)]
    durations = [s.duration_s for _, s in iterations(driver)]
    assert durations == [
        approx(0.01 + 0.064),  # first chunk: a forward of 64 tokens
        approx(0.01 + 0.001 * 54 + 1e-6 * 54 * 64 + 1e-4 * 64),  # 0.073856
        approx(0.01 + 0.001 * 46 + 1e-6 * 46 * 118 + 1e-4 * 118),  # 0.073228
        approx(0.01 + 0.001 * 36 + 1e-6 * 36 * 164 + 1e-4 * 164),  # 0.068304
    ]
    assert max(durations) <= 0.074 + 1e-12  # no iteration past the budget's time
    # Two stages, one after another, each iteration: 2 · 0.289388 s.
    assert driver.of(FirstToken) == [(approx(2 * 0.289388), FirstToken("r", 0))]


def test_the_same_prompt_unchunked_costs_one_forward() -> None:
    base = make_profile(forward_a_s=0.01)
    chunk = ChunkCoeffs(a=0.01, b=0.001, c=0.0, e=1e-6, f=1e-4)
    profile = dataclasses.replace(base, ours=dataclasses.replace(base.ours, chunk=(chunk, chunk)))
    driver = EngineDriver(make_engine(profile))  # no budget: v1, one chunk
    driver.add(make_request("r", 0.0, 200, 1))
    driver.run()
    assert [s.duration_s for _, s in iterations(driver)] == [approx(0.21)]


@dataclasses.dataclass(frozen=True)
class _NoChunks:
    """The profile's model, except that pricing a chunk with a past fails."""

    base: LatencyModel
    name: str = "no-chunks"

    @property
    def num_stages(self) -> int:
        return self.base.num_stages

    def forward_s(self, stage: int, batch_size: int, num_tokens: int) -> float:
        return self.base.forward_s(stage, batch_size, num_tokens)

    def backward_s(self, stage: int, batch_size: int, num_tokens: int) -> float:
        return self.base.backward_s(stage, batch_size, num_tokens)

    def decode_step_s(self, stage: int, batch_size: int, sum_context_tokens: int) -> float:
        return self.base.decode_step_s(stage, batch_size, sum_context_tokens)

    def chunk_forward_s(self, stage: int, num_new_tokens: int, num_past_tokens: int) -> float:
        raise AssertionError("an unchunked engine priced a chunk with a past")


@pytest.mark.parametrize("num_micro_batches", [1, None])
def test_without_a_budget_no_chunk_is_priced_with_a_past(num_micro_batches: int | None) -> None:
    """v1 (and micro-batches without chunking) price prefill exactly as before:
    only `forward_s` and `decode_step_s`, so their predictions are unchanged."""
    profile = make_profile(forward_a_s=0.01)
    config = make_engine(profile, num_micro_batches=num_micro_batches).config
    driver = EngineDriver(NodeEngine(0, profile, _NoChunks(profile.ours), config))
    for i, num_prompt in enumerate((200, 50, 900, 10, 300)):
        driver.add(make_request(f"r{i}", 0.01 * i, num_prompt, 5))
    driver.run()
    assert len(driver.of(FirstToken)) == 5
    with pytest.raises(AssertionError, match="with a past"):
        chunked = EngineDriver(
            NodeEngine(
                0,
                profile,
                _NoChunks(profile.ours),
                make_engine(profile, prefill_token_budget=64).config,
            )
        )
        chunked.add(make_request("r", 0.0, 200, 1))
        chunked.run()


def test_a_shrunk_later_chunk_uses_up_its_whole_share_of_the_budget() -> None:
    # The later chunk of "r" takes 54 tokens but the time of 64: the budget is
    # spent, so "s", waiting since iteration 1, gets no 10 tokens squeezed into
    # iteration 2 (which would run past the budget's time); it joins once r's
    # last chunk leaves budget time over.
    base = make_profile(forward_a_s=0.01)
    chunk = ChunkCoeffs(a=0.01, b=0.001, c=0.0, e=1e-6, f=1e-4)
    profile = dataclasses.replace(base, ours=dataclasses.replace(base.ours, chunk=(chunk, chunk)))
    driver = EngineDriver(make_engine(profile, prefill_token_budget=64))
    driver.add(make_request("r", 0.0, 200, 1))
    driver.add(make_request("s", 0.01, 30, 1))
    driver.run()
    starts = iterations(driver)
    spans = [
        list(zip([r.task.task_id for r in s.work.prefill], s.work.prefill_spans, strict=True))  # type: ignore[attr-defined]
        for _, s in starts
    ]
    assert spans[0] == [("r", (0, 64))]
    assert spans[1] == [("r", (64, 54))]  # and nothing for "s"
    assert spans[2] == [("r", (118, 46))]
    assert spans[3] == [("r", (164, 36)), ("s", (0, 5))]  # 36 after 164 leave 5 tokens' time
    assert spans[4] == [("s", (5, 25))]
    assert max(s.duration_s for _, s in starts) <= 0.074 + 1e-12
