"""Engine v2 on the staged model: chunked prefill spans and micro-batches in flight.

A chunked prefill must give what the whole prompt gives (first token,
inference loss, prompt logprobs, later decodes), and iterations of different
micro-batches running on different stages' threads at once must leave each
request with the tokens it makes alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch

from lemix.model.presets import ModelSpec, build_model
from lemix.model.runner import GenRequest, InferenceRunner, PrefillSpan
from lemix.model.staged import StagedModel

VOCAB = 300


def _staged(num_stages: int = 2) -> StagedModel:
    return StagedModel(build_model(ModelSpec("tiny-llama", vocab_size=VOCAB, seed=3)), num_stages)


def _prompt(n: int, offset: int) -> tuple[int, ...]:
    return tuple((offset + 11 * i) % (VOCAB - 3) + 3 for i in range(n))


def _chunks(num_prompt: int, chunk: int) -> Iterator[PrefillSpan]:
    for start in range(0, num_prompt, chunk):
        yield start, min(chunk, num_prompt - start)


def _step(
    runner: InferenceRunner,
    iteration: int,
    prefill: list[str],
    decode: list[str],
    spans: list[PrefillSpan] | None = None,
) -> list[str]:
    stopped: list[str] = []
    for s in range(runner.staged.num_stages):
        stopped = runner.run_stage(s, iteration, prefill, decode, spans)
    return stopped


def _capture_logits(runner: InferenceRunner) -> list[torch.Tensor]:
    """The last stage's logits [N, vocab] of every iteration, in order."""
    captured: list[torch.Tensor] = []
    real_sample = runner._sample

    def sample(logits, *rest):  # type: ignore[no-untyped-def]
        captured.append(logits.clone())
        return real_sample(logits, *rest)

    runner._sample = sample  # type: ignore[method-assign]
    return captured


def _request(key: str, prompt: tuple[int, ...]) -> GenRequest:
    return GenRequest(
        key, prompt, 6, reference_ids=_prompt(5, 40), top_logprobs=3, prompt_logprobs=2
    )


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_chunked_prefill_gives_what_the_whole_prompt_gives(chunk: int) -> None:
    runner = InferenceRunner(_staged(), eos_id=None)
    prompt = _prompt(17, 2)
    whole = _request("whole", prompt)
    runner.admit(whole)
    captured = _capture_logits(runner)
    _step(runner, 0, ["whole"], [])
    whole_first_row = captured[-1][len(prompt) - 1]
    while len(whole.generated) < whole.max_tokens:
        _step(runner, 1, [], ["whole"])

    # The chunked request prefills while another request decodes beside it,
    # as the engine batches them.
    mate = GenRequest("mate", _prompt(9, 5), 30)
    mate_alone = runner.generate_alone(GenRequest("alone", mate.prompt_ids, 30))
    runner.admit(mate)
    _step(runner, 2, ["mate"], [])
    chunked = _request("chunked", prompt)
    runner.admit(chunked)
    spans = list(_chunks(len(prompt), chunk))
    for i, span in enumerate(spans):
        _step(runner, 3, ["chunked"], ["mate"], [span])
        is_last = i == len(spans) - 1
        assert len(chunked.generated) == (1 if is_last else 0)
        assert (chunked.inference_loss is not None) == is_last
    # Row of the chunk's last prompt token (the chunk goes first in the batch).
    first_row = captured[-1][spans[-1][1] - 1]
    assert torch.allclose(first_row, whole_first_row, atol=1e-4)
    while len(chunked.generated) < chunked.max_tokens:
        _step(runner, 4, [], ["chunked", "mate"])
    while len(mate.generated) < mate.max_tokens:
        _step(runner, 5, [], ["mate"])

    assert chunked.generated == whole.generated
    assert chunked.inference_loss == pytest.approx(whole.inference_loss, rel=1e-4)
    assert len(chunked.prompt_logprob_entries) == len(prompt) - 1
    for got, want in zip(chunked.prompt_logprob_entries, whole.prompt_logprob_entries, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert [e.top[0][0] for e in chunked.logprobs] == [e.top[0][0] for e in whole.logprobs]
    assert mate.generated == mate_alone


def test_prefill_spans_must_follow_the_prompt_in_order() -> None:
    runner = InferenceRunner(_staged(), eos_id=None)
    runner.admit(GenRequest("r", _prompt(10, 1), 4))
    with pytest.raises(ValueError, match="not within"):
        runner.run_stage(0, 0, ["r"], [], [(8, 3)])
    with pytest.raises(ValueError, match="not within"):
        runner.run_stage(0, 0, ["r"], [], [(0, 0)])
    with pytest.raises(ValueError, match="1 prefills but 2"):
        runner.run_stage(0, 0, ["r"], [], [(0, 5), (5, 5)])
    with pytest.raises(ValueError, match="starts at 5 but 0"):
        runner.run_stage(0, 0, ["r"], [], [(5, 5)])
    _step(runner, 0, ["r"], [], [(0, 5)])
    with pytest.raises(ValueError, match="starts at 2 but 5"):
        runner.run_stage(0, 1, ["r"], [], [(2, 5)])


@dataclass
class _Group:
    """One micro-batch: its requests and how far each has got."""

    keys: list[str]
    chunk: int
    prefill: list[str] = field(default_factory=list)
    spans: list[PrefillSpan] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)


