"""The served model's limits (issue 11): executors publish their vocabulary and
positions in Redis, the gateway refuses what the model cannot run with a 400
(INVALID_ARGUMENT) before anything is submitted, and `/v1/models` shows
``max_model_len``. An executor's own refusal of a task ends the task, never
the node: the next valid request is served on every node.

Pure parts first; then two torch executors (tiny model, real tokens) behind
the real scheduler and gateway, driven by the official `openai` client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from task_stack import TaskStack, eventually
from torch_stack import MODEL, openai_client, start_torch_stack

from gateway.model_limits import DEFAULT_CONTEXT_TOKENS, context_tokens
from gateway.validate import validate_generate
from lemix._proto.lemix.v1 import gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from lemix.infra.rpc import convert as rpc_convert
from lemix.infra.rpc.client import channel
from lemix.infra.rpc.errors import InvalidArgument
from lemix.infra.store.heartbeat import IS_HEALTHY_FIELD
from lemix.infra.store.model_limits import (
    MAX_MODEL_LEN_FIELD,
    VOCAB_SIZE_FIELD,
    ModelLimits,
    model_limit_fields,
    model_limits_from_states,
)
from lemix.infra.store.server import EmbeddedRedis
from lemix.tokenizer import ApproxTokenizer
from lemix.types import Task, TaskKind, TaskPayload

TINY_MAX_POSITIONS = 2048  # lemix.model.presets: the tiny Llama's max_position_embeddings


def test_nodes_are_read_strictly_and_a_bad_field_leaves_only_its_node_out() -> None:
    states = {
        0: {k: str(v) for k, v in model_limit_fields(ModelLimits(2048, 1024)).items()},
        1: {VOCAB_SIZE_FIELD: "1000", MAX_MODEL_LEN_FIELD: "4096"},
        2: {},  # the emulated backend publishes nothing
        3: {VOCAB_SIZE_FIELD: "many"},
    }
    limits, bad = model_limits_from_states(states)
    assert limits == ModelLimits(vocab_size=1000, max_model_len=1024)
    assert list(bad) == [3] and "model_vocab_size" in bad[3]
    assert model_limits_from_states({2: {}}) == (ModelLimits(), {})
    assert model_limit_fields(None) == {}


def test_context_is_the_smaller_of_the_gateways_cap_and_the_models() -> None:
    assert context_tokens(0, ModelLimits()) == DEFAULT_CONTEXT_TOKENS
    assert context_tokens(0, ModelLimits(100, 2048)) == 2048
    assert context_tokens(512, ModelLimits(100, 2048)) == 512
    assert context_tokens(8192, ModelLimits(100, 2048)) == 2048
    assert context_tokens(512, ModelLimits()) == 512


def test_an_out_of_vocabulary_id_is_refused_naming_it() -> None:
    request = gateway_pb2.GenerateRequest(prompt_token_ids=[1, 99, 100, 5], max_tokens=2)
    with pytest.raises(InvalidArgument, match=r"prompt_token_ids\[2\] = 100 .*\(ids 0\.\.99\)"):
        validate_generate(
            request, tokenizer=ApproxTokenizer(), max_context_tokens=64, vocab_size=100
        )
    # Unknown vocabulary (0): nothing to check against.
    validate_generate(request, tokenizer=ApproxTokenizer(), max_context_tokens=64)


# ------------------------------------------------------------ real stack


@pytest.fixture
async def two_nodes(redis_server: EmbeddedRedis) -> AsyncIterator[TaskStack]:
    stack = await start_torch_stack(redis_server.url, "limits", num_executors=2)
    try:
        yield stack
    finally:
        await stack.close()


async def _healthy_nodes(stack: TaskStack) -> list[int]:
    states = await stack.executors[0].store.get_node_states()
    return sorted(n for n, fields in states.items() if fields.get(IS_HEALTHY_FIELD) != "0")


async def _valid_requests_succeed(client: openai.AsyncOpenAI, num: int) -> None:
    for i in range(num):
        reply = await client.completions.create(
            model=MODEL, prompt=f"Count to {i}:", max_tokens=2, temperature=0
        )
        assert reply.choices[0].finish_reason in ("length", "stop")


async def test_bad_input_is_a_400_and_every_node_keeps_serving(two_nodes: TaskStack) -> None:
    stack = two_nodes
    vocab_size = stack.executors[0].node.backend.model_limits().vocab_size  # type: ignore[union-attr]
    async with openai_client(stack) as client:
        models = await client.models.list()
        assert models.data[0].model_extra == {"max_model_len": TINY_MAX_POSITIONS}

        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model=MODEL, prompt=[1, 2, vocab_size], max_tokens=2)
        assert f"prompt_token_ids[2] = {vocab_size} is not a token" in info.value.message
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(
                model=MODEL, prompt=[1] * (TINY_MAX_POSITIONS - 10), max_tokens=11
            )
        assert f"exceeds the context limit of {TINY_MAX_POSITIONS} tokens" in info.value.message
        # max_tokens left out: the rest of the model's context, not the gateway's 4096.
        with pytest.raises(openai.BadRequestError, match="leaving no room for output"):
            await client.completions.create(model=MODEL, prompt=[1] * TINY_MAX_POSITIONS)

        assert await _healthy_nodes(stack) == [0, 1]
        await _valid_requests_succeed(client, 4)


async def test_an_executors_refusal_ends_the_task_not_the_node(two_nodes: TaskStack) -> None:
    """A task that slips past the gateway (sent to the scheduler directly) is
    refused by the executor: it ends REJECTED with the executor's reason, and
    both nodes stay healthy and keep serving."""
    stack = two_nodes
    assert stack.scheduler is not None
    vocab_size = stack.executors[0].node.backend.model_limits().vocab_size  # type: ignore[union-attr]
    task_ids = [f"bad-{i}" for i in range(2)]  # two: the planner may try both nodes
    async with channel(stack.scheduler.address) as chan:
        scheduler = scheduler_pb2_grpc.SchedulerStub(chan)
        for task_id in task_ids:
            task = Task(task_id, TaskKind.INFERENCE, 0.0, num_prompt_tokens=2, max_output_tokens=2)
            payload = TaskPayload(prompt_token_ids=(1, vocab_size + 7))
            await scheduler.Submit(
                scheduler_pb2.SubmitRequest(task=rpc_convert.task_to_proto(task, payload)),
                timeout=10.0,
            )
    url = f"http://{stack.gateways[0].http_address}/v1/lemix/tasks"
    states: dict[str, dict[str, object]] = {}
    async with aiohttp.ClientSession() as http:

        async def all_final() -> bool:
            for task_id in task_ids:
                async with http.get(f"{url}/{task_id}") as response:
                    states[task_id] = await response.json()
            return all(s["is_final"] for s in states.values())

        await eventually(all_final, what="the refused tasks to end")
    for state in states.values():
        assert state["state"] == "rejected", state
        assert "out of the model's vocabulary" in str(state["reason"]), state
    assert await _healthy_nodes(stack) == [0, 1]
    async with openai_client(stack) as client:
        await _valid_requests_succeed(client, 4)
