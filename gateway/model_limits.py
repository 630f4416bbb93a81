"""The served model's limits as the gateway checks requests against them.

Executors publish their model's vocabulary size and positions in their
heartbeat hash (`lemix.infra.store.model_limits`); `ModelLimitsCache` reads
them from the live nodes at most every `refresh_s` (one read in flight; the
callers that arrive meanwhile share it). A failed read keeps the last limits
known and is logged: the request then fails on Redis where it really needs
it (submission), with the status that says so.

`context_tokens` is what prompt + ``max_tokens`` must fit in: the gateway's
`max_context_tokens` (0 = no cap of its own) and the model's `max_model_len`,
whichever is smaller; `DEFAULT_CONTEXT_TOKENS` when neither is known (the
emulated backend runs no model and publishes none).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from redis.exceptions import RedisError

from lemix.infra.store.model_limits import ModelLimits, model_limits_from_states
from lemix.infra.store.store import Store

log = structlog.get_logger(__name__)

# The context limit when neither the gateway's config nor any executor sets one.
DEFAULT_CONTEXT_TOKENS = 4096
# How long the limits read from Redis are reused: they change only when a
# node with another model joins, and one read per second costs nothing.
LIMITS_REFRESH_S = 1.0


def context_tokens(configured: int, limits: ModelLimits) -> int:
    """The context limit requests are checked against (module doc)."""
    if configured and limits.max_model_len:
        return min(configured, limits.max_model_len)
    return configured or limits.max_model_len or DEFAULT_CONTEXT_TOKENS


class ModelLimitsCache:
    """The strictest limits the live executors publish; `ModelLimits()` until
    one does. `clock` is monotonic seconds."""

    def __init__(
        self, store: Store, clock: Callable[[], float], *, refresh_s: float = LIMITS_REFRESH_S
    ) -> None:
        self._store = store
        self._clock = clock
        self._refresh_s = refresh_s
        self._limits = ModelLimits()
        self._read_s: float | None = None
        self._reading: asyncio.Future[ModelLimits] | None = None

    async def get(self) -> ModelLimits:
        """The limits, read again when older than `refresh_s`; never raises
        for Redis (module doc)."""
        if self._read_s is not None and self._clock() - self._read_s < self._refresh_s:
            return self._limits
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read())
        # shield: one caller going away must not cancel the others' read
        return await asyncio.shield(self._reading)

    async def _read(self) -> ModelLimits:
        try:
            states = await self._store.get_node_states()
        except (RedisError, OSError) as exc:
            log.warning("gateway.model_limits_read_failed", error=str(exc))
            return self._limits
        else:
            limits, bad = model_limits_from_states(states)
            for node_id, error in bad.items():
                log.warning("gateway.bad_model_limits", node_id=node_id, error=error)
            if limits != self._limits:
                log.info(
                    "gateway.model_limits",
                    vocab_size=limits.vocab_size,
                    max_model_len=limits.max_model_len,
                )
            # Only a read that found a node is kept for `refresh_s`: until an
            # executor publishes, every request looks again.
            if states:
                self._limits, self._read_s = limits, self._clock()
            return limits
        finally:
            self._reading = None
