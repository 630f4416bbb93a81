"""Stack-wide counters (`Store.incr_stats`, the ``stats`` hash that GetStats
reads), summed in memory and written in batches.

A service counts per request or per task without a Redis command of its
own: `add` sums in memory, `flush` writes every delta in one round trip. The
owner flushes on a timer (gateway: `stats_flush_s`; executor: each
heartbeat), before it reads them, and on stop. A failed flush keeps its
deltas for the next one: a count is late, never dropped while the process
lives (a crash loses the unflushed ones: these are statistics; per-task
truth is in the task hashes).
"""

from __future__ import annotations

from collections import Counter

from lemix.infra.store.store import Store


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
