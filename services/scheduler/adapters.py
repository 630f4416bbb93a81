"""The scheduler core's ports, implemented over gRPC (executors) and Redis.

* `GrpcDispatcher` — the `Dispatcher` port: executor Dispatch/Cancel/SyncWeights
  over one cached channel per node address, every call with a deadline; the
  Dispatches of one tick to one node go as one `DispatchMany`
  (`services.scheduler.dispatch_batches`).
* `RedisResultWriter` — the `ResultWriter` port: task states in batches (final
  ones with the client's end message, `Store.finish_tasks`), progress lookups;
  and the `AttemptLedger` port (attempt numbers: `Store.begin_attempts`,
  `Store.fence_attempts`).
* `RedisEventSink` — the `RecordingPlanner` sink: buffers events in memory (the
  planner's call must not wait for Redis) and appends them, in order, from one
  background task; `flush()` waits until everything recorded so far is stored.
  Once a snapshot event (compaction, services/scheduler/recovery.py) is
  stored, it trims the log before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice

import grpc
import grpc.aio
import structlog
from redis.exceptions import RedisError

from lemix._proto.lemix.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from lemix.infra.rpc.client import channel
from lemix.infra.rpc.convert import task_to_proto
from lemix.infra.rpc.errors import InvalidArgument, Unavailable, error_from_rpc
from lemix.infra.store.codec import FieldValue
from lemix.infra.store.messages import end_message
from lemix.infra.store.store import Store
from lemix.infra.store.task_hash import (
    FINISH_T_FIELD,
    IS_FINAL_FIELD,
    NODE_ID_FIELD,
    STATUS_FIELD,
    StoredStatus,
)
from lemix.planner.recording import Event
from lemix.types import Placement, ReplicaAverage, Task, TaskPayload, WeightSync
from services.scheduler.codec import EVENT_FIELD, events_to_fields
from services.scheduler.dispatch_batches import NodeDispatchBatcher
from services.scheduler.ports import DispatchError, StateWrite, TaskProgress, TaskRefused
from services.scheduler.recovery import SNAPSHOT_MARKER
from services.scheduler.weight_syncs import WeightSyncQueue

log = structlog.get_logger(__name__)


# Dispatch failures that say nothing about the task, only that the node did
# not answer: it is marked down and the task goes elsewhere. Any other status
# is the executor's verdict on THIS task (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
# FAILED_PRECONDITION, INTERNAL...): the task ends, the node stays up.
_NODE_FAULT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
    }
)
# Of those, the ones where the request may have reached the executor (its
# answer was lost or late): the task may run there, so it is revoked.
_MAYBE_TAKEN_CODES = frozenset(
    {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
)


def dispatch_error(node_id: int, err: grpc.aio.AioRpcError) -> DispatchError:
    """A failed Dispatch as the core's `TaskRefused` or node `DispatchError`."""
    code = err.code()
    details = err.details() or code.name
    if code in _NODE_FAULT_CODES:
        return DispatchError(f"{code.name}: {details}", is_maybe_taken=code in _MAYBE_TAKEN_CODES)
    return TaskRefused(code.name, f"node {node_id} refused the task: {details}")


