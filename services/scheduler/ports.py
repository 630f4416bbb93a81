"""The scheduler core's ports and the values that cross them.

`SchedulerCore` (core.py) talks to the outside only through a `Dispatcher`
(executor RPCs; adapters.GrpcDispatcher), a `ResultWriter` (Redis;
adapters.RedisResultWriter) and, for fencing, an `AttemptLedger` (Redis; the
same adapter). What a failed Dispatch means is said by the
exception's type: `TaskRefused` (the executor refused this task: the task
ends, the node is fine) or `DispatchError` (the node did not take it: the task
goes elsewhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from lemix.infra.store.task_hash import StoredStatus
from lemix.reasons import ReasonCode, format_reason, reason_code
from lemix.types import Placement, ReplicaAverage, Task, WeightSync


def rejection_reason(reason: str) -> str:
    """A planner rejection's reason as the client sees it, status name first.

    The planner rejects for two causes: no live node (already "UNAVAILABLE:
    ...") and "can never fit", which the protocol names RESOURCE_EXHAUSTED; a
    reason without a prefix would otherwise reach the client as INTERNAL.
    """
    if reason_code(reason) is not None:  # docs/protocol.md, "Task ids and reasons"
        return reason
    return format_reason(ReasonCode.RESOURCE_EXHAUSTED, reason)


class DispatchError(Exception):
    """The node failed to take a placed task: unreachable, no address, timed out.

    `is_maybe_taken`: the call may have reached the executor (its deadline
    passed), so it may run the task; the core revokes it there.
    """

    def __init__(self, message: str, *, is_maybe_taken: bool = False) -> None:
        super().__init__(message)
        self.is_maybe_taken = is_maybe_taken


class TaskRefused(DispatchError):
    """The executor answered and refused THIS task (bad input, can never fit):
    the task ends with `reason`; the node is fine and stays up."""

    def __init__(self, status: str, details: str) -> None:
        super().__init__(f"{status}: {details}")
        self.status = status
        self.details = details

    @property
    def reason(self) -> str:
        return f"{self.status}: {self.details}"


@dataclass(frozen=True, slots=True)
class StateWrite:
    """A task state the core wants stored; kept and retried until it is."""

    task_id: str
    status: str  # a `StoredStatus`: placed | queued (not final) | failed | rejected (final)
    node_id: int | None = None  # for "placed"
    reason: str = ""  # for final states: "STATUS_NAME: text"

    @property
    def is_final(self) -> bool:
        return self.status not in (StoredStatus.PLACED, StoredStatus.QUEUED)


@dataclass(frozen=True, slots=True)
class TaskProgress:
    """What Redis says about a task the core holds (for a node that went down)."""

    is_final: bool  # its end is written (the completion may still be on its way)
    status: str  # its final status when `is_final`
    has_output: bool  # its node produced output for it (inference: streaming began)


class Dispatcher(Protocol):
    async def dispatch(self, placement: Placement, task: Task) -> bool | None:
        """Hand `task` to its node's executor; True when the executor records
        the task's placed state itself (else the core has it written).

        Raises `TaskRefused` when the executor refuses the task, `DispatchError`
        when the node cannot be reached; any other exception is treated as
        "not taken" too.
        """
        ...

    async def sync_weights(self, sync: WeightSync | ReplicaAverage) -> None:
        """Queue a SEPARATE weight sync or a replica average; returns before it runs."""
        ...


class AttemptLedger(Protocol):
    """Attempt numbers in Redis: the fencing tokens of placements
    (docs/protocol.md, "Fencing"). Each call is one round trip."""

    async def begin_attempts(
        self, task_ids: Sequence[str], check_cancelled: Sequence[str]
    ) -> tuple[list[int], list[bool]]:
        """Number a new placement of each task, before its Dispatch (the
        attempts, in order), and tell which of `check_cancelled` were cancelled."""
        ...

    async def fence(self, taken: Sequence[tuple[str, int]]) -> list[TaskProgress]:
        """Make each (task_id, attempt) stale unless the task was placed again
        since (its executor's writes stop landing), and read, in the same
        atomic step, what it left."""
        ...


class ResultWriter(Protocol):
    async def write_states(self, writes: Sequence[StateWrite]) -> None:
        """Store task states (final ones with the client's end message); raise
        on failure, then every write is retried (each is idempotent)."""
        ...

    async def progress(self, task_ids: Sequence[str]) -> list[TaskProgress]:
        """Per task, in order, what Redis knows of its end and output."""
        ...
