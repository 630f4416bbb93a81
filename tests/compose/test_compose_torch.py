"""The CPU compose stack with the torch backend: a real model in a container.

One executor replica runs the `tiny-llama` preset (2 stages on the CPU, the
profile measured for it); the gateway and the executor each train the same
byte-level BPE tokenizer from the packaged corpus at start. Text comes back
through the published HTTP port (official `openai` client) and gRPC port,
and training samples are taken and trained, every id accounted for.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import docker
import openai
import pytest
from compose_support import ComposeProject, running_project
from conftest import RESULTS

from lemix._proto.lemix.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from lemix.harness.faults import Load, account, audit_clean, wait_ready
from lemix.infra.rpc.client import channel

pytestmark = [pytest.mark.timeout(900)]

TORCH_ENV = {
    "LEMIX_EXECUTOR_BACKEND": "torch",
    "LEMIX_MODEL": "tiny-llama",
    "LEMIX_TOKENIZER": "bpe:2048",  # the gateway's and the executor's
    "LEMIX_PROFILE": "/app/profiles/cpu-tiny-llama-2stage.json",
    "LEMIX_NUM_NODES": "1",
}


@pytest.fixture(scope="module")
def torch_project(
    docker_client: docker.DockerClient, lemix_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ComposeProject]:
    with running_project(
        docker_client,
        f"lemixcitorch{os.getpid()}",
        tmp_path_factory.mktemp("compose-torch"),
        TORCH_ENV,
        num_executors=1,
        results=RESULTS,
    ) as stack:
        yield stack
    assert stack.leftovers() == {"containers": [], "volumes": [], "networks": []}


def test_torch_executor_serves_text_over_http(torch_project: ComposeProject) -> None:
    client = openai.OpenAI(
        base_url=f"{torch_project.http_base_url}/v1", api_key="unused", timeout=120
    )
    (model,) = [m.id for m in client.models.list().data]
    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    choice = completion.choices[0]
    assert choice.finish_reason in ("length", "stop") and choice.text.strip(), completion
    assert completion.usage is not None and completion.usage.prompt_tokens > 0


async def test_torch_executor_serves_and_trains_every_id_accounted(
    torch_project: ComposeProject,
) -> None:
    async with channel(torch_project.grpc_target) as chan:
        stub = gateway_pb2_grpc.GatewayStub(chan)
        await wait_ready(stub, timeout_s=120)
        request = gateway_pb2.GenerateRequest(
            prompt="What is the capital of France?",
            reference="Paris is the capital of France.",
            max_tokens=4,
            sampling=common_pb2.SamplingParams(ignore_eos=True),
        )
        messages = [m async for m in stub.Generate(request, timeout=120)]
        assert messages[-1].is_finished and messages[-1].inference_loss > 0
        assert "".join(m.text for m in messages).strip()

        load = Load(stub, prompt_tokens=16, max_tokens=4)
        inference = asyncio.create_task(load.generate_paced(10, 0.3))
        await load.train(8, per_call=4)
        await inference
        await load.finish_streams(timeout_s=300)
        result = await account(stub, load, timeout_s=300)
        result.assert_nothing_lost()
        assert await audit_clean(stub) == []
        by_state = result.by_state()
        assert by_state.get("TASK_STATE_COMPLETED", 0) == len(result.states), by_state
        RESULTS["torch_backend"] = {
            "submitted": len(result.states),
            "completed": by_state.get("TASK_STATE_COMPLETED", 0),
            "lost": len(result.lost) + len(result.missing_training),
        }
