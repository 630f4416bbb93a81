"""The scheduler service: Redis intake/completions/heartbeats in, executor dispatch out.

`SchedulerService` owns the plumbing around a `SchedulerCore`: it connects to
Redis, rebuilds the planner from the event log (restart recovery), runs four
loops and the gRPC server. Scheduling logic stays in the planner; sequencing
in the core; this module only moves data between them and the outside.

Loops (each survives Redis blips: it logs, backs off and goes on):

* intake — new tasks from the intake stream (consumer group), at least once:
  a redelivered task the core already holds, or one already final, is only
  acked; decisions are made durable (events flushed) before the entries are
  acked, so a crash in between replays to the same state.
* completions — executors' task ends, from the stored cursor on; the cursor
  moves only after the resulting events are stored.
* nodes — heartbeats polled every `node_poll_s`; appearances and expiries
  become `on_node_health`, and the advertised address is where we dispatch.
* timer — wakes the planner when deferred training must be looked at again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc.aio
import redis.asyncio as aioredis
import structlog
from grpc_health.v1 import health
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lemix import telemetry
from lemix._proto.lemix.v1 import scheduler_pb2_grpc
from lemix.planner.recording import Event, RecordingPlanner
from lemix.planner.registry import build_planner
from lemix.profile import Profile, load_profile
from lemix.redis_keys import RedisKeys
from lemix.rpc import SCHEDULER_SERVICE
from lemix.rpc.errors import InvalidArgument, Unavailable
from lemix.rpc.server import start_server, stop_server
from lemix.store import IS_FINAL_FIELD, Entry, Fields, Store, get_bool, get_optional_int
from lemix.types import Task, TaskPayload
from services.scheduler.adapters import GrpcDispatcher, RedisEventSink, RedisResultWriter
from services.scheduler.codec import event_from_fields, task_from_fields, task_to_fields
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.recovery import check_config, recover, start_event
from services.scheduler.servicer import SchedulerServicer

log = structlog.get_logger(__name__)

T = TypeVar("T")

MAX_TASK_ID_CHARS = 256
CANCELLED_BEFORE_PLACEMENT = "CANCELLED: cancelled before it was scheduled"
_LOOP_BACKOFF_S = 0.5  # after an unexpected error in a loop iteration
_MIN_TIMER_S = 0.001  # never spin on a wake-up that is (float-)due now


@dataclass(frozen=True)
class SchedulerSnapshot:
    """What GetState reports."""

    policy: str
    num_placed: int
    num_deferred: int
    num_rejected: int
    nodes: dict[int, Fields]  # live nodes' heartbeat hashes, by node id


@contextlib.asynccontextmanager
async def redis_unavailable(what: str) -> AsyncIterator[None]:
    """Turn "cannot reach Redis" into `Unavailable` for an RPC caller."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise Unavailable(f"{what}: Redis is unreachable ({exc}); retry later") from exc


def check_task_id(task_id: str) -> None:
    """Task ids become Redis key parts: non-empty, no whitespace, bounded."""
    if not task_id:
        raise InvalidArgument("task_id is empty")
    if len(task_id) > MAX_TASK_ID_CHARS or any(ch.isspace() for ch in task_id):
        raise InvalidArgument(
            f"task_id must be at most {MAX_TASK_ID_CHARS} characters without whitespace, "
            f"got {task_id[:40]!r}")


