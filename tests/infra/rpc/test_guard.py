"""lemix.infra.rpc.guard and lemix.infra.rpc.auth over real gRPC: malformed requests and the
service token, for every call shape, sent as raw bytes or through `channel`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from structlog.testing import capture_logs

from lemix._proto.lemix.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2_grpc,
)
from lemix.infra.rpc import GATEWAY_SERVICE, SCHEDULER_SERVICE
from lemix.infra.rpc.auth import TokenCheck, bearer, check_service_token, generate_token
from lemix.infra.rpc.client import DEFAULT_DEADLINE_S, channel
from lemix.infra.rpc.errors import handle_errors
from lemix.infra.rpc.server import start_server

TOKEN = "t0ken-of-this-test-stack-0123456789"
# Not a protobuf message: field 1 as a length-delimited value running past the end.
GARBAGE = b"\x0a\xff\xff\xff\xff\x0f" + b"\x00" * 4
CANCEL = "/lemix.v1.Scheduler/Cancel"
GENERATE = "/lemix.v1.Gateway/Generate"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


@dataclass
class Calls:
    """What reached the servicers: a refused call must never get this far."""

    names: list[str] = field(default_factory=list)


class CountingScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    @handle_errors
    async def Cancel(
        self, request: common_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.CancelResponse:
        self.calls.names.append(f"Cancel:{request.task_id}")
        return common_pb2.CancelResponse(is_found=True)


class CountingGateway(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    @handle_errors
    async def Generate(
        self,
        request: gateway_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        self.calls.names.append(f"Generate:{request.request_id}")
        yield gateway_pb2.GenerateResponse(request_id=request.request_id, token_ids=[7])
        yield gateway_pb2.GenerateResponse(request_id=request.request_id, is_finished=True)


@dataclass
class Server:
    address: str
    calls: Calls


async def _serve(service_token: str | None) -> tuple[grpc.aio.Server, Server]:
    calls = Calls()
    server, port, _ = await start_server(
        [
            (scheduler_pb2_grpc.add_SchedulerServicer_to_server, CountingScheduler(calls)),
            (gateway_pb2_grpc.add_GatewayServicer_to_server, CountingGateway(calls)),
        ],
        "127.0.0.1",
        0,
        service_names=[SCHEDULER_SERVICE, GATEWAY_SERVICE],
        service_token=service_token,
    )
    return server, Server(f"127.0.0.1:{port}", calls)


@pytest.fixture
async def open_server() -> AsyncIterator[Server]:
    server, running = await _serve(None)
    yield running
    await server.stop(None)


@pytest.fixture
async def locked_server() -> AsyncIterator[Server]:
    server, running = await _serve(TOKEN)
    yield running
    await server.stop(None)


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return () if token is None else (("authorization", bearer(token)),)


async def _raw_unary(address: str, method: str, body: bytes, token: str | None = None) -> bytes:
    """One unary call with `body` as the request's bytes, whatever they are."""
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.unary_unary(method)  # no serializers: bytes in, bytes out
        reply: bytes = await call(body, timeout=DEFAULT_DEADLINE_S, metadata=_metadata(token))
        return reply


async def _raw_server_stream(
    address: str, method: str, body: bytes, token: str | None = None
) -> list[bytes]:
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.unary_stream(method)
        return [r async for r in call(body, timeout=DEFAULT_DEADLINE_S, metadata=_metadata(token))]


async def _raw_bidi(
    address: str, method: str, bodies: list[bytes], token: str | None = None
) -> list[bytes]:
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.stream_stream(method)(timeout=DEFAULT_DEADLINE_S, metadata=_metadata(token))
        for body in bodies:
            await call.write(body)
        await call.done_writing()
        return [r async for r in call]


