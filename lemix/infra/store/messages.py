"""Stream messages between the services: output messages and completion entries.

Output stream ``ns:out:<task_id>`` (docs/protocol.md, "Flow of one inference
request"): the executor's sink appends token messages and the ``end`` message
(the scheduler writes an ``end`` too when it ends a task itself); the gateway's
`OutputStream` reads them. `Store.finish_task` adds `task_hash.final_fields`
(status, reason, ``is_final=1``) to the ``end`` message. A real model adds the
optional fields of `lemix.outputs` (token ids, finish reason) and
`LOSS_FIELD`.

Completions stream ``ns:completions``: the executor reports each task's end
(`completion_fields`); the scheduler, its one reader, applies them
(`completion_from_fields`).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import NamedTuple

from lemix.infra.store.codec import FieldValue, get_float, get_optional_int
from lemix.infra.store.task_hash import (
    ATTEMPT_FIELD,
    NODE_ID_FIELD,
    REASON_FIELD,
    STATUS_FIELD,
    TASK_ID_FIELD,
)

# ------------------------------------------------------------ output messages

TYPE_FIELD = "type"  # an `OutputType`
NUM_TOKENS_FIELD = "n"  # tokens produced so far (a redelivered message repeats it)
IS_FIRST_FIELD = "first"  # "1" on the first token message
NODE_FIELD = "node"  # the node id that produced it
VERSION_FIELD = "version"  # training updates in the serving weights (first token)
T_FIELD = "t"  # epoch s when written
LOSS_FIELD = "inference_loss"  # optional, on the end message when a reference was given
ACCURACY_FIELD = "reference_accuracy"  # optional, beside LOSS_FIELD: top-1 accuracy on it


class OutputType(StrEnum):
    """The ``type`` of an output message."""

    TOKEN = "token"
    END = "end"


def first_token_message(node_id: int, weight_version: int, t: float) -> dict[str, FieldValue]:
    """A task's first token message: it also says which weights serve it."""
    return {
        TYPE_FIELD: OutputType.TOKEN,
        NUM_TOKENS_FIELD: 1,
        IS_FIRST_FIELD: True,
        NODE_FIELD: node_id,
        VERSION_FIELD: weight_version,
        T_FIELD: t,
    }


def token_message(num_tokens: int, node_id: int, t: float) -> dict[str, FieldValue]:
    """A later token message: `num_tokens` produced so far."""
    return {
        TYPE_FIELD: OutputType.TOKEN,
        NUM_TOKENS_FIELD: num_tokens,
        NODE_FIELD: node_id,
        T_FIELD: t,
    }


def end_message(num_tokens: int, node_id: int | None, t: float) -> dict[str, FieldValue]:
    """The ``end`` message's own fields (`Store.finish_task` adds status,
    reason, ``is_final``). `node_id` None: ended by the scheduler, on no node."""
    fields: dict[str, FieldValue] = {TYPE_FIELD: OutputType.END, NUM_TOKENS_FIELD: num_tokens}
    if node_id is not None:
        fields[NODE_FIELD] = node_id
    fields[T_FIELD] = t
    return fields


# -------------------------------------------------------------- completions


class Completion(NamedTuple):
    """One completions entry: a node's word that a task ended there."""

    task_id: str  # "" when the entry has none (it is skipped)
    status: str  # `StoredStatus`: completed | failed | requeued
    reason: str
    node_id: int | None
    attempt: int | None  # the attempt it ran as (fencing); None from an old writer
    t: float  # epoch s; 0.0 when missing


def completion_fields(
    task_id: str, status: str, reason: str, *, node_id: int, t: float, attempt: int
) -> dict[str, FieldValue]:
    """A completions entry for the scheduler (`Store.append_completion`)."""
    return {
        TASK_ID_FIELD: task_id,
        NODE_ID_FIELD: node_id,
        STATUS_FIELD: status,
        REASON_FIELD: reason,
        T_FIELD: t,
        ATTEMPT_FIELD: attempt,
    }


def completion_from_fields(fields: Mapping[str, str]) -> Completion:
    """A completions entry read back; raises ValueError on a malformed number."""
    return Completion(
        task_id=fields.get(TASK_ID_FIELD, ""),
        status=fields.get(STATUS_FIELD, ""),
        reason=fields.get(REASON_FIELD, ""),
        node_id=get_optional_int(fields, NODE_ID_FIELD),
        attempt=get_optional_int(fields, ATTEMPT_FIELD),
        t=get_float(fields, T_FIELD),
    )