class SchedulerService:
    """The scheduler process: `await start()`, serve, `await stop()`.

    `redis_client` and `profile` may be injected (tests); otherwise they come
    from `config` at `start()`. An injected client is not closed on stop.
    """

    def __init__(self, config: SchedulerConfig, *, redis_client: aioredis.Redis | None = None,
                 profile: Profile | None = None) -> None:
        self.config = config
        self._owns_redis = redis_client is None
        self._redis = redis_client
        self._profile = profile
        self._stopping = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []
        self._payloads: dict[str, TaskPayload] = {}
        self._unknown_nodes: set[int] = set()
        self._has_unacked_intake = False
        self._completions_cursor: str | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self.port = 0
        self.epoch_s = 0.0
        self.num_recovered_events = 0

    # ================================================================ lifecycle

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def clock(self) -> float:
        """Planner time: wall-clock seconds since the namespace's stored epoch."""
        return time.time() - self.epoch_s

    async def start(self) -> None:
        """Connect, recover, start the loops and the gRPC server."""
        config = self.config
        if self._redis is None:
            # Blocking reads wait up to read_block_s: the socket must outlast them.
            self._redis = aioredis.Redis.from_url(
                config.redis_url, decode_responses=True, socket_connect_timeout=5.0,
                socket_timeout=config.read_block_s + 10.0)
        self.store = Store(self._redis, RedisKeys(config.namespace))
        await self._redis.ping()
        self.epoch_s = await self.store.scheduler_epoch(time.time())
        await self._build_core()
        await self.store.ensure_group()
        # Nodes are down until their first heartbeat (recorded without
        # planning, so deferred work is not rejected before the first poll).
        await self.core.mark_down(range(config.num_nodes))
        await self._poll_nodes()
        stale = await self.store.claim_stale(config.consumer_name,
                                             round(config.claim_min_idle_s * 1000))
        if stale:
            log.info("intake_reclaimed", num_entries=len(stale))
            await self._handle_intake(stale)
        self._loops = [
            asyncio.create_task(self._run_loop("intake", self._intake_step), name="intake"),
            asyncio.create_task(self._completions_loop(), name="completions"),
            asyncio.create_task(self._run_loop("nodes", self._nodes_step), name="nodes"),
            asyncio.create_task(self._run_loop("timer", self._timer_step), name="timer"),
        ]
        self._server, self.port, self._health = await start_server(
            [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, SchedulerServicer(self))],
            config.host, config.port, service_names=[SCHEDULER_SERVICE])
        log.info("scheduler_started", address=self.address, policy=config.policy,
                 num_nodes=config.num_nodes, namespace=config.namespace,
                 recovered_events=self.num_recovered_events,
                 recovered_tasks=self.core.num_tasks, live_nodes=self.live_node_ids)

    async def _build_core(self) -> None:
        config = self.config
        profile = self._profile or load_profile(config.resolved_profile_path)
        planner_config = config.planner_config(profile)
        # The gateway judges requests against the SLO the planner protects.
        await self.store.put_slo(planner_config.slo_ttft_s, planner_config.slo_tbt_s)
        planner = build_planner(config.policy, planner_config, profile, config.memory)
        events: list[Event] = [event_from_fields(f) for _, f in await self.store.read_events()]
        check_config(events, planner_config, config.policy)
        recovered = recover(events, planner)
        self.num_recovered_events = recovered.num_events
        self.events = RedisEventSink(self.store)
        self.events(start_event(planner_config, config.policy, time.time()))
        self.dispatcher = GrpcDispatcher(
            deadline_s=config.dispatch_deadline_s,
            weight_sync_deadline_s=config.weight_sync_deadline_s,
            weight_sync_dir=config.weight_sync_dir, payload_of=self._payloads.get)
        self.writer = RedisResultWriter(self.store)
        self.core = SchedulerCore(
            RecordingPlanner(planner, self.events), self.dispatcher, self.writer, self.clock,
            on_forget=self._forget_payload, is_cancelled=self.store.is_cancelled,
            policy=config.policy)
        self.core.restore(recovered.tasks, recovered.num_placed, recovered.num_rejected)
        for task in recovered.tasks:  # deferred or requeued work still needs its payload
            state = await self.store.get_task_state(task.task_id)
            if state:
                self._payloads[task.task_id] = task_from_fields(state)[1]
            else:
                log.warning("payload_lost", task_id=task.task_id)
        self.events.start()

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, stop the loops, store the events, stop the server, close Redis."""
        grace = self.config.stop_grace_s if grace_s is None else grace_s
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        self._stopping.set()
        if self._loops:
            _, pending = await asyncio.wait(self._loops, timeout=grace + self.config.read_block_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*self._loops, return_exceptions=True)
            self._loops = []
        if hasattr(self, "events"):
            try:
                await self.events.stop(timeout_s=max(grace, 1.0))
            except TimeoutError:
                log.error("events_flush_timeout", pending=self.events.num_pending)
        if self._server is not None and self._health is not None:
            await stop_server(self._server, self._health, grace)
            self._server = None
        if hasattr(self, "dispatcher"):
            await self.dispatcher.close()
        if self._redis is not None and self._owns_redis:
            await self._redis.aclose()
        log.info("scheduler_stopped")

    # ============================================================ RPC-facing

    async def submit(self, task: Task, payload: TaskPayload) -> bool:
        """Store a task durably in the intake; False when its id was seen before."""
        check_task_id(task.task_id)
        async with redis_unavailable("Submit"):
            return await self.store.submit_task(task_to_fields(task, payload))

    async def cancel(self, task_id: str, reason: str) -> bool:
        """Cancel wherever the task is; True if the scheduler or its executor knew it."""
        check_task_id(task_id)
        reason = reason or "cancelled by the client"
        node_id = self.core.node_of(task_id)
        if node_id is None:
            async with redis_unavailable("Cancel"):
                await self.store.mark_cancelled(task_id)  # the intake drops it if unread
                if self.core.knows(task_id):
                    # Deferred: end it now; the core drops it when it would place it.
                    await self.writer.end_task(task_id, "failed", f"CANCELLED: {reason}")
                    return True
                state = await self.store.get_task_state(task_id)
            node_id = self.core.node_of(task_id)  # placed while we were marking it?
            if node_id is None:
                return bool(state) and state.get(IS_FINAL_FIELD) != "1"
        return await self.dispatcher.cancel(node_id, task_id, reason)

    async def snapshot(self) -> SchedulerSnapshot:
        """Counters and live nodes; events recorded so far are stored first."""
        async with redis_unavailable("GetState"):
            try:
                await self.events.flush(timeout_s=self.config.dispatch_deadline_s)
            except TimeoutError:
                raise Unavailable("GetState: the event log cannot be stored") from None
            nodes = await self.store.get_node_states()
        return SchedulerSnapshot(
            policy=self.config.policy,
            num_placed=self.core.num_placed,
            num_deferred=self.core.planner.planner.num_deferred,
            num_rejected=self.core.num_rejected,
            nodes=nodes,
        )

    # ================================================================= loops

    async def _run_loop(self, name: str, step: Callable[[], Awaitable[None]]) -> None:
        while not self._stopping.is_set():
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._log_loop_error(name, exc)
                await self._sleep_or_stop(_LOOP_BACKOFF_S)

    @staticmethod
    def _log_loop_error(name: str, exc: Exception) -> None:
        if isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError):
            # An outage: expected, retried; a traceback per retry is noise.
            log.warning("loop_redis_unreachable", loop=name, error=str(exc))
        else:
            log.error("loop_error", loop=name, exc_info=exc)

    async def _until_stop(self, aw: Awaitable[T]) -> T | None:
        """`aw`'s result, or None once stop begins (then `aw` is cancelled).

        Only waits are raced with stop, never the handling of what they
        returned: an intake entry read but not handled stays pending and is
        reclaimed by the next start.
        """
        work = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            stop.cancel()
        if work.done():
            return work.result()
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await work
        return None

    async def _sleep_or_stop(self, delay_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay_s)

    @property
    def _block_ms(self) -> int:
        return max(1, round(self.config.read_block_s * 1000))

    # ---------------------------------------------------------------- intake

    async def _intake_step(self) -> None:
        if self._has_unacked_intake:
            # The last batch failed half-way (Redis blip): its entries are still
            # pending for us and XREADGROUP ">" will not return them again.
            stale = await self.store.claim_stale(self.config.consumer_name, 0)
            if stale:
                await self._handle_intake(stale)
            self._has_unacked_intake = False
        entries = await self._until_stop(self.store.read_intake(
            self.config.consumer_name, self.config.intake_batch, self._block_ms))
        if entries:
            self._has_unacked_intake = True
            await self._handle_intake(entries)
            self._has_unacked_intake = False

    async def _handle_intake(self, entries: list[Entry]) -> None:
        taken = [t for t in [await self._parse(fields) for _, fields in entries] if t]
        # One pipelined round trip for every check, one for every state write:
        # per-task round trips made this loop the stack's bottleneck.
        lookup = await self.store.intake_lookup([task.task_id for task, _, _ in taken])
        accepted = []
        for (task, payload, fields), (is_final, is_cancelled) in zip(taken, lookup, strict=True):
            if is_final:
                continue  # finished before a restart; its result stands
            if is_cancelled:
                await self.writer.end_task(task.task_id, "failed", CANCELLED_BEFORE_PLACEMENT)
                continue
            self._payloads[task.task_id] = payload
            accepted.append((task, fields))
        # The task's fields go to its state hash too: a restart finds the
        # payload of deferred training there (the intake entry is deleted).
        await self.store.set_task_states([
            (task.task_id, {**fields, "status": "queued", "arrival_s": task.arrival_s,
                            "queued_t": time.time()})
            for task, fields in accepted])
        await self.core.on_tasks([task for task, _ in accepted])
        # Write-ahead: the decisions these entries caused are stored before the
        # entries go, so a crash in between replays them (and the redelivered
        # entries are recognised as known).
        await self.events.flush()
        await self.store.ack_intake([entry_id for entry_id, _ in entries])

    async def _parse(self, fields: Fields) -> tuple[Task, TaskPayload, Fields] | None:
        """The entry's task, or None when it is malformed (ended) or already known."""
        task_id = fields.get("task_id", "")
        try:
            task, payload = task_from_fields(fields, arrival_s=self.clock())
        except (KeyError, ValueError) as exc:
            log.error("intake_malformed", task_id=task_id, error=str(exc))
            if task_id:
                await self.writer.end_task(task_id, "rejected",
                                           f"INVALID_ARGUMENT: malformed task fields ({exc})")
            return None
        if self.core.knows(task_id):
            return None  # redelivered; the planner has it
        return task, payload, fields

    def _forget_payload(self, task_id: str) -> None:
        self._payloads.pop(task_id, None)

    # ----------------------------------------------------------- completions

    async def _completions_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                if self._completions_cursor is None:
                    self._completions_cursor = await self.store.get_completions_cursor()
                entries = await self._until_stop(
                    self.store.read_completions(self._completions_cursor, self._block_ms))
                if entries:
                    await self._handle_completions(entries)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._log_loop_error("completions", exc)
                await self._sleep_or_stop(_LOOP_BACKOFF_S)

    async def _handle_completions(self, entries: list[Entry]) -> None:
        for entry_id, fields in entries:
            status = fields.get("status", "")
            task_id = fields.get("task_id", "")
            if task_id:
                await self.core.on_finished(
                    task_id, is_success=status == "completed", is_requeue=status == "requeued",
                    node_id=get_optional_int(fields, "node_id"))
            # Advanced per entry: after an error the loop resumes after the last
            # entry applied, never applying one twice within this process.
            self._completions_cursor = entry_id
        await self.events.flush()  # the stored cursor never runs ahead of the log
        await self.store.set_completions_cursor(entry_id)

    # ----------------------------------------------------------------- nodes

    async def _nodes_step(self) -> None:
        await self._sleep_or_stop(self.config.node_poll_s)
        if not self._stopping.is_set():
            await self._poll_nodes()
            await self._export_queue_depths()

    async def _export_queue_depths(self) -> None:
        telemetry.set_queue_depth("intake_pending", await self.store.pending_count())
        telemetry.set_queue_depth("deferred_training", self.core.planner.planner.num_deferred)
        telemetry.set_queue_depth("held", self.core.num_tasks)

    async def _poll_nodes(self) -> None:
        states = await self.store.get_node_states()
        for node_id in sorted(set(states) - set(range(self.config.num_nodes))):
            if node_id not in self._unknown_nodes:
                self._unknown_nodes.add(node_id)
                log.warning("node_out_of_range", node_id=node_id,
                            num_nodes=self.config.num_nodes)
        for node_id in range(self.config.num_nodes):
            fields = states.get(node_id) or {}
            address = fields.get("address", "")
            is_live = bool(address) and get_bool(fields, "is_healthy", True)
            if is_live:
                await self.dispatcher.set_address(node_id, address)
            if is_live == (node_id not in self.core.down_nodes):
                continue
            failed_s = self.core.dispatch_failed_s.get(node_id)
            if (is_live and failed_s is not None
                    and self.clock() - failed_s < self.config.dispatch_retry_s):
                continue  # it heartbeats but just failed a dispatch: give it a pause
            log.info("node_up" if is_live else "node_down", node_id=node_id, address=address)
            await self.core.on_node_health(node_id, is_live)

    @property
    def live_node_ids(self) -> list[int]:
        """Nodes the planner may place on now."""
        return [i for i in range(self.config.num_nodes) if i not in self.core.down_nodes]

    # ----------------------------------------------------------------- timer

    async def _timer_step(self) -> None:
        self.core.wakeup.clear()
        wake_s = self.core.next_wakeup_s()
        delay_s = None if wake_s is None else max(wake_s - self.clock(), _MIN_TIMER_S)
        woken = asyncio.ensure_future(self.core.wakeup.wait())
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            done, _ = await asyncio.wait({woken, stop}, timeout=delay_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            stop.cancel()
        if not done:  # the deadline passed with nothing new: let the planner look
            await self.core.on_timer()
