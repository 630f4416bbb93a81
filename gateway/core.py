"""`GatewayCore`: what a request does inside the gateway, whatever its protocol.

The gRPC servicer (`gateway.servicer`) and the OpenAI-compatible HTTP API
(`gateway.http_api`) both translate their requests into `GenerateRequest` /
`TrainRequest` messages and call this object, so validation, admission,
submission and stream handling exist once.

Admission, in order: a valid request (`admit`), a live executor (node states
in Redis, cached `node_check_s`), a free in-flight slot (`max_in_flight`),
then Submit. A stream the caller abandons (cancel, deadline, disconnect) or
the gateway gives up on (idle timeout, Redis down) has its task cancelled at
the scheduler, so the executor frees its KV; the slot is released in every
case.

Errors are domain errors (`lemix.rpc.errors`), plus `TaskEnded` for a task that
ended failed or rejected; each protocol maps them to its own status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

import grpc
import grpc.aio
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.config import GatewayConfig
from gateway.convert import OutputStream, TaskEnded, node_state_from_fields, stats_to_proto
from gateway.tokenizer import Tokenizer
from gateway.validate import validate_generate, validate_train
from lemix._proto.lemix.v1 import common_pb2, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from lemix.rpc import convert as rpc_convert
from lemix.rpc.errors import (
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    error_from_rpc,
)
from lemix.store import Store
from lemix.types import Task, TaskPayload

log = structlog.get_logger(__name__)

T = TypeVar("T")

# Counters this gateway increments (`Store.incr_stat`; GetStats reports the
# `gateway.convert.COUNTER_FIELDS` ones).
REQUESTS_RECEIVED = "requests_received"
TRAIN_REQUESTS_RECEIVED = "train_requests_received"
REQUESTS_REJECTED_INVALID = "requests_rejected_invalid"
REQUESTS_REJECTED_BUSY = "requests_rejected_busy"
REQUESTS_REJECTED_UNAVAILABLE = "requests_rejected_unavailable"
REQUESTS_CANCELLED = "requests_cancelled"
NUM_INFERENCE = "num_inference"  # inference tasks the scheduler acknowledged (new ids)
NUM_TRAINING = "num_training"  # training tasks the scheduler acknowledged (new ids)

# A finished task's output stream is kept this long after its reader saw the
# end, so an idempotent retry (same request_id) can replay it; then it expires.
OUTPUT_RETAIN_S = 300.0
# Train submits its tasks concurrently, at most this many Submits at once.
TRAIN_SUBMIT_CONCURRENCY = 32
# Why a task was cancelled when the gateway itself stopped streaming it.
GATEWAY_STOPPED_REASON = "CANCELLED: the gateway stopped streaming this task"

NO_EXECUTOR_MESSAGE = "no live executor: start one with `lemix up` or check the executors"


class SubmitDeadlineExceeded(Unavailable):
    """Submit got no answer in time; the scheduler may or may not hold the task."""


class GatewayCore:
    """Generate / Train / stats over a `Store` and a Scheduler stub.

    `clock` (monotonic seconds) measures TTFT/E2E and the live-executor cache.
    """

    def __init__(
        self,
        config: GatewayConfig,
        store: Store,
        scheduler: scheduler_pb2_grpc.SchedulerStub,
        tokenizer: Tokenizer,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.store = store
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.clock = clock
        self._num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._live_checked_s: float | None = None
        self._is_live = False

    @property
    def num_in_flight(self) -> int:
        """Generate streams holding a slot right now."""
        return self._num_in_flight

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every stream to release its slot; True if so."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    # ============================================================ operations

    async def admit(self, request: gateway_pb2.GenerateRequest) -> tuple[Task, TaskPayload]:
        """Count and validate a Generate request; raises `InvalidArgument`."""
        await self._count(REQUESTS_RECEIVED)
        try:
            return validate_generate(
                request, tokenizer=self.tokenizer,
                max_context_tokens=self.config.max_context_tokens,
            )  # fmt: skip
        except InvalidArgument:
            await self._count(REQUESTS_REJECTED_INVALID)
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
        from it. `gone_reason()` is the PROTOCOL.md reason to cancel the task
        with when the caller goes away (cancellation, or closing this iterator
        early). Raises domain errors, or `TaskEnded` for a failed task.
        """
        await self._require_live_executor()
        await self._acquire_slot()
        stream = OutputStream(
            task.task_id, task.max_output_tokens, received_s, self.clock, tokenizer=self.tokenizer
        )
        is_submitted = True  # from the moment Submit is sent, the scheduler may hold it
        cancel_reason = GATEWAY_STOPPED_REASON
        try:
            try:
                await self._submit(task, payload)
            except ServiceError as exc:
                is_submitted = isinstance(exc, SubmitDeadlineExceeded)
                raise
            async with contextlib.aclosing(self._follow(stream)) as responses:
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
                self._release_slot()

    async def train(self, request: gateway_pb2.TrainRequest) -> list[str]:
        """Validate and submit training samples; the task ids once every one is
        durable. Raises domain errors."""
        await self._count(TRAIN_REQUESTS_RECEIVED)
        try:
            tasks = validate_train(
                request, tokenizer=self.tokenizer,
                max_context_tokens=self.config.max_context_tokens,
            )  # fmt: skip
        except InvalidArgument:
            await self._count(REQUESTS_REJECTED_INVALID)
            raise
        limit = asyncio.Semaphore(TRAIN_SUBMIT_CONCURRENCY)

        async def submit(task: Task, payload: TaskPayload) -> bool:
            async with limit:
                return await self._submit(task, payload)

        # Every Submit runs to its end (each has a deadline) before we answer,
        # so a failure never leaves calls running behind the reply.
        results = await asyncio.gather(*(submit(t, p) for t, p in tasks), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [task.task_id for task, _ in tasks]

    async def stats(self) -> gateway_pb2.Stats:
        """The stack's counters, its live nodes and this gateway's streams."""
        counters = await self._redis(self.store.get_stats())
        states = await self._redis(self.store.get_node_states())
        nodes = []
        for node_id, fields in sorted(states.items()):
            try:
                nodes.append(node_state_from_fields(node_id, fields))
            except ValueError as exc:  # one bad hash must not hide the others
                log.warning("gateway.bad_node_state", node_id=node_id, error=str(exc))
        return stats_to_proto(counters, nodes, self._num_in_flight)

    async def has_live_executor(self) -> bool:
        """True when some executor's heartbeat is live (cached `node_check_s`).

        Raises `Unavailable` when Redis cannot be reached.
        """
        now_s = self.clock()
        if self._live_checked_s is None or now_s - self._live_checked_s >= self.config.node_check_s:
            states = await self._redis(self.store.get_node_states())
            self._is_live, self._live_checked_s = bool(states), now_s
        return self._is_live

    # ============================================================= admission

    async def _require_live_executor(self) -> None:
        if not await self.has_live_executor():
            await self._count(REQUESTS_REJECTED_UNAVAILABLE)
            raise Unavailable(NO_EXECUTOR_MESSAGE)

    async def _acquire_slot(self) -> None:
        """Take an in-flight slot (no await between check and take) or raise
        `ResourceExhausted`."""
        if self._num_in_flight >= self.config.max_in_flight:
            num_in_flight = self._num_in_flight
            await self._count(REQUESTS_REJECTED_BUSY)
            raise ResourceExhausted(
                f"server busy: {num_in_flight} requests in flight "
                f"(limit {self.config.max_in_flight}); retry with backoff"
            )
        self._num_in_flight += 1
        self._idle.clear()

    def _release_slot(self) -> None:
        self._num_in_flight -= 1
        if self._num_in_flight == 0:
            self._idle.set()

    # ============================================================ delegation

    async def _follow(
        self, stream: OutputStream
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """Read the task's output stream to its end message, yielding responses."""
        task_id = stream.task_id
        last_id = "0-0"
        while not stream.is_ended:
            entries = await self._read_output(task_id, last_id)
            for entry_id, fields in entries:
                last_id = entry_id
                try:
                    response = stream.on_message(fields)
                except TaskEnded:
                    await self._retire_output(task_id)
                    raise
                if response is not None:
                    yield response
                if stream.is_ended:
                    break
        await self._retire_output(task_id)

    async def _submit(self, task: Task, payload: TaskPayload) -> bool:
        """Scheduler.Submit with a deadline; True for a new task, False for a
        known id (idempotent resubmit). Raises domain errors."""
        request = scheduler_pb2.SubmitRequest(task=rpc_convert.task_to_proto(task, payload))
        try:
            reply = await self.scheduler.Submit(request, timeout=self.config.submit_deadline_s)
        except grpc.aio.AioRpcError as err:
            raise self._scheduler_error("Submit", err) from err
        if not reply.is_duplicate:
            await self._count(NUM_TRAINING if task.is_training else NUM_INFERENCE)
        return not reply.is_duplicate

    def _scheduler_error(self, method: str, err: grpc.aio.AioRpcError) -> Exception:
        where = f"scheduler at {self.config.scheduler_address}"
        if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            return SubmitDeadlineExceeded(
                f"{where} did not answer {method} within "
                f"{self.config.submit_deadline_s:g} s; retry later"
            )
        error = error_from_rpc(err)
        if isinstance(error, Unavailable):
            return Unavailable(f"{where} is unavailable ({err.details()}); retry later")
        return error  # the scheduler's own refusal, or an AioRpcError (-> INTERNAL, logged)

    async def _read_output(self, task_id: str, last_id: str) -> list[tuple[str, dict[str, str]]]:
        """The next output messages, waiting up to the idle timeout for one."""
        timeout_s = self.config.stream_idle_timeout_s
        entries = await self._redis(
            self.store.read_output(task_id, last_id, block_ms=max(1, round(timeout_s * 1000)))
        )
        if not entries:
            raise Unavailable(
                f"task {task_id} produced no output for {timeout_s:g} s "
                "(its executor may have failed); it was cancelled, retry it"
            )
        return entries

    async def _abandon(self, task_id: str, reason: str) -> None:
        """Cancel a task nobody will read (best effort, short deadline)."""
        await self._count(REQUESTS_CANCELLED)
        request = common_pb2.CancelRequest(task_id=task_id, reason=reason)
        try:
            await self.scheduler.Cancel(request, timeout=self.config.cancel_deadline_s)
        except grpc.aio.AioRpcError as err:
            log.warning("gateway.cancel_failed", task_id=task_id, reason=reason,
                        code=err.code().name, error=err.details())  # fmt: skip
        except Exception as exc:  # e.g. the channel closed under us at shutdown
            # Best effort by design: the caller is already failing or gone.
            log.warning("gateway.cancel_failed", task_id=task_id, reason=reason,
                        error=f"{type(exc).__name__}: {exc}")  # fmt: skip
        else:
            log.info("gateway.cancelled", task_id=task_id, reason=reason)

    async def _retire_output(self, task_id: str) -> None:
        try:
            await self.store.expire_output(task_id, OUTPUT_RETAIN_S)
        except RedisError as exc:
            log.warning("gateway.expire_output_failed", task_id=task_id, error=str(exc))

    async def _redis(self, awaitable: Awaitable[T]) -> T:
        """Await a Store call; an unreachable Redis reads as `Unavailable`."""
        try:
            return await awaitable
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise Unavailable(f"state store (Redis) unavailable: {exc}; retry later") from exc

    async def _count(self, name: str, by: int = 1) -> None:
        """Best effort: a counter must never fail a request."""
        try:
            await self.store.incr_stat(name, by)
        except RedisError as exc:
            log.warning("gateway.count_failed", counter=name, error=str(exc))
