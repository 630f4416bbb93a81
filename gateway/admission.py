"""Admission in the gateway: in-flight slots and the stack's liveness (`GatewayCore`'s base).

`Admission` holds what decides whether a request may start, and the request
counters that record each refusal: a free in-flight slot (`max_in_flight`;
taken with no I/O, so a flood is refused with RESOURCE_EXHAUSTED at once,
never queued behind the Redis pool), then a live executor and a live
scheduler (their heartbeat keys in Redis, cached `node_check_s`, one check in
flight at a time). `gateway.core.GatewayCore` adds the operations (validate,
submit, stream) on top; see its module doc for the whole admission order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import NamedTuple, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.config import GatewayConfig
from lemix.infra.rpc.errors import ResourceExhausted, Unavailable
from lemix.infra.store.counters import BatchedCounters
from lemix.infra.store.store import Store

T = TypeVar("T")

# Counters this gateway increments (batched: `lemix.infra.store.counters.BatchedCounters`;
# GetStats reports the `gateway.convert.COUNTER_FIELDS` ones).
REQUESTS_RECEIVED = "requests_received"
TRAIN_REQUESTS_RECEIVED = "train_requests_received"
REQUESTS_REJECTED_INVALID = "requests_rejected_invalid"
REQUESTS_REJECTED_BUSY = "requests_rejected_busy"
REQUESTS_REJECTED_UNAVAILABLE = "requests_rejected_unavailable"
REQUESTS_CANCELLED = "requests_cancelled"
NUM_INFERENCE = "num_inference"  # inference tasks the scheduler acknowledged (new ids)
NUM_TRAINING = "num_training"  # training tasks the scheduler acknowledged (new ids)

NO_EXECUTOR_MESSAGE = "no live executor: start one with `lemix up` or check the executors"
NO_SCHEDULER_MESSAGE = "no live scheduler: start one with `lemix up` or check the scheduler"
# What a busy gateway tells HTTP clients to wait before retrying (Retry-After).
BUSY_RETRY_AFTER_S = 1


class Liveness(NamedTuple):
    """Whether the services that serve new work are running (`GatewayCore.liveness`)."""

    has_executor: bool
    has_scheduler: bool


class Busy(ResourceExhausted):
    """Every in-flight slot is taken; retry after `retry_after_s`."""

    retry_after_s = BUSY_RETRY_AFTER_S


class Admission:
    """In-flight slots, the liveness check and the counters (module doc).

    `clock` (monotonic seconds) times the liveness cache.
    """

    def __init__(self, config: GatewayConfig, store: Store, clock: Callable[[], float]) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self.counters = BatchedCounters(store)
        self._num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._live_checked_s: float | None = None
        self._liveness = Liveness(has_executor=False, has_scheduler=False)
        self._live_check: asyncio.Future[Liveness] | None = None  # the check in flight

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

    async def liveness(self) -> Liveness:
        """Whether an executor and the scheduler are live (their heartbeat
        keys; cached `node_check_s`; callers that arrive while a check runs
        share its answer).

        Raises `Unavailable` when Redis cannot be reached.
        """
        now_s = self.clock()
        if self._live_checked_s is not None and now_s - self._live_checked_s < (
            self.config.node_check_s
        ):
            return self._liveness
        if self._live_check is None:
            self._live_check = asyncio.ensure_future(self._check_live(now_s))
            # Read its error even if every caller went away (no "never retrieved").
            self._live_check.add_done_callback(lambda f: f.cancelled() or f.exception())
        check = self._live_check
        # shield: one caller going away must not cancel the others' check
        return await asyncio.shield(check)

    async def _check_live(self, now_s: float) -> Liveness:
        try:
            states, is_scheduler_alive = await self._redis(self.store.get_liveness())
            self._liveness = Liveness(bool(states), is_scheduler_alive)
            self._live_checked_s = now_s
            return self._liveness
        finally:
            self._live_check = None

    async def _require_live_stack(self) -> None:
        """Refuse new work (UNAVAILABLE) while no executor or no scheduler
        runs: the intake would keep it, but nobody would serve it."""
        liveness = await self.liveness()
        if not liveness.has_executor:
            self.counters.add(REQUESTS_REJECTED_UNAVAILABLE)
            raise Unavailable(NO_EXECUTOR_MESSAGE)
        if not liveness.has_scheduler:
            self.counters.add(REQUESTS_REJECTED_UNAVAILABLE)
            raise Unavailable(NO_SCHEDULER_MESSAGE)

    def _acquire_slot(self) -> None:
        """Take an in-flight slot or raise `Busy` (no I/O, no await)."""
        if self._num_in_flight >= self.config.max_in_flight:
            self.counters.add(REQUESTS_REJECTED_BUSY)
            raise Busy(
                f"server busy: {self._num_in_flight} requests in flight "
                f"(limit {self.config.max_in_flight}); retry after "
                f"{BUSY_RETRY_AFTER_S} s with backoff"
            )
        self._num_in_flight += 1
        self._idle.clear()

    def _release_slot(self) -> None:
        self._num_in_flight -= 1
        if self._num_in_flight == 0:
            self._idle.set()

    # Here because the liveness check needs it; `GatewayCore` awaits its Store calls with it too.
    async def _redis(self, awaitable: Awaitable[T]) -> T:
        """Await a Store call; an unreachable Redis reads as `Unavailable`."""
        try:
            return await awaitable
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise Unavailable(f"state store (Redis) unavailable: {exc}; retry later") from exc
