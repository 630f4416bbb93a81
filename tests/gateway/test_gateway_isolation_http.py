"""Isolation at the gateway's HTTP API (issue 12): malformed bodies are 400s
(never 500s), a busy gateway answers 429 with Retry-After (never 503), and a
reused `request_id` is 409 unless it repeats the same request. The flood runs
against the fake scheduler; idempotency against the real scheduler, executor
and Redis (`test_http_api.stack`).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import aiohttp
import pytest
from gateway_fakes import FakeScheduler, GatewayFactory, Script, flushed_stats
from test_http_api import HttpStack, stack  # noqa: F401 - the real stack's fixture

from gateway.http_body import MAX_JSON_DEPTH
from gateway.service import GatewayService
from lemix.infra.rpc.server import MAX_MESSAGE_BYTES
from lemix.infra.store.store import Store

Json = dict[str, Any]


async def _post(
    gateway: GatewayService, path: str, data: str | bytes, headers: dict[str, str] | None = None
) -> tuple[int, Json, Any]:
    """(status, body, response headers) of a POST on the HTTP API."""
    url = f"http://{gateway.http_address}{path}"
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
        ) as response,
    ):
        return response.status, await response.json(), response.headers


def _completion(**fields: Any) -> str:
    return json.dumps({"prompt": "hello there", "max_tokens": 3, **fields})


# ---------------------------------------------------------------- bad bodies


@pytest.mark.usefixtures("live_node")
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[" * 100_000 + "]" * 100_000, f"more than {MAX_JSON_DEPTH} levels deep"),
        (
            '{"prompt": ' + "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1) + "}",
            f"more than {MAX_JSON_DEPTH} levels deep",
        ),
        (
            '{"prompt": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", "max_tokens": "x"}',
            "max_tokens must be an integer",
        ),  # brackets inside a string do not nest
        ("[1, 2]", "the request body must be a JSON object, got list"),
        ('"text"', "the request body must be a JSON object, got str"),
        ("null", "the request body must be a JSON object, got NoneType"),
        ('{"prompt": 1' + "0" * 5000 + "}", "not valid JSON"),  # an int too long to parse
        (
            '{"prompt": "hi", "max_tokens": 3, "temperature": 1e-300}',
            "must be 0 (greedy) or in [0.01, 100]",
        ),
        (
            '{"prompt": "hi", "max_tokens": 3, "temperature": Infinity}',
            "temperature must be a number",
        ),
        ('{"prompt": "hi", "max_tokens": 3, "top_p": 0}', "top_p must be in (0, 1]"),
        ('{"prompt": "hi", "max_tokens": 3, "request_id": 7}', "request_id must be a string"),
    ],
    ids=[
        "deep-array",
        "depth-over-limit",
        "brackets-in-string",
        "list",
        "string",
        "null",
        "huge-int",
        "tiny-temperature",
        "infinite-temperature",
        "top-p-0",
        "request-id-type",
    ],
)
async def test_malformed_bodies_are_400(gateway: GatewayService, body: str, message: str) -> None:
    status, reply, _ = await _post(gateway, "/v1/completions", body)
    assert status == 400 and message in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error"
    status, reply, _ = await _post(gateway, "/v1/completions", _completion())
    assert status == 200 and reply["usage"]["completion_tokens"] == 3


@pytest.mark.usefixtures("live_node")
async def test_train_body_that_is_not_an_object_is_400(gateway: GatewayService) -> None:
    status, reply, _ = await _post(gateway, "/v1/lemix/train", "[]")
    assert status == 400 and "must be a JSON object" in reply["error"]["message"]


@pytest.mark.usefixtures("live_node")
async def test_a_body_over_the_size_limit_is_refused_with_the_limit(
    gateway: GatewayService,
) -> None:
    body = b'{"prompt": "' + b"x" * MAX_MESSAGE_BYTES + b'"}'
    status, reply, _ = await _post(gateway, "/v1/completions", body)
    assert status == 413 and str(MAX_MESSAGE_BYTES) in reply["error"]["message"]


@pytest.mark.usefixtures("live_node")
async def test_non_utf8_body_is_400(gateway: GatewayService) -> None:
    status, reply, _ = await _post(gateway, "/v1/completions", b'{"prompt": "\xff\xfe"}')
    assert status == 400 and "not UTF-8" in reply["error"]["message"]


# ------------------------------------------------------------------- overload


@pytest.mark.usefixtures("live_node")
async def test_busy_is_429_with_retry_after(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler
) -> None:
    fake_scheduler.script = Script(is_held=True)
    gateway = await make_gateway(max_in_flight=1)
    url = f"http://{gateway.http_address}/v1/completions"
    async with aiohttp.ClientSession() as session:
        held = await session.post(url, data=_completion(max_tokens=50, stream=True))
        assert held.status == 200
        await held.content.readline()  # the first chunk: the slot is taken
        status, reply, headers = await _post(gateway, "/v1/completions", _completion())
        held.close()
    assert status == 429 and headers["Retry-After"] == "1"
    assert "server busy: 1 requests in flight (limit 1)" in reply["error"]["message"]


@pytest.mark.slow
@pytest.mark.usefixtures("live_node")
async def test_an_http_flood_gets_results_or_429_never_503(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler, store: Store
) -> None:
    num_requests, max_in_flight = 1500, 4
    fake_scheduler.script = Script(token_delay_s=0.01)
    gateway = await make_gateway(max_in_flight=max_in_flight, stats_flush_s=3600.0)
    url = f"http://{gateway.http_address}/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)  # every request on its own connection
    timeout = aiohttp.ClientTimeout(total=60.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one() -> tuple[int, str]:
            async with session.post(url, data=_completion()) as response:
                body = await response.json()
                assert ("usage" in body) is (response.status == 200), body
                return response.status, response.headers.get("Retry-After", "")

        outcomes = await asyncio.gather(*(one() for _ in range(num_requests)))
    statuses = Counter(status for status, _ in outcomes)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] >= max_in_flight  # at least the first ones got through
    assert all(retry == "1" for status, retry in outcomes if status == 429)
    stats = await flushed_stats(gateway, store)
    assert stats["requests_rejected_busy"] == statuses[429]
    assert stats["num_inference"] == statuses[200]


# -------------------------------------------------------------- idempotency


async def test_request_id_reuse_is_409_unless_it_is_the_same_request(
    stack: HttpStack,  # noqa: F811 - the fixture imported above
) -> None:
    gateway = await stack.make_gateway()
    status, first, _ = await _post(
        gateway, "/v1/completions", _completion(request_id="job-7", seed=3)
    )
    assert status == 200, first
    status, again, _ = await _post(
        gateway, "/v1/completions", _completion(request_id="job-7", seed=3)
    )
    assert status == 200 and again["id"] == first["id"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]

    status, reply, _ = await _post(
        gateway, "/v1/completions", _completion(request_id="job-7", seed=4)
    )
    assert status == 409, reply
    assert reply["error"]["message"] == (
        "request_id 'job-7' was already used with a different request; use a new id"
    )
    assert reply["error"]["type"] == "conflict_error"
    # The header form, and another client's scope: its own task, no conflict.
    status, other, _ = await _post(
        gateway,
        "/v1/completions",
        _completion(seed=4),
        headers={"X-Request-Id": "job-7", "X-Client-Id": "someone-else"},
    )
    assert status == 200 and other["id"] != first["id"] and other["id"].startswith("cmpl-job-7@")
