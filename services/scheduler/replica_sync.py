"""The live half of replica sync: drive one `ReplicaAverage` over the executors.

Two phases over the existing SyncWeights RPC and its file mechanism (the
weight-sync directory every executor shares):

1. SAVE: every participant writes its stage weights to ``replicas/node<i>``
   under the weight-sync directory, all at once.
2. AVERAGE: every participant whose save succeeded adds ``mean(saves) -
   own save`` to its weights (`services.executor.weights.average_into_stage`),
   all at once. What a node trained between its save and phase 2 is kept.

A node that fails or times out in phase 1 is left out of the mean and of
phase 2; with fewer than two saves the round is skipped. One node's failure
costs the others at most one deadline and never blocks their serving: each
phase is a blocking item on a node's own stages only. Optimizer state stays
local. Each node's save directory is reused every round, so the disk holds
one replica per node, not one per round.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import PurePosixPath

import structlog

from lemix._proto.lemix.v1 import executor_pb2
from lemix.types import ReplicaAverage

log = structlog.get_logger(__name__)

SAVE = executor_pb2.SyncWeightsRequest.DIRECTION_SAVE
AVERAGE = executor_pb2.SyncWeightsRequest.DIRECTION_AVERAGE

# (node id, direction, location, sources) -> the SyncWeights call, with its deadline;
# raises on failure.
SyncCall = Callable[[int, int, str, Sequence[str]], Awaitable[None]]


def replica_location(weight_sync_dir: str, node_id: int) -> str:
    """Where node `node_id` saves its replica for averaging."""
    return str(PurePosixPath(weight_sync_dir) / "replicas" / f"node{node_id}")


async def run_replica_average(
    call: SyncCall, average: ReplicaAverage, weight_sync_dir: str
) -> tuple[int, ...]:
    """Run both phases; returns the nodes that took the average (empty: skipped)."""
    started = time.monotonic()
    nodes = average.node_ids
    locations = {n: replica_location(weight_sync_dir, n) for n in nodes}
    saved = await _each(call, nodes, SAVE, locations, (), average.round, "save")
    if len(saved) < 2:
        log.warning("replica_average_skipped", round=average.round, nodes=nodes, saved=saved)
        return ()
    sources = tuple(locations[n] for n in saved)
    done = await _each(call, saved, AVERAGE, locations, sources, average.round, "average")
    log.info(
        "replica_average_done",
        round=average.round,
        nodes=list(done),
        num_sources=len(sources),
        duration_s=round(time.monotonic() - started, 3),
    )
    return done


async def _each(
    call: SyncCall,
    nodes: Sequence[int],
    direction: int,
    locations: dict[int, str],
    sources: Sequence[str],
    round_: int,
    phase: str,
) -> tuple[int, ...]:
    """`call` on every node at once (a handful: the cluster's trainers);
    the nodes it succeeded on, in order. A failure is logged, not raised."""
    results = await asyncio.gather(
        *(call(n, direction, locations[n], sources) for n in nodes), return_exceptions=True
    )
    ok: list[int] = []
    for node_id, result in zip(nodes, results, strict=True):
        if isinstance(result, BaseException):
            if isinstance(result, asyncio.CancelledError):
                raise result
            log.warning(
                "replica_average_node_failed",
                round=round_,
                phase=phase,
                node=node_id,
                error=str(result),
            )
        else:
            ok.append(node_id)
    return tuple(ok)
