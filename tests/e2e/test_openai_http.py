"""`lemix up`'s stack serves the OpenAI-compatible HTTP API: the gateway names
it on its SERVING line (``http=HOST:PORT``) and `Stack.http_address` has it."""

from __future__ import annotations

from pathlib import Path

import openai

from lemix.stack.launcher import Stack, StackConfig


async def test_stack_serves_chat_completions_over_http(tmp_path: Path) -> None:
    config = StackConfig(
        num_nodes=1,
        gateway_port=0,
        http_port=0,
        time_scale=0.05,
        log_dir=tmp_path / "logs",
        namespace="e2e-http",
    )
    async with Stack(config) as stack:
        host, _, port = stack.http_address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        async with openai.AsyncOpenAI(
            base_url=f"http://{stack.http_address}/v1", api_key="x", max_retries=0
        ) as client:
            reply = await client.chat.completions.create(
                model="lemix", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert stack.failed_child() is None
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 4
