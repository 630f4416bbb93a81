"""A gateway's background upkeep: the Redis writes it batches, so that taking
a request in does no Redis round trip for bookkeeping.

* `BatchedCounters`: `add` sums request counters in memory; `flush` writes
  every delta in one round trip (`Store.incr_stats`), every `stats_flush_s`,
  before GetStats reads them, and on stop. A failed flush keeps its deltas
  for the next one: a count is late, never dropped.
* `StreamLeases`: the leases this gateway holds on the streams it reads
  (`RedisKeys.stream_lease`). `take` writes one at once, since it must exist
  before Submit (the scheduler cancels a streamed task whose lease is missing:
  its gateway died); one loop renews them all every `ttl_s / 3` in one round
  trip and deletes, in the same round trip, the leases of streams released
  since (woken by a release, it gathers the releases of the next
  `RELEASE_BATCH_S` into one round trip).
* `Upkeep`: runs both loops; `stop` flushes the counters and drops every lease.

A Redis error in a loop is logged and retried on the next tick (a renewal
sooner): upkeep never fails a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import structlog
from redis.exceptions import RedisError

from lemix.infra.store.store import Store

log = structlog.get_logger(__name__)

# A failed renewal is retried after at most this long (not a whole ttl/3).
RENEW_RETRY_S = 0.5
# Lease drops and stream retirements released within this long of each
# other share one round trip.
RELEASE_BATCH_S = 0.05
# `Upkeep.stop` cancels its loops again this often until they end.
STOP_POLL_S = 0.1


class BatchedCounters:
    """Request counters summed in memory and written to Redis in batches."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._pending: Counter[str] = Counter()

    @property
    def pending(self) -> dict[str, int]:
        """Deltas not written yet."""
        return dict(self._pending)

    def add(self, name: str, by: int = 1) -> None:
        """Count `by` more of `name` (no I/O)."""
        self._pending[name] += by

    async def flush(self) -> None:
        """Write the pending deltas in one round trip. On a Redis error they
        stay pending (and the error propagates). A write whose reply was lost
        may then count twice: these are statistics, not per-task accounting."""
        if not self._pending:
            return
        deltas, self._pending = self._pending, Counter()
        try:
            await self._store.incr_stats(deltas)
        except BaseException:
            self._pending.update(deltas)
            raise


