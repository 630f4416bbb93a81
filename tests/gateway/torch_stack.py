"""A whole stack on the real tiny model, in the test's process: the session's
redis-server, the scheduler, torch executors (tiny Llama preset, two stages
on the CPU, the byte-level BPE tokenizer trained once and cached) and a
gateway with the same tokenizer, each on a free port.

Shared by the OpenAI-API tests that need real token ids (model limits, stop,
n, logprobs): the emulated backend generates counts, not tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from task_stack import TaskStack

from lemix.infra.store.server import EmbeddedRedis
from lemix.profile import load_profile, torch_cpu_profile_path

TOKENIZER = "bpe:2048"
MODEL = "lemix"


async def start_torch_stack(
    redis_url: str,
    namespace: str,
    *,
    num_executors: int = 1,
    gateway_tokenizer: str = TOKENIZER,
    **gateway_overrides: Any,
) -> TaskStack:
    """Scheduler, `num_executors` torch executors and one gateway, started
    (the gateway's tokenizer may be another spec of the same vocabulary, e.g.
    a model directory with a chat template)."""
    profile_path = torch_cpu_profile_path()
    stack = TaskStack(redis_url, namespace, profile_path)
    try:
        for node_id in range(num_executors):
            await stack.start_executor(
                node_id,
                backend="torch",
                tokenizer=TOKENIZER,
                time_scale=1.0,
                torch_threads=1,
                stage_timeout_s=60.0,
            )
        await stack.start_scheduler(load_profile(profile_path))
        await stack.start_gateway(tokenizer=gateway_tokenizer, **gateway_overrides)
    except BaseException:
        await stack.close()
        raise
    return stack


@pytest.fixture
async def torch_stack(
    redis_server: EmbeddedRedis, request: pytest.FixtureRequest
) -> AsyncIterator[TaskStack]:
    namespace = f"torch-{request.node.name[:40]}"
    stack = await start_torch_stack(redis_server.url, namespace)
    try:
        yield stack
    finally:
        await stack.close()


def openai_client(stack: TaskStack, **options: Any) -> openai.AsyncOpenAI:
    gateway = stack.gateways[0]
    return openai.AsyncOpenAI(
        base_url=f"http://{gateway.http_address}/v1",
        api_key="x",
        max_retries=0,
        timeout=60,
        **options,
    )
