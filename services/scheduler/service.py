"""The scheduler service: Redis intake/completions/heartbeats in, executor dispatch out.

`SchedulerService` owns the plumbing around a `SchedulerCore`: it connects to
Redis, rebuilds the planner from the event log (restart recovery: the last
snapshot plus the events after it; the log is compacted as it grows,
services/scheduler/recovery.py), runs four loops and the gRPC server.
Scheduling logic stays in the planner; sequencing in the core; the service
only moves data between them and the outside.

One class in four modules: `services.scheduler.service_base` (shared state,
loop plumbing), `services.scheduler.intake` (the intake loop),
`services.scheduler.completions` (the completions loop) and this one
(lifecycle and wiring, the RPC-facing methods, the nodes and timer loops).

Loops (each survives Redis blips: it logs, backs off and goes on):

* intake — new tasks from the intake stream (consumer group), at least once:
  a redelivered task the core already holds, or one already final, is only
  acked; decisions are made durable (events flushed) before the entries are
  acked, so a crash in between replays to the same state.
* completions — executors' task ends, from the stored cursor on; the cursor
  moves only after the resulting events are stored.
* nodes — heartbeats polled every `node_poll_s` (`NodeSupervisor`: dead and
  restarted nodes, the Redis-outage grace, revoked tasks); state writes a Redis
  error left behind are retried; the leases of the gateways streaming held
  inference are checked every `lease_check_s`; a lapsed one cancels its tasks (`LeaseWatch`).
* timer — wakes the planner when deferred training must be looked at again.

Redis: one client over a blocking pool of `config.redis_max_connections`
(the loops' connections plus `max_rpc_redis_calls` for RPCs, which wait on a
semaphore before touching Redis so they cannot starve the loops).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lemix._proto.lemix.v1 import scheduler_pb2_grpc
from lemix.infra import telemetry
from lemix.infra.rpc import SCHEDULER_SERVICE
from lemix.infra.rpc.errors import InvalidArgument, Unavailable
from lemix.infra.rpc.server import start_server, stop_server
from lemix.infra.store.client import RedisClientConfig, connect, export_pool_metrics
from lemix.infra.store.codec import Fields, get_optional_int
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.store import Store
from lemix.infra.store.task_fields import task_from_fields, task_to_fields
from lemix.infra.store.task_hash import (
    ATTEMPT_FIELD,
    GATEWAY_ID_FIELD,
    IS_FINAL_FIELD,
    STATUS_FIELD,
    StoredStatus,
    gateways_of,
)
from lemix.planner.recording import RecordingPlanner
from lemix.planner.registry import build_planner
from lemix.profile import load_profile
from lemix.reasons import ReasonCode, format_reason
from lemix.types import Task, TaskKind, TaskPayload
from services.scheduler.adapters import GrpcDispatcher, RedisEventSink, RedisResultWriter
from services.scheduler.completions import CompletionsLoop
from services.scheduler.core import SchedulerCore
from services.scheduler.intake import IntakeLoop
from services.scheduler.recovery import (
    SnapshottingSink,
    check_config,
    events_to_recover,
    recover,
    start_event,
)
from services.scheduler.service_base import describe_redis_error
from services.scheduler.servicer import SchedulerServicer
from services.scheduler.supervision import LeaseWatch, NodeSupervisor

log = structlog.get_logger(__name__)

MAX_TASK_ID_CHARS = 256
GATEWAY_GONE = "the gateway streaming this request is gone"
_CANCELLED_LOOP_WAIT_S = 2.0  # how long a stop waits for its cancelled loops
_MIN_TIMER_S = 0.001  # never spin on a wake-up that is (float-)due now
_RECOVER_BATCH = 500  # task hashes read per round trip at restart


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
    """Turn a failed Redis call into `Unavailable` for an RPC caller."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise Unavailable(f"{what}: {describe_redis_error(exc)}; retry later") from exc


