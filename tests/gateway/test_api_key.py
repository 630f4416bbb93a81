"""`--api-key` on the gateway's public API, over real HTTP (the official
`openai` client) and real gRPC: a missing or wrong key is refused (401 in
OpenAI's shape / UNAUTHENTICATED) before anything runs, a right key is
served, and probes, reflection and metrics stay open."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import grpc.aio
import openai
import pytest
from gateway_fakes import FakeScheduler, GatewayFactory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from multidict import CIMultiDict

from gateway.config import GatewayConfig, build_parser, from_env_and_args
from gateway.service import GatewayService
from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc
from lemix.infra.rpc import GATEWAY_SERVICE
from lemix.infra.rpc.auth import ApiKeyCheck, parse_api_keys
from lemix.infra.rpc.client import DEFAULT_DEADLINE_S, channel

KEY = "sk-test-key-one"
OTHER_KEY = "sk-test-key-two"
MESSAGES: list[Any] = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
async def keyed(make_gateway: GatewayFactory, live_node: int) -> GatewayService:
    """A gateway that accepts either of two keys."""
    return await make_gateway(http_port=0, api_key=f"{KEY}, {OTHER_KEY}")


def _client(gateway: GatewayService, api_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{gateway.http_url}/v1", api_key=api_key, max_retries=0, timeout=30.0
    )


async def _http(
    gateway: GatewayService, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, CIMultiDict[str], str]:
    url = f"{gateway.http_url}{path}"
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, headers=headers or {}) as response,
    ):
        return response.status, response.headers.copy(), await response.text()


# ------------------------------------------------------------------ HTTP


async def test_http_wrong_or_missing_key_is_401_and_a_right_key_is_served(
    keyed: GatewayService, fake_scheduler: FakeScheduler
) -> None:
    async with _client(keyed, "sk-wrong") as client:
        with pytest.raises(openai.AuthenticationError) as info:
            await client.chat.completions.create(model="lemix", messages=MESSAGES, max_tokens=2)
    assert info.value.status_code == 401
    assert isinstance(info.value.body, dict)
    assert info.value.body["code"] == "invalid_api_key"
    assert info.value.body["type"] == "invalid_request_error"
    assert info.value.response.headers["WWW-Authenticate"] == "Bearer"
    assert KEY not in info.value.message and "sk-wrong" not in info.value.message
    assert fake_scheduler.submitted == []  # refused before anything ran

    status, headers, body = await _http(keyed, "GET", "/v1/models")  # no header at all
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert '"invalid_api_key"' in body and "Authorization: Bearer" in body
    status, _, _ = await _http(keyed, "GET", "/v1/models", {"Authorization": f"Basic {KEY}"})
    assert status == 401

    for key in (KEY, OTHER_KEY):  # each configured key is accepted
        async with _client(keyed, key) as client:
            reply = await client.chat.completions.create(
                model="lemix", messages=MESSAGES, max_tokens=2
            )
        assert reply.usage is not None and reply.usage.completion_tokens == 2
    # The scheme is case-insensitive (RFC 7235).
    status, _, _ = await _http(keyed, "GET", "/v1/models", {"Authorization": f"bearer {KEY}"})
    assert status == 200


async def test_http_task_route_needs_the_key_and_probes_stay_open(keyed: GatewayService) -> None:
    status, _, _ = await _http(keyed, "GET", "/v1/lemix/tasks/some-task")
    assert status == 401
    status, _, _ = await _http(
        keyed, "GET", "/v1/lemix/tasks/some-task", {"Authorization": f"Bearer {KEY}"}
    )
    assert status == 404  # past the key check: an unknown task
    for path in ("/health", "/ping", "/version", "/metrics"):
        status, _, _ = await _http(keyed, "GET", path)
        assert status == 200, path


# ------------------------------------------------------------------ gRPC


def _train_request() -> gateway_pb2.TrainRequest:
    return gateway_pb2.TrainRequest(
        samples=[gateway_pb2.TrainSample(query="question", reference="answer")]
    )


async def test_grpc_wrong_or_missing_key_is_unauthenticated(
    keyed: GatewayService, fake_scheduler: FakeScheduler
) -> None:
    for api_key in ("", "sk-wrong"):
        async with channel(keyed.address, api_key=api_key) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Train(_train_request(), timeout=DEFAULT_DEADLINE_S)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in (info.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                stream = stub.Generate(
                    gateway_pb2.GenerateRequest(prompt="hi", max_tokens=2),
                    timeout=DEFAULT_DEADLINE_S,
                )
                async for _ in stream:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Per-task reads too: task ids are not secrets.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetTask(
                    gateway_pb2.GetTaskRequest(task_id="some-task"), timeout=DEFAULT_DEADLINE_S
                )
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert fake_scheduler.submitted == []


async def test_grpc_right_key_is_served_and_health_and_reflection_stay_open(
    keyed: GatewayService,
) -> None:
    async with channel(keyed.address, api_key=OTHER_KEY) as ch:
        reply = await gateway_pb2_grpc.GatewayStub(ch).Train(
            _train_request(), timeout=DEFAULT_DEADLINE_S
        )
        assert len(reply.task_ids) == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await gateway_pb2_grpc.GatewayStub(ch).GetTask(
                gateway_pb2.GetTaskRequest(task_id="no-such-task"), timeout=DEFAULT_DEADLINE_S
            )
        assert info.value.code() == grpc.StatusCode.NOT_FOUND  # past the key check
    async with channel(keyed.address) as ch:  # no key
        health = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=GATEWAY_SERVICE), timeout=DEFAULT_DEADLINE_S
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        names = await _reflected_services(ch)
        assert GATEWAY_SERVICE in names


async def _reflected_services(ch: grpc.aio.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)

    async def requests() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    async for reply in stub.ServerReflectionInfo(requests(), timeout=DEFAULT_DEADLINE_S):
        return [service.name for service in reply.list_services_response.service]
    return []


async def test_without_a_key_the_api_stays_open(
    make_gateway: GatewayFactory, live_node: int
) -> None:
    gateway = await make_gateway(http_port=0)
    status, _, _ = await _http(gateway, "GET", "/v1/models")
    assert status == 200
    async with channel(gateway.address) as ch:
        reply = await gateway_pb2_grpc.GatewayStub(ch).Train(
            _train_request(), timeout=DEFAULT_DEADLINE_S
        )
    assert len(reply.task_ids) == 1


# ------------------------------------------------------------------ config


def test_api_key_option_reads_the_variable_and_never_shows_the_key() -> None:
    config = from_env_and_args([], {"LEMIX_API_KEY": f"{KEY},{OTHER_KEY}"})
    assert config.api_keys == (KEY, OTHER_KEY)
    assert from_env_and_args(["--api-key", KEY], {"LEMIX_API_KEY": OTHER_KEY}).api_keys == (KEY,)
    assert from_env_and_args([], {}).api_keys == ()
    assert KEY not in repr(config)
    assert "--api-key" in build_parser().format_help()
    with pytest.raises(ValueError, match="printable ASCII") as info:
        GatewayConfig(api_key="has space,other")
    assert "has space" not in str(info.value)
    with pytest.raises(ValueError, match="empty key"):
        GatewayConfig(api_key=f"{KEY},,{OTHER_KEY}")


def test_api_key_check_compares_whole_keys() -> None:
    check = ApiKeyCheck(parse_api_keys(f"{KEY},{OTHER_KEY}"))
    assert check.is_key(KEY) and check.is_key(OTHER_KEY)
    assert not check.is_key(KEY[:-1]) and not check.is_key(KEY + "x") and not check.is_key("")
    assert check.problem([("authorization", f"Bearer {KEY}")]) is None
    assert "invalid API key" in (check.problem([("authorization", KEY)]) or "")
    assert "requires an API key" in (check.problem(None) or "")
    assert check.http_problem(f"Bearer {OTHER_KEY}") is None
    assert check.http_problem(None) is not None and check.http_problem("Bearer") is not None
    with pytest.raises(ValueError):
        ApiKeyCheck(())
