"""The staged model computes what the unsplit Hugging Face model computes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lemix.model.presets import ModelSpec, build_model
from lemix.model.staged import Segment, StagedModel, split_layers
from lemix.model.training import PipelineTrainer, Sample, TrainingConfig

FAMILIES = ["tiny-llama", "tiny-gpt2"]
VOCAB = 300


def _model(name: str, seed: int = 1) -> torch.nn.Module:
    return build_model(ModelSpec(name, vocab_size=VOCAB, seed=seed))


def _ids(n: int, offset: int = 5) -> list[int]:
    return [(offset + 7 * i) % VOCAB for i in range(n)]


def test_split_layers_even_and_remainder_first() -> None:
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    with pytest.raises(ValueError, match="num_stages"):
        split_layers(2, 3)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_prefill_logits_equal_unsplit(name: str, num_stages: int) -> None:
    model = _model(name)
    reference = copy.deepcopy(model)
    staged = StagedModel(model, num_stages)
    ids = _ids(37)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(staged.logits(ids), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_kv_cached_decode_equals_unsplit(name: str) -> None:
    model = _model(name)
    reference = copy.deepcopy(model)
    staged = StagedModel(model, 2)
    ids = _ids(30)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    for stage in staged.stages:
        stage.kv.allocate("r", len(ids))
    rows = []
    with torch.no_grad():
        x: torch.Tensor = torch.tensor(ids[:12])
        for stage in staged.stages:
            x = stage.forward(x, torch.arange(12), [Segment(0, 12, "r", 12)])
        rows.append(x[0])
        for t in range(12, len(ids)):
            x = torch.tensor([ids[t]])
            for stage in staged.stages:
                x = stage.forward(x, torch.tensor([t]), [Segment(0, 1, "r", 1)])
            rows.append(x[0])
    torch.testing.assert_close(torch.cat(rows), expected, rtol=1e-4, atol=1e-5)
    assert all(stage.kv.get("r").length == len(ids) for stage in staged.stages)


def test_packed_ragged_batch_equals_each_alone() -> None:
    staged = StagedModel(_model("tiny-llama"), 2)
    a, b = _ids(9), _ids(21, offset=11)
    alone = [staged.logits(a), staged.logits(b)]
    with torch.no_grad():
        x: torch.Tensor = torch.tensor(a + b)
        positions = torch.tensor(list(range(9)) + list(range(21)))
        for stage in staged.stages:
            x = stage.forward(x, positions, [Segment(0, 9), Segment(9, 30)])
    torch.testing.assert_close(x[0, :9], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x[0, 9:], alone[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_staged_backward_gradients_equal_monolithic(name: str) -> None:
    model = _model(name)
    mono = copy.deepcopy(model)
    ids = _ids(24)
    num_ref = 8
    logits = mono(torch.tensor([ids])).logits[0]
    F.cross_entropy(logits[-num_ref - 1 : -1], torch.tensor(ids[-num_ref:])).backward()
    expected = {name_: p.grad for name_, p in mono.named_parameters()}

    staged = StagedModel(model, 2)
    trainer = PipelineTrainer(staged, TrainingConfig(max_grad_norm=0))
    names = {id(p): n for n, p in model.named_parameters()}
    trainer.forward(0, "t", [Sample(tuple(ids), num_ref)])
    trainer.forward(1, "t")
    trainer.backward(1, "t")
    trainer.backward(0, "t")
    # The gradients wait in the stages until their optimizer steps.
    captured = {names[id(p)]: p.grad.clone() for stage in staged.stages for p in stage.parameters()}
    assert set(captured) == set(expected)
    for key, grad in expected.items():
        torch.testing.assert_close(captured[key], grad, rtol=1e-4, atol=1e-6, msg=key)


def test_training_changes_weights_and_lowers_loss() -> None:
    staged = StagedModel(_model("tiny-llama"), 2)
    trainer = PipelineTrainer(staged, TrainingConfig(learning_rate=1e-3))
    sample = Sample(tuple(_ids(32)), 12)
    before_loss = trainer.loss([sample])
    before = [p.detach().clone() for p in staged.stages[0].parameters()]
    for step in range(6):
        for s in range(2):
            trainer.forward(s, f"t{step}", [sample] if s == 0 else [])
        trainer.backward(1, f"t{step}")
        assert trainer.optimizer_step(1, f"t{step}") is None
        trainer.backward(0, f"t{step}")
        assert trainer.optimizer_step(0, f"t{step}") is not None  # stage 0: the loss
    after = staged.stages[0].parameters()
    assert any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
    assert trainer.num_steps == [6, 6]
    assert trainer.loss([sample]) < before_loss - 0.5


def test_in_flight_backward_uses_the_weights_its_forward_used() -> None:
    """Two tasks in flight, the first stepping each stage before the second's
    backward gets there: the second's gradients must be those of the weights
    its forward used (stashed), i.e. equal to running it alone from the start."""
    sa, sb = Sample(tuple(_ids(20)), 6), Sample(tuple(_ids(20, offset=3)), 6)

    def run(interleaved: bool) -> dict[int, list[torch.Tensor]]:
        staged = StagedModel(_model("tiny-llama"), 2)
        trainer = PipelineTrainer(staged, TrainingConfig(max_grad_norm=0))
        grads: dict[int, list[torch.Tensor]] = {}

        def fwd(key: str, sample: Sample) -> None:
            trainer.forward(0, key, [sample])
            trainer.forward(1, key)

        def bwd(key: str, stage: int) -> None:
            trainer.backward(stage, key)
            if key == "a":
                grads[stage] = [p.grad.clone() for p in staged.stages[stage].parameters()]
            trainer.optimizer_step(stage, key)

        if interleaved:
            fwd("b", sb)
            fwd("a", sa)
            bwd("b", 1)  # steps stage 1 while a's stage-1 graph is live
            bwd("a", 1)
            bwd("b", 0)  # steps stage 0 while a's stage-0 graph is live
            bwd("a", 0)
            assert [st.num_snapshots for st in trainer.stashes] == [1, 1]
        else:
            fwd("a", sa)
            bwd("a", 1)
            bwd("a", 0)
        return grads

    interleaved, alone = run(True), run(False)
    for stage in (0, 1):
        for got, want in zip(interleaved[stage], alone[stage], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