class GrpcDispatcher:
    """Executor calls by node id; the service tells it where each node listens.

    `payload_of(task_id)` supplies what the executor needs beyond the planner's
    `Task` (token ids, sampling); None sends the task without a payload.
    `attempt_of(task_id)` is the placement's attempt number (the core's), sent
    with the Dispatch; 0 sends none.
    """

    def __init__(
        self,
        *,
        deadline_s: float,
        weight_sync_deadline_s: float,
        weight_sync_dir: str,
        payload_of: Callable[[str], TaskPayload | None] = lambda _: None,
        attempt_of: Callable[[str], int] = lambda _: 0,
        service_token: str = "",
    ) -> None:
        self.deadline_s = deadline_s
        self._service_token = service_token  # every executor call carries it
        self.weight_sync_deadline_s = weight_sync_deadline_s
        self.weight_sync_dir = weight_sync_dir
        self._payload_of = payload_of
        self._attempt_of = attempt_of
        self._addresses: dict[int, str] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, executor_pb2_grpc.ExecutorStub] = {}
        # SEPARATE's weight syncs and replica averages, in the background.
        self.syncs = WeightSyncQueue(self._sync_call, weight_sync_dir)
        self._batches = NodeDispatchBatcher(self._stub, dispatch_error, deadline_s)

    # ------------------------------------------------------------ addresses

    async def set_address(self, node_id: int, address: str) -> None:
        """Where node `node_id`'s executor listens (from its heartbeat).

        A node that moved leaves its old channel behind: closed once unused.
        A new address's channel starts connecting now (the node advertises it
        once it serves), so the node's first Dispatch does not also pay the
        TCP and HTTP/2 handshakes (~2 ms of a lone request's TTFT here).
        """
        old = self._addresses.get(node_id)
        self._addresses[node_id] = address
        if address not in self._stubs:
            self._stub(node_id)
            self._channels[address].get_state(try_to_connect=True)
        if old and old != address and old not in self._addresses.values():
            self._stubs.pop(old, None)
            ch = self._channels.pop(old, None)
            if ch is not None:
                await ch.close()

    def address_of(self, node_id: int) -> str | None:
        return self._addresses.get(node_id)

    def _stub(self, node_id: int) -> executor_pb2_grpc.ExecutorStub:
        address = self._addresses.get(node_id)
        if not address:
            raise DispatchError(f"node {node_id} has not advertised an address")
        stub = self._stubs.get(address)
        if stub is None:
            self._channels[address] = channel(address, service_token=self._service_token)
            stub = self._stubs[address] = executor_pb2_grpc.ExecutorStub(self._channels[address])
        return stub

    async def close(self) -> None:
        await self._batches.close()
        await self.syncs.close()
        channels, self._channels, self._stubs = self._channels, {}, {}
        for ch in channels.values():
            await ch.close()

    # ------------------------------------------------------------ Dispatcher

    async def dispatch(self, placement: Placement, task: Task) -> bool:
        """Executor Dispatch, sent with the node's other Dispatches of this
        tick as one `DispatchMany` (`dispatch_batches`); True when the
        executor records the placed state itself. Raises `TaskRefused`
        when the executor refuses the task, `DispatchError` when the node
        does not answer (`dispatch_error`)."""
        try:
            message = task_to_proto(task, self._payload_of(task.task_id))
        except InvalidArgument as exc:  # Submit validated it: a bug, not a node fault
            raise RuntimeError(f"cannot encode task {task.task_id}: {exc}") from exc
        request = executor_pb2.DispatchRequest(
            task=message,
            predicted_response_s=placement.predicted_response_s,
            attempt=self._attempt_of(task.task_id),
        )
        return await self._batches.dispatch(placement.node_id, request)

    async def cancel(self, node_id: int, task_id: str, reason: str) -> bool:
        """Executor Cancel; returns its is_found. Raises `Unavailable` (or the
        peer's mapped error) when the call fails."""
        try:
            stub = self._stub(node_id)
        except DispatchError as exc:
            raise Unavailable(str(exc)) from None
        request = common_pb2.CancelRequest(task_id=task_id, reason=reason)
        try:
            reply = await stub.Cancel(request, timeout=self.deadline_s)
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from err
        return bool(reply.is_found)

    async def sync_weights(self, sync: WeightSync | ReplicaAverage) -> None:
        """Queue a weight sync (SAVE on the source, then LOAD on each target)
        or a replica average (`services.scheduler.replica_sync`)."""
        self.syncs.enqueue(sync)

    async def _sync_call(
        self, node_id: int, direction: int, location: str, version: int, sources: Sequence[str]
    ) -> None:
        request = executor_pb2.SyncWeightsRequest(
            direction=direction,  # type: ignore[arg-type]
            location=location,
            weight_version=version,
            sources=list(sources),
        )
        try:
            await self._stub(node_id).SyncWeights(request, timeout=self.weight_sync_deadline_s)
        except grpc.aio.AioRpcError as err:
            raise DispatchError(
                f"SyncWeights on node {node_id}: {err.code().name}: {err.details()}"
            ) from err


