"""Per-task truth: what GetTask, WatchTasks, AuditTasks and the HTTP task route
answer, read from Redis where the other services record a task's life.

Who writes what (docs/protocol.md, "Task states"):

===================  ==============================================  ==================
written by           when                                            task hash fields
===================  ==============================================  ==================
scheduler Submit     durable in the intake (the ack to the gateway)  none yet: the
                                                                     dedupe marker
scheduler intake     taken from the intake                           task fields,
                                                                     ``status=queued``,
                                                                     ``submit_t``,
                                                                     ``queued_t``
executor sink        its first write after taking it (the            ``status=placed``,
                     scheduler's, for an executor that does not      ``node_id``,
                     record it)                                      ``placed_t``
executor sink        first output                                    none: the output
                                                                     stream appears
executor sink /      final (`Store.finish_task`)                     ``status``,
scheduler                                                            ``reason``,
                                                                     ``is_final=1``,
                                                                     ``finish_t``, ...
===================  ==============================================  ==================

So a task is QUEUED from the moment Submit acknowledged it (dedupe marker, no
hash yet) until placed; PLACED once an executor took it; RUNNING once its
output stream exists (inference only: training writes no output until its
end, so it shows PLACED until final); final as `finish_task` recorded it, a
``failed`` whose reason starts with ``CANCELLED:`` being CANCELLED. An id with
neither hash nor marker is unknown (never acknowledged, or expired).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lemix._proto.lemix.v1 import common_pb2, gateway_pb2
from lemix.infra.rpc.errors import InvalidArgument, NotFound, Unavailable
from lemix.infra.store.codec import Fields, get_optional_float, get_optional_int
from lemix.infra.store.store import Store
from lemix.infra.store.task_hash import (
    FINISH_T_FIELD,
    IS_FINAL_FIELD,
    NODE_ID_FIELD,
    NUM_OUTPUT_TOKENS_FIELD,
    REASON_FIELD,
    STATUS_FIELD,
    SUBMIT_T_FIELD,
    WEIGHT_VERSION_FIELD,
    StoredStatus,
)
from lemix.infra.store.tasks import StoredTask
from lemix.infra.task_states import FINAL_STATES
from lemix.reasons import ReasonCode, reason_code

T = TypeVar("T")

# WatchTasks: ids per call (one pipelined round trip of 3 commands per id per
# poll), and how often it polls.
MAX_WATCH_TASKS = 10_000
DEFAULT_POLL_INTERVAL_S = 0.2
MIN_POLL_INTERVAL_S = 0.05
# AuditTasks: tasks per reply, and SCAN's keys-per-step hint.
DEFAULT_AUDIT_LIMIT = 1_000
MAX_AUDIT_LIMIT = 100_000
AUDIT_SCAN_COUNT = 1_000

# Longest task id looked up: a client's request id (at most 128 characters)
# plus its client-scope suffix (``@<12 hex>``, gateway.validate), with room.
MAX_TASK_ID_CHARS = 256
IN_INTAKE_REASON = "in the intake stream: no scheduler has taken it yet"
# The state-hash fields a TaskInfo is built from (never the payload).
INFO_FIELDS = (
    "kind",
    STATUS_FIELD,
    REASON_FIELD,
    IS_FINAL_FIELD,
    NODE_ID_FIELD,
    SUBMIT_T_FIELD,
    "queued_t",
    "placed_t",
    FINISH_T_FIELD,
    NUM_OUTPUT_TOKENS_FIELD,
    "training_loss",
    WEIGHT_VERSION_FIELD,
    "inference_loss",
)

_STATUS_STATES: dict[str, gateway_pb2.TaskState] = {
    StoredStatus.QUEUED: gateway_pb2.TASK_STATE_QUEUED,
    StoredStatus.REQUEUED: gateway_pb2.TASK_STATE_QUEUED,  # training handed back
    StoredStatus.PLACED: gateway_pb2.TASK_STATE_PLACED,
    StoredStatus.COMPLETED: gateway_pb2.TASK_STATE_COMPLETED,
    StoredStatus.FAILED: gateway_pb2.TASK_STATE_FAILED,
    StoredStatus.REJECTED: gateway_pb2.TASK_STATE_REJECTED,
    # Not written today; a hash holding one reads as that state.
    "running": gateway_pb2.TASK_STATE_RUNNING,
    "cancelled": gateway_pb2.TASK_STATE_CANCELLED,
}
_KINDS = {"inference": common_pb2.TASK_KIND_INFERENCE, "training": common_pb2.TASK_KIND_TRAINING}


def _state_of(fields: Fields, has_output: bool) -> gateway_pb2.TaskState:
    status = fields.get(STATUS_FIELD, "")
    state = _STATUS_STATES.get(status)
    if fields.get(IS_FINAL_FIELD) == "1" and state not in FINAL_STATES:
        state = gateway_pb2.TASK_STATE_FAILED  # final with a status this build does not know
    if state is None:  # a transient status this build does not know: not final, not placed
        state = gateway_pb2.TASK_STATE_QUEUED
    is_cancelled = reason_code(fields.get(REASON_FIELD, "")) is ReasonCode.CANCELLED
    if state == gateway_pb2.TASK_STATE_FAILED and is_cancelled:
        return gateway_pb2.TASK_STATE_CANCELLED
    if state == gateway_pb2.TASK_STATE_PLACED and has_output:
        return gateway_pb2.TASK_STATE_RUNNING
    return state


def task_info(task_id: str, stored: StoredTask) -> gateway_pb2.TaskInfo | None:
    """The TaskInfo of what Redis holds for `task_id`; None when it is unknown."""
    fields = stored.fields
    if not fields:
        if not stored.is_submitted:
            return None
        return gateway_pb2.TaskInfo(
            task_id=task_id, state=gateway_pb2.TASK_STATE_QUEUED, reason=IN_INTAKE_REASON
        )
    state = _state_of(fields, stored.has_output)
    info = gateway_pb2.TaskInfo(
        task_id=task_id,
        kind=_KINDS.get(fields.get("kind", ""), common_pb2.TASK_KIND_UNSPECIFIED),
        state=state,
        reason=fields.get(REASON_FIELD, ""),
        is_final=state in FINAL_STATES,
        submitted_at_s=get_optional_float(fields, SUBMIT_T_FIELD) or 0.0,
        queued_at_s=get_optional_float(fields, "queued_t") or 0.0,
        placed_at_s=get_optional_float(fields, "placed_t") or 0.0,
        finished_at_s=get_optional_float(fields, FINISH_T_FIELD) or 0.0,
        num_output_tokens=get_optional_int(fields, NUM_OUTPUT_TOKENS_FIELD) or 0,
    )
    node_id = get_optional_int(fields, NODE_ID_FIELD)
    if node_id is not None:
        info.node_id = node_id
    for name in ("training_loss", "inference_loss"):
        value = get_optional_float(fields, name)
        if value is not None and math.isfinite(value):
            setattr(info, name, value)
    version = get_optional_int(fields, WEIGHT_VERSION_FIELD)
    if version is not None:
        info.weight_version = version
    return info


def unknown_info(task_id: str) -> gateway_pb2.TaskInfo:
    return gateway_pb2.TaskInfo(task_id=task_id, state=gateway_pb2.TASK_STATE_UNKNOWN)


def submitted_at_s(info: gateway_pb2.TaskInfo) -> float | None:
    """When the task became durable (or the earliest time recorded), epoch s."""
    times = (info.submitted_at_s, info.queued_at_s, info.placed_at_s)
    return next((t for t in times if t > 0), None)


def check_task_id(what: str, task_id: str) -> str:
    """`task_id` if well formed (non-empty, at most `MAX_TASK_ID_CHARS`
    printable characters, no whitespace), else `InvalidArgument`."""
    if not task_id:
        raise InvalidArgument(f"{what} is empty: pass a task id (from Train or Generate)")
    if len(task_id) > MAX_TASK_ID_CHARS:
        raise InvalidArgument(
            f"{what} is {len(task_id)} characters; task ids have at most {MAX_TASK_ID_CHARS}"
        )
    if any(ch.isspace() or not ch.isprintable() for ch in task_id):
        raise InvalidArgument(
            f"{what} must not contain whitespace or control characters: {task_id!r}"
        )
    return task_id


class TaskReader:
    """Reads task states from a `Store`. `clock` is wall-clock epoch seconds
    (the services stamp task times with it); `sleep` waits between polls."""

    def __init__(
        self,
        store: Store,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.store = store
        self.clock = clock
        self.sleep = sleep

    async def get(self, task_id: str) -> gateway_pb2.TaskInfo:
        """The task's state; raises InvalidArgument, NotFound or Unavailable."""
        check_task_id("task_id", task_id)
        (stored,) = await self._redis(self.store.get_task_states([task_id], INFO_FIELDS))
        info = task_info(task_id, stored)
        if info is None:
            raise NotFound(
                f"task {task_id!r} is unknown: this stack never acknowledged it, "
                "or its record expired"
            )
        return info

    async def get_many(self, task_ids: Sequence[str]) -> list[gateway_pb2.TaskInfo]:
        """States in order (UNKNOWN for an unknown id), one round trip."""
        stored = await self._redis(self.store.get_task_states(task_ids, INFO_FIELDS))
        return [
            task_info(task_id, s) or unknown_info(task_id)
            for task_id, s in zip(task_ids, stored, strict=True)
        ]

    async def watch(
        self, request: gateway_pb2.WatchTasksRequest, time_remaining_s: Callable[[], float | None]
    ) -> AsyncGenerator[gateway_pb2.TaskInfo, None]:
        """WatchTasks: every task's state once, then each change, until all are
        final or the time is up (`request.timeout_s`, or `time_remaining_s()`,
        the call's deadline, None for none). Raises InvalidArgument/Unavailable."""
        task_ids = check_watch_ids(request.task_ids)
        poll_s = _poll_interval_s(request.poll_interval_s)
        if not math.isfinite(request.timeout_s) or request.timeout_s < 0:
            raise InvalidArgument(
                f"timeout_s must be >= 0 (0 = the call's deadline), got {request.timeout_s}"
            )
        end_s = time.monotonic() + request.timeout_s if request.timeout_s else math.inf
        last: dict[str, gateway_pb2.TaskInfo] = {}
        pending = list(task_ids)
        while True:
            infos = await self.get_many(pending)
            for info in infos:
                if last.get(info.task_id) != info:
                    last[info.task_id] = info
                    yield info
            pending = [info.task_id for info in infos if not info.is_final]
            remaining_s = time_remaining_s()
            left_s = min(end_s - time.monotonic(), math.inf if remaining_s is None else remaining_s)
            if not pending or left_s <= poll_s:
                return
            await self.sleep(poll_s)

    async def audit(self, request: gateway_pb2.AuditRequest) -> gateway_pb2.AuditReply:
        """AuditTasks: non-final tasks submitted at least `min_age_s` ago, oldest
        first, from the task hashes (SCAN) and the intake stream."""
        min_age_s = request.min_age_s
        if not math.isfinite(min_age_s) or min_age_s < 0:
            raise InvalidArgument(f"min_age_s must be a number >= 0, got {min_age_s}")
        limit = request.limit or DEFAULT_AUDIT_LIMIT
        if limit > MAX_AUDIT_LIMIT:
            raise InvalidArgument(f"limit is {limit}; at most {MAX_AUDIT_LIMIT}")
        cutoff_s = self.clock() - min_age_s
        oldest = _Oldest(limit)
        num_scanned = 0
        cursor = 0
        while True:
            cursor, batch = await self._redis(
                self.store.scan_task_states(cursor, INFO_FIELDS, AUDIT_SCAN_COUNT)
            )
            num_scanned += len(batch)
            for task_id, fields in batch:
                if task_id in oldest.task_ids:
                    continue  # SCAN may return a key twice
                info = task_info(task_id, StoredTask(fields, False, False))
                if info is None or info.is_final:
                    continue
                at_s = submitted_at_s(info)
                if at_s is None or at_s <= cutoff_s:  # no time recorded: old by default
                    oldest.add(at_s or 0.0, info)
            if cursor == 0:
                break
        # Submitted but never taken by a scheduler: still in the intake, oldest
        # first (a task briefly in both is counted from its hash). Entry ids
        # are Redis's clock, submit times the scheduler's: judge by the latter.
        entries = await self._redis(self.store.read_intake_entries(count=limit + 1))
        num_scanned += len(entries)
        candidates: list[tuple[str, float, Fields]] = []
        for entry_id, fields in entries:
            task_id = fields.get("task_id", "")
            at_s = get_optional_float(fields, SUBMIT_T_FIELD) or _entry_time_s(entry_id)
            if task_id and task_id not in oldest.task_ids and at_s <= cutoff_s:
                candidates.append((task_id, at_s, fields))
        # An entry outlives its task's end until the scheduler's ack deletes
        # it (acks wait to be shared: `intake_ack_delay_s`): a final task is
        # not "in the intake" (one pipelined read, at most `limit` + 1 ids).
        states = await self._redis(
            self.store.get_task_states([c[0] for c in candidates], [IS_FINAL_FIELD])
        )
        for (task_id, at_s, fields), state in zip(candidates, states, strict=True):
            if state.fields.get(IS_FINAL_FIELD) != "1":
                oldest.add(
                    at_s,
                    gateway_pb2.TaskInfo(
                        task_id=task_id,
                        kind=_KINDS.get(fields.get("kind", ""), common_pb2.TASK_KIND_UNSPECIFIED),
                        state=gateway_pb2.TASK_STATE_QUEUED,
                        reason=IN_INTAKE_REASON,
                        submitted_at_s=at_s,
                    ),
                )
        tasks = oldest.take()
        return gateway_pb2.AuditReply(
            tasks=tasks,
            num_scanned=num_scanned,
            # limit+1 intake entries read: if all matched, num_matched says so.
            is_truncated=oldest.num_matched > len(tasks),
        )

    async def _redis(self, awaitable: Awaitable[T]) -> T:
        try:
            return await awaitable
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise Unavailable(f"state store (Redis) unavailable: {exc}; retry later") from exc


