"""The sampler on hand-made logits (vLLM's semantics), and on the tiny model
through `InferenceRunner`: filters, penalties, min_tokens, stop_token_ids."""

from __future__ import annotations

import math

import pytest
import torch

from lemix.model.presets import ModelSpec, build_model
from lemix.model.runner import GenRequest, InferenceRunner
from lemix.model.sampling import (
    SamplingState,
    apply_penalties,
    choose_token,
    filter_probs,
)
from lemix.model.staged import StagedModel

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])  # best: 3, then 0, 5, 2, 1, 4


def _draws(state_args: dict[str, float | int], n: int = 300, seed: int = 7) -> set[int]:
    state = SamplingState(seed=seed, **state_args)  # type: ignore[arg-type]
    return {choose_token(LOGITS, state) for _ in range(n)}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    out = apply_penalties(LOGITS, SamplingState(repetition_penalty=2.0), [0, 1], [1, 4])
    expected = torch.tensor([1.0, -2.0, 0.5, 3.0, -4.0, 1.0])
    assert torch.equal(out, expected)
    assert torch.equal(LOGITS, torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0]))  # not in place


def test_frequency_and_presence_penalties_count_the_output_only() -> None:
    state = SamplingState(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(LOGITS, state, prompt_ids=[2, 2, 2], output_ids=[3, 3, 0])
    # token 3: twice (2 x 0.5 + 0.25); token 0: once (0.5 + 0.25); prompt's 2: untouched
    expected = LOGITS.clone()
    expected[3] -= 1.25
    expected[0] -= 0.75
    assert torch.allclose(out, expected)
    negative = apply_penalties(LOGITS, SamplingState(presence_penalty=-1.0), [], [4])
    assert float(negative[4]) == pytest.approx(-1.0)  # < 0 encourages repeats


def test_penalties_change_greedy_choice() -> None:
    assert choose_token(LOGITS, SamplingState()) == 3
    penalised = SamplingState(repetition_penalty=2.0)  # 3 -> 1.5 < 2.0
    assert choose_token(LOGITS, penalised, prompt_ids=[3]) == 0
    assert choose_token(LOGITS, SamplingState(presence_penalty=1.5), output_ids=[3]) == 0


def test_top_k_keeps_the_k_best_and_top_k_1_is_greedy() -> None:
    assert _draws({"temperature": 1.0, "top_k": 1}) == {3}
    assert _draws({"temperature": 1.0, "top_k": 2}) == {3, 0}
    assert _draws({"temperature": 5.0}) == set(range(6))  # no filter: everything shows up


def test_min_p_drops_tokens_below_the_fraction_of_the_best() -> None:
    probs = torch.softmax(LOGITS, dim=-1)
    ratio = probs / probs.max()  # token 0: e^-1 = 0.37, token 5: e^-2 = 0.14
    kept = filter_probs(probs, SamplingState(min_p=0.3))
    assert {int(i) for i in torch.nonzero(kept)} == {int(i) for i in torch.nonzero(ratio >= 0.3)}
    assert _draws({"temperature": 1.0, "min_p": 0.3}) == {3, 0}


def test_top_k_then_top_p_works_on_the_renormalised_remainder() -> None:
    probs = torch.softmax(LOGITS, dim=-1)
    # top_k 2 leaves 3 (0.73) and 0 (0.27) after renormalising; top_p 0.7 keeps 3 alone.
    kept = filter_probs(probs, SamplingState(top_k=2, top_p=0.7))
    assert torch.count_nonzero(kept) == 1 and int(torch.argmax(kept)) == 3


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([0.0, 0.0, 9.0, 8.0, 1.0])  # 2 = EOS is the best, 3 a stop id
    state = SamplingState(min_tokens=2, stop_token_ids=(3,))
    assert choose_token(logits, state, output_ids=[], eos_id=2) == 4
    assert choose_token(logits, state, output_ids=[4], eos_id=2) == 4
    assert choose_token(logits, state, output_ids=[4, 4], eos_id=2) == 2  # reached: unmasked
    assert torch.equal(logits, torch.tensor([0.0, 0.0, 9.0, 8.0, 1.0]))  # logprobs read them after


def test_seeded_sampling_is_reproducible_and_bad_values_are_refused() -> None:
    first = [choose_token(LOGITS, s) for s in [SamplingState(temperature=1.0, seed=3)] * 20]
    again = [choose_token(LOGITS, s) for s in [SamplingState(temperature=1.0, seed=3)] * 20]
    assert first == again
    for bad in (
        SamplingState(top_k=-1),
        SamplingState(min_p=1.5),
        SamplingState(repetition_penalty=0.0),
        SamplingState(presence_penalty=math.nan),
    ):
        with pytest.raises(ValueError, match="invalid|must be"):
            choose_token(LOGITS, bad)
    with pytest.raises(ValueError, match="non-finite"):
        choose_token(torch.tensor([0.0, math.inf]), SamplingState())


# ------------------------------------------------------------ the tiny model

VOCAB = 300
EOS = 2


@pytest.fixture(scope="module")
def runner() -> InferenceRunner:
    staged = StagedModel(build_model(ModelSpec("tiny-llama", vocab_size=VOCAB, seed=3)), 2)
    return InferenceRunner(staged, eos_id=EOS)


PROMPT = tuple(range(10, 40))


def _generate(runner: InferenceRunner, key: str, **sampling: object) -> list[int]:
    return runner.generate_alone(GenRequest(key, PROMPT, 24, **sampling))  # type: ignore[arg-type]


def test_runner_top_k_1_equals_greedy(runner: InferenceRunner) -> None:
    greedy = _generate(runner, "g")
    assert _generate(runner, "k1", temperature=1.5, top_k=1, seed=5) == greedy


def test_runner_huge_repetition_penalty_never_repeats_a_token(runner: InferenceRunner) -> None:
    out = _generate(runner, "r", repetition_penalty=1e6)
    assert not set(out) & set(PROMPT)
    assert len(set(out)) == len(out)  # each output token is penalised once out, too


def test_runner_penalties_change_seeded_output(runner: InferenceRunner) -> None:
    plain = _generate(runner, "p0", temperature=1.0, seed=9)
    assert _generate(runner, "p1", temperature=1.0, seed=9) == plain
    assert _generate(runner, "p2", temperature=1.0, seed=9, frequency_penalty=2.0) != plain
    assert _generate(runner, "p3", temperature=1.0, seed=9, presence_penalty=2.0) != plain


def test_runner_stop_token_ids_end_the_sequence_after_min_tokens(runner: InferenceRunner) -> None:
    greedy = _generate(runner, "s0")
    stop = greedy[2]
    first = greedy.index(stop)
    req = GenRequest("s1", PROMPT, 24, stop_token_ids=(stop,))
    assert runner.generate_alone(req) == greedy[: first + 1]
    assert req.finish_reason == "stop"
    masked = GenRequest("s2", PROMPT, 24, stop_token_ids=(stop,), min_tokens=first + 3)
    out = runner.generate_alone(masked)
    assert len(out) >= first + 3
    assert stop not in out[: first + 3]
