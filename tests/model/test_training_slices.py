"""Training in slices (layer groups) equals training in whole passes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lemix.model.presets import ModelSpec, build_model
from lemix.model.runner import GenRequest, InferenceRunner
from lemix.model.staged import StagedModel
from lemix.model.training import PipelineTrainer, Sample, TrainingConfig, unit_group

VOCAB = 300
SAMPLE = Sample(tuple((5 + 7 * i) % VOCAB for i in range(24)), 8)
OTHER = Sample(tuple((3 + 11 * i) % VOCAB for i in range(20)), 6)

# Gradients (before each step) and updated weights, per parameter name.
Grads = dict[str, torch.Tensor]


def _trainer(name: str = "tiny-llama", max_grad_norm: float = 0.0) -> PipelineTrainer:
    staged = StagedModel(build_model(ModelSpec(name, vocab_size=VOCAB, seed=1)), 2)
    return PipelineTrainer(staged, TrainingConfig(max_grad_norm=max_grad_norm))


class Capture:
    """Records each parameter's gradient as the optimizer is about to step it,
    per task (`task`: the one whose backward runs now)."""

    def __init__(self, trainer: PipelineTrainer) -> None:
        self.task = ""
        self.grads: dict[str, Grads] = {}
        names = {id(p): n for n, p in trainer.staged.model.named_parameters()}
        real_step = trainer._step

        def step(stage_index: int, params: list[torch.nn.Parameter] | None = None) -> None:
            grads = self.grads.setdefault(self.task, {})
            for p in params or trainer.staged.stages[stage_index].parameters():
                assert p.grad is not None, "stepping a parameter with no gradient"
                assert names[id(p)] not in grads, "a parameter stepped twice in one task"
                grads[names[id(p)]] = p.grad.clone()
            real_step(stage_index, params)

        trainer._step = step  # type: ignore[method-assign]


def _weights(trainer: PipelineTrainer) -> Grads:
    return {n: p.detach().clone() for n, p in trainer.staged.model.named_parameters()}


def _train(
    trainer: PipelineTrainer,
    key: str,
    sample: Sample,
    forward_counts: tuple[int, int] | None,
    backward_counts: tuple[int, int] | None,
    between: Callable[[], None] = lambda: None,
    capture: Capture | None = None,
    step_counts: tuple[int, int] | None = None,
) -> float | None:
    """One task through both stages; counts per stage (None: whole passes;
    the optimizer steps in `backward_counts` slices unless `step_counts` says
    otherwise); `between` runs after every slice (an inference iteration,
    another task...). Each stage steps after its backward; stage 0's backward
    runs before stage 1's step, as the engine may run it (the step is off the
    backward chain)."""
    step_counts = step_counts or backward_counts
    if capture is not None:
        capture.task = key
    for s in (0, 1):
        if forward_counts is None:
            trainer.forward(s, key, [sample] if s == 0 else [])
            continue
        for i in range(forward_counts[s]):
            trainer.forward(s, key, [sample] if s == 0 else [], part=(i, forward_counts[s]))
            between()
    for s in (1, 0):
        if backward_counts is None:
            trainer.backward(s, key)
            continue
        for i in reversed(range(backward_counts[s])):
            trainer.backward(s, key, part=(i, backward_counts[s]))
            between()
    loss = None
    for s in (1, 0):
        if step_counts is None:
            loss = trainer.optimizer_step(s, key)
            continue
        for i in range(step_counts[s]):
            loss = trainer.optimizer_step(s, key, part=(i, step_counts[s]))
            between()
    return loss


def _assert_same(got: Grads, want: Grads) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_unit_groups_cover_the_stage_in_order() -> None:
    # Stage 0 of 4 layers: embedding + 4 layers = 5 units.
    assert [unit_group(5, 4, True, i, 2) for i in range(2)] == [range(0, 3), range(3, 5)]
    # Last stage: 2 layers + head; 3 groups; 5 groups leave some empty.
    assert [unit_group(3, 2, False, i, 3) for i in range(3)] == [
        range(0, 0),
        range(0, 1),
        range(1, 3),
    ]
    groups = [unit_group(3, 2, True, i, 5) for i in range(5)]
    assert groups[0].start == 0 and groups[-1].stop == 3
    assert all(a.stop == b.start for a, b in zip(groups, groups[1:], strict=False))
    with pytest.raises(ValueError, match="slice index"):
        unit_group(3, 2, True, 2, 2)


@pytest.mark.parametrize(
    ("name", "forward_counts", "backward_counts"),
    [
        ("tiny-llama", (2, 2), (2, 2)),
        ("tiny-llama", (3, 3), (3, 3)),
        ("tiny-llama", (1, 2), (3, 2)),  # the engine sizes forward and backward apart
        ("tiny-llama", (1, 1), (1, 1)),
        ("tiny-llama", (5, 4), (4, 5)),  # more groups than layers: empty slices
        ("tiny-gpt2", (2, 3), (3, 2)),
    ],
)
def test_sliced_gradients_and_updated_weights_equal_whole_passes(
    name: str, forward_counts: tuple[int, int], backward_counts: tuple[int, int]
) -> None:
    whole = _trainer(name)
    whole_capture = Capture(whole)
    whole_loss = _train(whole, "t", SAMPLE, None, None, capture=whole_capture)

    sliced = _trainer(name)
    sliced_capture = Capture(sliced)
    sliced_loss = _train(
        sliced,
        "t",
        SAMPLE,
        forward_counts,
        backward_counts,
        capture=sliced_capture,
        step_counts=forward_counts,  # sized apart from the backward too
    )

    assert sliced_loss == whole_loss
    assert sliced.num_steps == whole.num_steps == [1, 1]
    _assert_same(sliced_capture.grads["t"], whole_capture.grads["t"])
    _assert_same(_weights(sliced), _weights(whole))
    assert not sliced._sliced and not sliced._grads and not sliced._packed
    # A task's update of one group never copies weights for its own later slices.
    assert [st.num_snapshots for st in sliced.stashes] == [0, 0]


def test_inference_between_slices_changes_nothing_and_is_served() -> None:
    whole = _trainer()
    whole_capture = Capture(whole)
    for step in range(2):
        _train(whole, f"t{step}", SAMPLE, None, None, capture=whole_capture)

    sliced = _trainer()
    sliced_capture = Capture(sliced)
    runner = InferenceRunner(sliced.staged, eos_id=None)
    runner.admit(GenRequest("r", (7, 8, 9, 10), max_tokens=40))
    num_iterations = [0]

    def iteration() -> None:  # one inference iteration, every stage, on this thread
        prefill, decode = (["r"], []) if num_iterations[0] == 0 else ([], ["r"])
        for s in (0, 1):
            runner.run_stage(s, num_iterations[0], prefill, decode)
        num_iterations[0] += 1

    for step in range(2):  # the second task's forward uses the first's update
        _train(sliced, f"t{step}", SAMPLE, (2, 3), (3, 2), iteration, sliced_capture)
    for step in range(2):
        _assert_same(sliced_capture.grads[f"t{step}"], whole_capture.grads[f"t{step}"])
    _assert_same(_weights(sliced), _weights(whole))
    # Served between every slice: 5 forward + 5 backward + 5 step slices per task.
    assert len(runner.requests["r"].generated) == num_iterations[0] == 2 * (5 + 5 + 5)


def test_clipping_is_per_stage_however_the_step_is_sliced() -> None:
    """max_grad_norm = 1 cuts in on this model: the first step slice clips the
    whole stage's norm (its backward is complete), so any slicing updates the
    weights exactly as whole passes do."""
    unclipped = _trainer(max_grad_norm=0.0)
    capture = Capture(unclipped)  # the gradients as they come (a step sees them clipped)
    _train(unclipped, "t", SAMPLE, None, None, capture=capture)
    stage_norms = [
        torch.linalg.vector_norm(torch.stack([capture.grads["t"][n].norm() for n in names]))
        for names in _stage_names(unclipped)
    ]
    assert all(norm > 1.0 for norm in stage_norms)  # clipping really cuts in
    whole = _trainer(max_grad_norm=1.0)
    _train(whole, "t", SAMPLE, None, None)
    assert any(
        not torch.allclose(a, b, atol=1e-6)
        for a, b in zip(_weights(whole).values(), _weights(unclipped).values(), strict=True)
    )

    one = _trainer(max_grad_norm=1.0)
    _train(one, "t", SAMPLE, (1, 1), (1, 1))
    _assert_same(_weights(one), _weights(whole))

    two = _trainer(max_grad_norm=1.0)
    _train(two, "t", SAMPLE, (2, 2), (2, 2))
    _assert_same(_weights(two), _weights(whole))
    three = _trainer(max_grad_norm=1.0)
    _train(three, "t", SAMPLE, (2, 2), (3, 2), step_counts=(2, 3))
    _assert_same(_weights(three), _weights(whole))


def _stage_names(trainer: PipelineTrainer) -> list[list[str]]:
    names = {id(p): n for n, p in trainer.staged.model.named_parameters()}
    return [[names[id(p)] for p in st.parameters()] for st in trainer.staged.stages]


def test_a_step_overtaking_another_tasks_live_slices_uses_the_stash() -> None:
    """Task b's optimizer slices step each group while a's sliced graph is live:
    a's gradients are those of the weights its forward used (as if alone)."""

    def run(interleaved: bool) -> tuple[Grads, list[int]]:
        trainer = _trainer()
        capture = Capture(trainer)

        def fwd(key: str, sample: Sample) -> None:
            for s in (0, 1):
                for i in range(2):
                    trainer.forward(s, key, [sample] if s == 0 else [], part=(i, 2))

        def bwd(key: str, stage: int) -> None:
            capture.task = key
            for i in (2, 1, 0):
                trainer.backward(stage, key, part=(i, 3))
            for i in (0, 1, 2):
                trainer.optimizer_step(stage, key, part=(i, 3))

        if interleaved:
            fwd("b", OTHER)
            fwd("a", SAMPLE)
            bwd("b", 1)
            bwd("a", 1)
            bwd("b", 0)
            bwd("a", 0)
        else:
            fwd("a", SAMPLE)
            bwd("a", 1)
            bwd("a", 0)
        return capture.grads["a"], [st.num_snapshots for st in trainer.stashes]

    (interleaved, snapshots), (alone, alone_snapshots) = run(True), run(False)
    _assert_same(interleaved, alone)
    # b's group steps copy only weights a's live graph saved: stage 0's groups are
    # the embedding (its backward needs no weight: no copy), layer 0, layer 1;
    # stage 1's are empty, layer 2, layer 3 + head. Alone, nothing is copied.
    assert snapshots == [2, 2] and alone_snapshots == [0, 0]