class RedisResultWriter:
    """Task states in the task's Redis hash/stream, a batch per round trip.

    Final states carry the client's end message and, with `finished_ttl_s`,
    expire that long after; their output streams after `output_ttl_s`
    (default: `finished_ttl_s`).
    """

    def __init__(
        self,
        store: Store,
        finished_ttl_s: float | None = None,
        output_ttl_s: float | None = None,
    ) -> None:
        self.store = store
        self.finished_ttl_s = finished_ttl_s
        self.output_ttl_s = finished_ttl_s if output_ttl_s is None else output_ttl_s

    async def end_task(self, task_id: str, status: str, reason: str) -> None:
        """Write one task's final state and end message (see `write_states`)."""
        await self.write_states([StateWrite(task_id, status, reason=reason)])

    async def write_states(self, writes: Sequence[StateWrite]) -> None:
        t = time.time()
        updates: list[tuple[str, dict[str, FieldValue]]] = []
        for write in writes:
            if write.status == StoredStatus.PLACED:
                fields: dict[str, FieldValue] = {
                    STATUS_FIELD: StoredStatus.PLACED,
                    NODE_ID_FIELD: write.node_id,
                    "placed_t": t,
                }
                updates.append((write.task_id, fields))
            elif write.status == StoredStatus.QUEUED:  # taken back from a node: no node now
                fields = {STATUS_FIELD: StoredStatus.QUEUED, NODE_ID_FIELD: "", "requeued_t": t}
                updates.append((write.task_id, fields))
        # A state write never overwrites a final state (`Store.set_task_state`).
        await self.store.set_task_states(updates)
        ends = [(w.task_id, w.status, w.reason) for w in writes if w.is_final]
        if not ends:
            return
        is_first = await self.store.finish_tasks(
            ends,
            output_fields=end_message(0, None, t),
            state_fields={FINISH_T_FIELD: t},
            ttl_s=self.finished_ttl_s,
            output_ttl_s=self.output_ttl_s or 0.0,
        )
        # Count each task once (a retried or redelivered end ends nothing new).
        num_rejected = sum(
            1
            for (_, s, _), first in zip(ends, is_first, strict=True)
            if first and s == StoredStatus.REJECTED
        )
        num_failed = sum(is_first) - num_rejected
        for name, count in (("num_rejected", num_rejected), ("num_failed", num_failed)):
            if count:
                await self.store.incr_stat(name, count)

    async def progress(self, task_ids: Sequence[str]) -> list[TaskProgress]:
        stored = await self.store.get_task_states(task_ids, [IS_FINAL_FIELD, STATUS_FIELD])
        return [
            TaskProgress(
                is_final=s.fields.get(IS_FINAL_FIELD) == "1",
                status=s.fields.get(STATUS_FIELD, ""),
                has_output=s.has_output,
            )
            for s in stored
        ]

    # ------------------------------------------------------------ AttemptLedger

    async def begin_attempts(
        self, task_ids: Sequence[str], check_cancelled: Sequence[str]
    ) -> tuple[list[int], list[bool]]:
        return await self.store.begin_attempts(task_ids, check_cancelled)

    async def fence(self, taken: Sequence[tuple[str, int]]) -> list[TaskProgress]:
        return [
            TaskProgress(is_final=p.is_final, status=p.status, has_output=p.has_output)
            for p in await self.store.fence_attempts(taken)
        ]


_EVENTS_PER_TRIP = 500
_EVENTS_PER_ENTRY = 250  # bounds an entry (a recovery reads it whole)


def _entry_groups(events: Sequence[Event]) -> list[list[Event]]:
    """`events` cut into stream entries, in order: a snapshot alone, runs of
    other events together (at most `_EVENTS_PER_ENTRY` each)."""
    groups: list[list[Event]] = []
    run: list[Event] = []
    for event in events:
        if SNAPSHOT_MARKER in event:
            if run:
                groups.append(run)
                run = []
            groups.append([event])
            continue
        run.append(event)
        if len(run) == _EVENTS_PER_ENTRY:
            groups.append(run)
            run = []
    if run:
        groups.append(run)
    return groups


_STOP_WAIT_S = 1.0  # what the sink's loop gets to finish its last round trip on stop