def check_task_id(task_id: str) -> None:
    """Task ids become Redis key parts: non-empty, no whitespace, bounded."""
    if not task_id:
        raise InvalidArgument("task_id is empty")
    if len(task_id) > MAX_TASK_ID_CHARS or any(ch.isspace() for ch in task_id):
        raise InvalidArgument(
            f"task_id must be at most {MAX_TASK_ID_CHARS} characters without whitespace, "
            f"got {task_id[:40]!r}"
        )


class SchedulerService(IntakeLoop, CompletionsLoop):
    """The scheduler process: `await start()`, serve, `await stop()`.

    `redis_client` and `profile` may be injected (tests); otherwise they come
    from `config` at `start()`. An injected client is not closed on stop.
    Stop (`lemix.infra.lifecycle`): NOT_SERVING, the loops end (up to the
    grace plus one blocking read), the events are stored, the server stops
    (RPCs in flight get the grace), the executor channels and Redis close.
    The state and the constructor are `ServiceBase`'s.
    """

    # ================================================================ lifecycle

    async def _start(self) -> None:
        """Connect, recover, start the loops and the gRPC server."""
        config = self.config
        if self._redis is None:
            # Sized from our own concurrency (module docstring); blocking reads
            # wait up to read_block_s, so the socket timeout outlasts them.
            self._redis = connect(
                RedisClientConfig(
                    url=config.redis_url,
                    max_connections=config.redis_max_connections,
                    socket_timeout_s=config.redis_socket_timeout_s,
                )
            )
            self.lifecycle.add_client("redis", self._redis.aclose)
            export_pool_metrics(self._redis)
        self.store = Store(self._redis, RedisKeys(config.namespace))
        await self._redis.ping()
        self.epoch_s = await self.store.scheduler_epoch(time.time())
        await self._build_core()
        await self.store.ensure_group()
        self._intake_fresh_after = await self.store.intake_last_id()
        # Nodes are down until their first heartbeat (recorded without
        # planning, so deferred work is not rejected before the first poll).
        await self.core.mark_down(range(config.num_nodes))
        await self.nodes.poll()
        stale = await self.store.claim_stale(
            config.consumer_name, round(config.claim_min_idle_s * 1000)
        )
        if stale:
            log.info("intake_reclaimed", num_entries=len(stale))
            await self._handle_intake(stale, is_redelivery=True)
        self._loops = [
            asyncio.create_task(self._run_loop("intake", self._intake_step), name="intake"),
            asyncio.create_task(self._completions_loop(), name="completions"),
            asyncio.create_task(self._run_loop("nodes", self._nodes_step), name="nodes"),
            asyncio.create_task(self._run_loop("timer", self._timer_step), name="timer"),
        ]
        self.lifecycle.add_work("loops", self._stop_loops)
        server, self.port, health = await start_server(
            [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, SchedulerServicer(self))],
            config.host,
            config.port,
            service_names=[SCHEDULER_SERVICE],
            service_token=config.service_token,
        )
        self.lifecycle.on_stopping(health.enter_graceful_shutdown)
        self.lifecycle.add_server("grpc", lambda grace_s: stop_server(server, health, grace_s))
        await self.store.mark_scheduler_alive(self._alive_ttl_s)  # gateways may send work now
        log.info(
            "scheduler_started",
            address=self.address,
            policy=config.policy,
            num_nodes=config.num_nodes,
            namespace=config.namespace,
            recovered_events=self.num_recovered_events,
            from_snapshot=self.is_recovered_from_snapshot,
            recovered_tasks=self.core.num_tasks,
            live_nodes=self.live_node_ids,
        )

    async def _build_core(self) -> None:
        config = self.config
        profile = self._profile or load_profile(config.resolved_profile_path)
        planner_config = config.planner_config(profile)
        # The gateway judges requests against the SLO the planner protects.
        await self.store.put_slo(planner_config.slo_ttft_s, planner_config.slo_tbt_s)
        planner = build_planner(config.policy, planner_config, profile, config.memory)
        # From the last snapshot on (compaction trims the rest; a failed trim
        # may leave older entries, which are not even parsed).
        events = events_to_recover(await self.store.read_events())
        check_config(events, planner_config, config.policy)
        recovered = recover(events, planner)
        self.num_recovered_events = recovered.num_events
        self.is_recovered_from_snapshot = recovered.is_from_snapshot
        self.events = RedisEventSink(self.store)
        # Registered before it runs: events recorded so far are stored inline.
        self.lifecycle.add_work("events", self._stop_events)
        # Every event goes through the recorder: it keeps the log's tally and
        # records a snapshot every `snapshot_every_events` (recovery.py).
        self.recorder = SnapshottingSink(
            self.events,
            planner,
            recovered.tally,
            snapshot_every_events=config.snapshot_every_events,
            wall_clock=time.time,
            num_events_since_snapshot=recovered.num_events,
        )
        self.recorder(start_event(planner_config, config.policy, time.time()))
        self.dispatcher = GrpcDispatcher(
            deadline_s=config.dispatch_deadline_s,
            weight_sync_deadline_s=config.weight_sync_deadline_s,
            weight_sync_dir=config.weight_sync_dir,
            payload_of=self._payloads.get,
            attempt_of=self._attempt_of,
            service_token=config.service_token,
        )
        self.lifecycle.add_client("executor channels", self.dispatcher.close)
        self.writer = RedisResultWriter(
            self.store,
            finished_ttl_s=config.finished_task_ttl_s or None,
            output_ttl_s=config.output_ttl_s or None,
        )
        self.core = SchedulerCore(
            RecordingPlanner(planner, self.recorder),
            self.dispatcher,
            self.writer,
            self.clock,
            on_forget=self._forget_task,
            ledger=self.writer,
            policy=config.policy,
            max_concurrent_dispatches=config.max_concurrent_dispatches,
            max_task_moves=config.max_task_moves,
        )
        self.core.restore(recovered.tasks, recovered.num_placed, recovered.num_rejected)
        self.nodes = NodeSupervisor(config, self.store, self.core, self.dispatcher)
        self.leases = LeaseWatch(self.store, config.lease_check_s)
        await self._recover_tasks(recovered.tasks)
        self.events.start()

    async def _recover_tasks(self, tasks: list[Task]) -> None:
        """Payloads, attempts, unconfirmed placements and gateway leases of
        recovered tasks."""
        unconfirmed = []
        attempts: dict[str, int] = {}
        states: list[Fields] = []
        for i in range(0, len(tasks), _RECOVER_BATCH):  # a round trip per batch, not per task
            states += await self.store.get_task_state_hashes(
                [t.task_id for t in tasks[i : i + _RECOVER_BATCH]]
            )
        for task, state in zip(tasks, states, strict=True):
            if not state:  # deferred or requeued work still needs its payload
                log.warning("payload_lost", task_id=task.task_id)
                continue
            self._payloads[task.task_id] = task_from_fields(state)[1]
            attempts[task.task_id] = get_optional_int(state, ATTEMPT_FIELD) or 0
            if (
                self.core.node_of(task.task_id) is not None
                and state.get(STATUS_FIELD) == StoredStatus.QUEUED
            ):
                unconfirmed.append(task.task_id)
        # Before the requeue below: it revokes (and so fences) those attempts.
        self.core.restore_attempts(attempts)
        # Placed in the log but never marked placed: the predecessor died
        # around the Dispatch. Placed again (and cancelled on the old node).
        moved = self.core.requeue_unconfirmed(unconfirmed)
        if moved:
            log.warning("unconfirmed_placements_requeued", num_tasks=len(moved))
        gateways = {
            task.task_id: gateways_of(state)
            for task, state in zip(tasks, states, strict=True)
            if task.kind is TaskKind.INFERENCE
        }
        gateway_ids = sorted({g for ids in gateways.values() for g in ids})
        held = dict(
            zip(gateway_ids, await self.store.gateway_leases_held(gateway_ids), strict=True)
        )
        self.leases.note([(t, g) for t, ids in gateways.items() for g in ids if held[g]])

    async def _stop_loops(self, grace_s: float) -> None:
        """Ask the loops to stop; cancel those still running after the grace
        plus one blocking read."""
        self._stopping.set()
        try:  # gateways refuse new work from their next check instead of queueing it
            await self.store.drop_scheduler_alive()
        except (RedisError, OSError) as exc:  # it lapses with its TTL
            log.warning("drop_alive_failed", error=str(exc))
        loops, self._loops = self._loops, []
        if not loops:
            return
        _, pending = await asyncio.wait(loops, timeout=grace_s + self.config.read_block_s)
        for task in pending:
            task.cancel()
        if pending:
            # Bounded: a cancelled blocking redis-py read has been seen never
            # to settle (the gateway tests' intake reader, redis-py 8.1), and
            # a stop must not hang on it; the process is ending anyway.
            _, stuck = await asyncio.wait(pending, timeout=_CANCELLED_LOOP_WAIT_S)
            if stuck:
                log.warning("loops_not_settled", num_loops=len(stuck))
        for task in loops:  # retrieved, so none is reported "never retrieved"
            if task.done() and not task.cancelled():
                task.exception()
        # What was to ride on the loops' next reads: handled intake entries'
        # acks (left pending, the next start reclaims them, known) and the
        # last completions batch's expiries and cursor (re-applied at start).
        # The acks only after the events they caused are stored (write-ahead,
        # `IntakeLoop._intake_step`): if that fails, they stay pending.
        try:
            if self._intake_acks:
                await self.events.flush(timeout_s=max(grace_s, 1.0))
                await self.store.ack_intake(self._intake_acks)
                self._intake_acks.clear()
            await self._send_cursor_advance()
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("stop_writes_left", num_acks=len(self._intake_acks), error=str(exc))

    async def _stop_events(self, grace_s: float) -> None:
        """Store the events recorded so far (at least 1 s to try), then stop the sink."""
        try:
            await self.events.stop(timeout_s=max(grace_s, 1.0))
        except TimeoutError:
            log.error("events_flush_timeout", pending=self.events.num_pending)

    def _attempt_of(self, task_id: str) -> int:
        return self.core.attempt_of(task_id)

    def _forget_task(self, task_id: str) -> None:
        self._payloads.pop(task_id, None)
        self.leases.forget(task_id)

    def _on_stopped(self) -> None:
        log.info("scheduler_stopped")

    # ============================================================ RPC-facing

    async def submit(self, task: Task, payload: TaskPayload, *, gateway_id: str = "") -> bool:
        """Store a task durably in the intake; False when its id was seen
        before. `gateway_id` names the gateway streaming its output ("" for
        none): that gateway's lease then covers it (`LeaseWatch`)."""
        check_task_id(task.task_id)
        fields = task_to_fields(task, payload)
        if gateway_id:
            fields[GATEWAY_ID_FIELD] = gateway_id
        # A direct client may name a gateway that holds no lease: the intake
        # checks (as it did for every task before gateways wrote their own).
        self._check_at_intake_add(task.task_id)
        async with self._rpc_redis_slots, redis_unavailable("Submit"):
            is_new = await self.store.submit_task(fields)
        if not is_new and gateway_id:
            # A retry through another gateway: its lease covers the task too,
            # recorded in the task hash so a restarted scheduler knows it.
            self.leases.also(task.task_id, gateway_id)
            async with self._rpc_redis_slots, redis_unavailable("Submit"):
                await self.store.add_task_gateway(task.task_id, gateway_id)
        return is_new

    async def cancel(self, task_id: str, reason: str) -> bool:
        """Cancel wherever the task is; True if the scheduler or its executor knew it."""
        check_task_id(task_id)
        reason = reason or "cancelled by the client"
        node_id = self.core.node_of(task_id)
        if node_id is None:
            # The gateway's reasons may already carry the code (a stop
            # sequence's); the engine strips it the same way.
            detail = reason.removeprefix(f"{ReasonCode.CANCELLED.value}: ").strip()
            ended = format_reason(ReasonCode.CANCELLED, detail)
            # The intake finds the marker only if it looks: tell it to. It may
            # have read the entry already and be about to hand the task over:
            # the core ends it then instead of planning it.
            self._check_at_intake_add(task_id)
            self.core.cancel_on_take(task_id, ended)
            async with self._rpc_redis_slots, redis_unavailable("Cancel"):
                await self.store.mark_cancelled(task_id)  # the intake drops it if unread
                if self.core.knows(task_id):
                    # Deferred: end it now; the core drops it when it would place it.
                    await self.writer.end_task(task_id, StoredStatus.FAILED, ended)
                    return True
                state = await self.store.get_task_state(task_id)
            node_id = self.core.node_of(task_id)  # placed while we were marking it?
            if node_id is None:
                # A hash without a status holds only the cancel marker just
                # written: the task was never taken in.
                return STATUS_FIELD in state and state.get(IS_FINAL_FIELD) != "1"
        return await self.dispatcher.cancel(node_id, task_id, reason)

    async def snapshot(self) -> SchedulerSnapshot:
        """Counters and live nodes; events recorded so far are stored first."""
        async with self._rpc_redis_slots, redis_unavailable("GetState"):
            try:
                await self.events.flush(timeout_s=self.config.dispatch_deadline_s)
            except TimeoutError:
                raise Unavailable("GetState: the event log cannot be stored") from None
            nodes = await self.store.get_node_states()
        return SchedulerSnapshot(
            policy=self.config.policy,
            num_placed=self.core.num_placed,
            num_deferred=self.core.num_deferred,
            num_rejected=self.core.num_rejected,
            nodes=nodes,
        )

    # ================================================================= loops
    # (intake and completions: services.scheduler.intake, .completions)

    # ----------------------------------------------------------------- nodes

    async def _nodes_step(self) -> None:
        await self._sleep_or_stop(self.config.node_poll_s)
        if self._stopping.is_set():
            return
        await self.nodes.poll()
        await self.store.mark_scheduler_alive(self._alive_ttl_s)
        await self.core.retry_writes()
        await self._cancel_orphans()
        await self._export_queue_depths()

    async def _export_queue_depths(self) -> None:
        telemetry.set_queue_depth("intake_pending", await self.store.pending_count())
        telemetry.set_queue_depth("deferred_training", self.core.num_deferred)
        telemetry.set_queue_depth("held", self.core.num_tasks)

    async def _cancel_orphans(self) -> None:
        """Cancel held inference whose gateway's lease lapsed."""
        for task_id in await self.leases.lapsed(self.core.knows):
            try:
                await self.cancel(task_id, GATEWAY_GONE)
            except Unavailable as exc:  # its node or Redis: the next check retries
                log.warning("orphan_cancel_failed", task_id=task_id, error=str(exc))
                continue
            except Exception as exc:  # the executor answered no: asking again won't help
                log.warning(
                    "orphan_cancel_refused", task_id=task_id, error=f"{type(exc).__name__}: {exc}"
                )
            else:
                log.info("orphan_cancelled", task_id=task_id)
            self.leases.forget(task_id)

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
            done, _ = await asyncio.wait(
                {woken, stop}, timeout=delay_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            woken.cancel()
            stop.cancel()
        if not done:  # the deadline passed with nothing new: let the planner look
            await self.core.on_timer()
