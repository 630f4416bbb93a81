"""The asyncio Redis client the shared test fixtures use: through the project's
factory (`lemix.infra.store.client.connect`), with its pool sized on purpose
(redis-py's async default is 100 and raises when exhausted) and a socket
timeout that outlasts any blocking read a test makes."""

from __future__ import annotations

import redis.asyncio as aioredis

from lemix.infra.store.client import RedisClientConfig, connect

MAX_CONNECTIONS = 16
SOCKET_TIMEOUT_S = 30.0


def connect_for_tests(url: str) -> aioredis.Redis:
    return connect(RedisClientConfig(url, MAX_CONNECTIONS, SOCKET_TIMEOUT_S))
