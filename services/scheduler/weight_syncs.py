"""The scheduler's weight movements, one after another in a background task.

SEPARATE's weight syncs (SAVE on the source, then LOAD on each serving node)
and replica averages (`services.scheduler.replica_sync`) take seconds to
minutes. They run here, in decision order and never two at once, so two never
touch one node's weights together, and the core (which holds its lock while
applying decisions) never waits for one. The RPC itself is injected (the
dispatcher's SyncWeights call, with its deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import PurePosixPath

import structlog

from lemix._proto.lemix.v1 import executor_pb2
from lemix.types import ReplicaAverage, WeightSync
from services.scheduler.ports import DispatchError
from services.scheduler.replica_sync import run_replica_average

log = structlog.get_logger(__name__)

_SAVE = executor_pb2.SyncWeightsRequest.DIRECTION_SAVE
_LOAD = executor_pb2.SyncWeightsRequest.DIRECTION_LOAD

# (node id, direction, location, weight version, sources) -> one SyncWeights
# call; raises `DispatchError` (or another exception) when it fails.
SyncRpc = Callable[[int, int, str, int, Sequence[str]], Awaitable[None]]


class WeightSyncQueue:
    """Runs queued `WeightSync`s and `ReplicaAverage`s in order."""

    def __init__(self, rpc: SyncRpc, weight_sync_dir: str) -> None:
        self._rpc = rpc
        self.weight_sync_dir = weight_sync_dir
        self._queue: deque[WeightSync | ReplicaAverage] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.num_syncs_done = 0
        self.num_replica_averages_done = 0  # rounds run, taken by >= 2 nodes or skipped

    def enqueue(self, sync: WeightSync | ReplicaAverage) -> None:
        """Queue one; the background task starts with the first."""
        self._queue.append(sync)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="weight-syncs")

    async def close(self) -> None:
        """Stop the background task; what is queued is dropped."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                sync = self._queue.popleft()
                if isinstance(sync, ReplicaAverage):
                    await run_replica_average(self._average_rpc, sync, self.weight_sync_dir)
                    self.num_replica_averages_done += 1
                    continue
                try:
                    await self._run_sync(sync)
                    self.num_syncs_done += 1
                except DispatchError as exc:
                    log.warning(
                        "weight_sync_failed",
                        source=sync.source_node_id,
                        targets=list(sync.target_node_ids),
                        error=str(exc),
                    )

    async def _average_rpc(
        self, node_id: int, direction: int, location: str, sources: Sequence[str]
    ) -> None:
        await self._rpc(node_id, direction, location, 0, sources)

    async def _run_sync(self, sync: WeightSync) -> None:
        location = str(
            PurePosixPath(self.weight_sync_dir)
            / f"node{sync.source_node_id}-v{sync.num_training_updates}"
        )
        started = time.monotonic()
        await self._rpc(sync.source_node_id, _SAVE, location, sync.num_training_updates, ())
        for target in sync.target_node_ids:
            await self._rpc(target, _LOAD, location, sync.num_training_updates, ())
        log.info(
            "weight_sync_done",
            source=sync.source_node_id,
            targets=list(sync.target_node_ids),
            version=sync.num_training_updates,
            duration_s=round(time.monotonic() - started, 3),
        )
