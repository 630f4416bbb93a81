"""`GatewayCore`: what a request does inside the gateway, whatever its protocol.

The gRPC servicer (`gateway.servicer`) and the OpenAI-compatible HTTP API
(`gateway.http_api`) both translate their requests into `GenerateRequest` /
`TrainRequest` messages and call this object, so validation, admission,
submission and stream handling exist once.

Admission, in order: a valid request (`admit`: no I/O but a cached read of
the model's limits, `gateway.model_limits`), a free in-flight slot
(`max_in_flight`; taken before any Redis I/O, so a flood is refused with
RESOURCE_EXHAUSTED at once, never queued behind the Redis pool), a live
executor and a live scheduler (their heartbeat keys in Redis, cached
`node_check_s`, one check in flight at a time), then the task's write to the
scheduler's durable intake stream (`Store.submit_tasks`, idempotent by id),
which also renews this gateway's lease on the task's stream when it needs it
and wakes the output reader: one round trip, no RPC to the scheduler.
Request counters are summed in memory and flushed in batches.

A stream the caller abandons (cancel, deadline, disconnect) or the gateway
gives up on (idle timeout, Redis down past it) has its task cancelled at the
scheduler, so the executor frees its KV; the slot and the lease are released
in every case. A transient Redis error while reading does not end the stream:
the read resumes from the last entry seen, with backoff, within the idle
timeout.

Admission's slots, liveness check and counters live in `gateway.admission`
(`Admission`, this class's base); this module has the operations and the
stream handling.

Errors are domain errors (`lemix.infra.rpc.errors`), plus `TaskEnded` for a task that
ended failed or rejected; each protocol maps them to its own status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence

import grpc
import grpc.aio
import structlog
from redis.exceptions import RedisError

from gateway.admission import (
    NUM_INFERENCE,
    NUM_TRAINING,
    REQUESTS_CANCELLED,
    REQUESTS_RECEIVED,
    REQUESTS_REJECTED_INVALID,
    TRAIN_REQUESTS_RECEIVED,
    Admission,
)
from gateway.config import GatewayConfig
from gateway.convert import OutputStream, TaskEnded, merge_responses, stats_to_proto
from gateway.model_limits import ModelLimitsCache, context_tokens
from gateway.reader import Follower, OutputReader
from gateway.upkeep import StreamLeases, Upkeep
from gateway.validate import ANONYMOUS_SCOPE, validate_generate, validate_train
from lemix._proto.lemix.v1 import common_pb2, gateway_pb2, scheduler_pb2_grpc
from lemix.infra.rpc.errors import (
    InvalidArgument,
    Unavailable,
)
from lemix.infra.store.heartbeat import node_states_from_heartbeats
from lemix.infra.store.intake import GatewayHold, SubmitOutcome, TaskIdConflict
from lemix.infra.store.store import Store
from lemix.infra.store.task_fields import task_to_fields
from lemix.infra.store.task_hash import GATEWAY_ID_FIELD
from lemix.tokenizer import Tokenizer
from lemix.types import Task, TaskPayload

log = structlog.get_logger(__name__)

# Train writes its tasks to the intake this many per round trip.
TRAIN_SUBMIT_CHUNK = 128
# The output reader's blocking read returns after this long at most, so a
# stream added while a wake was lost waits no longer than that.
READ_BLOCK_CAP_S = 1.0
# Why a task was cancelled when the gateway itself stopped streaming it.
GATEWAY_STOPPED_REASON = "CANCELLED: the gateway stopped streaming this task"


class SubmitDeadlineExceeded(Unavailable):
    """The intake write got no answer in time; the task may or may not be stored."""


def new_gateway_id() -> str:
    """This gateway process's name: its lease's owner, named in each task it writes."""
    return f"gw-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class GatewayCore(Admission):
    """Generate / Train / stats over a `Store` and a Scheduler stub.

    `clock` (monotonic seconds) measures TTFT/E2E, the live-executor cache and
    the read-retry deadline. `gateway_id` names this gateway's lease on its
    streams. `start()` runs the upkeep loops (counters, lease); `close()` ends them.
    """

    def __init__(
        self,
        config: GatewayConfig,
        store: Store,
        scheduler: scheduler_pb2_grpc.SchedulerStub,
        tokenizer: Tokenizer,
        *,
        clock: Callable[[], float] = time.monotonic,
        gateway_id: str | None = None,
    ) -> None:
        super().__init__(config, store, clock)  # config, store, clock, counters, admission state
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.leases = StreamLeases(store, gateway_id or new_gateway_id(), config.stream_lease_ttl_s)
        self._upkeep = Upkeep(self.counters, self.leases, flush_s=config.stats_flush_s)
        # One blocking XREAD for every stream served (within the Redis
        # client's socket timeout, which exceeds the stream idle timeout).
        self.reader = OutputReader(
            store,
            self.leases.owner,
            block_s=min(config.stream_idle_timeout_s, READ_BLOCK_CAP_S),
        )
        self.model_limits = ModelLimitsCache(store, clock)  # what executors publish

    def start(self) -> None:
        """Start the upkeep loops and the output reader (in the running event loop)."""
        self._upkeep.start()
        self.reader.start()

    async def close(self) -> None:
        """End the reader and the upkeep loops: counters flushed, the lease
        and the reader's wake stream dropped."""
        await self.reader.stop()
        await self._upkeep.stop()
        try:
            await self.store.drop_reader_wake(self.leases.owner)
        except (RedisError, OSError) as exc:  # it lapses with its TTL
            log.warning("gateway.drop_wake_failed", error=str(exc))

    # ============================================================ operations

    async def admit(
        self, request: gateway_pb2.GenerateRequest, *, scope: str = ANONYMOUS_SCOPE
    ) -> tuple[Task, TaskPayload]:
        """Count and validate a Generate request from a caller in `scope`
        (`gateway.validate.client_scope`) against the served model's limits
        (`gateway.model_limits`: a cached Redis read); raises `InvalidArgument`."""
        self.counters.add(REQUESTS_RECEIVED)
        limits = await self.model_limits.get()
        try:
            return validate_generate(
                request,
                tokenizer=self.tokenizer,
                max_context_tokens=context_tokens(self.config.max_context_tokens, limits),
                vocab_size=limits.vocab_size,
                scope=scope,
            )
        except InvalidArgument:
            self.counters.add(REQUESTS_REJECTED_INVALID)
            raise

    async def generate(
        self,
        task: Task,
        payload: TaskPayload,
        *,
        received_s: float,
        gone_reason: Callable[[], str],
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """Run an admitted task and yield its responses until the final one.

        `received_s` (on `clock`) is when the request arrived: TTFT and E2E count
        from it. `gone_reason()` is the docs/protocol.md reason to cancel the task
        with when the caller goes away (cancellation, or closing this iterator
        early). Raises domain errors, or `TaskEnded` for a failed task.
        """
        self._acquire_slot()  # first: a busy gateway answers without touching Redis
        is_leased = False
        is_submitted = False  # True once the intake write may have landed
        stream = OutputStream(
            task.task_id, task.max_output_tokens, received_s, self.clock, tokenizer=self.tokenizer
        )
        cancel_reason = GATEWAY_STOPPED_REASON
        follower: Follower | None = None
        try:
            await self._require_live_stack()
            # Followed before the task is written, so that a wake of the
            # reader (when it blocks in a read without this stream) goes in
            # the same round trip.
            follower = self.reader.follow(task.task_id)
            wake = self.reader.claim_wake()
            try:
                # The lease, when it needs writing, goes ahead of the task:
                # the scheduler cancels a streamed task whose gateway's lease
                # is missing (it died).
                await self.leases.take(
                    task.task_id,
                    lambda lease_ttl_s: self._submit(
                        [(task, payload)], GatewayHold(self.leases.owner, lease_ttl_s, wake)
                    ),
                )
            except SubmitDeadlineExceeded:
                is_submitted = True
                raise
            is_leased = is_submitted = True
            async with contextlib.aclosing(self._follow(stream, follower)) as responses:
                async for response in responses:
                    yield response
        except (asyncio.CancelledError, GeneratorExit):
            cancel_reason = gone_reason()
            raise
        finally:
            try:
                if is_submitted and not stream.is_ended:
                    await asyncio.shield(self._abandon(task.task_id, cancel_reason))
            finally:
                if follower is not None:
                    self.reader.unfollow(follower)
                if is_leased:
                    self.leases.release(task.task_id)
                self._release_slot()

    async def train(
        self, request: gateway_pb2.TrainRequest, *, scope: str = ANONYMOUS_SCOPE
    ) -> list[str]:
        """Validate and submit training samples; the task ids once every one is
        durable. Raises domain errors."""
        self.counters.add(TRAIN_REQUESTS_RECEIVED)
        config = self.config
        limits = await self.model_limits.get()
        try:
            tasks = validate_train(
                request,
                tokenizer=self.tokenizer,
                max_context_tokens=context_tokens(config.max_context_tokens, limits),
                vocab_size=limits.vocab_size,
                max_samples=config.max_train_samples,
                max_train_batch_size=config.max_train_batch_size,
                scope=scope,
            )
        except InvalidArgument:
            self.counters.add(REQUESTS_REJECTED_INVALID)
            raise
        await self._require_live_stack()
        # In chunks, each one round trip: a chunk is durable (or a duplicate)
        # before the next is sent, and one reply never holds Redis for long.
        for start in range(0, len(tasks), TRAIN_SUBMIT_CHUNK):
            await self._submit(tasks[start : start + TRAIN_SUBMIT_CHUNK])
        return [task.task_id for task, _ in tasks]

    async def stats(self) -> gateway_pb2.Stats:
        """The stack's counters (this gateway's flushed first), its live nodes
        and this gateway's streams."""
        try:
            await self.counters.flush()
        except RedisError as exc:  # kept for the next flush; the read below reports Redis
            log.warning("gateway.counters_flush_failed", error=str(exc))
        counters = await self._redis(self.store.get_stats())
        states = await self._redis(self.store.get_node_states())
        nodes, bad = node_states_from_heartbeats(states)
        for node_id, error in bad.items():  # left out: one bad hash must not hide the others
            log.warning("gateway.bad_node_state", node_id=node_id, error=error)
        return stats_to_proto(counters, nodes, self._num_in_flight)

    # ============================================================ delegation

    async def _follow(
        self, stream: OutputStream, follower: Follower
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """Read the task's output stream to its end message, yielding responses.

        The messages one read returns go out as one response (`merge_responses`):
        a caller that fell behind, or a node that wrote several iterations
        between two reads, costs one stream write, not one per message.
        """
        while not stream.is_ended:
            pending: gateway_pb2.GenerateResponse | None = None
            try:
                for _, fields in await self._next_output(follower):
                    response = stream.on_message(fields)
                    if response is not None:
                        pending = (
                            response if pending is None else merge_responses(pending, response)
                        )
                    if stream.is_ended:
                        break
            except TaskEnded:
                if pending is not None:  # what came before the failed end is still sent
                    yield pending
                raise
            if pending is not None:
                yield pending

    async def _submit(
        self, tasks: Sequence[tuple[Task, TaskPayload]], hold: GatewayHold | None = None
    ) -> list[bool]:
        """Write tasks to the scheduler's intake (`Store.submit_tasks`: durable,
        idempotent by id), in one round trip within `submit_deadline_s`; per
        task True when new, False for a known id (an idempotent resubmit).
        Raises `TaskIdConflict` when an id names another request (that task
        is not written; the others are), `SubmitDeadlineExceeded` (the write
        may have landed) or `Unavailable` (Redis unreachable)."""
        records = []
        for task, payload in tasks:
            fields = task_to_fields(task, payload)
            fields[GATEWAY_ID_FIELD] = self.leases.owner  # whose lease covers its stream
            records.append(fields)
        try:
            async with asyncio.timeout(self.config.submit_deadline_s):
                outcomes = await self._redis(self.store.submit_tasks(records, hold=hold))
        except TimeoutError:
            raise SubmitDeadlineExceeded(
                f"state store (Redis) did not take the request within "
                f"{self.config.submit_deadline_s:g} s; retry later"
            ) from None
        for (task, _), outcome in zip(tasks, outcomes, strict=True):
            if outcome is SubmitOutcome.ADDED:
                self.counters.add(NUM_TRAINING if task.is_training else NUM_INFERENCE)
            elif outcome is SubmitOutcome.DUPLICATE and hold is not None:
                # A retry through this gateway of a task another one streamed:
                # this lease covers it too (the scheduler reads the record
                # before calling the task orphaned).
                await self._redis(self.store.add_task_gateway(task.task_id, self.leases.owner))
        conflicts = [t.task_id for (t, _), o in zip(tasks, outcomes, strict=True) if o < 0]
        if conflicts:
            raise TaskIdConflict(
                f"request_id {conflicts[0]!r} was already used with a different request; "
                "use a new id"
            )
        return [outcome is SubmitOutcome.ADDED for outcome in outcomes]

    async def _next_output(self, follower: Follower) -> list[tuple[str, dict[str, str]]]:
        """The output messages the reader got for `follower` since the last
        call, waiting up to the idle timeout for one. The reader retries a
        Redis error itself (from the last entry seen, so nothing is skipped
        or repeated); past the idle timeout the stream ends UNAVAILABLE."""
        timeout_s = self.config.stream_idle_timeout_s
        try:
            return await follower.next(timeout_s)
        except TimeoutError:
            error = self.reader.last_error
            if error is not None:
                raise Unavailable(
                    f"state store (Redis) unavailable for {timeout_s:g} s while "
                    f"streaming task {follower.task_id} ({error}); it was cancelled, retry it"
                ) from None
            raise Unavailable(
                f"task {follower.task_id} produced no output for {timeout_s:g} s "
                "(its executor may have failed); it was cancelled, retry it"
            ) from None

    async def _abandon(self, task_id: str, reason: str) -> None:
        """Cancel a task nobody will read (best effort, short deadline)."""
        self.counters.add(REQUESTS_CANCELLED)
        request = common_pb2.CancelRequest(task_id=task_id, reason=reason)
        try:
            await self.scheduler.Cancel(request, timeout=self.config.cancel_deadline_s)
        except grpc.aio.AioRpcError as err:
            log.warning(
                "gateway.cancel_failed",
                task_id=task_id,
                reason=reason,
                code=err.code().name,
                error=err.details(),
            )
        except Exception as exc:  # e.g. the channel closed under us at shutdown
            # Best effort by design: the caller is already failing or gone.
            log.warning(
                "gateway.cancel_failed",
                task_id=task_id,
                reason=reason,
                error=f"{type(exc).__name__}: {exc}",
            )
        else:
            log.info("gateway.cancelled", task_id=task_id, reason=reason)