def check_watch_ids(task_ids: Sequence[str]) -> list[str]:
    """WatchTasks' ids, checked: 1..MAX_WATCH_TASKS well-formed, distinct ids."""
    if not task_ids:
        raise InvalidArgument("task_ids is empty: pass the ids to watch")
    if len(task_ids) > MAX_WATCH_TASKS:
        raise InvalidArgument(
            f"{len(task_ids)} task ids; at most {MAX_WATCH_TASKS} per call "
            "(split them over several calls)"
        )
    seen: set[str] = set()
    for i, task_id in enumerate(task_ids):
        check_task_id(f"task_ids[{i}]", task_id)
        if task_id in seen:
            raise InvalidArgument(f"task_ids[{i}] {task_id!r} repeats an earlier id")
        seen.add(task_id)
    return list(task_ids)


class _Oldest:
    """The `limit` oldest of many (at_s, TaskInfo), in bounded memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_matched = 0
        self.task_ids: set[str] = set()  # every id added (for de-duplication)
        self._items: list[tuple[float, str, gateway_pb2.TaskInfo]] = []

    def add(self, at_s: float, info: gateway_pb2.TaskInfo) -> None:
        self.num_matched += 1
        self.task_ids.add(info.task_id)
        self._items.append((at_s, info.task_id, info))
        if len(self._items) >= 2 * self.limit:
            self._items = self._sorted()[: self.limit]

    def take(self) -> list[gateway_pb2.TaskInfo]:
        return [info for _, _, info in self._sorted()[: self.limit]]

    def _sorted(self) -> list[tuple[float, str, gateway_pb2.TaskInfo]]:
        return sorted(self._items, key=lambda item: (item[0], item[1]))


def _poll_interval_s(value: float) -> float:
    if not value:
        return DEFAULT_POLL_INTERVAL_S
    if not math.isfinite(value) or value < MIN_POLL_INTERVAL_S:
        raise InvalidArgument(
            f"poll_interval_s must be >= {MIN_POLL_INTERVAL_S} "
            f"(0 = {DEFAULT_POLL_INTERVAL_S}), got {value}"
        )
    return value


def _entry_time_s(entry_id: str) -> float:
    """A stream entry id's time part ("<ms>-<seq>") in epoch seconds."""
    return int(entry_id.partition("-")[0]) / 1000.0
