"""The final accounting of `lemix replay`: every task's final state, by id.

`TaskWatch.run` reads, through the gateway's WatchTasks, the state of every id
whose outcome the client cannot vouch for: training ids (Train acknowledged
them, their ends happen in the stack) and inference tasks whose stream did not
complete (failed, refused or never answered: the stack may still hold them). A
completed stream needs no look-up: its end message is written atomically with
the task's final state (`Store.finish_task`).

It first takes one snapshot of each id (WatchTasks with a tiny timeout: one
poll), then watches the ids still open until the deadline, in calls of at most
`MAX_IDS_PER_CALL` ids; a failed call (the gateway is gone) is retried until
the deadline and its error kept, so the ids it could not look up are reported
with the reason. `settle` then turns what was seen into each `TaskRecord`'s
status: a task with no final state stays ``status=None`` (lost).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio

from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc
from lemix.infra.task_states import is_final, state_name
from lemix.types import TaskKind, TaskRecord, TaskStatus

MAX_IDS_PER_CALL = 10_000  # the gateway's WatchTasks bound
MAX_CONCURRENT_CALLS = 4
SNAPSHOT_TIMEOUT_S = 0.001  # WatchTasks answers every id's state once, then ends
RETRY_S = 0.5  # after a failed call, before the next try

_STATUS_OF_STATE = {
    gateway_pb2.TASK_STATE_COMPLETED: TaskStatus.COMPLETED,
    gateway_pb2.TASK_STATE_REJECTED: TaskStatus.REJECTED,
    gateway_pb2.TASK_STATE_FAILED: TaskStatus.FAILED,
    gateway_pb2.TASK_STATE_CANCELLED: TaskStatus.FAILED,  # with its "CANCELLED: ..." reason
}


@dataclass
class Tracked:
    """One replayed task: its metrics record and the ids the stack knows it by."""

    record: TaskRecord
    stack_ids: list[str]  # inference: its request id; training: what Train returned
    is_acknowledged: bool = False  # Train returned its ids: the stack must end each
    client_error: str = ""  # an unexpected client-side failure of its call
    # Filled by `settle`: the ids with no final state.
    lost_ids: list[str] = field(default_factory=list)

    @property
    def needs_lookup(self) -> bool:
        """False only for a completed inference stream (final by construction)."""
        return not (
            self.record.kind is TaskKind.INFERENCE and self.record.status is TaskStatus.COMPLETED
        )

    @property
    def is_unknown_an_answer(self) -> bool:
        """An id the stack does not know is settled by the client's own outcome
        (a refused or failed call that never reached the scheduler)."""
        return self.record.kind is TaskKind.INFERENCE and self.record.status is not None


class TaskWatch:
    """Looks ids up through a Gateway stub; `infos` holds the last state seen."""

    def __init__(
        self,
        stub: gateway_pb2_grpc.GatewayStub,
        *,
        lookup_deadline_s: float,
        max_ids_per_call: int = MAX_IDS_PER_CALL,
    ) -> None:
        self.stub = stub
        self.lookup_deadline_s = lookup_deadline_s
        self.max_ids_per_call = max_ids_per_call
        self.infos: dict[str, gateway_pb2.TaskInfo] = {}
        self.last_error = ""  # the last failed call's status, for the lost ids' reason
        self._settled_if_unknown: set[str] = set()

    async def run(self, items: Sequence[Tracked], deadline_s: float) -> None:
        """Look up every id that needs it until each is settled or `deadline_s`
        (monotonic) passes; never raises for a failed call."""
        ids: list[str] = []
        for item in items:
            if item.needs_lookup:
                ids.extend(item.stack_ids)
                if item.is_unknown_an_answer:
                    self._settled_if_unknown.update(item.stack_ids)
        while True:
            unseen = [task_id for task_id in ids if task_id not in self.infos]
            if unseen:
                await self._poll(unseen, SNAPSHOT_TIMEOUT_S)
            still_open = [task_id for task_id in ids if self.is_open(task_id)]
            left_s = deadline_s - time.monotonic()
            if not still_open or left_s <= 0:
                return
            is_ok = await self._poll([i for i in still_open if i in self.infos], left_s)
            if not is_ok or any(task_id not in self.infos for task_id in still_open):
                await asyncio.sleep(min(RETRY_S, max(0.0, deadline_s - time.monotonic())))

    def is_open(self, task_id: str) -> bool:
        """Not yet known to be settled: unseen, not final, or unknown to the stack
        where only the stack can answer."""
        info = self.infos.get(task_id)
        if info is None:
            return True
        if info.state == gateway_pb2.TASK_STATE_UNKNOWN:
            return task_id not in self._settled_if_unknown
        return not is_final(info.state)

    async def _poll(self, task_ids: list[str], timeout_s: float) -> bool:
        """WatchTasks over `task_ids` in bounded calls; False if any call failed."""
        if not task_ids:
            return True
        limit = asyncio.Semaphore(MAX_CONCURRENT_CALLS)
        chunks = [
            task_ids[i : i + self.max_ids_per_call]
            for i in range(0, len(task_ids), self.max_ids_per_call)
        ]

        async def call(chunk: list[str]) -> bool:
            async with limit:
                return await self._watch(chunk, timeout_s)

        return all(await asyncio.gather(*(call(chunk) for chunk in chunks)))

    async def _watch(self, task_ids: list[str], timeout_s: float) -> bool:
        request = gateway_pb2.WatchTasksRequest(task_ids=task_ids, timeout_s=timeout_s)
        try:
            async for info in self.stub.WatchTasks(
                request, timeout=timeout_s + self.lookup_deadline_s
            ):
                self.infos[info.task_id] = info
        except grpc.aio.AioRpcError as err:
            self.last_error = f"{err.code().name}: {err.details()}"
            return False
        except Exception as exc:  # the channel itself broke: same as a failed call
            self.last_error = f"{type(exc).__name__}: {exc}"
            return False
        return True


def settle(item: Tracked, watch: TaskWatch, *, t0_epoch_s: float, end_s: float) -> list[str]:
    """Set `item.record`'s final status from the client's outcome and the states
    `watch` saw; returns (and keeps in `item.lost_ids`) the ids with no final
    state. A record with a lost id ends with ``status=None`` (lost) and a reason
    naming what was last seen. `t0_epoch_s` is the epoch time of the run's
    time origin; `end_s` the run's end on its clock."""
    record = item.record
    if not item.needs_lookup:
        return []
    if not item.stack_ids:  # Train was refused, failed, or never answered
        if record.status is None:
            item.lost_ids = [record.task_id]
            record.reason = item.client_error or "Train got no answer within the deadline"
        return item.lost_ids
    infos = [watch.infos.get(task_id) for task_id in item.stack_ids]
    lost = [
        (task_id, info)
        for task_id, info in zip(item.stack_ids, infos, strict=True)
        if watch.is_open(task_id)
    ]
    if lost:
        item.lost_ids = [task_id for task_id, _ in lost]
        record.status = None
        record.reason = "no final state: " + "; ".join(
            _why_open(task_id, info, watch.last_error) for task_id, info in lost
        )
        return item.lost_ids
    if record.kind is TaskKind.INFERENCE:
        (info,) = infos
        if record.status is None and info is not None:  # the stack ended it; we got no answer
            record.status = TaskStatus.FAILED
            record.reason = (item.client_error or "no answer reached the client") + (
                f"; the stack recorded it {state_name(info.state)}: {info.reason}"
            )
            record.finish_s = end_s
        return []
    _settle_training(record, [info for info in infos if info is not None], t0_epoch_s, end_s)
    return []


