"""The torch backend trains in slices (train_slice_s) like in whole passes,
serving inference between slices."""

from __future__ import annotations

from collections.abc import Sequence

from executor_sinks import RecordingSink
from factories import make_profile, make_request, make_training

from lemix.engine import (
    EngineConfig,
    Finished,
    NodeEngine,
    StageStart,
    TrainingSlice,
    WorkKind,
)
from lemix.model.presets import ModelSpec, build_model
from lemix.model.runner import InferenceRunner
from lemix.model.staged import StagedModel
from lemix.model.training import PipelineTrainer, TrainingConfig
from lemix.types import TaskPayload
from services.executor.backends.torch import TorchBackend
from services.executor.node import ExecutorNode
from services.executor.torch_setup import model_profile

VOCAB = 300
# Profile s; training passes here take 0.03-0.06 profile s per stage (make_profile).
SLICE_S = 0.01


class LoggingBackend(TorchBackend):
    """Records every item it runs, in order (one stage's items run in order)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.started: list[StageStart] = []

    async def execute(self, start: StageStart, expected_wall_s: float) -> Sequence[str] | None:
        self.started.append(start)
        return await super().execute(start, expected_wall_s)


def _prompt(n: int, offset: int) -> tuple[int, ...]:
    return tuple((offset + 13 * i) % (VOCAB - 3) + 3 for i in range(n))


async def _train_and_serve(slice_s: float | None) -> tuple[list[float], LoggingBackend]:
    """Three training tasks one after another (so each starts from the previous
    one's weights, whatever the timing), each next to a request being served."""
    staged = StagedModel(build_model(ModelSpec("tiny-llama", vocab_size=VOCAB, seed=3)), 2)
    # No clipping: with slices it clips each layer group's norm, not the stage's
    # (lemix.model.training), and this test compares against whole passes.
    trainer = PipelineTrainer(staged, TrainingConfig(learning_rate=1e-3, max_grad_norm=0))
    backend = LoggingBackend(staged, InferenceRunner(staged, eos_id=None), trainer)
    profile = model_profile(make_profile(2), staged, ["cpu", "cpu"], 1 << 30)
    config = EngineConfig(emit_tokens=True, max_training_slice_s=slice_s)
    sink = RecordingSink()
    node = ExecutorNode(NodeEngine(0, profile, profile.ours, config), backend, sink)
    await node.start()
    sample = _prompt(30, 9)
    losses = []
    for step in range(3):
        prompt = _prompt(8, step)
        node.dispatch(
            make_request(f"r{step}", 0.0, len(prompt), 8), TaskPayload(prompt_token_ids=prompt)
        )
        node.dispatch(
            make_training(f"t{step}", 0.0, len(sample)),
            TaskPayload(prompt_token_ids=sample, reference_token_ids=sample[-10:]),
        )
        await sink.wait_for({f"r{step}", f"t{step}"})
        assert backend.last_training_loss is not None
        losses.append(backend.last_training_loss)
    await node.stop(grace_s=5.0)
    assert all(isinstance(outcome, Finished) for outcome in sink.ended.values())
    assert backend.num_training_done == 3 and trainer.num_steps == [3, 3]
    served = [sink.ended[f"r{step}"] for step in range(3)]
    assert all(isinstance(o, Finished) and o.num_output_tokens == 8 for o in served)
    return losses, backend


async def test_sliced_training_completes_with_the_losses_of_whole_passes() -> None:
    whole_losses, whole = await _train_and_serve(None)
    sliced_losses, sliced = await _train_and_serve(SLICE_S)
    assert sliced_losses == whole_losses  # same weights, same updates, bit for bit here
    assert sliced_losses[2] < sliced_losses[1] < sliced_losses[0]
    assert not any(isinstance(s.work, TrainingSlice) for s in whole.started)
    counts = {
        (s.kind, s.stage): s.work.count for s in sliced.started if isinstance(s.work, TrainingSlice)
    }
    assert all(
        counts.get((kind, stage), 0) >= 2
        for kind in (WorkKind.FORWARD, WorkKind.BACKWARD)
        for stage in (0, 1)
    )
    # Inference ran between two slices of one training pass on a stage.
    assert _iterations_between_slices(sliced.started) > 0
    assert not sliced.trainer._sliced and not sliced.trainer._grads


def _iterations_between_slices(started: list[StageStart]) -> int:
    """Iterations a stage started while a training pass of it was part-done."""
    num = 0
    for stage in (0, 1):
        pending = False  # a slice ran on this stage and its pass has slices left
        for start in (s for s in started if s.stage == stage):
            if isinstance(start.work, TrainingSlice):
                last = start.work.index == (
                    0 if start.kind == WorkKind.BACKWARD else start.work.count - 1
                )
                pending = not last
            elif start.kind == WorkKind.ITERATION and pending:
                num += 1
    return num


async def test_concurrent_training_with_every_engine_v2_knob_ends_every_task() -> None:
    """Six training tasks and six requests dispatched at once on the 2026-12-04
    engine (two micro-batches, chunks, slices, gathered and paced decodes,
    forward-first, a spare task): more than S tasks train at once, every
    task ends finished, each stage steps once per task, and no item failed."""
    staged = StagedModel(build_model(ModelSpec("tiny-llama", vocab_size=VOCAB, seed=3)), 2)
    trainer = PipelineTrainer(staged, TrainingConfig(learning_rate=1e-3))
    backend = LoggingBackend(staged, InferenceRunner(staged, eos_id=None), trainer)
    profile = model_profile(make_profile(2), staged, ["cpu", "cpu"], 1 << 30)
    config = EngineConfig(
        emit_tokens=True,
        num_micro_batches=2,
        prefill_token_budget=8,
        max_training_slice_s=SLICE_S,
        is_decode_gathered=True,
        decode_pace_s=0.02,
        training_order="forward-first",
        spare_training_in_flight=1,
    )
    engine = NodeEngine(0, profile, profile.ours, config)
    in_flight: list[int] = []
    execute = backend.execute

    async def counting(start: StageStart, expected_wall_s: float) -> Sequence[str] | None:
        in_flight.append(len(engine._training))
        return await execute(start, expected_wall_s)

    backend.execute = counting  # type: ignore[method-assign]
    sink = RecordingSink()
    node = ExecutorNode(engine, backend, sink)
    await node.start()
    sample = _prompt(30, 9)
    ids = set()
    for i in range(6):
        prompt = _prompt(8 + i, i)
        node.dispatch(
            make_request(f"r{i}", 0.0, len(prompt), 8), TaskPayload(prompt_token_ids=prompt)
        )
        node.dispatch(
            make_training(f"t{i}", 0.0, len(sample)),
            TaskPayload(prompt_token_ids=sample, reference_token_ids=sample[-10:]),
        )
        ids |= {f"r{i}", f"t{i}"}
    await sink.wait_for(ids)
    await node.stop(grace_s=5.0)
    assert node.driver.num_errors == 0
    assert all(isinstance(sink.ended[i], Finished) for i in ids)
    assert all(sink.ended[f"r{i}"].num_output_tokens == 8 for i in range(6))  # type: ignore[attr-defined]
    assert backend.num_training_done == 6 and trainer.num_steps == [6, 6]
    assert max(in_flight) == 3  # S = 2, plus the spare
    assert not trainer._sliced and not trainer._grads
