"""A task's state hash (``ns:task:<task_id>``): the fields several services share.

Who writes what (docs/protocol.md, "Task states"; `gateway.tasks` reads it):

=====================  =========================================================
writer                 fields
=====================  =========================================================
intake write           the task (`lemix.infra.store.task_fields.task_to_fields`),
(gateway / Submit)     ``status=queued``, `SUBMIT_T_FIELD`, ``queued_t``,
                       `GATEWAY_ID_FIELD`, `ATTEMPT_FIELD` 1 (the first
                       placement's number; `scripts.SUBMIT_LUA`)
scheduler intake       for a task it checks: the same again, `ATTEMPT_FIELD` + 1
check                  (`scripts.ACCEPT_LUA`)
executor sink          ``status=placed``, `NODE_ID_FIELD`, `PLACED_T_FIELD` with
(or the scheduler's    its first write after taking the task, fenced by attempt
dispatch, for an       (folded into the end when the task ends in that write);
executor that does     the scheduler writes them after the Dispatch only when
not record it)         the executor's reply does not say it records them
scheduler dispatch     `ATTEMPT_FIELD` + 1 before a later placement's Dispatch
scheduler, taken back  ``status=queued``, `NODE_ID_FIELD` "", ``requeued_t``
executor sink / sched  `final_fields` (status, reason, ``is_final=1``),
(`Store.finish_task`)  `FINISH_T_FIELD`, `NODE_ID_FIELD`,
                       `NUM_OUTPUT_TOKENS_FIELD`, `WEIGHT_VERSION_FIELD`, losses
=====================  =========================================================

`StoredStatus` is the ``status`` field's vocabulary, also used by a task's
``end`` output message and by completion entries (`messages`). A failed or
rejected task's reason reads ``"<ReasonCode>: text"`` (`lemix.reasons.format_reason`,
`reason_code`). The Lua scripts (`scripts`) spell ``is_final``, ``status`` and
``attempt`` themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

TASK_ID_FIELD = "task_id"
STATUS_FIELD = "status"  # a `StoredStatus`
REASON_FIELD = "reason"  # "" or "<ReasonCode>: text"
IS_FINAL_FIELD = "is_final"  # "1" on a finished task's hash and its last output message
# Fencing (docs/protocol.md, "Fencing"): the attempt number of the task's
# current placement; an executor's write for an older attempt is dropped. A
# hash without the field fences nothing.
ATTEMPT_FIELD = "attempt"
NODE_ID_FIELD = "node_id"  # the node it is placed on / ended on ("" when taken back)
# "1": Cancel came before the task was placed (`Store.mark_cancelled`): the
# intake ends it instead of placing it. Written on a task not taken yet, it
# creates the hash (with a TTL) ahead of the task's own fields.
CANCELLED_FIELD = "cancelled"
SUBMIT_T_FIELD = "submit_t"  # epoch s when Submit stored it
# The gateway streaming the task's output (Submit's `GATEWAY_ID_METADATA`);
# its lease (`RedisKeys.gateway_lease`) lapsing cancels the task. Absent on a
# task submitted straight to the scheduler.
GATEWAY_ID_FIELD = "gateway_id"
# "also_gateway:<id>": another gateway streams the task too (an idempotent
# retry through it): its lease covers the task as well, after a restart too.
ALSO_GATEWAY_PREFIX = "also_gateway:"
# gRPC metadata key by which a gateway names itself on Submit (no proto change).
GATEWAY_ID_METADATA = "lemix-gateway-id"
PLACED_T_FIELD = "placed_t"  # epoch s when an executor took it
FINISH_T_FIELD = "finish_t"  # epoch s when it ended
NUM_OUTPUT_TOKENS_FIELD = "num_output_tokens"
WEIGHT_VERSION_FIELD = "weight_version"  # training updates in the weights that served it


class StoredStatus(StrEnum):
    """The ``status`` of a task hash, of a task's ``end`` message and of a
    completion entry. A StrEnum: members compare equal to the stored text."""

    QUEUED = "queued"  # hash: waiting for a node (also once taken back from one)
    PLACED = "placed"  # hash: an executor took it
    REQUEUED = "requeued"  # completion only: training handed back, to be placed again
    COMPLETED = "completed"  # final
    FAILED = "failed"  # final, with a reason (``CANCELLED: ...`` when cancelled)
    REJECTED = "rejected"  # final: refused before it ran, with a reason


FINAL_STATUSES = frozenset({StoredStatus.COMPLETED, StoredStatus.FAILED, StoredStatus.REJECTED})


def final_fields(status: str, reason: str) -> dict[str, str]:
    """The fields that end a task, on its hash and on its ``end`` message alike."""
    return {STATUS_FIELD: str(status), REASON_FIELD: reason, IS_FINAL_FIELD: "1"}


def gateways_of(fields: Mapping[str, str]) -> list[str]:
    """Every gateway a task hash names as streaming the task: its first
    (`GATEWAY_ID_FIELD`) and those of later retries (`ALSO_GATEWAY_PREFIX`)."""
    first = fields.get(GATEWAY_ID_FIELD, "")
    also = sorted(
        k[len(ALSO_GATEWAY_PREFIX) :] for k in fields if k.startswith(ALSO_GATEWAY_PREFIX)
    )
    return ([first] if first else []) + [g for g in also if g and g != first]
