"""Serving on the staged model: continuous batching, KV offload, sampling, loss."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from lemix.model.presets import ModelSpec, build_model
from lemix.model.runner import GenRequest, InferenceRunner, reference_accuracy, token_logprob
from lemix.model.staged import StagedModel

VOCAB = 300
EOS = 2


def _staged(name: str = "tiny-llama") -> StagedModel:
    return StagedModel(build_model(ModelSpec(name, vocab_size=VOCAB, seed=3)), 2)


def _prompt(n: int, offset: int) -> tuple[int, ...]:
    return tuple((offset + 11 * i) % (VOCAB - 3) + 3 for i in range(n))


def _step(
    runner: InferenceRunner, iteration: int, prefill: list[str], decode: list[str]
) -> list[str]:
    stopped: list[str] = []
    for s in range(runner.staged.num_stages):
        stopped = runner.run_stage(s, iteration, prefill, decode)
    return stopped


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_continuous_batching_gives_each_request_its_solo_greedy_tokens(name: str) -> None:
    staged = _staged(name)
    runner = InferenceRunner(staged, eos_id=None)
    specs = [("a", _prompt(5, 1), 12), ("b", _prompt(17, 2), 7), ("c", _prompt(9, 3), 10)]
    solo = {
        key: runner.generate_alone(GenRequest(key, prompt, max_tokens))
        for key, prompt, max_tokens in specs
    }
    # Staggered joins, as Algorithm 3 admits them: a, then b and c join later.
    reqs = {key: GenRequest(key, prompt, max_tokens) for key, prompt, max_tokens in specs}
    for req in reqs.values():
        runner.admit(req)
    running: list[str] = []
    joins = {0: ["a"], 3: ["b", "c"]}
    for it in range(40):
        prefill = joins.get(it, [])
        _step(runner, it, prefill, running)
        running = [k for k in running + prefill if len(reqs[k].generated) < reqs[k].max_tokens]
        if not running and it > 3:
            break
    assert {k: r.generated for k, r in reqs.items()} == solo


def test_offload_then_reload_gives_identical_next_token_logits() -> None:
    staged = _staged()
    runner = InferenceRunner(staged, eos_id=None)
    captured: list[torch.Tensor] = []
    real_sample = runner._sample

    def sample(logits, *rest):  # type: ignore[no-untyped-def]
        captured.append(logits.clone())
        return real_sample(logits, *rest)

    runner._sample = sample  # type: ignore[method-assign]

    def decode_after(offload: bool) -> torch.Tensor:
        req = GenRequest(f"r{offload}", _prompt(23, 5), 8)
        runner.admit(req)
        _step(runner, 0, [req.key], [])
        _step(runner, 1, [], [req.key])
        if offload:
            moved = runner.offload(req.key)
            assert moved == sum(st.kv.bytes_per_token() for st in staged.stages) * (23 + 8)
            assert all(st.kv.device_bytes == 0 for st in staged.stages)
            assert runner.reload(req.key) == moved
        _step(runner, 2, [], [req.key])
        runner.release(req.key)
        return captured[-1]

    assert torch.equal(decode_after(offload=False), decode_after(offload=True))
    assert all(st.kv.device_bytes == 0 and st.kv.host_bytes == 0 for st in staged.stages)


def test_inference_loss_is_teacher_forced_cross_entropy_on_the_reference() -> None:
    staged = _staged()
    reference_model = copy.deepcopy(staged.model)
    runner = InferenceRunner(staged, eos_id=None)
    prompt, answer = _prompt(14, 7), _prompt(6, 9)
    req = GenRequest("r", prompt, 4, reference_ids=answer)
    tokens = runner.generate_alone(req)
    with torch.no_grad():
        logits = reference_model(torch.tensor([prompt + answer])).logits[0]
    expected = F.cross_entropy(logits[len(prompt) - 1 : -1], torch.tensor(answer))
    assert req.inference_loss == pytest.approx(float(expected), rel=1e-5)
    # The reference does not leak into generation: same tokens without it.
    assert tokens == runner.generate_alone(GenRequest("s", prompt, 4))


def test_reference_accuracy_is_the_teacher_forced_top1_hit_rate() -> None:
    staged = _staged()
    reference_model = copy.deepcopy(staged.model)
    prompt = _prompt(12, 3)
    # A reference the model predicts at even positions only: its greedy token
    # there, a different one at odd positions, so the expected rate is 3/6.
    answer: list[int] = []
    with torch.no_grad():
        for i in range(6):
            best = int(
                reference_model(torch.tensor([prompt + tuple(answer)])).logits[0, -1].argmax()
            )
            answer.append(best if i % 2 == 0 else (best + 1) % VOCAB)
        logits = reference_model(torch.tensor([prompt + tuple(answer)])).logits[0]
    direct = (logits[len(prompt) - 1 : -1].argmax(dim=-1) == torch.tensor(answer)).float().mean()
    assert float(direct) == pytest.approx(0.5)
    req = GenRequest("r", prompt, 2, reference_ids=tuple(answer))
    InferenceRunner(staged, eos_id=None).generate_alone(req)
    assert req.reference_accuracy == pytest.approx(float(direct))


def test_reference_accuracy_counts_argmax_hits_lowest_id_on_ties() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [1.0, 1.0, 0.0], [3.0, 0.0, 0.0]])
    assert reference_accuracy(logits, torch.tensor([1, 0, 2])) == pytest.approx(2 / 3)
    assert reference_accuracy(logits, torch.tensor([2, 1, 1])) == 0.0


def test_eos_stops_a_request_unless_ignored() -> None:
    staged = _staged()
    runner = InferenceRunner(staged, eos_id=None)
    first = runner.generate_alone(GenRequest("probe", _prompt(8, 1), 1))[0]
    runner.eos_id = first  # make the greedy first token the end-of-sequence
    req = GenRequest("r", _prompt(8, 1), 10)
    runner.admit(req)
    assert _step(runner, 0, ["r"], []) == ["r"]
    assert req.finish_reason == "stop" and req.generated == [first]
    ignoring = GenRequest("i", _prompt(8, 1), 3, ignore_eos=True)
    assert len(runner.generate_alone(ignoring)) == 3
    assert ignoring.finish_reason == "length"


def test_sampling_is_reproducible_per_seed_and_top_p_one_token_is_greedy() -> None:
    runner = InferenceRunner(_staged(), eos_id=None)
    prompt = _prompt(10, 4)

    def run(key: str, **kw: float) -> list[int]:
        return runner.generate_alone(GenRequest(key, prompt, 12, **kw))  # type: ignore[arg-type]

    assert run("a", temperature=1.0, seed=5) == run("b", temperature=1.0, seed=5)
    assert run("a", temperature=1.0, seed=5) != run("c", temperature=1.0, seed=6)
    # top_p tiny keeps only the most likely token: same as greedy.
    assert run("d", temperature=0.7, top_p=1e-6, seed=1) == run("e")


def test_admit_refuses_what_exceeds_the_model_positions() -> None:
    runner = InferenceRunner(_staged(), eos_id=None)
    with pytest.raises(ValueError, match="positions"):
        runner.admit(GenRequest("r", _prompt(10, 1), 5000))
    with pytest.raises(ValueError, match="no prompt"):
        runner.admit(GenRequest("r", (), 5))


def test_logprobs_of_a_mixed_batch_come_from_each_requests_own_rows() -> None:
    """The last stage computes logits only for the rows sampling reads: all of
    a prompt_logprobs request's, one row of the others. Each request's
    logprobs and first token must still be those of its own full-prompt logits."""
    staged = _staged()
    runner = InferenceRunner(staged, eos_id=None)
    specs = {"plain": _prompt(7, 1), "scored": _prompt(9, 2), "top": _prompt(5, 3)}
    reqs = {
        "plain": GenRequest("plain", specs["plain"], 3),
        "scored": GenRequest("scored", specs["scored"], 3, prompt_logprobs=2),
        "top": GenRequest("top", specs["top"], 3, top_logprobs=1),
    }
    for req in reqs.values():
        runner.admit(req)
    _step(runner, 0, ["plain", "scored", "top"], [])
    alone = {key: staged.logits(prompt) for key, prompt in specs.items()}
    for key, req in reqs.items():
        assert req.generated == [int(alone[key][-1].argmax())]
    want = [
        token_logprob(row, t, 2)
        for row, t in zip(alone["scored"], specs["scored"][1:], strict=False)
    ]
    got = reqs["scored"].prompt_logprob_entries
    assert [e.top[0][0] for e in got] == [e.top[0][0] for e in want]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-5)
    top_want = token_logprob(alone["top"][-1], reqs["top"].generated[0], 1)
    assert reqs["top"].logprobs[0].logprob == pytest.approx(top_want.logprob, abs=1e-5)


def test_batched_greedy_fails_only_the_request_with_non_finite_logits() -> None:
    runner = InferenceRunner(_staged(), eos_id=None)
    for key in ("nan", "inf", "ok"):
        runner.requests[key] = GenRequest(key, _prompt(3, 1), 5, generated=[4])
    logits = torch.zeros(3, VOCAB)
    logits[0, 7] = math.nan
    logits[1, 9] = -math.inf
    logits[2, 11] = 1.0
    assert runner._sample(logits, [], [], ["nan", "inf", "ok"], [0, 1, 2]) == []
    assert set(runner.take_failures()) == {"nan", "inf"}
    assert runner.requests["ok"].generated == [4, 11]
    assert runner.requests["nan"].generated == [4]
