"""Failure reasons: ``"<CODE>: text"``, where CODE names the gRPC status a
client gets for it (docs/protocol.md, "Task ids and reasons"). The engine and
the planner write them; the store, the gateway and the scheduler read them."""

from __future__ import annotations

from enum import StrEnum


class ReasonCode(StrEnum):
    """The status name a failure reason starts with (``"UNAVAILABLE: text"``;
    docs/protocol.md, "Task ids and reasons"): gRPC status code names."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"


# In a RESOURCE_EXHAUSTED reason for a task too large for any node (the
# planner's): the client's fault, not the cluster's (no SLO miss).
NEVER_FITS = "too large for any node"


def format_reason(code: ReasonCode, text: str) -> str:
    """``"CODE: text"``, the form every writer of a reason uses."""
    return f"{code}: {text}"


def reason_code(reason: str) -> ReasonCode | None:
    """The code a reason starts with (the text before its first ``:``, blanks
    stripped); None when it has no known one."""
    prefix, sep, _ = reason.partition(":")
    if not sep:
        return None
    try:
        return ReasonCode(prefix.strip())
    except ValueError:
        return None
