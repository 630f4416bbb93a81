"""A task's state as clients see it (`lemix.v1.TaskInfo`), in words.

The gateway answers GetTask / WatchTasks / AuditTasks with `TaskInfo`
messages; the HTTP API (`GET /v1/lemix/tasks/{id}`), `lemix audit --json` and
`lemix replay` show them as JSON objects. This module maps between
the two, so every surface spells states and fields alike. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from lemix._proto.lemix.v1 import common_pb2, gateway_pb2

# State enum number -> its lowercase name ("queued", ..., "cancelled").
STATE_NAMES: dict[int, str] = {
    number: name.removeprefix("TASK_STATE_").lower()
    for name, number in gateway_pb2.TaskState.items()
}
# Every task id ends in exactly one of these (DESIGN.md).
FINAL_STATES = frozenset(
    {
        gateway_pb2.TASK_STATE_COMPLETED,
        gateway_pb2.TASK_STATE_FAILED,
        gateway_pb2.TASK_STATE_REJECTED,
        gateway_pb2.TASK_STATE_CANCELLED,
    }
)
_KIND_NAMES = {
    common_pb2.TASK_KIND_INFERENCE: "inference",
    common_pb2.TASK_KIND_TRAINING: "training",
}


def state_name(state: int) -> str:
    """ "queued", "completed", ...; "unknown" for a number this build does not know."""
    return STATE_NAMES.get(state, "unknown")


def is_final(state: int) -> bool:
    return state in FINAL_STATES


def task_info_to_dict(info: gateway_pb2.TaskInfo) -> dict[str, Any]:
    """`info` as a JSON-safe dict: states and kinds by name, times as epoch
    seconds or null when not recorded, optional fields null when absent."""

    def when(value: float) -> float | None:
        return value if value > 0 else None

    return {
        "task_id": info.task_id,
        "kind": _KIND_NAMES.get(info.kind),
        "state": state_name(info.state),
        "is_final": info.is_final,
        "reason": info.reason,
        "node_id": info.node_id if info.HasField("node_id") else None,
        "submitted_at_s": when(info.submitted_at_s),
        "queued_at_s": when(info.queued_at_s),
        "placed_at_s": when(info.placed_at_s),
        "finished_at_s": when(info.finished_at_s),
        "num_output_tokens": info.num_output_tokens,
        "training_loss": info.training_loss if info.HasField("training_loss") else None,
        "weight_version": info.weight_version if info.HasField("weight_version") else None,
        "inference_loss": info.inference_loss if info.HasField("inference_loss") else None,
    }
