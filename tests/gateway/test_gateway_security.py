"""The gateway's side of internal-RPC security, over real gRPC and HTTP: it
sends the service token to a scheduler that requires it (the gateway calls
the scheduler to cancel; it writes new tasks to the intake in Redis), and
can keep /metrics off its public HTTP port."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from gateway_fakes import FakeScheduler, GatewayFactory, Script
from waiting import wait_until

from gateway.service import GatewayService
from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2_grpc
from lemix.infra.rpc import SCHEDULER_SERVICE
from lemix.infra.rpc.client import DEFAULT_DEADLINE_S, channel
from lemix.infra.rpc.server import start_server
from lemix.infra.store.store import Store

TOKEN = "gateway-test-service-token-0123456789"


@pytest.fixture
async def locked_scheduler(
    store: Store, fake_scheduler: FakeScheduler
) -> AsyncIterator[FakeScheduler]:
    """A fake scheduler whose server requires the service token (the
    default one stops reading the intake: this one plays the tasks)."""
    await fake_scheduler.stop_reading()
    fake = FakeScheduler(store, script=Script(is_held=True))
    await fake.start()
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


async def _cancel_a_held_request(gateway: GatewayService, scheduler: FakeScheduler) -> None:
    """Start a Generate the fake holds after its first token, then go away:
    the gateway cancels the task at the scheduler."""
    async with channel(gateway.address) as ch:  # the public API: no token
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(
            gateway_pb2.GenerateRequest(prompt="hello", max_tokens=8),
            timeout=DEFAULT_DEADLINE_S,
        )
        async for _ in call:
            break  # the first token: the task runs
        call.cancel()
    await wait_until(lambda: not gateway.servicer.num_in_flight, timeout_s=10.0)


async def test_gateway_sends_the_token_to_the_scheduler(
    make_gateway: GatewayFactory,
    locked_scheduler: FakeScheduler,
    live_node: int,
) -> None:
    gateway = await make_gateway(scheduler_address=locked_scheduler.address, service_token=TOKEN)
    await _cancel_a_held_request(gateway, locked_scheduler)
    ((task, _),) = locked_scheduler.submitted
    assert locked_scheduler.cancelled_ids() == [task.task_id]


async def test_gateway_without_the_token_cancels_nothing(
    make_gateway: GatewayFactory,
    locked_scheduler: FakeScheduler,
    live_node: int,
) -> None:
    gateway = await make_gateway(scheduler_address=locked_scheduler.address)
    await _cancel_a_held_request(gateway, locked_scheduler)
    assert len(locked_scheduler.submitted) == 1  # written to the intake, not through the RPC
    assert locked_scheduler.cancelled == []  # the Cancel was refused (logged by the gateway)


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
