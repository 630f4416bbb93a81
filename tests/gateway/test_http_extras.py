"""HTTP details OpenAI/vLLM clients rely on, over real HTTP against a gateway
with the fake scheduler: ``X-Request-Id`` on every response, ``Retry-After``
(whole seconds) on every 429 and 503, ``/ping`` and ``/version``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest
from gateway_fakes import FakeScheduler, GatewayFactory, Script
from multidict import CIMultiDict

import lemix
from gateway.service import GatewayService
from lemix.infra.store.store import Store

MESSAGES: list[Any] = [{"role": "user", "content": "Say hello."}]


def _client(gateway: GatewayService) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{gateway.http_url}/v1", api_key="x", max_retries=0, timeout=30.0
    )


async def _get(
    gateway: GatewayService, path: str, headers: dict[str, str] | None = None
) -> tuple[int, CIMultiDict[str], bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{gateway.http_url}{path}", headers=headers or {}) as response,
    ):
        return response.status, response.headers.copy(), await response.read()


async def _eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_ping_and_version(make_gateway: GatewayFactory) -> None:
    gateway = await make_gateway()  # no live executor: /health is 503, /ping is not
    status, _, body = await _get(gateway, "/ping")
    assert (status, body) == (200, b"")
    status, _, body = await _get(gateway, "/version")
    assert status == 200 and body.decode() == f'{{"version": "{lemix.__version__}"}}'


async def test_health_names_what_is_missing(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler, store: Store
) -> None:
    gateway = await make_gateway()  # node_check_s 0: every check reads Redis
    status, _, body = await _get(gateway, "/health")
    assert status == 503 and b"no live executor" in body
    await store.put_node_state(7, {"address": "127.0.0.1:1"}, ttl_s=60.0)
    assert (await _get(gateway, "/health"))[0] == 200
    await store.drop_scheduler_alive()
    status, _, body = await _get(gateway, "/health")
    assert status == 503 and b"no live scheduler" in body


async def test_request_id_is_echoed_on_every_response(
    make_gateway: GatewayFactory, live_node: int
) -> None:
    gateway = await make_gateway()
    async with _client(gateway) as client:
        given = await client.chat.completions.with_raw_response.create(
            model="lemix",
            messages=MESSAGES,
            max_tokens=2,
            extra_headers={"X-Request-Id": "client-req-1"},
        )
        assert given.headers["X-Request-Id"] == "client-req-1"
        plain = await client.chat.completions.with_raw_response.create(
            model="lemix", messages=MESSAGES, max_tokens=2
        )
        # None given: the task id, which the completion's id carries too.
        assert plain.parse().id == f"chatcmpl-{plain.headers['X-Request-Id']}"
        streamed = await client.completions.with_raw_response.create(
            model="lemix", prompt="hi", max_tokens=2, stream=True
        )
        chunks = [chunk async for chunk in streamed.parse()]
        assert chunks[0].id == f"cmpl-{streamed.headers['X-Request-Id']}"
        with pytest.raises(openai.BadRequestError) as info:  # an error answer too
            await client.chat.completions.create(
                model="lemix",
                messages=[],
                max_tokens=2,
                extra_headers={"X-Request-Id": "client-req-2"},
            )
        assert info.value.response.headers["X-Request-Id"] == "client-req-2"
    for path in ("/v1/models", "/nothing", "/ping"):
        _, headers, _ = await _get(gateway, path, {"X-Request-Id": "probe-7"})
        assert headers["X-Request-Id"] == "probe-7", path
        _, headers, _ = await _get(gateway, path)
        assert headers["X-Request-Id"], path  # one made up


async def test_retry_after_on_429_and_503(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler, live_node: int
) -> None:
    fake_scheduler.script = Script(is_held=True)  # the first request holds its slot
    gateway = await make_gateway(max_in_flight=1)
    async with _client(gateway) as client:
        held = await client.chat.completions.create(
            model="lemix", messages=MESSAGES, max_tokens=50, stream=True
        )
        await held.__anext__()
        try:
            with pytest.raises(openai.RateLimitError) as busy:
                await client.completions.create(model="lemix", prompt="hi", max_tokens=2)
            assert busy.value.status_code == 429
            assert int(busy.value.response.headers["Retry-After"]) >= 1
        finally:
            await held.close()
    await _eventually(lambda: gateway.servicer.num_in_flight == 0)

    lonely = await make_gateway(namespace="no-executors-here")
    status, headers, _ = await _get(lonely, "/health")
    assert status == 503 and int(headers["Retry-After"]) >= 1
    async with _client(lonely) as client:
        with pytest.raises(openai.InternalServerError) as unavailable:
            await client.completions.create(model="lemix", prompt="hi", max_tokens=2)
    assert unavailable.value.status_code == 503
    assert int(unavailable.value.response.headers["Retry-After"]) >= 1