def _settle_training(
    record: TaskRecord, infos: list[gateway_pb2.TaskInfo], t0_epoch_s: float, end_s: float
) -> None:
    failed = [info for info in infos if info.state != gateway_pb2.TASK_STATE_COMPLETED]
    if failed:
        record.status = _STATUS_OF_STATE.get(failed[0].state, TaskStatus.FAILED)
        record.reason = failed[0].reason or state_name(failed[0].state)
    else:
        record.status = TaskStatus.COMPLETED
    finished = [info.finished_at_s - t0_epoch_s for info in infos if info.finished_at_s > 0]
    record.finish_s = max(finished) if finished else end_s
    placed = [info.placed_at_s - t0_epoch_s for info in infos if info.placed_at_s > 0]
    if placed:
        record.placed_s = min(placed)
    nodes = [info.node_id for info in infos if info.HasField("node_id")]
    if nodes:
        record.node_id = nodes[0]


def _why_open(task_id: str, info: gateway_pb2.TaskInfo | None, last_error: str) -> str:
    if info is None:
        return f"{task_id} could not be looked up ({last_error or 'no answer'})"
    if info.state == gateway_pb2.TASK_STATE_UNKNOWN:
        return f"{task_id} is unknown to the stack"
    where = f" on node {info.node_id}" if info.HasField("node_id") else ""
    return f"{task_id} last seen {state_name(info.state)}{where}"
