"""The gateway's side of internal-RPC security, over real gRPC and HTTP: it
sends the service token to a scheduler that requires it, and can keep
/metrics off its public HTTP port."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import grpc
import grpc.aio
import pytest
from gateway_fakes import FakeScheduler, GatewayFactory

from gateway.service import GatewayService
from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2_grpc
from lemix.infra.rpc import SCHEDULER_SERVICE
from lemix.infra.rpc.client import DEFAULT_DEADLINE_S, channel
from lemix.infra.rpc.server import start_server
from lemix.infra.store.store import Store

TOKEN = "gateway-test-service-token-0123456789"


@pytest.fixture
async def locked_scheduler(store: Store) -> AsyncIterator[FakeScheduler]:
    """A fake scheduler whose server requires the service token."""
    fake = FakeScheduler(store)
    server, port, _ = await start_server(
        [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, fake)],
        "127.0.0.1",
        0,
        service_names=[SCHEDULER_SERVICE],
        service_token=TOKEN,
    )
    fake.address = f"127.0.0.1:{port}"
    try:
        yield fake
    finally:
        await fake.close()
        await server.stop(None)


async def _train(gateway: GatewayService) -> gateway_pb2.TrainResponse:
    samples = [gateway_pb2.TrainSample(query=f"question {i}", reference="answer") for i in range(3)]
    async with channel(gateway.address) as ch:  # the public API: no token
        reply: gateway_pb2.TrainResponse = await gateway_pb2_grpc.GatewayStub(ch).Train(
            gateway_pb2.TrainRequest(samples=samples), timeout=DEFAULT_DEADLINE_S
        )
        return reply


async def test_gateway_sends_the_token_to_the_scheduler(
    make_gateway: GatewayFactory,
    locked_scheduler: FakeScheduler,
    live_node: int,
) -> None:
    gateway = await make_gateway(scheduler_address=locked_scheduler.address, service_token=TOKEN)
    reply = await _train(gateway)
    assert len(reply.task_ids) == 3
    assert sorted(t.task_id for t, _ in locked_scheduler.submitted) == sorted(reply.task_ids)


async def test_gateway_without_the_token_submits_nothing(
    make_gateway: GatewayFactory,
    locked_scheduler: FakeScheduler,
    live_node: int,
) -> None:
    gateway = await make_gateway(scheduler_address=locked_scheduler.address)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _train(gateway)
    # A misconfigured stack, not the caller's fault: never UNAUTHENTICATED to the public.
    assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
    assert locked_scheduler.submitted == []


async def _get_status(gateway: GatewayService, path: str) -> int:
    url = f"http://{gateway.http_address}{path}"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status


async def test_http_metrics_can_be_kept_off_the_public_port(
    make_gateway: GatewayFactory,
) -> None:
    default = await make_gateway()
    assert await _get_status(default, "/metrics") == 200  # `lemix up` keeps it
    private = await make_gateway(is_http_metrics_enabled=False)
    assert await _get_status(private, "/metrics") == 404
    assert await _get_status(private, "/v1/models") == 200  # the API itself still serves
