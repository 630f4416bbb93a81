"""Node liveness and stream leases: what the scheduler's nodes loop decides.

`NodeSupervisor.poll` reads every node's heartbeat and turns changes into
core inputs:

* a node that heartbeats with an address and is healthy is up. One that was
  down gets, first, a Cancel for each task taken away from it (`core.revoked`:
  a SIGSTOPped executor that resumes must not run them twice), and only then
  work. The attempts it held are fenced before those Cancels
  (`core.fence_revoked`), so the "CANCELLED" ends they make are not written.
  A node that just failed a Dispatch waits `dispatch_retry_s` first.
* a node that reports itself unhealthy, or whose heartbeat expired (the
  executor's TTL, 3 x its heartbeat period), is down at once: no new work.
  Once it has been down `node_lost_after_s` it is lost: its tasks are taken
  away from it (`SchedulerCore.on_node_down`). So every task of a dead node
  is re-queued or failed with a reason within heartbeat TTL +
  node_lost_after_s + node_poll_s of its last heartbeat (1.5 + 2 + 0.5 s by
  default; plus one Dispatch deadline for a re-placement). A heartbeat that
  is merely late costs no task.
* an executor that restarted between two polls (its engine clock `now_s` went
  back) lost what it held: its tasks are taken away too.

Grace: heartbeats missing right after the scheduler starts, after a Redis
error, or after Redis restarted (its run id changed) may only mean Redis lost
or delayed them, not that the executors died. Such nodes are declared down
only once `redis_outage_grace_s` has passed since Redis answered again.

`LeaseWatch` follows the gateways' leases (`RedisKeys.gateway_lease`, one
per gateway): an inference task whose gateway's lease lapsed has nobody
reading its output.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import structlog

from lemix.infra.rpc.errors import Unavailable
from lemix.infra.store.codec import Fields, get_bool, get_optional_float
from lemix.infra.store.heartbeat import ADDRESS_FIELD, IS_HEALTHY_FIELD, NOW_S_FIELD
from lemix.infra.store.store import Store
from services.scheduler.adapters import GrpcDispatcher
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore

log = structlog.get_logger(__name__)

# Engine-clock slack when comparing two heartbeats of one executor: more than
# this backwards means a new process.
_RESTART_SLACK_S = 1e-3


class NodeSupervisor:
    """Turns polled heartbeats into node health (see the module docstring)."""

    def __init__(
        self,
        config: SchedulerConfig,
        store: Store,
        core: SchedulerCore,
        dispatcher: GrpcDispatcher,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.store = store
        self.core = core
        self.dispatcher = dispatcher
        self._clock = clock
        # Starting counts as Redis coming back: the heartbeats may be stale.
        self._grace_until_s = clock() + config.redis_outage_grace_s
        self._is_redis_suspect = False
        self._run_id: str | None = None
        self._unknown_nodes: set[int] = set()
        self._engine_now_s: dict[int, float] = {}
        self._down_since_s: dict[int, float] = {}  # when each node was last seen not live
        self._cancel_slots = asyncio.Semaphore(config.max_concurrent_dispatches)

    def on_redis_error(self) -> None:
        """A loop failed to reach Redis: grant a grace once it answers again."""
        self._is_redis_suspect = True

    @property
    def is_in_grace(self) -> bool:
        return self._clock() < self._grace_until_s

    async def poll(self) -> None:
        """Read the heartbeats once and apply what changed."""
        is_suspect, self._is_redis_suspect = self._is_redis_suspect, False
        run_id = await self.store.server_run_id()
        states = await self.store.get_node_states()
        if is_suspect or (self._run_id is not None and run_id != self._run_id):
            self._grace_until_s = self._clock() + self.config.redis_outage_grace_s
            log.warning(
                "redis_back_node_grace",
                grace_s=self.config.redis_outage_grace_s,
                is_restarted=self._run_id is not None and run_id != self._run_id,
            )
        self._run_id = run_id
        self._warn_out_of_range(states)
        by_node = self.core.tasks_by_node()
        for node_id in range(self.config.num_nodes):
            await self._apply(node_id, states.get(node_id), bool(by_node.get(node_id)))

    async def _apply(self, node_id: int, fields: Fields | None, has_tasks: bool) -> None:
        core = self.core
        # Liveness reads these fields leniently (lemix.infra.store.heartbeat).
        address = (fields or {}).get(ADDRESS_FIELD, "")
        is_live = bool(address) and get_bool(fields or {}, IS_HEALTHY_FIELD, True)
        if is_live:
            self._down_since_s.pop(node_id, None)
            await self.dispatcher.set_address(node_id, address)
            if self._has_restarted(node_id, fields or {}) and has_tasks:
                log.warning("node_restarted", node_id=node_id, address=address)
                await core.on_node_down(node_id, "restarted")
            if node_id not in core.down_nodes:
                return
            failed_s = core.dispatch_failed_s.get(node_id)
            if failed_s is not None and core.clock() - failed_s < self.config.dispatch_retry_s:
                return  # it heartbeats but just failed a dispatch: give it a pause
            if not await self._cancel_revoked(node_id):
                return  # it did not answer: not up yet, try at the next poll
            log.info("node_up", node_id=node_id, address=address)
            await core.on_node_health(node_id, True)
            return
        if fields is None and self.is_in_grace:
            return  # its heartbeat may be missing only because Redis lost it
        why = "went down" if fields is None else "reported itself unhealthy"
        now_s = self._clock()
        down_s = now_s - self._down_since_s.setdefault(node_id, now_s)
        if node_id not in core.down_nodes:
            log.info("node_down", node_id=node_id, why=why)
            await core.on_node_health(node_id, False)
        if has_tasks and down_s >= self.config.node_lost_after_s:
            log.warning("node_lost", node_id=node_id, why=why, down_s=round(down_s, 3))
            # Retried at each poll while tasks are still on it (the progress
            # lookup failed).
            await core.on_node_down(node_id, why)

    def _has_restarted(self, node_id: int, fields: Fields) -> bool:
        try:
            now_s = get_optional_float(fields, NOW_S_FIELD)
        except ValueError:
            return False
        if now_s is None:
            return False
        last_s = self._engine_now_s.get(node_id)
        self._engine_now_s[node_id] = now_s
        return last_s is not None and now_s < last_s - _RESTART_SLACK_S

    async def _cancel_revoked(self, node_id: int) -> bool:
        """Cancel, on `node_id`, every task taken away from it; True when all
        calls were answered (the node is reachable)."""
        task_ids = list(self.core.revoked.get(node_id, ()))
        if not task_ids:
            return True
        reason = f"the scheduler moved this task off node {node_id} while the node was down"
        await self.core.fence_revoked(node_id)  # a Redis error: retried at the next poll

        async def cancel(task_id: str) -> bool:
            async with self._cancel_slots:
                try:
                    await self.dispatcher.cancel(node_id, task_id, reason)
                except Unavailable:
                    return False
                except Exception as exc:  # answered, e.g. INVALID_ARGUMENT: nothing to redo
                    log.warning(
                        "revoke_cancel_failed",
                        node_id=node_id,
                        task_id=task_id,
                        error=f"{type(exc).__name__}: {exc}",
                    )
                return True

        answered = await asyncio.gather(*(cancel(t) for t in task_ids))
        done = [t for t, ok in zip(task_ids, answered, strict=True) if ok]
        self.core.clear_revoked(node_id, done)
        log.info(
            "node_revoked_cancelled",
            node_id=node_id,
            num_cancelled=len(done),
            num_unanswered=len(task_ids) - len(done),
        )
        return len(done) == len(task_ids)

    def _warn_out_of_range(self, states: dict[int, Fields]) -> None:
        for node_id in sorted(set(states) - set(range(self.config.num_nodes))):
            if node_id not in self._unknown_nodes:
                self._unknown_nodes.add(node_id)
                log.warning("node_out_of_range", node_id=node_id, num_nodes=self.config.num_nodes)


class LeaseWatch:
    """Inference tasks streamed by a gateway that holds a lease, checked now and then.

    Only tasks whose gateway's lease was live at intake are watched: one
    submitted straight to the scheduler (no gateway) is never cancelled for
    lacking one. A task read through several gateways (an idempotent retry
    through another) is orphaned only once every one of their leases lapsed;
    the gateway that takes such a retry records itself in the task hash
    (`Store.add_task_gateway`), read back before a task is called orphaned.
    """

    def __init__(
        self, store: Store, check_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.store = store
        self.check_s = check_s
        self._clock = clock
        self._gateways_of: dict[str, set[str]] = {}
        self._next_check_s = clock() + check_s

    def note(self, leased: Sequence[tuple[str, str]]) -> None:
        """Watch these (task id, gateway id) pairs."""
        for task_id, gateway_id in leased:
            self._gateways_of.setdefault(task_id, set()).add(gateway_id)

    def also(self, task_id: str, gateway_id: str) -> None:
        """Another gateway reads a watched task: its lease covers it too (an
        unwatched task stays unwatched)."""
        gateway_ids = self._gateways_of.get(task_id)
        if gateway_ids is not None:
            gateway_ids.add(gateway_id)

    def forget(self, task_id: str) -> None:
        self._gateways_of.pop(task_id, None)

    def gateways_watching(self, task_id: str) -> set[str]:
        """The gateways whose leases keep a watched task (empty: unwatched)."""
        return set(self._gateways_of.get(task_id, ()))

    @property
    def num_watched(self) -> int:
        return len(self._gateways_of)

    async def lapsed(self, is_held: Callable[[str], bool]) -> list[str]:
        """Watched tasks the scheduler still holds whose every gateway's lease
        lapsed; checked (one round trip, one key per gateway) at most every
        `check_s`."""
        now_s = self._clock()
        if now_s < self._next_check_s or not self._gateways_of:
            return []
        self._next_check_s = now_s + self.check_s
        task_ids = sorted(t for t in self._gateways_of if is_held(t))
        gateway_ids = sorted({g for t in task_ids for g in self._gateways_of[t]})
        live = await self._live(gateway_ids)
        lapsed = [t for t in task_ids if not self._gateways_of[t] & live]
        if not lapsed:
            return []
        # A retry through another gateway is recorded by that gateway in the
        # task hash (it writes the intake itself): read before cancelling.
        for task_id, also in (await self.store.also_gateways(lapsed)).items():
            self._gateways_of[task_id] |= also
        extra = sorted({g for t in lapsed for g in self._gateways_of[t]} - set(gateway_ids))
        live |= await self._live(extra)
        return [t for t in lapsed if not self._gateways_of[t] & live]

    async def _live(self, gateway_ids: list[str]) -> set[str]:
        held = await self.store.gateway_leases_held(gateway_ids)
        return {g for g, is_live in zip(gateway_ids, held, strict=True) if is_live}
