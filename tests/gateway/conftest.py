"""Fixtures for the gateway tests: real Redis (`redis_server`, a unique
namespace per test), a real fake-scheduler gRPC server, real gateways.

The repository root goes on `sys.path`: without it, `import gateway` finds
this `tests/gateway/` folder (a namespace package, since `tests/` is on the
path) before the editable install's `gateway` package. Setting pytest's
``pythonpath = ["."]`` in pyproject.toml would make this unnecessary.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
if _REPO_ROOT not in sys.path:
    sys.path.append(_REPO_ROOT)

import grpc.aio  # noqa: E402
import pytest  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
from gateway_fakes import FAKE_NODE_ID, FakeScheduler, GatewayFactory  # noqa: E402
from redis_pool import TEST_POOL_SIZE  # noqa: E402

from gateway.config import GatewayConfig  # noqa: E402
from gateway.service import GatewayService  # noqa: E402
from lemix._proto.lemix.v1 import gateway_pb2_grpc, scheduler_pb2_grpc  # noqa: E402
from lemix.infra.rpc import SCHEDULER_SERVICE  # noqa: E402
from lemix.infra.rpc.client import channel  # noqa: E402
from lemix.infra.rpc.server import start_server  # noqa: E402
from lemix.infra.store.keys import RedisKeys  # noqa: E402
from lemix.infra.store.server import EmbeddedRedis  # noqa: E402
from lemix.infra.store.store import Store  # noqa: E402


@pytest.fixture
def namespace() -> str:
    return f"gwtest-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def store(redis_server: EmbeddedRedis, namespace: str) -> AsyncIterator[Store]:
    client = aioredis.Redis.from_url(
        redis_server.url, decode_responses=True, max_connections=TEST_POOL_SIZE
    )
    try:
        yield Store(client, RedisKeys(namespace))
    finally:
        await client.aclose()


@pytest.fixture
async def live_node(store: Store) -> int:
    """One executor heartbeat, as an executor writes it (docs/protocol.md)."""
    await store.put_node_state(
        FAKE_NODE_ID,
        {
            "now_s": 1.5,
            "num_running": 0,
            "is_healthy": True,
            "address": "127.0.0.1:1",
            "num_stages": 2,
            "memory_capacity_bytes": 8 << 30,
        },
        ttl_s=60.0,
    )
    return FAKE_NODE_ID


@pytest.fixture
async def fake_scheduler(store: Store) -> AsyncIterator[FakeScheduler]:
    fake = FakeScheduler(store)
    await fake.start()
    server, port, _ = await start_server(
        [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, fake)],
        "127.0.0.1",
        0,
        service_names=[SCHEDULER_SERVICE],
    )
    fake.address = f"127.0.0.1:{port}"
    try:
        yield fake
    finally:
        await fake.close()
        await server.stop(None)


@pytest.fixture
async def make_gateway(
    redis_server: EmbeddedRedis, namespace: str, fake_scheduler: FakeScheduler
) -> AsyncIterator[GatewayFactory]:
    """Start a gateway on a free port (test-friendly timings); stopped at teardown."""
    started: list[GatewayService] = []

    async def make(**overrides: Any) -> GatewayService:
        values: dict[str, Any] = {
            "port": 0,
            "scheduler_address": fake_scheduler.address,
            "redis_url": redis_server.url,
            "namespace": namespace,
            "node_check_s": 0.0,
            "stream_idle_timeout_s": 10.0,
            "shutdown_grace_s": 1.0,
            **overrides,
        }
        service = GatewayService(GatewayConfig(**values))
        await service.start()
        started.append(service)
        return service

    try:
        yield make
    finally:
        for service in started:
            await service.stop()


@pytest.fixture
async def gateway(make_gateway: GatewayFactory) -> GatewayService:
    return await make_gateway()


@pytest.fixture
async def stub(gateway: GatewayService) -> AsyncIterator[gateway_pb2_grpc.GatewayStub]:
    async with channel(gateway.address) as ch:
        yield gateway_pb2_grpc.GatewayStub(ch)


@pytest.fixture
async def raw_channel(gateway: GatewayService) -> AsyncIterator[grpc.aio.Channel]:
    """A channel that sends messages far over the server's size limit."""
    big = 64 * 1024 * 1024
    async with grpc.aio.insecure_channel(
        gateway.address,
        options=[("grpc.max_send_message_length", big), ("grpc.max_receive_message_length", big)],
    ) as ch:
        yield ch