class RedisEventSink:
    """Planner events to the Redis events stream, in order, off the hot path.

    Call the sink itself (`sink(event)`) from the planner; it only buffers.
    A background task appends: at once when someone waits (`flush`), else
    what `coalesce_s` gathers goes in one entry (an `XADD` per planner input
    was a command per request). A failed append is retried (events are never
    dropped or reordered) after `retry_s`. Once a snapshot event is stored,
    the entries before it are trimmed (a failed trim is retried likewise; a
    restart reads from the last snapshot either way).
    """

    def __init__(self, store: Store, retry_s: float = 0.2, coalesce_s: float = 0.02) -> None:
        self.store = store
        self.retry_s = retry_s
        self.coalesce_s = coalesce_s
        self._flush_wanted = asyncio.Event()  # a `flush` waits: append now
        self._buffer: deque[Event] = deque()
        self._num_recorded = 0
        self._num_stored = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._trim_before_id: str | None = None  # the latest stored snapshot's entry id
        self._is_stopping = False
        self.num_snapshots_stored = 0
        self.num_trimmed_entries = 0
        self.last_snapshot_bytes = 0

    def __call__(self, event: Event) -> None:
        self._buffer.append(event)
        self._num_recorded += 1
        self._wake.set()

    @property
    def num_pending(self) -> int:
        return self._num_recorded - self._num_stored

    @property
    def num_recorded(self) -> int:
        """Events recorded so far (`sink(event)` calls)."""
        return self._num_recorded

    @property
    def num_stored(self) -> int:
        """Of those, the first this many are in Redis."""
        return self._num_stored

    def start(self) -> None:
        if self._task is None:
            self._is_stopping = False
            self._task = asyncio.create_task(self._run(), name="event-sink")

    async def flush(self, timeout_s: float | None = None) -> None:
        """Return once every event recorded before this call is stored.

        Raises `TimeoutError` after `timeout_s` (Redis unreachable); the events
        stay buffered.
        """
        target = self._num_recorded
        if self._num_stored >= target:
            return
        if self._task is None:  # not running: write inline
            await asyncio.wait_for(self._drain(), timeout_s)
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((target, waiter))
        self._flush_wanted.set()
        await asyncio.wait_for(waiter, timeout_s)

    async def stop(self, timeout_s: float | None = None) -> None:
        """Store what is buffered (up to `timeout_s`), then stop the background task."""
        try:
            await self.flush(timeout_s)
        finally:
            if self._task is not None:
                # The loop finishes what it is doing (a trim after the flush)
                # and exits on the flag; cancelled only if that takes long. The
                # flag also ends it when redis-py swallows the cancellation
                # (one landing mid-command can be, with redis-py 8.1).
                self._is_stopping = True
                self._wake.set()
                self._flush_wanted.set()
                _, running = await asyncio.wait({self._task}, timeout=_STOP_WAIT_S)
                for task in running:
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
                self._task = None
            if self._buffer:
                log.error("events_not_stored", num_events=len(self._buffer))

    async def _drain(self) -> None:
        # Whatever has accumulated goes in one pipelined round trip, in order,
        # packed into as few entries as the snapshots allow (codec module doc);
        # events leave the buffer only once Redis has them.
        while self._buffer:
            events = list(islice(self._buffer, _EVENTS_PER_TRIP))
            groups = _entry_groups(events)
            batch = [events_to_fields(group) for group in groups]
            entry_ids = await self.store.append_events(batch)
            for group, fields, entry_id in zip(groups, batch, entry_ids, strict=True):
                if SNAPSHOT_MARKER in group[0]:
                    self._on_snapshot_stored(entry_id, len(str(fields[EVENT_FIELD])))
            for _ in events:
                self._buffer.popleft()
            self._num_stored += len(events)
            if self._waiters:
                self._release_waiters()
        if self._trim_before_id is not None:
            # After the waiters: trimming is upkeep, nobody waits for it.
            num_trimmed = await self.store.trim_events_before(self._trim_before_id)
            self._trim_before_id = None
            self.num_trimmed_entries += num_trimmed
            log.info(
                "events_compacted", num_trimmed=num_trimmed, snapshot_bytes=self.last_snapshot_bytes
            )

    def _on_snapshot_stored(self, entry_id: str, num_bytes: int) -> None:
        self._trim_before_id = entry_id
        self.num_snapshots_stored += 1
        self.last_snapshot_bytes = num_bytes

    def _release_waiters(self) -> None:
        waiting = []
        for target, waiter in self._waiters:
            if waiter.done():
                continue
            if target <= self._num_stored:
                waiter.set_result(None)
            else:
                waiting.append((target, waiter))
        self._waiters = waiting

    async def _run(self) -> None:
        while not self._is_stopping:
            await self._wake.wait()
            if not self._waiters and not self._is_stopping:
                # asyncio.timeout, not wait_for (which may swallow a cancel: `stop`)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.coalesce_s):
                        await self._flush_wanted.wait()
            self._wake.clear()
            self._flush_wanted.clear()
            try:
                await self._drain()  # on stop: a last pass (a pending trim)
            except (RedisError, OSError) as exc:
                log.warning("event_append_failed", pending=len(self._buffer), error=str(exc))
                if self._is_stopping:
                    return
                await asyncio.sleep(self.retry_s)
                self._wake.set()
