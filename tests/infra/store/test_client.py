"""lemix.infra.store.client with its pool (`pool`) and packer (`packing`), on a
real Redis: the bound holds and waiters are served under contention, and the
bytes and errors of a packed command are redis-py's own."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError

from lemix.infra.store.client import RedisClientConfig, connect, pool_in_use
from lemix.infra.store.packing import with_hiredis_packing
from lemix.infra.store.pool import FastBlockingConnectionPool, is_supported
from lemix.infra.store.server import EmbeddedRedis


def _client(server: EmbeddedRedis, max_connections: int, **options: float) -> aioredis.Redis:
    return connect(
        RedisClientConfig(
            server.url, max_connections=max_connections, socket_timeout_s=5.0, **options
        )
    )


async def test_the_fast_pool_is_used_and_keeps_its_bound_under_contention(
    redis_server: EmbeddedRedis,
) -> None:
    client = _client(redis_server, 3)
    pool = client.connection_pool
    assert isinstance(pool, FastBlockingConnectionPool) and is_supported(pool)
    most_in_use = 0

    async def one(i: int) -> str | None:
        nonlocal most_in_use
        # A short blocking read holds its connection across awaits, so the
        # callers really contend for the three connections.
        await client.xread({f"test:pool:{i}": "$"}, block=5)
        most_in_use = max(most_in_use, pool_in_use(client))
        return await client.set(f"test:pool:key:{i}", str(i))  # type: ignore[no-any-return]

    try:
        results = await asyncio.gather(*(one(i) for i in range(60)))
        assert all(results)
        assert most_in_use <= 3
        assert len(pool._available_connections) + len(pool._in_use_connections) <= 3
        assert pool_in_use(client) == 0  # every connection came back
        values = await client.mget([f"test:pool:key:{i}" for i in range(60)])
        assert values == [str(i) for i in range(60)]
    finally:
        await client.aclose()


async def test_an_exhausted_pool_still_raises_after_its_wait(redis_server: EmbeddedRedis) -> None:
    client = _client(redis_server, 1, pool_timeout_s=0.1)
    try:
        blocked = asyncio.create_task(client.xread({"test:pool:none": "$"}, block=400))
        await asyncio.sleep(0.05)
        with pytest.raises(RedisConnectionError, match="No connection available"):
            await client.ping()
        await blocked
        assert await client.ping()  # and serves again once one is back
    finally:
        await client.aclose()


def test_a_credential_provider_keeps_redis_pys_own_pool() -> None:
    class _Provider:
        def get_credentials(self) -> tuple[str]:
            return ("secret",)

    pool = FastBlockingConnectionPool.from_url(
        "redis://127.0.0.1:1/0", max_connections=1, credential_provider=_Provider()
    )
    assert not is_supported(pool)


ARGS = ("EVALSHA", "a" * 40, 2, "k1", "k2", 7, -3, 2**70, 1.5, 0.1, 1e20, "é", b"\x00\xff", "")


@pytest.mark.parametrize(
    "args",
    [
        ARGS,
        ("CONFIG GET", "maxmemory"),
        (b"CLIENT SETNAME", "x"),
        ("SET", "k", bytearray(b"ab")),
        ("SET", "k", memoryview(b"ab")),
    ],
)
def test_hiredis_packing_sends_the_bytes_redis_py_would(args: tuple[object, ...]) -> None:
    packed = with_hiredis_packing(Connection)().pack_command(*args)
    assert b"".join(packed) == b"".join(Connection().pack_command(*args))


@pytest.mark.parametrize("value", [None, True, object()])
def test_hiredis_packing_raises_redis_pys_error_for_what_it_cannot_send(value: object) -> None:
    with pytest.raises(DataError):
        with_hiredis_packing(Connection)().pack_command("SET", "k", value)


async def test_packed_commands_round_trip_through_redis(redis_server: EmbeddedRedis) -> None:
    client = _client(redis_server, 2)
    try:
        assert type(client.connection_pool).__name__ == "FastBlockingConnectionPool"
        await client.hset("test:pack", mapping={"a": 1.5, "b": "é", "c": 2**70})
        assert await client.hgetall("test:pack") == {"a": "1.5", "b": "é", "c": str(2**70)}
    finally:
        await client.delete("test:pack")
        await client.aclose()
