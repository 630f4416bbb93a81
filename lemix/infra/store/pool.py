"""A blocking connection pool whose uncontended path takes no locks.

redis-py's asyncio `BlockingConnectionPool` takes its `asyncio.Condition`
(and a timeout and a context manager) to check a connection out, and its
lock and the condition again to put it back: ~12 µs of CPU per round trip on
this project's 2-core host, about a sixth of a whole `GET` round trip
(`benchmarks/control_plane.py` counts 8-9 round trips per request across
the services). asyncio runs one callback at a time, so while nobody waits
for a connection and nothing holds those locks, checking a connection out
of the free list and back in is already atomic without them.

`FastBlockingConnectionPool` does exactly that and hands every other case to
redis-py's own code: a caller that must wait (no free connection), a release
while anyone waits (they are notified as before), maintenance mode (which
serialises pool changes through the lock). The bound, the blocking and the
`pool_timeout_s` error are therefore redis-py's. It reads private attributes
of redis-py's pool (`_available_connections`, `_in_use_connections`,
`_condition`, `_lock`, `_in_maintenance`); `is_supported()` checks they are
there, and `connect` uses redis-py's pool unchanged when they are not (a
future redis-py) or when a credential provider is set (its re-authentication
listens to the release event this fast path does not send).
"""

from __future__ import annotations

from typing import Any

import redis.asyncio.connection as aioconn

_PRIVATE_ATTRIBUTES = (
    "_available_connections",
    "_in_use_connections",
    "_condition",
    "_lock",
    "_in_maintenance",
)


class FastBlockingConnectionPool(aioconn.BlockingConnectionPool):
    """`BlockingConnectionPool` without locks while uncontended (module doc)."""

    def _is_contended(self) -> bool:
        condition = self._condition
        return bool(
            self._in_maintenance
            or condition._waiters  # type: ignore[attr-defined]
            or condition.locked()
            or self._lock.locked()
        )

    async def get_connection(self, *args: Any, **kwargs: Any) -> aioconn.AbstractConnection:
        if args or kwargs or not self._available_connections or self._is_contended():
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-any-return]
        connection = self._available_connections.pop()
        self._in_use_connections.add(connection)
        # As redis-py's: connect if needed, and never hand out a connection
        # with unread data on it.
        try:
            await self.ensure_connection(connection)
        except BaseException:
            await self.release(connection)
            raise
        return connection

    async def release(self, connection: aioconn.AbstractConnection) -> None:
        if self._is_contended() or connection.should_reconnect():
            await super().release(connection)
            return
        self._in_use_connections.remove(connection)
        self._available_connections.append(connection)
        # redis-py then dispatches an after-release event, which only its
        # credential providers (re-authentication) listen to; LeMix uses none.


def is_supported(pool: aioconn.ConnectionPool) -> bool:
    """Whether `pool` (a redis-py `BlockingConnectionPool`) has the private
    attributes `FastBlockingConnectionPool` relies on, and no credential
    provider (module doc)."""
    if not isinstance(pool, aioconn.BlockingConnectionPool):
        return False
    if pool.connection_kwargs.get("credential_provider") is not None:
        return False
    if not all(hasattr(pool, name) for name in _PRIVATE_ATTRIBUTES):
        return False
    return hasattr(pool._condition, "_waiters")
