"""The OpenAI-compatible HTTP API, driven by the official `openai` client.

Real services on free ports, in this process: Redis (the session fixture), an
emulated executor, the scheduler and gateways. Every error case checks that
the gateway still serves a good request afterwards.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from factories import make_profile
from gateway_fakes import flushed_stats
from prometheus_client import REGISTRY

from gateway import service as gateway_service
from gateway.config import GatewayConfig
from gateway.openai_convert import chat_prompt
from gateway.service import GatewayService
from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc
from lemix.infra.store.server import EmbeddedRedis
from lemix.infra.store.store import Store
from lemix.profile import save_profile
from lemix.tokenizer import ApproxTokenizer
from services.executor.config import ExecutorConfig
from services.executor.service import ExecutorService
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService

TIME_SCALE = 0.1  # a decode step of the test profile (2 stages x 10 ms) takes 2 ms
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello to the cluster."},
]
TOKEN = re.compile(r"<t\d+>")  # one emulated token, as ApproxTokenizer decodes it


def _num_tokens(text: str) -> int:
    return len(TOKEN.findall(text))


@dataclass
class HttpStack:
    """One namespace: an emulated executor, the scheduler, gateways on demand."""

    redis_url: str
    namespace: str
    scheduler: SchedulerService
    executor: ExecutorService
    gateways: list[GatewayService] = field(default_factory=list)

    async def make_gateway(self, **overrides: Any) -> GatewayService:
        values: dict[str, Any] = {
            "port": 0,
            "http_port": 0,
            "scheduler_address": self.scheduler.address,
            "redis_url": self.redis_url,
            "namespace": self.namespace,
            "node_check_s": 0.0,
            "stream_idle_timeout_s": 10.0,
            "shutdown_grace_s": 1.0,
            **overrides,
        }
        gateway = GatewayService(GatewayConfig(**values))
        await gateway.start()
        self.gateways.append(gateway)
        return gateway


@pytest.fixture
async def stack(
    redis_server: EmbeddedRedis, namespace: str, tmp_path: Path
) -> AsyncIterator[HttpStack]:
    profile = make_profile(capacity_bytes=10**9, weight_bytes=10**6, name="http-test")
    save_profile(profile, tmp_path / "profile.json")
    executor = ExecutorService(
        ExecutorConfig(
            node_id=0,
            redis_url=redis_server.url,
            namespace=namespace,
            profile_path=tmp_path / "profile.json",
            time_scale=TIME_SCALE,
            heartbeat_s=0.05,
            # Everything runs in this one process: on a loaded machine an event
            # loop stall outlives 3 heartbeats, and a node that looks dead makes
            # requests UNAVAILABLE. These tests are not about liveness.
            node_ttl_s=5.0,
            shutdown_grace_s=0.5,
        )
    )
    scheduler = SchedulerService(
        SchedulerConfig(
            redis_url=redis_server.url,
            namespace=namespace,
            num_nodes=1,
            slo_ttft_s=1.0,
            slo_tbt_s=0.5,
            node_poll_s=0.05,
            read_block_s=0.1,
            shutdown_grace_s=0.5,
            consumer="http-test",
        ),
        profile=profile,
    )
    await executor.start()
    await scheduler.start()
    # The scheduler sees node 0 at its next node poll; a request before that
    # gets UNAVAILABLE (no live executor), so the stack is ready once it does.
    await _eventually(lambda: scheduler.live_node_ids == [0], timeout_s=10.0)
    s = HttpStack(redis_server.url, namespace, scheduler, executor)
    try:
        yield s
    finally:
        for gateway in s.gateways:
            await gateway.stop()
        await scheduler.stop(grace_s=0.2)
        await executor.stop(grace_s=0.2)


@pytest.fixture
async def gateway(stack: HttpStack) -> GatewayService:
    return await stack.make_gateway()


def _client(gateway: GatewayService) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://{gateway.http_address}/v1", api_key="x", max_retries=0, timeout=30.0
    )


@pytest.fixture
async def client(gateway: GatewayService) -> AsyncIterator[openai.AsyncOpenAI]:
    async with _client(gateway) as c:
        yield c


async def _assert_still_serving(gateway: GatewayService) -> None:
    """A good chat request completes; no stream is left holding a slot."""
    async with _client(gateway) as c:
        reply = await c.chat.completions.create(model="lemix", messages=MESSAGES, max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    await _eventually(lambda: gateway.servicer.num_in_flight == 0)


async def _eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _get(gateway: GatewayService, path: str) -> tuple[int, str, str]:
    """(status, content type, body) of a GET on the HTTP API."""
    url = f"http://{gateway.http_address}{path}"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, response.headers["Content-Type"], await response.text()


async def _post(gateway: GatewayService, path: str, data: str) -> tuple[int, Any]:
    url = f"http://{gateway.http_address}{path}"
    headers = {"Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, headers=headers) as response,
    ):
        return response.status, await response.json()


# ---------------------------------------------------------------- completions


async def test_chat_completion(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(model="lemix", messages=MESSAGES, max_tokens=6)
    (choice,) = reply.choices
    assert reply.id.startswith("chatcmpl-inf-") and reply.object == "chat.completion"
    assert reply.model == "lemix" and abs(reply.created - time.time()) < 60
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(ApproxTokenizer().encode(chat_prompt(MESSAGES)))
    assert reply.usage.completion_tokens == _num_tokens(choice.message.content or "") == 6
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6


async def test_chat_completion_stream_with_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="lemix",
        messages=MESSAGES,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0.0,
        seed=7,
    )
    chunks = [chunk async for chunk in stream]
    *content_chunks, usage_chunk = chunks
    assert content_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert [c.choices[0].finish_reason for c in content_chunks][-1] == "length"
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == _num_tokens(text) == 20


async def test_completion_with_text_and_with_token_ids(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(model="lemix", prompt="Once upon a time", max_tokens=4)
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion"
    assert reply.usage is not None and reply.usage.prompt_tokens == 4  # 16 bytes / 4
    assert _num_tokens(reply.choices[0].text) == reply.usage.completion_tokens == 4

    stream = await client.completions.create(
        model="lemix",
        prompt=[11, 12, 13, 14, 15],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 5
    assert chunks[-1].usage.completion_tokens == _num_tokens(text) == 9


# -------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 5000}, "exceeds the context limit of 4096 tokens"),
        ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"logit_bias": {"5": 1}}, "logit_bias is not supported"),
        ({"n": 0}, "n must be an integer in [1, 16]"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role must be one of"),
    ],
    ids=["over-context", "temperature", "logit-bias", "n", "no-messages", "bad-role"],
)
async def test_invalid_chat_is_400(
    gateway: GatewayService, client: openai.AsyncOpenAI, kwargs: dict[str, Any], message: str
) -> None:
    request: dict[str, Any] = {"model": "lemix", "messages": MESSAGES, "max_tokens": 3, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(**request)
    assert info.value.status_code == 400 and message in info.value.message
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    await _assert_still_serving(gateway)


async def test_bad_json_unknown_model_and_route(
    gateway: GatewayService, client: openai.AsyncOpenAI
) -> None:
    status, body = await _post(gateway, "/v1/chat/completions", "{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=3)
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_found"
    status, body = await _post(gateway, "/v1/nothing", "{}")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    await _assert_still_serving(gateway)


async def test_over_the_in_flight_bound_is_429_and_disconnect_cancels(
    stack: HttpStack, store: Store
) -> None:
    gateway = await stack.make_gateway(max_in_flight=1)
    async with _client(gateway) as c:
        held = await c.chat.completions.create(
            model="lemix", messages=MESSAGES, max_tokens=3000, stream=True
        )
        first = await held.__anext__()
        assert first.choices[0].delta.role == "assistant"
        assert gateway.servicer.num_in_flight == 1

        with pytest.raises(openai.RateLimitError) as info:
            await c.completions.create(model="lemix", prompt="hi", max_tokens=2)
        assert info.value.status_code == 429
        assert "server busy: 1 requests in flight (limit 1)" in info.value.message

        await held.close()  # the client disconnects mid-stream
        await _eventually(lambda: gateway.servicer.num_in_flight == 0)
    assert (await flushed_stats(gateway, store))["requests_cancelled"] == 1
    await _assert_still_serving(gateway)


async def test_non_streaming_disconnect_cancels_the_task(
    gateway: GatewayService, store: Store
) -> None:
    cancelled = {"kind": "inference", "outcome": "cancelled", "code": "CANCELLED"}
    num_cancelled = _sample("lemix_gateway_requests_total", **cancelled)
    url = f"http://{gateway.http_address}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=0.5)  # the client gives up long before 3000 tokens
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with pytest.raises(TimeoutError):
            await session.post(url, json={"prompt": "hi", "max_tokens": 3000})
    await _eventually(lambda: gateway.servicer.num_in_flight == 0)
    assert (await flushed_stats(gateway, store))["requests_cancelled"] == 1
    assert _sample("lemix_gateway_requests_total", **cancelled) == num_cancelled + 1
    await _assert_still_serving(gateway)


async def test_no_live_executor_is_503(stack: HttpStack) -> None:
    gateway = await stack.make_gateway(namespace=f"{stack.namespace}-empty")
    async with _client(gateway) as c:
        with pytest.raises(openai.InternalServerError) as info:
            await c.chat.completions.create(model="lemix", messages=MESSAGES, max_tokens=3)
        assert info.value.status_code == 503 and "no live executor" in info.value.message
        assert [m.id for m in (await c.models.list()).data] == ["lemix"]  # still serving
    status, _, body = await _get(gateway, "/health")
    assert status == 503 and "no live executor" in body


# ------------------------------------------------------ models, health, train


async def test_models_health_and_metrics(
    gateway: GatewayService, client: openai.AsyncOpenAI
) -> None:
    models = await client.models.list()
    assert [(m.id, m.owned_by) for m in models.data] == [("lemix", "lemix")]
    assert (await client.models.retrieve("lemix")).id == "lemix"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("other")
    assert (await _get(gateway, "/health"))[0] == 200
    status, content_type, body = await _get(gateway, "/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    assert "# TYPE" in body or body == ""  # the default registry's exposition


async def test_train_returns_task_ids(gateway: GatewayService, store: Store) -> None:
    samples = [
        {"query": "What is LeMix?", "reference": "A scheduler."},
        {"query": "And Redis?", "reference": "Its queues."},
        {"query": "Why?", "reference": "Because."},
    ]
    status, body = await _post(
        gateway, "/v1/lemix/train", json.dumps({"samples": samples, "batch_size": 2})
    )
    assert status == 200, body
    assert len(body["task_ids"]) == 2 and all(t.startswith("trn-") for t in body["task_ids"])
    assert (await flushed_stats(gateway, store))["num_training"] == 2

    status, body = await _post(gateway, "/v1/lemix/train", '{"samples": []}')
    assert status == 400 and "no samples" in body["error"]["message"]
    await _assert_still_serving(gateway)


async def test_stop_with_open_stream_releases_everything(stack: HttpStack) -> None:
    gateway = await stack.make_gateway(shutdown_grace_s=0.2)
    async with _client(gateway) as c:
        held = await c.chat.completions.create(
            model="lemix", messages=MESSAGES, max_tokens=3000, stream=True
        )
        await held.__anext__()
        await gateway.stop()
        assert gateway.servicer.num_in_flight == 0
        await held.close()


async def test_a_stream_cut_by_shutdown_gets_an_error_event_then_done(stack: HttpStack) -> None:
    """Past its drain grace a stopping gateway ends open streams with an
    UNAVAILABLE error event and [DONE], not a bare cut (issue 11)."""
    gateway = await stack.make_gateway(shutdown_grace_s=0.2)
    body = {"model": "lemix", "messages": MESSAGES, "max_tokens": 3000, "stream": True}
    url = f"http://{gateway.http_address}/v1/chat/completions"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as reply:
        assert reply.status == 200
        first = await reply.content.readline()
        assert first.startswith(b"data: {")
        stopping = asyncio.create_task(gateway.stop())
        rest = (await reply.content.read()).decode()
        await stopping
    events = [line for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", rest[-500:]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "unavailable" and "shutting down" in error["message"]


# ------------------------------------------------------------ metrics, bind


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model_name": "lemix", **labels}) or 0.0


def _counts() -> dict[str, float]:
    """The gateway metrics this process has recorded so far (the default registry)."""
    requests = "lemix_gateway_requests_total"
    return {
        "completed": _sample(requests, kind="inference", outcome="completed", code="OK"),
        "invalid": _sample(requests, kind="inference", outcome="rejected", code="INVALID_ARGUMENT"),
        "not_found": _sample(requests, kind="inference", outcome="failed", code="NOT_FOUND"),
        "accepted": _sample(requests, kind="training", outcome="accepted", code="OK"),
        "train_invalid": _sample(
            requests, kind="training", outcome="rejected", code="INVALID_ARGUMENT"
        ),
        "tokens": _sample("lemix_gateway_output_tokens_total"),
        "prompt_tokens": _sample("lemix_gateway_prompt_tokens_total"),
        "itl": _sample("lemix_gateway_itl_seconds_count"),
        "length": _sample("lemix_gateway_finish_reasons_total", finish_reason="length"),
        "ttft": _sample("lemix_gateway_ttft_seconds_count"),
        "slo": sum(
            _sample("lemix_gateway_slo_requests_total", result=r)
            for r in ("met", "missed", "unknown")
        ),
    }


async def test_http_requests_count_in_the_metrics_like_grpc(
    gateway: GatewayService, client: openai.AsyncOpenAI
) -> None:
    before = _counts()
    await client.chat.completions.create(model="lemix", messages=MESSAGES, max_tokens=3)
    stream = await client.completions.create(model="lemix", prompt="hi", max_tokens=4, stream=True)
    assert [chunk async for chunk in stream]
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="lemix", messages=[], max_tokens=3)
    status, _ = await _post(gateway, "/v1/chat/completions", "{not json")
    assert status == 400
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=3)
    samples = [{"query": "q", "reference": "r"}] * 2
    assert (await _post(gateway, "/v1/lemix/train", json.dumps({"samples": samples})))[0] == 200
    assert (await _post(gateway, "/v1/lemix/train", '{"samples": []}'))[0] == 400
    # One gRPC Generate beside them counts once, like an HTTP one.
    grpc_before = _sample("lemix_gateway_prompt_tokens_total")
    async with grpc.aio.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(prompt="hi", max_tokens=2)
        assert [r async for r in stub.Generate(request)][-1].is_finished
    assert _sample("lemix_gateway_prompt_tokens_total") > grpc_before  # gRPC counts its prompt

    after = _counts()
    delta = {name: after[name] - before[name] for name in after}
    assert delta.pop("prompt_tokens") >= 3  # each admitted prompt has >= 1 token
    assert delta == {
        "completed": 3,
        "invalid": 2,
        "not_found": 1,
        "accepted": 2,
        "train_invalid": 1,
        "tokens": 3 + 4 + 2,
        "itl": 2 + 3 + 1,  # one per token after each sequence's first
        "length": 3,
        "ttft": 3,
        # The client's faults (bad body, unknown model) are no SLO result.
        "slo": 3,
    }


async def test_each_choice_of_n_counts_its_own_tokens_gaps_and_finish(
    gateway: GatewayService, client: openai.AsyncOpenAI
) -> None:
    before = _counts()
    reply = await client.completions.create(
        model="lemix", prompt="hi", n=2, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert len(reply.choices) == 2
    after = _counts()
    delta = {name: after[name] - before[name] for name in after}
    assert delta["completed"] == 1 and delta["slo"] == 1  # one request
    assert delta["tokens"] == 2 * 3  # both choices' tokens
    assert delta["itl"] == 2 * (3 - 1)  # gaps within each choice, not across them
    assert delta["length"] == 2  # one finish per choice
    assert delta["ttft"] == 1


async def test_http_api_binds_the_configured_host(
    stack: HttpStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    hosts: list[str] = []
    real_start_http = gateway_service.start_http

    async def recording_start_http(app: Any, host: str, port: int, **kw: Any) -> tuple[Any, int]:
        hosts.append(host)
        runner, bound_port = await real_start_http(app, host, port, **kw)
        assert {address[0] for address in runner.addresses} == {host}
        return runner, bound_port

    monkeypatch.setattr(gateway_service, "start_http", recording_start_http)
    service = await stack.make_gateway(host="0.0.0.0")  # what containers set
    assert hosts == ["0.0.0.0"] and service.http_address.startswith("0.0.0.0:")
    url = f"http://127.0.0.1:{service.http_port}/health"  # all interfaces, loopback included
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
