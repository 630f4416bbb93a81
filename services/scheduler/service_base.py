"""The scheduler service's shared state and loop plumbing (`SchedulerService`'s base).

`ServiceBase` holds what every part of the service uses: the config, the
state the loops keep (payloads, the intake's unacked flag, the completions
cursor), the collaborators built at start (store, core, event sink, result
writer, supervisors) and the plumbing each loop runs in (back off on an
error, race a wait with stop). `services.scheduler.intake` adds the intake
loop, `services.scheduler.completions` the completions loop, and
`services.scheduler.service` the lifecycle, the RPC-facing methods, the
nodes and timer loops and the wiring. One class in four modules: see
`SchedulerService`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lemix.infra.lifecycle import Service
from lemix.infra.store.events import CursorAdvance
from lemix.infra.store.keys import SCHEDULER_ALIVE_TTL_S
from lemix.infra.store.store import Store
from lemix.profile import Profile
from lemix.types import TaskPayload
from services.scheduler.adapters import RedisEventSink, RedisResultWriter
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.supervision import LeaseWatch, NodeSupervisor

log = structlog.get_logger(__name__)

T = TypeVar("T")

_LOOP_BACKOFF_S = 0.5  # after an unexpected error in a loop iteration


def describe_redis_error(exc: BaseException) -> str:
    """What went wrong talking to Redis, by its real cause.

    The blocking pool's "No connection available." means every pooled
    connection stayed busy past its wait: overload, not an unreachable Redis.
    """
    if isinstance(exc, RedisConnectionError) and "No connection available" in str(exc):
        return "every pooled Redis connection stayed busy past the pool's wait (overloaded)"
    if isinstance(exc, RedisTimeoutError):
        return f"Redis did not answer in time ({exc})"
    return f"Redis is unreachable ({type(exc).__name__}: {exc})"


class ServiceBase(Service):
    """The service's state and loop plumbing (module doc); the constructor's
    arguments are `SchedulerService`'s."""

    # Built by `SchedulerService._start` (`_build_core`) before any loop runs.
    store: Store
    core: SchedulerCore
    events: RedisEventSink
    writer: RedisResultWriter
    nodes: NodeSupervisor
    leases: LeaseWatch

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        redis_client: aioredis.Redis | None = None,
        profile: Profile | None = None,
    ) -> None:
        super().__init__("scheduler", default_grace_s=config.shutdown_grace_s)
        self.config = config
        self._redis = redis_client
        self._profile = profile
        self._stopping = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []
        self._payloads: dict[str, TaskPayload] = {}
        self._rpc_redis_slots = asyncio.Semaphore(config.max_rpc_redis_calls)
        self._has_unacked_intake = False
        # Intake entries handled (their decisions stored) whose acks go with
        # an intake read once due (`IntakeLoop`), or at stop; and since when
        # (monotonic s) the oldest of them waits.
        self._intake_acks: list[str] = []
        self._intake_acks_since_s = 0.0
        # Events recorded when the last of them was handled: stored first.
        self._intake_acks_num_events = 0
        # The last completions batch's cursor step (expiries, stored cursor),
        # sent with the next completions read (`CompletionsLoop`), or at stop.
        self._cursor_advance: CursorAdvance | None = None
        # Intake entries up to this id were added before this scheduler read
        # the stream: a predecessor may hold cancel markers for them, so they
        # are checked (`IntakeLoop`); later ones only if this process was told
        # something about them (`_check_at_intake`).
        self._intake_fresh_after = "0-0"
        # Task ids to check at intake although their entry says the task is
        # its hash's own: cancelled, or submitted here, before the intake read
        # them. Insertion-ordered, bounded (`_CHECK_AT_INTAKE_MAX`).
        self._check_at_intake: dict[str, None] = {}
        self._completions_cursor: str | None = None
        self._stored_cursor: str | None = None  # the cursor last stored in Redis
        self._cursor_stored_s = -math.inf  # when (monotonic)
        self.port = 0
        self.epoch_s = 0.0
        self.num_recovered_events = 0  # events replayed at start (after the snapshot)
        self.is_recovered_from_snapshot = False
        # Renewed every node poll; a few polls may fail (Redis blip) before it lapses.
        self._alive_ttl_s = max(SCHEDULER_ALIVE_TTL_S, 4 * config.node_poll_s)

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def clock(self) -> float:
        """Planner time: wall-clock seconds since the namespace's stored epoch."""
        return time.time() - self.epoch_s

    async def _run_loop(self, name: str, step: Callable[[], Awaitable[None]]) -> None:
        while not self._stopping.is_set():
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._log_loop_error(name, exc)
                await self._sleep_or_stop(_LOOP_BACKOFF_S)

    def _log_loop_error(self, name: str, exc: Exception) -> None:
        if isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError):
            # An outage: expected, retried; a traceback per retry is noise. The
            # error's own type and text say which (refused, timed out, pool
            # exhausted).
            self.nodes.on_redis_error()
            log.warning("loop_redis_error", loop=name, error=describe_redis_error(exc))
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
