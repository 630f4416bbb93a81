"""The scheduler core's state and its bookkeeping (`SchedulerCore`'s base).

`CoreBase` holds what the core knows (the tasks it holds, their attempts and
moves, the nodes it has down, the revoked placements, the state writes not
yet stored) with the queries on it and the small steps every input uses:
forget a task, note or end its state, revoke a placement, set a node's
health, plan, move a rolled-back task, and store the noted writes.
`services.scheduler.placing` adds sending placements; `services.scheduler.
core` the inputs. One class in three modules: see `SchedulerCore`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from lemix.infra import telemetry
from lemix.infra.store.task_hash import StoredStatus
from lemix.planner.recording import RecordingPlanner
from lemix.types import Decision, Task
from services.scheduler.ports import AttemptLedger, Dispatcher, ResultWriter, StateWrite

log = structlog.get_logger(__name__)

DEFAULT_MAX_CONCURRENT_DISPATCHES = 32
DEFAULT_MAX_TASK_MOVES = 3
# Revoked ids remembered per node (oldest dropped): a node gone for good must
# not grow the scheduler's memory without bound.
_MAX_REVOKED_PER_NODE = 100_000
# Cancels of tasks not held yet, kept for the intake (oldest dropped past it:
# their cancel markers in Redis remain, for a restart's intake check).
_MAX_CANCEL_ON_TAKE = 100_000


class CoreBase:
    """The core's state, queries and bookkeeping (module doc); the
    constructor's arguments are `SchedulerCore`'s."""

    def __init__(
        self,
        planner: RecordingPlanner,
        dispatcher: Dispatcher,
        writer: ResultWriter,
        clock: Callable[[], float],
        *,
        on_forget: Callable[[str], None] | None = None,
        ledger: AttemptLedger | None = None,
        policy: str = "",
        max_concurrent_dispatches: int = DEFAULT_MAX_CONCURRENT_DISPATCHES,
        max_task_moves: int = DEFAULT_MAX_TASK_MOVES,
    ) -> None:
        if max_concurrent_dispatches < 1:
            raise ValueError(
                f"max_concurrent_dispatches must be >= 1, got {max_concurrent_dispatches}"
            )
        if max_task_moves < 0:
            raise ValueError(f"max_task_moves must be >= 0, got {max_task_moves}")
        self.planner = planner
        self.policy = policy
        self.dispatcher = dispatcher
        self.writer = writer
        self.clock = clock
        self.max_task_moves = max_task_moves
        self._lock = asyncio.Lock()  # planner inputs, one at a time (services.scheduler.core)
        self._flush_lock = asyncio.Lock()
        self._num_batches_out = 0  # batches of Dispatches sent, not yet settled
        self._is_plan_due = False  # a plan was put off while one was out
        self._dispatch_slots = asyncio.Semaphore(max_concurrent_dispatches)
        self._tasks: dict[str, Task] = {}  # placed, deferred or queued; not finished
        self._num_moves: dict[str, int] = {}  # re-placements so far, by task id
        self._attempts: dict[str, int] = {}  # attempt of the latest placement, by task id
        # Attempts numbered in the task hash ahead of the placement they are
        # for (at intake), by task id; the placement takes it instead of
        # numbering one itself.
        self._numbered: dict[str, int] = {}
        self._is_replan_due = False  # placements rolled back for want of Redis
        self._unwritten: dict[str, StateWrite] = {}  # latest state per task, not yet stored
        # Cancelled while the core did not hold them (`cancel_on_take`): the
        # reason each ends with when an intake batch hands it over after all.
        self._cancel_on_take: dict[str, str] = {}
        self.num_placed = 0
        self.num_rejected = 0
        self.num_dispatch_failures = 0
        self.num_refused = 0
        self.num_moved = 0
        # Nodes the planner has down, and when (planner time) a failed dispatch
        # took one down: the service re-admits it only after a pause.
        self.down_nodes: set[int] = set()
        self.dispatch_failed_s: dict[int, float] = {}
        # Tasks taken away from each node, with the attempt taken (insertion
        # ordered): the service cancels them there before the node gets work again.
        self.revoked: dict[int, dict[str, int]] = {}
        self.wakeup = asyncio.Event()  # set when the next timer may have changed
        self._on_forget = on_forget
        self._ledger = ledger

    # ------------------------------------------------------------ queries

    def knows(self, task_id: str) -> bool:
        return task_id in self._tasks

    def node_of(self, task_id: str) -> int | None:
        """The node a task is placed on, or None (queued, deferred or unknown)."""
        return self.planner.node_of(task_id)

    def task(self, task_id: str) -> Task | None:
        return self._tasks.get(task_id)

    def attempt_of(self, task_id: str) -> int:
        """The attempt number of the task's latest placement (0: none known)."""
        return self._attempts.get(task_id, 0)

    @property
    def num_tasks(self) -> int:
        return len(self._tasks)

    @property
    def num_unwritten(self) -> int:
        """State writes waiting for Redis."""
        return len(self._unwritten)

    def tasks_by_node(self) -> dict[int, list[str]]:
        """The held tasks placed on each node (nodes with none are absent)."""
        by_node: dict[int, list[str]] = {}
        for task_id in self._tasks:
            node_id = self.node_of(task_id)
            if node_id is not None:
                by_node.setdefault(node_id, []).append(task_id)
        return by_node

    @property
    def num_deferred(self) -> int:
        """Training the planner holds back for now (deferred, not rejected)."""
        return self.planner.num_deferred

    def next_wakeup_s(self) -> float | None:
        """When (planner time) deferred work must be looked at again, or None."""
        return self.planner.next_wakeup_s()

    @property
    def is_release_pending(self) -> bool:
        """The last plan stopped at its training cap: plan again at once."""
        return self.planner.is_release_pending

    # ------------------------------------------------------------ internals

    def cancel_on_take(self, task_id: str, reason: str) -> None:
        """End `task_id` with `reason` instead of planning it if an intake
        batch hands it over later. For a Cancel of a task the core does not
        hold: the intake may have read its entry before the cancel marker was
        written and be about to hand it over (no I/O)."""
        if task_id in self._tasks:
            return
        self._cancel_on_take[task_id] = reason
        if len(self._cancel_on_take) > _MAX_CANCEL_ON_TAKE:
            del self._cancel_on_take[next(iter(self._cancel_on_take))]

    def _forget(self, task_id: str) -> None:
        self._num_moves.pop(task_id, None)
        self._attempts.pop(task_id, None)
        self._numbered.pop(task_id, None)
        if self._tasks.pop(task_id, None) is not None and self._on_forget is not None:
            self._on_forget(task_id)

    def _note(self, write: StateWrite) -> None:
        self._unwritten[write.task_id] = write  # a later state supersedes an unstored one

    def _end(self, task_id: str, status: StoredStatus, reason: str) -> None:
        self._forget(task_id)
        self._note(StateWrite(task_id, status, reason=reason))

    def _revoke(self, node_id: int, task_id: str) -> None:
        held = self.revoked.setdefault(node_id, {})
        held[task_id] = self._attempts.get(task_id, 0)  # before it is placed again
        if len(held) > _MAX_REVOKED_PER_NODE:
            del held[next(iter(held))]

    def _set_health(self, node_id: int, is_healthy: bool, now_s: float) -> None:
        self.planner.on_node_health(node_id, is_healthy, now_s)
        telemetry.set_node_health(node_id, is_healthy)
        if is_healthy:
            self.down_nodes.discard(node_id)
            self.dispatch_failed_s.pop(node_id, None)
        else:
            self.down_nodes.add(node_id)

    def _plan(self, now_s: float) -> list[Decision]:
        """The planner's decisions now; its wall time is the decision latency."""
        start_s = time.perf_counter()
        decisions = self.planner.plan(now_s)
        telemetry.observe_decision(time.perf_counter() - start_s)
        return decisions

    def _move(self, task: Task, now_s: float, why: str) -> bool:
        """Submit a rolled-back task again, or end it once it has moved too often.

        True when it went back to the planner (a plan must follow).
        """
        num_moves = self._num_moves.get(task.task_id, 0) + 1
        if num_moves > self.max_task_moves:
            log.warning("task_gave_up", task_id=task.task_id, num_moves=num_moves - 1, why=why)
            self._end(
                task.task_id,
                StoredStatus.FAILED,
                f"{why}; gave up after placing it {num_moves} times",
            )
            return False
        self._num_moves[task.task_id] = num_moves
        self.num_moved += 1
        self.planner.submit(task, now_s)
        self._note(StateWrite(task.task_id, StoredStatus.QUEUED))
        return True

    async def _flush_writes(self) -> None:
        # One flush at a time, so a later state of a task is never stored
        # before an earlier one that is still on its way.
        async with self._flush_lock:
            await self._flush_writes_now()

    async def _flush_writes_now(self) -> None:
        if not self._unwritten:
            return
        writes = list(self._unwritten.values())
        try:
            await self.writer.write_states(writes)
        except Exception as exc:
            log.warning(
                "state_writes_deferred",
                num_writes=len(writes),
                error=f"{type(exc).__name__}: {exc}",
            )
            return
        for write in writes:
            if self._unwritten.get(write.task_id) is write:
                del self._unwritten[write.task_id]