async def _code(coro: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro  # type: ignore[misc]
    return info.value.code(), info.value.details() or ""


# ------------------------------------------------------------------ malformed requests


async def test_garbage_unary_request_is_invalid_argument(open_server: Server) -> None:
    code, details = await _code(_raw_unary(open_server.address, CANCEL, GARBAGE))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed lemix.v1.CancelRequest" in details
    assert "send a serialized lemix.v1.CancelRequest" in details
    assert open_server.calls.names == []  # the servicer never saw it
    # The same channel kind with a real message works: the server is unharmed.
    good = common_pb2.CancelRequest(task_id="t1").SerializeToString()
    reply = common_pb2.CancelResponse.FromString(
        await _raw_unary(open_server.address, CANCEL, good)
    )
    assert reply.is_found and open_server.calls.names == ["Cancel:t1"]


async def test_garbage_on_a_server_stream_is_invalid_argument(open_server: Server) -> None:
    code, details = await _code(_raw_server_stream(open_server.address, GENERATE, GARBAGE))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed lemix.v1.GenerateRequest" in details
    good = gateway_pb2.GenerateRequest(request_id="r1").SerializeToString()
    replies = await _raw_server_stream(open_server.address, GENERATE, good)
    assert [gateway_pb2.GenerateResponse.FromString(r).token_ids for r in replies] == [[7], []]
    assert open_server.calls.names == ["Generate:r1"]


async def test_garbage_on_a_bidi_stream_is_invalid_argument(open_server: Server) -> None:
    """Reflection is client- and server-streaming: the bad message mid-stream fails it."""
    good = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    code, details = await _code(_raw_bidi(open_server.address, REFLECTION, [good, GARBAGE]))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed grpc.reflection.v1alpha.ServerReflectionRequest" in details
    (reply,) = await _raw_bidi(open_server.address, REFLECTION, [good])
    names = {
        s.name
        for s in reflection_pb2.ServerReflectionResponse.FromString(
            reply
        ).list_services_response.service
    }
    assert SCHEDULER_SERVICE in names


async def test_garbage_health_check_is_invalid_argument(open_server: Server) -> None:
    code, details = await _code(_raw_unary(open_server.address, HEALTH_CHECK, GARBAGE))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "grpc.health.v1.HealthCheckRequest" in details


# ------------------------------------------------------------------ service token


async def test_without_the_token_every_call_is_unauthenticated(locked_server: Server) -> None:
    good = common_pb2.CancelRequest(task_id="t1").SerializeToString()
    code, details = await _code(_raw_unary(locked_server.address, CANCEL, good))
    assert code is grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer <token>" in details and "LEMIX_SERVICE_TOKEN" in details
    stream_request = gateway_pb2.GenerateRequest(request_id="r1").SerializeToString()
    code, _ = await _code(_raw_server_stream(locked_server.address, GENERATE, stream_request))
    assert code is grpc.StatusCode.UNAUTHENTICATED
    reflect = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    code, _ = await _code(_raw_bidi(locked_server.address, REFLECTION, [reflect]))
    assert code is grpc.StatusCode.UNAUTHENTICATED
    assert locked_server.calls.names == []


async def test_a_wrong_token_is_unauthenticated(locked_server: Server) -> None:
    good = common_pb2.CancelRequest(task_id="t1").SerializeToString()
    for wrong in (TOKEN[:-1], TOKEN + "x", "another-token-of-the-same-size-01234"):
        code, details = await _code(_raw_unary(locked_server.address, CANCEL, good, wrong))
        assert code is grpc.StatusCode.UNAUTHENTICATED, wrong
        assert "wrong service token" in details
    assert locked_server.calls.names == []


async def test_unauthenticated_garbage_is_refused_before_parsing(locked_server: Server) -> None:
    code, _ = await _code(_raw_unary(locked_server.address, CANCEL, GARBAGE))
    assert code is grpc.StatusCode.UNAUTHENTICATED
    # With the token, the same bytes are a malformed request.
    code, _ = await _code(_raw_unary(locked_server.address, CANCEL, GARBAGE, TOKEN))
    assert code is grpc.StatusCode.INVALID_ARGUMENT


async def test_channel_with_the_token_reaches_every_call_shape(locked_server: Server) -> None:
    async with channel(locked_server.address, service_token=TOKEN) as ch:
        scheduler = scheduler_pb2_grpc.SchedulerStub(ch)
        reply = await scheduler.Cancel(
            common_pb2.CancelRequest(task_id="t1"), timeout=DEFAULT_DEADLINE_S
        )
        assert reply.is_found
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(
            gateway_pb2.GenerateRequest(request_id="r1"), timeout=DEFAULT_DEADLINE_S
        )
        assert [r.token_ids async for r in call] == [[7], []]
        reflection = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            timeout=DEFAULT_DEADLINE_S
        )
        await reflection.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        await reflection.done_writing()
        assert (await reflection.read()).list_services_response.service
    assert locked_server.calls.names == ["Cancel:t1", "Generate:r1"]


async def test_health_checks_need_no_token(locked_server: Server) -> None:
    async with channel(locked_server.address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE), timeout=DEFAULT_DEADLINE_S
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_an_open_internal_server_warns_and_a_public_one_does_not() -> None:
    for token, is_warned in (("", True), (None, False), (TOKEN, False)):
        with capture_logs() as logs:
            server, _ = await _serve(token)
            await server.stop(None)
        warnings = [e for e in logs if e["event"] == "rpc.unauthenticated_server"]
        assert bool(warnings) is is_warned, token
        if warnings:
            assert "LEMIX_SERVICE_TOKEN" in warnings[0]["hint"]


# ------------------------------------------------------------------ the token itself


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("short", "at least 16 characters"),
        ("has a space in the middle!!", "without spaces"),
        ("tab\tinside-a-long-enough-token", "printable ASCII"),
        ("ünïcode-is-not-a-metadata-value", "printable ASCII"),
    ],
)
def test_bad_tokens_are_refused_with_a_hint(token: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        check_service_token(token)
    assert "secrets.token_urlsafe" in str(info.value)


def test_token_check_accepts_only_the_exact_bearer_value() -> None:
    token = generate_token()
    check_service_token(token)
    check = TokenCheck(token)
    assert check.problem([("authorization", bearer(token))]) is None
    assert check.problem([("x-other", "1"), ("authorization", bearer(token))]) is None
    assert "requires" in (check.problem([]) or "")
    assert "requires" in (check.problem(None) or "")
    assert "wrong" in (check.problem([("authorization", token)]) or "")  # no scheme
    assert "wrong" in (check.problem([("authorization", bearer(token).lower())]) or "")
    assert generate_token() != token
    with pytest.raises(ValueError):
        TokenCheck("")
