"""lemix.infra.rpc.server/errors/client against a real gRPC server on a free port."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from structlog.testing import capture_logs

from lemix._proto.lemix.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from lemix.infra.rpc import GATEWAY_SERVICE, SCHEDULER_SERVICE, convert
from lemix.infra.rpc.client import DEFAULT_DEADLINE_S, channel, wait_for_serving
from lemix.infra.rpc.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    error_from_rpc,
    handle_errors,
)
from lemix.infra.rpc.server import MAX_MESSAGE_BYTES, start_server, stop_server
from lemix.types import NodeSnapshot, Task, TaskKind

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
FIXED_NODE = NodeSnapshot(node_id=1, now_s=3.5, num_running=2, busy_fraction=0.5)


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Thin like a real servicer: convert -> (pretend to) delegate -> map errors."""

    @handle_errors
    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitResponse:
        task, _ = convert.task_from_proto(request.task)
        if task.task_id == "full":
            raise ResourceExhausted("intake queue full (1000 tasks); retry later")
        if task.task_id == "refused":
            raise InvalidArgument("prompt + max_tokens exceeds the 2048-token context")
        if task.task_id == "boom":
            raise RuntimeError("secret internal detail")
        return scheduler_pb2.SubmitResponse(task_id=task.task_id)

    @handle_errors
    async def Cancel(
        self, request: common_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.CancelResponse:
        if request.task_id == "missing":
            raise NotFound(f"no task {request.task_id!r}")
        return common_pb2.CancelResponse(is_found=True)

    @handle_errors
    async def GetState(
        self, request: scheduler_pb2.GetStateRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerState:
        return scheduler_pb2.SchedulerState(
            policy="lemix", num_placed=3, nodes=[convert.node_state_to_proto(FIXED_NODE)]
        )


class FakeGateway(gateway_pb2_grpc.GatewayServicer):
    """Server-streaming: two tokens, then whatever the request id asks for."""

    @handle_errors
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        for token_id in (11, 12):
            yield gateway_pb2.GenerateResponse(request_id=request.request_id, token_ids=[token_id])
        if request.request_id == "no-executor":
            raise Unavailable("no live executor")
        if request.request_id == "boom":
            raise KeyError("stream bug")
        if request.request_id == "slow":
            await asyncio.sleep(30)
        yield gateway_pb2.GenerateResponse(request_id=request.request_id, is_finished=True)


@dataclass
class Running:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    server, port, health_servicer = await start_server(
        [
            (scheduler_pb2_grpc.add_SchedulerServicer_to_server, FakeScheduler()),
            (gateway_pb2_grpc.add_GatewayServicer_to_server, FakeGateway()),
        ],
        "127.0.0.1",
        0,
        service_names=[SCHEDULER_SERVICE, GATEWAY_SERVICE],
    )
    yield Running(server, port, health_servicer)
    await server.stop(None)


@pytest.fixture
async def scheduler(running: Running) -> AsyncIterator[scheduler_pb2_grpc.SchedulerStub]:
    async with channel(running.address) as ch:
        yield scheduler_pb2_grpc.SchedulerStub(ch)


def _submit(
    task_id: str, kind: int = common_pb2.TASK_KIND_INFERENCE
) -> scheduler_pb2.SubmitRequest:
    task = Task(task_id, TaskKind.INFERENCE, 0.0, num_prompt_tokens=3, max_output_tokens=5)
    msg = convert.task_to_proto(task)
    msg.kind = kind  # type: ignore[assignment]
    return scheduler_pb2.SubmitRequest(task=msg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------- calls


async def test_unary_calls_succeed(
    running: Running, scheduler: scheduler_pb2_grpc.SchedulerStub
) -> None:
    assert running.port > 0
    state = await scheduler.GetState(scheduler_pb2.GetStateRequest(), timeout=DEFAULT_DEADLINE_S)
    assert state.policy == "lemix" and state.num_placed == 3
    assert [convert.node_state_from_proto(n).snapshot for n in state.nodes] == [FIXED_NODE]
    reply = await scheduler.Submit(_submit("ok-1"), timeout=DEFAULT_DEADLINE_S)
    assert reply.task_id == "ok-1"


@pytest.mark.parametrize(
    ("request_", "code", "details"),
    [
        (_submit("refused"), grpc.StatusCode.INVALID_ARGUMENT, "exceeds the 2048-token context"),
        # A ValueError from conversion, no servicer code involved.
        (
            _submit("x", kind=common_pb2.TASK_KIND_UNSPECIFIED),
            grpc.StatusCode.INVALID_ARGUMENT,
            "set TASK_KIND_INFERENCE or TASK_KIND_TRAINING",
        ),
        (_submit("full"), grpc.StatusCode.RESOURCE_EXHAUSTED, "intake queue full"),
    ],
)
async def test_domain_errors_map_to_status_codes(
    scheduler: scheduler_pb2_grpc.SchedulerStub,
    request_: scheduler_pb2.SubmitRequest,
    code: grpc.StatusCode,
    details: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await scheduler.Submit(request_, timeout=DEFAULT_DEADLINE_S)
    assert info.value.code() is code
    assert details in (info.value.details() or "")


async def test_not_found_maps_and_converts_back(
    scheduler: scheduler_pb2_grpc.SchedulerStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await scheduler.Cancel(common_pb2.CancelRequest(task_id="missing"), timeout=5)
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    err = error_from_rpc(info.value)
    assert isinstance(err, NotFound) and "no task 'missing'" in str(err)


async def test_unexpected_error_is_internal_logged_not_leaked(
    scheduler: scheduler_pb2_grpc.SchedulerStub,
) -> None:
    with capture_logs() as logs, pytest.raises(grpc.aio.AioRpcError) as info:
        await scheduler.Submit(_submit("boom"), timeout=DEFAULT_DEADLINE_S)
    assert info.value.code() is grpc.StatusCode.INTERNAL
    details = info.value.details() or ""
    assert "RuntimeError" in details and "secret" not in details
    (entry,) = [e for e in logs if e["event"] == "rpc.internal_error"]
    assert entry["error"] == "RuntimeError: secret internal detail"
    assert entry["method"] == "FakeScheduler.Submit"
    assert f"error_id={entry['error_id']}" in details


async def test_error_from_rpc_maps_codes_back(
    scheduler: scheduler_pb2_grpc.SchedulerStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await scheduler.Submit(_submit("full"), timeout=DEFAULT_DEADLINE_S)
    assert isinstance(error_from_rpc(info.value), ResourceExhausted)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await scheduler.Submit(_submit("boom"), timeout=DEFAULT_DEADLINE_S)
    assert error_from_rpc(info.value) is info.value  # no domain meaning


# --------------------------------------------------------------- streaming


async def _generate(address: str, request_id: str) -> tuple[list[int], grpc.aio.AioRpcError | None]:
    tokens: list[int] = []
    async with channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        call = stub.Generate(gateway_pb2.GenerateRequest(request_id=request_id), timeout=5)
        try:
            async for reply in call:
                tokens.extend(reply.token_ids)
        except grpc.aio.AioRpcError as err:
            return tokens, err
    return tokens, None


async def test_stream_ok(running: Running) -> None:
    assert await _generate(running.address, "fine") == ([11, 12], None)


@pytest.mark.parametrize(
    ("request_id", "code"),
    [("no-executor", grpc.StatusCode.UNAVAILABLE), ("boom", grpc.StatusCode.INTERNAL)],
)
async def test_stream_errors_after_some_tokens(
    running: Running, request_id: str, code: grpc.StatusCode
) -> None:
    tokens, err = await _generate(running.address, request_id)
    assert tokens == [11, 12]  # what was sent before the error still arrives
    assert err is not None and err.code() is code


async def test_client_cancel_is_not_an_internal_error(running: Running) -> None:
    with capture_logs() as logs:
        async with channel(running.address) as ch:
            call = gateway_pb2_grpc.GatewayStub(ch).Generate(
                gateway_pb2.GenerateRequest(request_id="slow"), timeout=5
            )
            await call.read()
            assert call.cancel()
            assert await call.code() is grpc.StatusCode.CANCELLED
        await asyncio.sleep(0.1)  # let the server side observe the cancellation
    assert not [e for e in logs if e["event"] == "rpc.internal_error"]


def test_handle_errors_rejects_sync_methods() -> None:
    with pytest.raises(TypeError, match="needs an async servicer method"):

        @handle_errors
        def Submit(self: object, request: object, context: object) -> None:  # noqa: N802
            return None


# --------------------------------------------------- health and reflection


async def test_health_serving_then_not_serving_on_stop(running: Running) -> None:
    await wait_for_serving(running.address, SCHEDULER_SERVICE, timeout_s=5)
    async with channel(running.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", SCHEDULER_SERVICE, GATEWAY_SERVICE):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == SERVING, name
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Check(health_pb2.HealthCheckRequest(service="lemix.v1.Nope"), timeout=5)
        assert info.value.code() is grpc.StatusCode.NOT_FOUND

        watch = stub.Watch(health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE))
        assert (await watch.read()).status == SERVING
        stopping = asyncio.create_task(
            stop_server(running.server, running.health, grace_s=1.0, drain_s=0.5)
        )
        # During the drain, health already says NOT_SERVING (polled and pushed)
        # while the server still answers.
        assert (await watch.read()).status == NOT_SERVING
        for name in ("", SCHEDULER_SERVICE):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == NOT_SERVING
        assert not stopping.done()
        await stopping
        watch.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_wait_for_serving_times_out_naming_the_cause() -> None:
    address = f"127.0.0.1:{_free_port()}"
    match = r"did not report lemix.v1.Scheduler SERVING within 0.5 s \(last: UNAVAILABLE"
    with pytest.raises(TimeoutError, match=match):
        await wait_for_serving(address, SCHEDULER_SERVICE, timeout_s=0.5)


async def test_wait_for_serving_waits_for_a_late_server() -> None:
    port = _free_port()
    waiter = asyncio.create_task(wait_for_serving(f"127.0.0.1:{port}", SCHEDULER_SERVICE, 10))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    server, _, health_servicer = await start_server(
        [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, FakeScheduler())],
        "127.0.0.1",
        port,
        service_names=[SCHEDULER_SERVICE],
    )
    try:
        await asyncio.wait_for(waiter, 5)
    finally:
        await stop_server(server, health_servicer, grace_s=0)


async def test_reflection_lists_services(running: Running) -> None:
    async with channel(running.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)

        async def ask(**kw: str) -> reflection_pb2.ServerReflectionResponse:
            call = stub.ServerReflectionInfo(timeout=5)
            await call.write(reflection_pb2.ServerReflectionRequest(**kw))
            await call.done_writing()
            return await call.read()

        listed = await ask(list_services="")
        names = {s.name for s in listed.list_services_response.service}
        assert names == {
            SCHEDULER_SERVICE,
            GATEWAY_SERVICE,
            health.SERVICE_NAME,
            reflection.SERVICE_NAME,
        }
        # And a tool like grpcurl can fetch the schema behind a name.
        files = await ask(file_containing_symbol=SCHEDULER_SERVICE)
        assert files.file_descriptor_response.file_descriptor_proto


async def test_bind_to_a_busy_port_fails_loudly(running: Running) -> None:
    with pytest.raises(OSError, match=f"cannot bind gRPC server to 127.0.0.1:{running.port}"):
        await start_server(
            [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, FakeScheduler())],
            "127.0.0.1",
            running.port,
            service_names=[SCHEDULER_SERVICE],
        )


def test_start_server_needs_service_names() -> None:
    with pytest.raises(ValueError, match="needs service_names"):
        asyncio.run(start_server([], service_names=[]))


# ------------------------------------------------------------ size limits


async def test_oversize_message_is_resource_exhausted_and_server_survives(
    running: Running, scheduler: scheduler_pb2_grpc.SchedulerStub
) -> None:
    huge = common_pb2.CancelRequest(task_id="t", reason="x" * (MAX_MESSAGE_BYTES + 1))
    # A client allowed to send more: the server's own limit refuses it.
    async with channel(running.address, max_message_bytes=4 * MAX_MESSAGE_BYTES) as big:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await scheduler_pb2_grpc.SchedulerStub(big).Cancel(huge, timeout=DEFAULT_DEADLINE_S)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    # Our default channel refuses it before sending.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await scheduler.Cancel(huge, timeout=DEFAULT_DEADLINE_S)
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    # Just under the limit still works, and the server keeps serving.
    fits = common_pb2.CancelRequest(task_id="t", reason="x" * (MAX_MESSAGE_BYTES - 64))
    assert (await scheduler.Cancel(fits, timeout=DEFAULT_DEADLINE_S)).is_found
    state = await scheduler.GetState(scheduler_pb2.GetStateRequest(), timeout=DEFAULT_DEADLINE_S)
    assert state.policy == "lemix"
