"""Engine v2 on the torch backend: micro-batches in flight and chunked prefill
behind a real executor node give the v1 engine's outputs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
from executor_sinks import RecordingSink
from factories import make_profile, make_request

from lemix.engine import EngineConfig, Finished, NodeEngine, StageStart, WorkKind
from lemix.model.presets import ModelSpec, build_model
from lemix.model.runner import GenRequest, InferenceRunner
from lemix.model.staged import StagedModel
from lemix.model.training import PipelineTrainer, TrainingConfig
from lemix.types import TaskPayload
from services.executor.backends.base import RequestsFailed
from services.executor.backends.torch import TorchBackend
from services.executor.node import ExecutorNode
from services.executor.torch_setup import model_profile

VOCAB = 300
NUM_STAGES = 2


def _prompt(n: int, offset: int) -> tuple[int, ...]:
    return tuple((offset + 13 * i) % (VOCAB - 3) + 3 for i in range(n))


PROMPTS = {
    "a": _prompt(6, 1),
    "b": _prompt(19, 2),
    "c": _prompt(11, 3),
    "d": _prompt(25, 4),
    "e": _prompt(9, 5),
    "f": _prompt(14, 6),
}
MAX_TOKENS = 7


class _Spy:
    """What the backend was asked to run: iterations' micro-batches and
    prefill spans, and how many iterations were in flight at once."""

    def __init__(self, backend: TorchBackend) -> None:
        self.micro_batches: set[int] = set()
        self.spans: list[tuple[int, int]] = []
        self.chunk_groups: dict[str, set[int]] = {}  # request -> groups its chunks rode
        self.in_flight: set[int] = set()
        self.max_in_flight = 0
        real = backend.execute

        async def execute(start: StageStart, expected_wall_s: float) -> Sequence[str] | None:
            if start.kind != WorkKind.ITERATION:
                return await real(start, expected_wall_s)
            iteration: Any = start.work
            if start.stage == 0:
                self.micro_batches.add(iteration.micro_batch)
                self.spans.extend(iteration.prefill_spans)
                for req in iteration.prefill:
                    groups = self.chunk_groups.setdefault(req.task.task_id, set())
                    groups.add(iteration.micro_batch)
                self.in_flight.add(id(iteration))
                self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
            try:
                return await real(start, expected_wall_s)
            finally:
                if start.stage == NUM_STAGES - 1:
                    self.in_flight.discard(id(iteration))

        backend.execute = execute  # type: ignore[method-assign]


async def _serve(config: EngineConfig) -> tuple[RecordingSink, TorchBackend, _Spy]:
    """Serve PROMPTS (greedy; "c" with a reference and prompt logprobs) on a
    fresh node with the same seeded weights; all dispatched at once."""
    staged = StagedModel(build_model(ModelSpec("tiny-llama", vocab_size=VOCAB, seed=3)), NUM_STAGES)
    backend = TorchBackend(
        staged, InferenceRunner(staged, eos_id=None), PipelineTrainer(staged, TrainingConfig())
    )
    spy = _Spy(backend)
    profile = model_profile(make_profile(NUM_STAGES), staged, ["cpu"] * NUM_STAGES, 1 << 30)
    sink = RecordingSink(backend)
    node = ExecutorNode(NodeEngine(0, profile, profile.ours, config), backend, sink)
    await node.start()
    for key, prompt in PROMPTS.items():
        payload = TaskPayload(prompt_token_ids=prompt)
        if key == "c":
            payload = TaskPayload(
                prompt_token_ids=prompt, reference_token_ids=_prompt(5, 40), prompt_logprobs=1
            )
        node.dispatch(make_request(key, 0.0, len(prompt), MAX_TOKENS), payload)
    await sink.wait_for(set(PROMPTS))
    await node.stop(grace_s=5.0)
    return sink, backend, spy


async def test_micro_batches_and_chunked_prefill_give_the_v1_outputs() -> None:
    v1, _, v1_spy = await _serve(EngineConfig(emit_tokens=True))
    v2, backend, spy = await _serve(
        EngineConfig(emit_tokens=True, num_micro_batches=2, prefill_token_budget=8)
    )
    # The v2 run did what it claims: both groups, chunks, two iterations in flight.
    assert v1_spy.max_in_flight == 1 and v1_spy.micro_batches == {0}
    assert spy.micro_batches == {0, 1} and spy.max_in_flight == 2
    assert max(n for _, n in spy.spans) <= 8 and any(start > 0 for start, _ in spy.spans)
    # Pipelined chunks: some prompt's chunks rode both groups' iterations.
    assert any(groups == {0, 1} for groups in spy.chunk_groups.values())
    for key in PROMPTS:
        assert isinstance(v2.ended[key], Finished), v2.ended[key]
        assert len(v2.ids[key]) == MAX_TOKENS
        assert v2.ids[key] == v1.ids[key], key
    assert v2.end_fields["c"]["finish_reason"] == "length"
    assert math.isclose(
        v2.end_fields["c"]["inference_loss"], v1.end_fields["c"]["inference_loss"], rel_tol=1e-4
    )
    assert len(v2.prompt_logprobs["c"]) == len(PROMPTS["c"]) - 1
    for got, want in zip(v2.prompt_logprobs["c"], v1.prompt_logprobs["c"], strict=True):
        assert math.isclose(got.logprob, want.logprob, abs_tol=1e-4)
    assert backend.num_stage_errors == 0 and not backend.runner.requests
    assert all(st.kv.device_bytes == 0 for st in backend.staged.stages)


def test_only_the_last_stage_takes_sampling_failures() -> None:
    """Stage 0 running micro-batch 1 must not take (and report) the failures the
    last stage just recorded for micro-batch 0: they are the last stage's to take."""
    staged = StagedModel(build_model(ModelSpec("tiny-llama", vocab_size=VOCAB, seed=3)), NUM_STAGES)
    runner = InferenceRunner(staged, eos_id=None)
    backend = TorchBackend(staged, runner, PipelineTrainer(staged, TrainingConfig()))
    runner.admit(GenRequest("ok", PROMPTS["a"], 3))
    runner.failures["poisoned"] = "INTERNAL: sampling failed: ValueError: nan"
    assert backend._run_iteration(0, 1, ["ok"], [], [(0, 4)]) == []
    assert runner.failures == {"poisoned": "INTERNAL: sampling failed: ValueError: nan"}
    with pytest.raises(RequestsFailed) as failed:
        backend._run_iteration(NUM_STAGES - 1, 1, ["ok"], [], [(0, 4)])
    assert failed.value.task_ids == ("poisoned",) and not runner.failures
    assert runner.requests["ok"].num_prefilled == 4 and not runner.requests["ok"].generated
    backend.close()