def test_slices_out_of_order_are_refused() -> None:
    trainer = _trainer()
    with pytest.raises(RuntimeError, match="before slice 0"):
        trainer.forward(0, "t", [SAMPLE], part=(1, 2))
    trainer.forward(0, "t", [SAMPLE], part=(0, 2))
    with pytest.raises(RuntimeError, match="out of order"):
        trainer.forward(0, "t", [SAMPLE], part=(0, 2))
    trainer.forward(0, "t", [SAMPLE], part=(1, 2))
    trainer.forward(1, "t", part=(0, 1))
    with pytest.raises(RuntimeError, match="out of order"):
        trainer.backward(1, "t", part=(0, 2))  # backward starts from the last group
    trainer.discard("t")
    assert not trainer._sliced and not trainer._packed
    # A whole-pass forward cannot be backpropagated in several slices.
    trainer.forward(0, "w", [SAMPLE])
    trainer.forward(1, "w")
    with pytest.raises(RuntimeError, match="sliced forward"):
        trainer.backward(1, "w", part=(1, 2))


def test_discarding_a_task_between_slices_releases_its_graphs() -> None:
    trainer = _trainer()
    for s in (0, 1):
        trainer.forward(s, "t", [SAMPLE] if s == 0 else [], part=(0, 1))
    trainer.backward(1, "t", part=(1, 2))  # stage 1's upper group's gradients, not stepped
    trainer.discard("t")
    assert not trainer._sliced and not trainer._grads and not trainer._packed
    # Its gradients are gone too: they would leak into the next task's step.
    assert not trainer._unapplied
    assert all(p.grad is None for st in trainer.staged.stages for p in st.parameters())
    for stash in trainer.stashes:
        assert not any(stash._live.values()) and not any(stash._snapshots.values())
    # The stages train on; num_steps counts completed passes only.
    assert _train(trainer, "u", SAMPLE, (2, 2), (2, 2)) is not None
    assert trainer.num_steps == [1, 1]


def test_gradients_of_two_tasks_never_mix_on_a_stage() -> None:
    """A stage holds one task's gradients from its backward to its optimizer
    step: another task's backward there in between, or a step of a task whose
    gradients it does not hold, is refused (the engine never asks for either)."""
    trainer = _trainer()
    for key, sample in (("a", SAMPLE), ("b", OTHER)):
        for s in (0, 1):
            trainer.forward(s, key, [sample] if s == 0 else [])
    trainer.backward(1, "a")
    with pytest.raises(RuntimeError, match="would mix"):
        trainer.backward(1, "b")
    with pytest.raises(RuntimeError, match="holds the gradients of 'a'"):
        trainer.optimizer_step(1, "b")
    trainer.backward(0, "a")  # stage 0 does not wait for stage 1's step
    assert trainer.optimizer_step(1, "a") is None
    trainer.backward(1, "b")  # stage 1 is free again
    assert trainer.optimizer_step(0, "a") is not None
    with pytest.raises(RuntimeError, match="holds the gradients of None"):
        trainer.optimizer_step(0, "b")  # b's backward has not reached stage 0