def _plan(group: _Group, runner: InferenceRunner) -> bool:
    """The group's next iteration (prefill chunks and decodes); False: all done."""
    group.prefill, group.spans, group.decode = [], [], []
    for key in group.keys:
        req = runner.requests[key]
        if req.num_prefilled < len(req.prompt_ids):
            group.prefill.append(key)
            num = min(group.chunk, len(req.prompt_ids) - req.num_prefilled)
            group.spans.append((req.num_prefilled, num))
        elif len(req.generated) < req.max_tokens:
            group.decode.append(key)
    return bool(group.prefill or group.decode)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_micro_batches_in_flight_on_different_stages_make_each_requests_solo_tokens(
    num_stages: int,
) -> None:
    """M = S groups in a pipeline: at each tick stage s runs the iteration that
    stage s - 1 ran the tick before, all stages at once on their own threads
    (stage 0 runs micro-batch 1 while stage 1 runs micro-batch 0)."""
    runner = InferenceRunner(_staged(num_stages), eos_id=None)
    specs = {
        "greedy": GenRequest("greedy", _prompt(13, 1), 9),
        "seeded": GenRequest("seeded", _prompt(6, 2), 11, temperature=1.0, seed=7),
        "chunked": GenRequest("chunked", _prompt(19, 3), 8),
        "chunked-seeded": GenRequest(
            "chunked-seeded", _prompt(11, 4), 10, temperature=0.8, top_p=0.9, seed=3
        ),
        "late": GenRequest("late", _prompt(7, 5), 6, temperature=1.0, seed=11),
    }
    solo = {
        key: runner.generate_alone(
            GenRequest(
                f"solo-{key}",
                r.prompt_ids,
                r.max_tokens,
                temperature=r.temperature,
                top_p=r.top_p,
                seed=r.seed,
            )
        )
        for key, r in specs.items()
    }
    for req in specs.values():
        runner.admit(req)
    groups = [
        _Group(["greedy", "seeded"], chunk=100),
        _Group(["chunked", "chunked-seeded"], chunk=4),
        _Group(["late"], chunk=3),
    ][:num_stages]
    if num_stages == 2:
        groups[1].keys.append("late")
    pools = [ThreadPoolExecutor(1) for _ in range(num_stages)]
    # in_stage[s]: (group, iteration id) stage s runs this tick.
    in_stage: list[tuple[int, int] | None] = [None] * num_stages
    num_iterations, tick = 0, 0
    is_done = [False] * len(groups)
    while not all(is_done):
        g = tick % len(groups)
        in_stage = [None, *in_stage[:-1]]
        if not is_done[g] and _plan(groups[g], runner):
            in_stage[0] = (g, num_iterations)
            num_iterations += 1
        else:
            is_done[g] = True  # its last iteration left the last stage last tick
        futures = []
        for s, work in enumerate(in_stage):
            if work is None:
                continue
            group = groups[work[0]]
            futures.append(
                pools[s].submit(
                    runner.run_stage,
                    s,
                    work[1],
                    list(group.prefill),
                    list(group.decode),
                    list(group.spans),
                )
            )
        for future in futures:
            future.result()
        assert not runner.take_failures()
        tick += 1
    for pool in pools:
        pool.shutdown()
    assert num_iterations > 10 and not runner._carry
    assert {k: r.generated for k, r in specs.items()} == solo
