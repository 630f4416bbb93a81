"""Hypothesis-fuzzed input against a whole live stack (in-process services,
real Redis, real gRPC and HTTP): arbitrary protobuf bytes on every Gateway
method and arbitrary JSON on the OpenAI routes.

Whatever arrives, the answer is a status the client can act on (never
UNKNOWN/INTERNAL over gRPC, never 500 over HTTP), the stack keeps serving,
and every task the fuzz caused ends final (AuditTasks is empty).

Hypothesis runs in a worker thread and sends each call to the test's event
loop (`run_coroutine_threadsafe`); examples are derandomized so a CI failure
reproduces.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import grpc
import grpc.aio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from task_stack import TaskStack, eventually, start_stack

from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc
from lemix.infra.rpc.client import channel
from lemix.infra.store.server import EmbeddedRedis

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

T = TypeVar("T")
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
UNARY = ("Train", "GetStats", "GetTask", "AuditTasks")
STREAMING = ("Generate", "WatchTasks")
BAD_GRPC = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED}
CALL_TIMEOUT_S = 10.0

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)
# Bodies near the real shape get past the first checks and exercise the rest.
known_keys = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "stream",
        "seed",
        "stop",
        "n",
        "request_id",
        "stream_options",
        "logprobs",
        "user",
    ]
)
shaped_bodies = st.dictionaries(known_keys, json_values, max_size=6)


@pytest.fixture
async def stack(redis_server: EmbeddedRedis, tmp_path: Path) -> AsyncIterator[TaskStack]:
    s = await start_stack(redis_server.url, f"fuzz-{tmp_path.name}", tmp_path)
    try:
        yield s
    finally:
        await s.close()


def _on(loop: asyncio.AbstractEventLoop) -> Callable[[Awaitable[T]], T]:
    def run(aw: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(aw, loop).result(timeout=60)  # type: ignore[arg-type]

    return run


async def _raw_call(chan: grpc.aio.Channel, method: str, body: bytes) -> grpc.StatusCode:
    path = f"/lemix.v1.Gateway/{method}"
    try:
        if method in STREAMING:
            call = chan.unary_stream(path)(body, timeout=CALL_TIMEOUT_S)
            async for _ in call:
                pass
        else:
            await chan.unary_unary(path)(body, timeout=CALL_TIMEOUT_S)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def _post(session: aiohttp.ClientSession, url: str, data: bytes) -> tuple[int, str]:
    async with session.post(
        url,
        data=data,
        headers={"Content-Type": "application/json"},
        timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S),
    ) as reply:
        return reply.status, await reply.text()


async def _still_serves(stub: gateway_pb2_grpc.GatewayStub) -> None:
    request = gateway_pb2.GenerateRequest(prompt_token_ids=[5] * 8, max_tokens=3)
    messages = [m async for m in stub.Generate(request, timeout=30)]
    assert messages[-1].is_finished and messages[-1].num_output_tokens == 3


async def _no_ghosts(stub: gateway_pb2_grpc.GatewayStub) -> None:
    async def is_clean() -> bool:
        reply = await stub.AuditTasks(gateway_pb2.AuditRequest(min_age_s=0.0), timeout=10)
        return not reply.tasks

    await eventually(is_clean, timeout_s=60, what="every fuzzed task final")


async def test_arbitrary_protobuf_bytes_get_an_actionable_status(stack: TaskStack) -> None:
    gateway = stack.gateways[0]
    loop = asyncio.get_running_loop()
    run = _on(loop)
    seen: dict[str, set[str]] = {}
    async with channel(gateway.address) as chan:
        stub = gateway_pb2_grpc.GatewayStub(chan)

        @FUZZ
        @given(method=st.sampled_from(UNARY + STREAMING), body=st.binary(max_size=200))
        def fuzz(method: str, body: bytes) -> None:
            code = run(_raw_call(chan, method, body))
            seen.setdefault(method, set()).add(code.name)
            assert code not in BAD_GRPC, (method, body, code)

        await asyncio.to_thread(fuzz)
        await _still_serves(stub)
        await _no_ghosts(stub)
    # The fuzz reached the parser's refusals, not only empty messages.
    assert any("INVALID_ARGUMENT" in codes for codes in seen.values()), seen


async def test_arbitrary_json_never_gets_a_500(stack: TaskStack) -> None:
    gateway = stack.gateways[0]
    run = _on(asyncio.get_running_loop())
    statuses: set[int] = set()
    base = f"http://{gateway.http_address}"
    async with aiohttp.ClientSession() as session, channel(gateway.address) as chan:

        @FUZZ
        @given(
            route=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/lemix/train"]),
            body=json_values | shaped_bodies,
        )
        def fuzz(route: str, body: Any) -> None:
            data = json.dumps(body, allow_nan=True).encode()
            status, text = run(_post(session, base + route, data))
            statuses.add(status)
            assert status < 500, (route, body, status, text)
            if status >= 400:
                assert "error" in json.loads(text), text

        await asyncio.to_thread(fuzz)
        await _still_serves(gateway_pb2_grpc.GatewayStub(chan))
        await _no_ghosts(gateway_pb2_grpc.GatewayStub(chan))
    assert 400 in statuses, statuses
