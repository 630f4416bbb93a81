"""Replica sync on real stage weights: the average is the element-wise mean,
through `weights.average_into_stage`, an executor node, and the scheduler's
two-phase driver (which skips a node that fails)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from executor_sinks import RecordingSink
from factories import make_profile

from lemix.engine import EngineConfig, NodeEngine, StageStart, WorkKind
from lemix.model.presets import ModelSpec, build_model
from lemix.model.runner import InferenceRunner
from lemix.model.staged import StagedModel
from lemix.model.training import PipelineTrainer, Sample, TrainingConfig
from lemix.types import ReplicaAverage
from services.executor import weights
from services.executor.backends.torch import TorchBackend
from services.executor.convert import SyncDirection, WeightSyncSpec
from services.executor.node import ExecutorNode
from services.executor.torch_setup import model_profile
from services.scheduler.replica_sync import AVERAGE, SAVE, run_replica_average

VOCAB = 64


def _staged(seed: int) -> StagedModel:
    return StagedModel(build_model(ModelSpec("tiny-llama", vocab_size=VOCAB, seed=seed)), 2)


def _params(staged: StagedModel) -> dict[str, torch.Tensor]:
    return {
        f"{s.index}.{name}": p.detach().clone()
        for s in staged.stages
        for name, p in s.modules.named_parameters()
    }


def test_averaging_two_replicas_gives_the_mean_parameters(tmp_path: Path) -> None:
    a, b = _staged(1), _staged(2)
    before_a, before_b = _params(a), _params(b)
    assert any(not torch.equal(before_a[k], before_b[k]) for k in before_a)
    for name, staged in (("a", a), ("b", b)):
        for stage in staged.stages:
            weights.save_stage(stage, tmp_path / name / f"stage{stage.index}.safetensors")
    for name, staged in (("a", a), ("b", b)):
        for stage in staged.stages:
            sources = [tmp_path / n / f"stage{stage.index}.safetensors" for n in ("a", "b")]
            own = tmp_path / name / f"stage{stage.index}.safetensors"
            weights.average_into_stage(stage, own, sources)
    after_a, after_b = _params(a), _params(b)
    for key in before_a:
        mean = (before_a[key] + before_b[key]) / 2
        torch.testing.assert_close(after_a[key], mean)
        torch.testing.assert_close(after_b[key], mean)


def test_updates_made_after_the_save_are_kept_on_top_of_the_mean(tmp_path: Path) -> None:
    a, b = _staged(1), _staged(2)
    mean = {k: (v + _params(b)[k]) / 2 for k, v in _params(a).items()}
    for name, staged in (("a", a), ("b", b)):
        weights.save_stage(staged.stages[0], tmp_path / name / "stage0.safetensors")
    stage = a.stages[0]
    first_name, first = next(iter(stage.modules.named_parameters()))
    with torch.no_grad():
        first.add_(1.0)  # a's training step between its save and phase 2
    sources = [tmp_path / n / "stage0.safetensors" for n in ("a", "b")]
    weights.average_into_stage(stage, tmp_path / "a" / "stage0.safetensors", sources)
    torch.testing.assert_close(first.detach(), mean[f"0.{first_name}"] + 1.0)


def test_a_mismatched_source_leaves_the_stage_unchanged(tmp_path: Path) -> None:
    a = _staged(1)
    weights.save_stage(a.stages[0], tmp_path / "a" / "stage0.safetensors")
    weights.save_stage(a.stages[1], tmp_path / "other" / "stage0.safetensors")  # wrong stage
    before = _params(a)
    with pytest.raises(ValueError, match="does not match"):
        weights.average_into_stage(
            a.stages[0],
            tmp_path / "a" / "stage0.safetensors",
            [tmp_path / "a" / "stage0.safetensors", tmp_path / "other" / "stage0.safetensors"],
        )
    after = _params(a)
    assert all(torch.equal(before[k], after[k]) for k in before)


def _node(seed: int) -> tuple[ExecutorNode, TorchBackend]:
    staged = _staged(seed)
    backend = TorchBackend(
        staged, InferenceRunner(staged, eos_id=None), PipelineTrainer(staged, TrainingConfig())
    )
    profile = model_profile(make_profile(2), staged, ["cpu", "cpu"], 1 << 30)
    engine = NodeEngine(0, profile, profile.ours, EngineConfig(emit_tokens=True))
    return ExecutorNode(engine, backend, RecordingSink(backend)), backend


async def test_two_executor_nodes_average_through_the_scheduler_driver(tmp_path: Path) -> None:
    (node_a, back_a), (node_b, back_b) = _node(1), _node(2)
    mean = {k: (v + _params(back_b.staged)[k]) / 2 for k, v in _params(back_a.staged).items()}
    nodes = {0: node_a, 1: node_b}
    for node in nodes.values():
        await node.start()
    calls: list[tuple[int, int]] = []

    async def call(node_id: int, direction: int, location: str, sources: Sequence[str]) -> None:
        calls.append((node_id, direction))
        kind = SyncDirection.SAVE if direction == SAVE else SyncDirection.AVERAGE
        await nodes[node_id].sync_weights(WeightSyncSpec(kind, location, 0, tuple(sources)))

    done = await run_replica_average(call, ReplicaAverage((0, 1), 1), str(tmp_path))
    assert done == (0, 1)
    assert calls == [(0, SAVE), (1, SAVE), (0, AVERAGE), (1, AVERAGE)]
    for back in (back_a, back_b):
        after = _params(back.staged)
        for key, value in mean.items():
            torch.testing.assert_close(after[key], value)
    assert node_a.engine.visible_updates == 0  # an average carries no weight version
    for node in nodes.values():
        await node.stop(grace_s=1.0)


async def test_a_node_failing_its_save_is_left_out_and_the_rest_go_on() -> None:
    calls: list[tuple[int, int, tuple[str, ...]]] = []

    async def call(node_id: int, direction: int, location: str, sources: Sequence[str]) -> None:
        calls.append((node_id, direction, tuple(sources)))
        if node_id == 1 and direction == SAVE:
            raise TimeoutError("SyncWeights on node 1: DEADLINE_EXCEEDED")

    done = await run_replica_average(call, ReplicaAverage((0, 1, 2), 3), "/w")
    assert done == (0, 2)
    averages = [c for c in calls if c[1] == AVERAGE]
    assert [c[0] for c in averages] == [0, 2]
    assert averages[0][2] == ("/w/replicas/node0", "/w/replicas/node2")


async def test_a_round_with_fewer_than_two_saves_is_skipped() -> None:
    calls: list[int] = []

    async def call(node_id: int, direction: int, location: str, sources: Sequence[str]) -> None:
        calls.append(direction)
        if node_id == 0:
            await asyncio.sleep(0)
            raise ConnectionError("node 0 is gone")

    assert await run_replica_average(call, ReplicaAverage((0, 1), 1), "/w") == ()
    assert calls == [SAVE, SAVE]  # no phase 2


def _stage0_input_grad(backend: TorchBackend) -> torch.Tensor:
    """The gradient stage 1's backward hands to stage 0 (what stage 0 steps with)."""
    return backend.trainer._grads[("k", 1)].clone()


