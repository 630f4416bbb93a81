"""Every LeMix service builds its Redis client here, with its pool sized on purpose.

redis-py's defaults are wrong for us in ways that lose work: the async pool
held up to 100 connections and *raised* `MaxConnectionsError` past that
(redis-py 8 made it 100 by default and non-blocking), so a burst of concurrent
Store calls failed instead of queueing. Here:

* the pool is a `BlockingConnectionPool` of `max_connections`, sized by the
  caller from its own concurrency: a caller past the bound *waits* up to
  `pool_timeout_s` for a connection, then gets a `redis.exceptions
  .ConnectionError` that says the pool was exhausted (never a silent drop);
* socket timeouts are explicit and must outlast the caller's blocking reads
  (XREAD/XREADGROUP BLOCK), or a quiet stream reads as a dead server;
* commands are packed by hiredis, not in Python (`packing`), and an
  uncontended pool checks connections out and in without locks (`pool`);
* retries are explicit: one quick retry of a *connection* error (a Redis
  restart drops every socket; the command had not run), none of a timeout
  (the command may have run, and XADD is not idempotent).

`export_pool_metrics` exports the bound and the connections in use
(``lemix_redis_pool_connections{state=max|in_use}``), so a dashboard can set
waiting against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from lemix.infra import telemetry
from lemix.infra.store.packing import with_hiredis_packing
from lemix.infra.store.pool import FastBlockingConnectionPool, is_supported

DEFAULT_CONNECT_TIMEOUT_S = 5.0
# Waiting longer than this for a pooled connection means the service is
# overloaded or Redis is stuck; the caller's error path (retry/back off) runs.
DEFAULT_POOL_TIMEOUT_S = 10.0
_RETRY_BACKOFF_BASE_S = 0.05
_RETRY_BACKOFF_CAP_S = 0.5
_NUM_RETRIES = 1


@dataclass(frozen=True)
class RedisClientConfig:
    """How one service talks to Redis; every field is a decision, not a default."""

    url: str
    max_connections: int
    socket_timeout_s: float
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    pool_timeout_s: float = DEFAULT_POOL_TIMEOUT_S
    decode_responses: bool = True

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("the Redis URL is empty")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        for name in ("socket_timeout_s", "connect_timeout_s", "pool_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def connect(config: RedisClientConfig) -> aioredis.Redis:
    """A client over its own blocking pool (closed with the client's `aclose()`).

    Nothing is sent until the first command: callers `await client.ping()` to
    fail fast on a bad URL.
    """
    options: dict[str, Any] = {
        "max_connections": config.max_connections,
        "timeout": config.pool_timeout_s,
        "decode_responses": config.decode_responses,
        "socket_timeout": config.socket_timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "health_check_interval": 0,
        "retry": Retry(
            ExponentialBackoff(cap=_RETRY_BACKOFF_CAP_S, base=_RETRY_BACKOFF_BASE_S),
            _NUM_RETRIES,
            supported_errors=(RedisConnectionError,),
        ),
    }
    pool: aioredis.BlockingConnectionPool = FastBlockingConnectionPool.from_url(
        config.url, **options
    )
    if not is_supported(pool):
        pool = aioredis.BlockingConnectionPool.from_url(config.url, **options)
    # from_url picked the class for the URL's scheme (TCP, TLS, unix socket).
    pool.connection_class = with_hiredis_packing(pool.connection_class)
    return aioredis.Redis.from_pool(pool)


def pool_size(client: aioredis.Redis) -> int:
    """The connection bound of `client`'s pool."""
    return int(client.connection_pool.max_connections)


def pool_in_use(client: aioredis.Redis) -> int:
    """Connections of `client`'s pool checked out now."""
    # redis-py has no public accessor; this one is what its own pool uses.
    return sum(1 for _ in client.connection_pool._get_in_use_connections())


def export_pool_metrics(client: aioredis.Redis) -> None:
    """Export `client`'s pool (bound, in use) as this process's pool gauge."""
    telemetry.set_redis_pool_source(pool_size(client), lambda: pool_in_use(client))
