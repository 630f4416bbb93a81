"""A gateway's background upkeep: the Redis writes it batches, so that taking
a request in does no Redis round trip for bookkeeping.

* the request counters (`BatchedCounters`) are flushed every
  `stats_flush_s`, before GetStats reads them, and on stop.
* `StreamLeases`: this gateway's one lease on every stream it reads
  (`RedisKeys.gateway_lease`; the task's intake fields name the gateway, so
  its hash says whose lease covers it). It must be live before the task
  exists (the scheduler cancels a streamed task whose gateway's lease is
  missing: its gateway died), so `take` has the task's intake write rewrite
  it, ahead of the task in the same round trip, only when the loop has not
  renewed it lately (at start, or while renewals fail); one loop renews it
  every `ttl_s / 3`.
  Per request no lease is written or deleted, and no stream expired: the
  scheduler expires a task's output stream once, when it sees the task end
  (`SchedulerConfig.output_retain_s`).
* `Upkeep`: runs both loops; `stop` flushes the counters and drops the lease.

A Redis error in a loop is logged and retried on the next tick (a renewal
sooner): upkeep never fails a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from redis.exceptions import RedisError

from lemix.infra.store.counters import BatchedCounters
from lemix.infra.store.store import Store

log = structlog.get_logger(__name__)

T = TypeVar("T")

# A failed renewal is retried after at most this long (not a whole ttl/3).
RENEW_RETRY_S = 0.5
# `Upkeep.stop` cancels its loops again this often until they end.
STOP_POLL_S = 0.1


class StreamLeases:
    """This gateway's (`owner`'s) lease on the streams it reads.

    Readers are counted per task id: two readers of one task (an idempotent
    retry) share it.
    """

    def __init__(
        self,
        store: Store,
        owner: str,
        ttl_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._store = store
        self.owner = owner
        self.ttl_s = ttl_s
        self._clock = clock
        self._refs: dict[str, int] = {}
        # When (on `clock`) the last write known to have landed lapses; a
        # write counts from when it was sent, so this is never late.
        self._held_until_s = -math.inf

    @property
    def renew_interval_s(self) -> float:
        return self.ttl_s / 3

    @property
    def live_ids(self) -> list[str]:
        """Task ids whose streams are being read."""
        return list(self._refs)

    @property
    def is_fresh(self) -> bool:
        """The lease has at least two renewal intervals left: the loop keeps
        it (a task written now finds it live with a wide margin)."""
        return self._held_until_s - self._clock() >= 2 * self.renew_interval_s

    async def take(self, task_id: str, write: Callable[[float | None], Awaitable[T]]) -> T:
        """Count a reader of `task_id` and run `write(lease_ttl_s)`, the round
        trip that stores its task (`Store.submit_tasks` with a `GatewayHold`):
        it rewrites the lease with `lease_ttl_s` ahead of the task, or, when
        None, the loop keeps the lease fresh and no lease write is needed.
        Returns what `write` returns; raises what it raises (the reader is
        then not counted)."""
        self._refs[task_id] = self._refs.get(task_id, 0) + 1
        lease_ttl_s = None if self.is_fresh else self.ttl_s
        sent_s = self._clock()
        try:
            result = await write(lease_ttl_s)
        except BaseException:
            self.release(task_id)
            raise
        if lease_ttl_s is not None:
            self._held_until_s = max(self._held_until_s, sent_s + lease_ttl_s)
        return result

    def release(self, task_id: str) -> None:
        """One reader is done (no I/O)."""
        num_refs = self._refs.get(task_id, 0) - 1
        if num_refs > 0:
            self._refs[task_id] = num_refs
        else:
            self._refs.pop(task_id, None)

    async def renew(self) -> None:
        """Renew the lease (and the reader's wake stream's TTL), one round
        trip. Raises the Redis error."""
        sent_s = self._clock()
        await self._store.keep_gateway_lease(self.owner, self.ttl_s)
        self._held_until_s = max(self._held_until_s, sent_s + self.ttl_s)

    async def drop(self) -> None:
        """Delete the lease (the gateway stops); a later `take` writes it again."""
        self._held_until_s = -math.inf
        await self._store.drop_gateway_lease(self.owner)


class Upkeep:
    """Runs the counters' flush loop and the lease's loop; `stop` ends both
    after a last flush and with the lease dropped."""

    def __init__(self, counters: BatchedCounters, leases: StreamLeases, *, flush_s: float) -> None:
        if flush_s <= 0:
            raise ValueError(f"flush_s must be > 0, got {flush_s}")
        self.counters = counters
        self.leases = leases
        self.flush_s = flush_s
        self._loops: list[asyncio.Task[None]] = []
        self._is_stopping = False

    def start(self) -> None:
        if self._loops:
            raise RuntimeError("Upkeep is already started")
        self._loops = [
            asyncio.create_task(self._flush_loop(), name="gateway-counters"),
            asyncio.create_task(self._lease_loop(), name="gateway-leases"),
        ]

    async def stop(self) -> None:
        """Stop the loops; then flush and drop the lease (best effort, logged)."""
        loops, self._loops = self._loops, []
        self._is_stopping = True
        # A cancel can be lost on Python 3.11: `asyncio.wait_for` (redis-py
        # reads through it) returns the result instead when its read completes
        # as the cancel lands. So the loops also check `_is_stopping`, and are
        # cancelled again until they end.
        while pending := [loop for loop in loops if not loop.done()]:
            for loop in pending:
                loop.cancel()
            await asyncio.wait(pending, timeout=STOP_POLL_S)
        await asyncio.gather(*loops, return_exceptions=True)
        # Streams still open at stop: the scheduler cancels them once the lease is gone.
        with contextlib.suppress(RedisError, OSError):
            await self.leases.drop()
        try:
            await self.counters.flush()
        except (RedisError, OSError) as exc:
            log.warning(
                "gateway.counters_lost_at_stop", pending=self.counters.pending, error=str(exc)
            )

    async def _flush_loop(self) -> None:
        while not self._is_stopping:
            await asyncio.sleep(self.flush_s)
            try:
                await self.counters.flush()
            except (RedisError, OSError) as exc:
                log.warning("gateway.counters_flush_failed", error=str(exc))

    async def _lease_loop(self) -> None:
        leases = self.leases
        delay_s = 0.0  # taken at once: requests then find it fresh
        while not self._is_stopping:
            await asyncio.sleep(delay_s)
            try:
                await leases.renew()
            except (RedisError, OSError) as exc:
                log.warning(
                    "gateway.lease_renew_failed", num_live=len(leases.live_ids), error=str(exc)
                )
                # The lease is running out: try again soon.
                delay_s = min(leases.renew_interval_s, RENEW_RETRY_S)
                continue
            delay_s = leases.renew_interval_s
