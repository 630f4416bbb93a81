"""The torch backend behind a real executor node: serving, training, EOS, syncs, measure."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from executor_sinks import RecordingSink
from factories import make_profile, make_request, make_training
from waiting import wait_until

from lemix.engine import EngineConfig, Failed, Finished, NodeEngine, StageStart
from lemix.infra.rpc.errors import InvalidArgument
from lemix.model.device_memory import stage_used_bytes
from lemix.model.presets import ModelSpec, build_model
from lemix.model.runner import GenRequest, InferenceRunner
from lemix.model.staged import StagedModel
from lemix.model.training import PipelineTrainer, TrainingConfig
from lemix.types import TaskPayload
from services.executor.backends import EmulatedBackend
from services.executor.backends.torch import TorchBackend
from services.executor.convert import (
    MeasurePhase,
    MeasureSpec,
    SyncDirection,
    WeightSyncSpec,
)
from services.executor.node import ExecutorNode
from services.executor.torch_setup import model_profile

VOCAB = 300


def _backend(seed: int = 3) -> TorchBackend:
    staged = StagedModel(build_model(ModelSpec("tiny-llama", vocab_size=VOCAB, seed=seed)), 2)
    return TorchBackend(
        staged, InferenceRunner(staged, eos_id=None), PipelineTrainer(staged, TrainingConfig())
    )


def _node(backend: TorchBackend) -> tuple[ExecutorNode, RecordingSink]:
    profile = model_profile(make_profile(2), backend.staged, ["cpu", "cpu"], 1 << 30)
    engine = NodeEngine(0, profile, profile.ours, EngineConfig(emit_tokens=True))
    sink = RecordingSink(backend)
    return ExecutorNode(engine, backend, sink), sink


def _prompt(n: int, offset: int) -> tuple[int, ...]:
    return tuple((offset + 13 * i) % (VOCAB - 3) + 3 for i in range(n))


async def test_serves_batched_requests_with_their_solo_tokens_and_trains() -> None:
    backend = _backend()
    node, sink = _node(backend)
    await node.start()
    prompts = {"a": _prompt(6, 1), "b": _prompt(19, 2), "c": _prompt(11, 3)}
    solo = {
        k: InferenceRunner(backend.staged, None).generate_alone(GenRequest(k, p, 8))
        for k, p in prompts.items()
    }
    sample = _prompt(30, 9)
    node.dispatch(
        make_training("t", 0.0, len(sample)),
        TaskPayload(prompt_token_ids=sample, reference_token_ids=sample[-10:]),
    )
    for key, prompt in prompts.items():
        node.dispatch(make_request(key, 0.0, len(prompt), 8), TaskPayload(prompt_token_ids=prompt))
    await sink.wait_for({"a", "b", "c", "t"})
    await node.stop(grace_s=5.0)
    assert all(isinstance(sink.ended[k], Finished) for k in (*prompts, "t"))
    # Tokens may differ from solo ones only if training changed the weights first;
    # requests that prefilled before the training step finished match exactly.
    assert backend.num_training_done == 1 and backend.trainer.num_steps == [1, 1]
    assert backend.last_training_loss is not None
    for key in prompts:
        assert len(sink.ids[key]) == 8 == sink.ended[key].num_output_tokens
        assert sink.end_fields[key]["finish_reason"] == "length"
    assert any(sink.ids[k] == solo[k] for k in prompts)
    # Everything released: KV buffers and training state.
    assert all(st.kv.device_bytes == 0 for st in backend.staged.stages)
    assert not backend.runner.requests


async def test_end_of_sequence_ends_a_request_early_with_stop() -> None:
    backend = _backend()
    prompt = _prompt(9, 4)
    greedy = InferenceRunner(backend.staged, None).generate_alone(GenRequest("p", prompt, 6))
    backend.runner.eos_id = greedy[2]
    node, sink = _node(backend)
    await node.start()
    node.dispatch(
        make_request("r", 0.0, len(prompt), 6),
        TaskPayload(prompt_token_ids=prompt, reference_token_ids=(5, 6)),
    )
    await sink.wait_for({"r"})
    await node.stop(grace_s=5.0)
    cut = greedy.index(greedy[2]) + 1
    assert sink.ended["r"].num_output_tokens == cut
    assert sink.ids["r"] == greedy[:cut]
    assert sink.end_fields["r"]["finish_reason"] == "stop"
    assert sink.end_fields["r"]["inference_loss"] > 0
    assert 0.0 <= sink.end_fields["r"]["reference_accuracy"] <= 1.0


async def test_refuses_tasks_it_cannot_run_with_invalid_argument() -> None:
    node, _ = _node(_backend())
    await node.start()
    with pytest.raises(InvalidArgument, match="token ids"):
        node.dispatch(make_request("r", 0.0, 10, 4), TaskPayload())
    with pytest.raises(InvalidArgument, match="vocabulary"):
        node.dispatch(make_request("v", 0.0, 2, 4), TaskPayload(prompt_token_ids=(1, VOCAB)))
    node.dispatch(make_request("ok", 0.0, 3, 2), TaskPayload(prompt_token_ids=(4, 5, 6)))
    await node.stop(grace_s=5.0)


async def test_weight_sync_saves_and_loads_real_stage_weights(tmp_path: Path) -> None:
    source, target = _backend(seed=1), _backend(seed=2)
    src_node, _ = _node(source)
    dst_node, _ = _node(target)
    await src_node.start()
    await dst_node.start()
    prompt = list(_prompt(12, 5))
    assert not torch.equal(source.staged.logits(prompt), target.staged.logits(prompt))
    saved = await src_node.sync_weights(WeightSyncSpec(SyncDirection.SAVE, str(tmp_path), 4))
    loaded = await dst_node.sync_weights(WeightSyncSpec(SyncDirection.LOAD, str(tmp_path), 4))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "stage0.safetensors",
        "stage1.safetensors",
    ]
    assert saved.num_bytes == loaded.num_bytes > 0
    assert torch.equal(source.staged.logits(prompt), target.staged.logits(prompt))
    assert dst_node.engine.visible_updates == 4
    await src_node.stop(grace_s=1.0)
    await dst_node.stop(grace_s=1.0)


async def test_measure_times_the_real_stage() -> None:
    node, _ = _node(_backend())
    await node.start()
    for phase in MeasurePhase:
        result = await node.measure(MeasureSpec(phase, 1, 2, 16, 64, 3))
        assert len(result.latency_s) == 3 and all(t > 0 for t in result.latency_s)
        assert result.peak_memory_bytes > node.engine.profile.memory.weight_bytes[1]
    await node.stop(grace_s=1.0)


async def test_multi_sample_training_task_packs_its_samples() -> None:
    from lemix.model.training import Sample

    backend = _backend()
    node, sink = _node(backend)
    await node.start()
    a, b = _prompt(20, 1), _prompt(12, 2)
    expected = backend.trainer.loss([Sample(a, 5), Sample(b, 3)])
    payload = TaskPayload(prompt_token_ids=a + b, sample_lengths=(20, 12), reference_lengths=(5, 3))
    task = make_training("t", 0.0, 20)
    node.dispatch(dataclasses.replace(task, batch_size=2), payload)
    await sink.wait_for({"t"})
    await node.stop(grace_s=5.0)
    assert backend.trainer.num_steps == [1, 1]
    assert backend.last_training_loss == pytest.approx(expected, rel=1e-5)
    # The task's own loss rides on its end (GetTask reports it).
    assert sink.end_fields["t"] == {"training_loss": pytest.approx(expected, rel=1e-5)}


def test_multi_sample_payload_is_checked() -> None:
    with pytest.raises(ValueError, match="add up"):
        TaskPayload(prompt_token_ids=(1, 2, 3), sample_lengths=(2, 2), reference_lengths=(1, 1))
    with pytest.raises(ValueError, match="within"):
        TaskPayload(prompt_token_ids=(1, 2, 3), sample_lengths=(1, 2), reference_lengths=(2, 1))
    payload = TaskPayload(
        prompt_token_ids=(1, 2, 3), sample_lengths=(1, 2), reference_lengths=(0, 1)
    )
    assert payload.samples() == [((1,), 0), ((2, 3), 1)]


async def test_measured_memory_follows_what_the_stages_hold() -> None:
    backend = _backend()
    node, sink = _node(backend)
    await node.start()
    idle = backend.used_bytes()
    weights = backend.staged.weight_bytes()
    assert idle == weights  # no grads, no optimizer state, no KV yet
    prompt = _prompt(10, 1)
    node.dispatch(make_request("r", 0.0, len(prompt), 30), TaskPayload(prompt_token_ids=prompt))
    kv = [st.kv.bytes_per_token() * (len(prompt) + 30) for st in backend.staged.stages]
    # No stage work has run yet (nothing awaited since the dispatch), so reading
    # from this thread races with nothing.
    held = [stage_used_bytes(st) for st in backend.staged.stages]
    assert held == [w + k for w, k in zip(weights, kv, strict=True)]
    sample = _prompt(16, 3)
    node.dispatch(
        make_training("t", 0.0, len(sample)),
        TaskPayload(prompt_token_ids=sample, reference_token_ids=sample[-4:]),
    )
    await sink.wait_for({"r", "t"})
    await node.stop(grace_s=5.0)
    # AdamW's two moments (plus a step counter) now live beside every weight;
    # the figure is the one each stage's thread recorded after its last item.
    assert all(u >= 3 * w for u, w in zip(backend.used_bytes(), weights, strict=True))


async def test_a_hung_stage_marks_the_node_unhealthy() -> None:
    class StuckBackend(EmulatedBackend):
        """Every stage item hangs until released."""

        def __init__(self) -> None:
            super().__init__()
            self.release = asyncio.Event()

        async def execute(self, start: StageStart, expected_wall_s: float) -> None:
            await self.release.wait()
            return None

    backend = StuckBackend()
    profile = make_profile(2)
    engine = NodeEngine(0, profile, profile.ours, EngineConfig(emit_tokens=True))
    node = ExecutorNode(engine, backend, RecordingSink(backend), stage_timeout_s=0.05)
    await node.start()
    assert node.snapshot().is_healthy
    node.dispatch(make_request("r", 0.0, 4, 1), TaskPayload())
    await wait_until(lambda: not node.snapshot().is_healthy, what="the hung stage reported")
    assert node.driver.longest_running_stage_s() > 0.05  # stage 0 ran past the timeout
    backend.release.set()
    await wait_until(lambda: engine.is_idle, what="the released work done")
    assert node.snapshot().is_healthy
    await node.stop(grace_s=1.0)


async def test_a_failing_iteration_ends_its_requests_failed_internal() -> None:
    backend = _backend()
    node, sink = _node(backend)
    await node.start()
    real = backend.runner.run_stage

    def broken(stage: int, iteration: int, prefill: list, decode: list, **kw: Any) -> list:
        if stage == 1 and "bad" in prefill:
            raise RuntimeError("boom")
        return real(stage, iteration, prefill, decode, **kw)

    backend.runner.run_stage = broken  # type: ignore[method-assign,assignment]
    node.dispatch(make_request("bad", 0.0, 5, 4), TaskPayload(prompt_token_ids=_prompt(5, 1)))
    await sink.wait_for({"bad"})
    node.dispatch(make_request("ok", 0.0, 5, 3), TaskPayload(prompt_token_ids=_prompt(5, 2)))
    await sink.wait_for({"ok"})
    await node.stop(grace_s=5.0)
    failed = sink.ended["bad"]
    assert isinstance(failed, Failed) and failed.reason.startswith("INTERNAL: stage 1 failed")
    assert isinstance(sink.ended["ok"], Finished) and len(sink.ids["ok"]) == 3  # node goes on
    assert not backend.runner.requests and all(
        st.kv.device_bytes == 0 for st in backend.staged.stages
    )


async def test_a_request_whose_sampling_fails_ends_alone_its_batch_mates_go_on() -> None:
    backend = _backend()
    node, sink = _node(backend)
    await node.start()
    prompts = {"tiny-t": _prompt(7, 1), "poison": _prompt(8, 2), "mate": _prompt(9, 3)}
    greedy = InferenceRunner(backend.staged, None).generate_alone(
        GenRequest("g", prompts["tiny-t"], 5)
    )
    # A temperature so small that logits / T overflows: greedy in the limit, not NaN.
    node.dispatch(
        make_request("tiny-t", 0.0, 7, 5),
        TaskPayload(prompt_token_ids=prompts["tiny-t"], temperature=1e-300, seed=1),
    )
    node.dispatch(
        make_request("poison", 0.0, 8, 5),
        TaskPayload(prompt_token_ids=prompts["poison"], temperature=1.0, seed=2),
    )
    node.dispatch(
        make_request("mate", 0.0, 9, 5),
        TaskPayload(prompt_token_ids=prompts["mate"], temperature=1.0, seed=3),
    )
    # TaskPayload refuses a NaN top_p, so poison the admitted request itself:
    # its draw then fails inside the batch it shares with the other two.
    backend.runner.requests["poison"].top_p = float("nan")
    await sink.wait_for(set(prompts))
    await node.stop(grace_s=5.0)
    failed = sink.ended["poison"]
    assert isinstance(failed, Failed) and failed.reason.startswith("INTERNAL: sampling failed")
    for key in ("tiny-t", "mate"):
        assert isinstance(sink.ended[key], Finished), sink.ended[key]
        assert len(sink.ids[key]) == 5
    assert sink.ids["tiny-t"] == greedy
    assert not backend.runner.requests