async def test_a_backward_straddling_an_average_uses_the_weights_its_forward_saw(
    tmp_path: Path,
) -> None:
    """The average changes the weights in place between a training task's
    forward and its backward: like an optimizer step, it goes through weight
    stashing, so the backward is the one of the forward that ran."""
    other = _staged(2)
    for stage in other.stages:
        weights.save_stage(stage, tmp_path / "b" / f"stage{stage.index}.safetensors")
    sample = [Sample(tuple(range(3, 20)), 5)]
    grads = []
    for is_averaged in (False, True):
        _, backend = _node(1)
        for stage in backend.staged.stages:
            weights.save_stage(stage, tmp_path / "a" / f"stage{stage.index}.safetensors")
        backend.trainer.forward(0, "k", sample)
        backend.trainer.forward(1, "k")
        if is_averaged:
            sources = (str(tmp_path / "a"), str(tmp_path / "b"))
            backend.prepare_sync("avg", SyncDirection.AVERAGE, str(tmp_path / "a"), sources)
            await backend.execute(StageStart(1, 0.0, WorkKind.BLOCKING, "avg"), 0.0)
            assert not torch.equal(  # the weights did change
                next(backend.staged.stages[1].modules.parameters()),
                next(_staged(1).stages[1].modules.parameters()),
            )
        backend.trainer.backward(1, "k")
        grads.append(_stage0_input_grad(backend))
        backend.close()
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
