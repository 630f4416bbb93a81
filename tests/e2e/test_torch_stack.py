"""The whole stack on a real model: torch executors serve text and train on it.

One node of two stages runs the tiny Llama preset on the CPU; the gateway and
the executor share the byte-level BPE tokenizer (trained once on the packaged
corpus and cached). Requests stream real text with the weights' inference loss
on their reference; a training sample updates the weights that serve the next
request; the OpenAI-compatible API returns text.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai

from lemix._proto.lemix.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from lemix.infra.rpc.client import channel
from lemix.profile import torch_cpu_profile_path
from lemix.stack.launcher import Stack, StackConfig

TOKENIZER = "bpe:2048"


async def _generate(
    stub: gateway_pb2_grpc.GatewayStub, prompt: str, reference: str, max_tokens: int
) -> list[gateway_pb2.GenerateResponse]:
    request = gateway_pb2.GenerateRequest(
        prompt=prompt,
        reference=reference,
        max_tokens=max_tokens,
        sampling=common_pb2.SamplingParams(ignore_eos=True),
    )
    return [m async for m in stub.Generate(request, timeout=60.0)]


async def test_torch_stack_serves_text_trains_and_speaks_openai(tmp_path: Path) -> None:
    config = StackConfig(
        num_nodes=1,
        gateway_port=0,
        http_port=0,
        backend="torch",
        profile_path=torch_cpu_profile_path(),
        tokenizer=TOKENIZER,
        log_dir=tmp_path / "logs",
        namespace="e2e-torch",
        extra_env={"LEMIX_LEARNING_RATE": "0.003"},
    )
    prompt, reference = "What is the capital of France?", "Paris is the capital of France."
    async with Stack(config) as stack, channel(stack.gateway_address) as chan:
        stub = gateway_pb2_grpc.GatewayStub(chan)
        first = await _generate(stub, prompt, reference, 6)
        assert first[-1].is_finished and first[-1].finish_reason == "length"
        assert sum(len(m.token_ids) for m in first) == 6 == first[-1].num_output_tokens
        assert "".join(m.text for m in first).strip()  # real text, not placeholders
        loss_before = first[-1].inference_loss
        assert loss_before > 0 and first[-1].weight_version == 0

        # Train on the reference a few times; the next request is served by the
        # updated weights (co-located: same node, same weights).
        samples = [
            gateway_pb2.TrainSample(sample_id=f"s{i}", query=prompt, reference=reference)
            for i in range(4)
        ]
        await stub.Train(gateway_pb2.TrainRequest(samples=samples), timeout=30.0)
        for _ in range(200):
            stats = await stub.GetStats(gateway_pb2.GetStatsRequest(), timeout=10.0)
            if stats.num_completed_training >= 4:
                break
            await asyncio.sleep(0.1)
        assert stats.num_completed_training == 4
        after = await _generate(stub, prompt, reference, 2)
        assert after[-1].weight_version == 4
        assert after[-1].inference_loss < loss_before

        async with openai.AsyncOpenAI(
            base_url=f"http://{stack.http_address}/v1", api_key="x", max_retries=0
        ) as client:
            reply = await client.chat.completions.create(
                model="lemix", messages=[{"role": "user", "content": "Say hello."}], max_tokens=5
            )
        assert stack.failed_child() is None
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 5
    assert isinstance(reply.choices[0].message.content, str)