class StreamLeases:
    """This gateway's (`owner`'s) leases on the streams it reads.

    Counted per task id: two readers of one task (an idempotent retry) share
    the lease, which is dropped when the last one releases it.
    """

    def __init__(
        self, store: Store, owner: str, ttl_s: float, *, retain_output_s: float = 300.0
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if retain_output_s <= 0:
            raise ValueError(f"retain_output_s must be > 0, got {retain_output_s}")
        self._store = store
        self.owner = owner
        self.ttl_s = ttl_s
        self.retain_output_s = retain_output_s
        self._refs: dict[str, int] = {}
        self._to_drop: set[str] = set()
        self._to_retire: set[str] = set()  # streams read to their end
        self.wake = asyncio.Event()  # set by a release: drop its lease now

    @property
    def renew_interval_s(self) -> float:
        return self.ttl_s / 3

    @property
    def live_ids(self) -> list[str]:
        """Task ids whose streams are being read."""
        return list(self._refs)

    async def take(self, task_id: str, *, wake: bool = False) -> None:
        """Write the lease now (one round trip; with `wake`, the output
        reader's wake goes in it: `gateway.reader`); the loop renews it until
        `release`. Raises the Redis error (the reference is then released)."""
        self._refs[task_id] = self._refs.get(task_id, 0) + 1
        self._to_drop.discard(task_id)
        try:
            await self._store.renew_stream_leases(self.owner, [task_id], self.ttl_s, wake=wake)
        except BaseException:
            self.release(task_id, drop=False)
            raise

    def release(self, task_id: str, *, drop: bool = True, retire_output: bool = False) -> None:
        """One reader is done (no I/O). With `drop`, the lease is deleted soon
        after the last reader is done; without, it is only no longer renewed
        and lapses by itself: for a Submit that was refused, whose id may name
        another request's task, whose lease is not ours to delete. With
        `retire_output` (the reader saw the stream's end) the output stream
        expires `retain_output_s` later, set in the same batched round trip."""
        if retire_output:
            self._to_retire.add(task_id)
            self.wake.set()
        num_refs = self._refs.get(task_id, 0) - 1
        if num_refs > 0:
            self._refs[task_id] = num_refs
            return
        self._refs.pop(task_id, None)
        if drop:
            self._to_drop.add(task_id)
            self.wake.set()

    async def sync(self, *, renew: bool) -> None:
        """Delete released leases and (with `renew`) renew the live ones, one
        round trip. Raises the Redis error (the releases stay pending)."""
        drop_ids = [task_id for task_id in self._to_drop if task_id not in self._refs]
        self._to_drop.clear()
        retire_ids, self._to_retire = list(self._to_retire), set()
        renew_ids = self.live_ids if renew else []
        try:
            await self._store.sync_stream_leases(
                self.owner,
                renew_ids,
                drop_ids,
                self.ttl_s,
                retire_ids=retire_ids,
                retain_s=self.retain_output_s,
                is_renewal=renew,
            )
        except BaseException:
            self._to_drop.update(task_id for task_id in drop_ids if task_id not in self._refs)
            self._to_retire.update(retire_ids)
            raise
        # Taken again while the delete was on its way: its SET may have landed
        # first, so write it again (rare: an idempotent retry at that moment).
        retaken = [task_id for task_id in drop_ids if task_id in self._refs]
        if retaken:
            await self._store.renew_stream_leases(self.owner, retaken, self.ttl_s)


class Upkeep:
    """Runs the counters' flush loop and the leases' loop; `stop` ends both
    after a last flush and with every lease dropped."""

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
        """Stop the loops; then flush and drop every lease (best effort, logged)."""
        loops, self._loops = self._loops, []
        self._is_stopping = True
        self.leases.wake.set()
        # A cancel can be lost on Python 3.11: `asyncio.wait_for` (redis-py
        # reads through it) returns the result instead when its read completes
        # as the cancel lands. So the loops also check `_is_stopping`, and are
        # cancelled again until they end.
        while pending := [loop for loop in loops if not loop.done()]:
            for loop in pending:
                loop.cancel()
            await asyncio.wait(pending, timeout=STOP_POLL_S)
        await asyncio.gather(*loops, return_exceptions=True)
        for task_id in self.leases.live_ids:  # streams still open at stop: theirs go too
            self.leases.release(task_id)
        with contextlib.suppress(RedisError, OSError):
            await self.leases.sync(renew=False)
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
        next_renew_s = time.monotonic() + leases.renew_interval_s
        while not self._is_stopping:
            # asyncio.timeout, not wait_for (which may swallow a cancel: `stop`)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_renew_s - time.monotonic())):
                    await leases.wake.wait()
            is_renewal = time.monotonic() >= next_renew_s
            if not is_renewal and not self._is_stopping:
                # Releases are not urgent (a lease left lapses by itself):
                # those of the next moment go in the same round trip.
                await asyncio.sleep(RELEASE_BATCH_S)
            leases.wake.clear()
            try:
                await leases.sync(renew=is_renewal)
            except (RedisError, OSError) as exc:
                log.warning(
                    "gateway.lease_sync_failed", num_live=len(leases.live_ids), error=str(exc)
                )
                if is_renewal:  # the leases are running out: try again soon
                    next_renew_s = time.monotonic() + min(leases.renew_interval_s, RENEW_RETRY_S)
                continue
            if is_renewal:
                next_renew_s = time.monotonic() + leases.renew_interval_s
