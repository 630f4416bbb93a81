"""lemix.infra.store's wire formats, without Redis: field values (`codec`), the
heartbeat hash (`heartbeat`), output and completion messages (`messages`),
task-hash statuses and reasons (`task_hash`), and how `Store` is put together."""

from __future__ import annotations

import inspect

import pytest

from lemix.infra.store.codec import (
    encode_fields,
    get_bool,
    get_float,
    get_int,
    get_optional_float,
    get_optional_int,
)
from lemix.infra.store.heartbeat import (
    heartbeat_fields,
    node_state_from_heartbeat,
    node_states_from_heartbeats,
)
from lemix.infra.store.messages import (
    Completion,
    completion_fields,
    completion_from_fields,
    end_message,
    first_token_message,
    token_message,
)
from lemix.infra.store.store import Store
from lemix.infra.store.task_hash import (
    FINAL_STATUSES,
    StoredStatus,
    final_fields,
)
from lemix.reasons import ReasonCode, format_reason, reason_code
from lemix.types import NodeSnapshot, TaskKind, TaskStatus

# ------------------------------------------------------------------ values


def test_codec_round_trips_numbers_bools_and_none() -> None:
    fields = encode_fields({"i": 7, "f": 0.1, "b": True, "n": None, "s": TaskKind.TRAINING})
    assert fields == {"i": "7", "f": "0.1", "b": "1", "n": "", "s": "training"}
    assert get_int(fields, "i") == 7 and get_int(fields, "missing", 3) == 3
    assert get_float(fields, "f") == 0.1
    assert get_bool(fields, "b") is True and get_bool(fields, "missing") is False
    assert get_optional_float(fields, "n") is None and get_optional_int(fields, "i") == 7
    with pytest.raises(TypeError):
        encode_fields({"x": [1, 2]})  # type: ignore[dict-item]


# ---------------------------------------------------------------- heartbeat


def _snapshot() -> NodeSnapshot:
    return NodeSnapshot(
        node_id=3,
        now_s=12.5,
        num_running=2,
        num_waiting=1,
        sum_context_tokens=900,
        max_remaining_decode_tokens=40,
        kv_used_bytes=1 << 33,  # past 32 bits: a uint64 field
        memory_capacity_bytes=1 << 34,
        busy_fraction=0.25,
        num_training_updates=7,
        is_healthy=False,
    )


def test_heartbeat_round_trips_every_node_state_field() -> None:
    fields = encode_fields(heartbeat_fields(_snapshot(), address="h:1", num_stages=2, t=99.0))
    assert (fields["address"], fields["num_stages"], fields["t"]) == ("h:1", "2", "99.0")
    node = node_state_from_heartbeat(3, fields)
    assert (node.node_id, node.address, node.num_stages, node.is_healthy) == (3, "h:1", 2, False)
    assert (node.now_s, node.busy_fraction, node.num_running, node.num_waiting) == (
        12.5,
        0.25,
        2,
        1,
    )
    assert (node.kv_used_bytes, node.memory_capacity_bytes) == (1 << 33, 1 << 34)
    assert (node.sum_context_tokens, node.max_remaining_decode_tokens) == (900, 40)
    assert node.num_training_updates == 7


def test_heartbeat_missing_fields_read_as_defaults() -> None:
    node = node_state_from_heartbeat(5, {})
    assert (node.node_id, node.address, node.num_running, node.is_healthy) == (5, "", 0, True)


@pytest.mark.parametrize(
    ("field", "text", "match"),
    [
        ("num_running", "many", "node 4: field 'num_running' is not a number"),
        ("now_s", "soon", "field 'now_s'"),
        ("num_waiting", "-1", "num_waiting must be in"),  # negative for an unsigned field
        ("num_stages", str(1 << 32), "num_stages must be in"),  # too large for uint32
        ("now_s", "nan", "now_s must be a finite number"),
        ("busy_fraction", "-0.5", "busy_fraction must be >= 0"),
    ],
)
def test_bad_heartbeat_field_makes_the_hash_unreadable(field: str, text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        node_state_from_heartbeat(4, {"address": "h:1", field: text})


def test_bad_heartbeats_are_left_out_and_reported_others_kept() -> None:
    nodes, bad = node_states_from_heartbeats(
        {
            2: {"address": "h:2", "num_running": "1"},
            0: {"address": "h:0"},
            1: {"address": "h:1", "kv_used_bytes": "lots"},
        }
    )
    assert [n.node_id for n in nodes] == [0, 2]  # in node id order
    assert list(bad) == [1] and "kv_used_bytes" in bad[1]


# ----------------------------------------------------------------- messages


def test_output_messages_keep_their_wire_fields_and_order() -> None:
    first = encode_fields(first_token_message(3, 2, 1.5))
    assert list(first.items()) == [
        ("type", "token"),
        ("n", "1"),
        ("first", "1"),
        ("node", "3"),
        ("version", "2"),
        ("t", "1.5"),
    ]
    later = encode_fields(token_message(4, 3, 2.0))
    assert list(later.items()) == [("type", "token"), ("n", "4"), ("node", "3"), ("t", "2.0")]
    end = encode_fields(end_message(4, 3, 2.5))
    assert list(end.items()) == [("type", "end"), ("n", "4"), ("node", "3"), ("t", "2.5")]
    # The scheduler ends tasks on no node.
    assert encode_fields(end_message(0, None, 3.0)) == {"type": "end", "n": "0", "t": "3.0"}


def test_completion_round_trips() -> None:
    fields = encode_fields(
        completion_fields("t1", StoredStatus.REQUEUED, "why", node_id=2, t=4.5, attempt=3)
    )
    assert list(fields) == ["task_id", "node_id", "status", "reason", "t", "attempt"]
    assert completion_from_fields(fields) == Completion("t1", "requeued", "why", 2, 3, 4.5)
    # An entry from before fencing has no attempt; one without a node, no node.
    old = completion_from_fields({"task_id": "t2", "status": "completed"})
    assert (old.node_id, old.attempt, old.t, old.reason) == (None, None, 0.0, "")
    with pytest.raises(ValueError):
        completion_from_fields({"task_id": "t3", "node_id": "x"})


# ---------------------------------------------------------------- task hash


def test_statuses_compare_as_their_stored_text() -> None:
    assert StoredStatus.COMPLETED == "completed" == TaskStatus.COMPLETED
    assert {str(s) for s in FINAL_STATUSES} == {str(s) for s in TaskStatus}
    assert final_fields(StoredStatus.FAILED, "x") == {
        "status": "failed",
        "reason": "x",
        "is_final": "1",
    }


@pytest.mark.parametrize(
    ("reason", "code"),
    [
        ("CANCELLED: the client went away", ReasonCode.CANCELLED),
        ("FAILED_PRECONDITION: weights", ReasonCode.FAILED_PRECONDITION),
        (" UNAVAILABLE : blank around the code", ReasonCode.UNAVAILABLE),
        ("INTERNAL: not a reason code", None),
        ("no code: at all", None),
        ("UNAVAILABLE without a colon", None),
        ("", None),
    ],
)
def test_reason_code(reason: str, code: ReasonCode | None) -> None:
    assert reason_code(reason) is code


def test_format_reason_reads_back() -> None:
    reason = format_reason(ReasonCode.RESOURCE_EXHAUSTED, "KV never fits")
    assert reason == "RESOURCE_EXHAUSTED: KV never fits"
    assert reason_code(reason) is ReasonCode.RESOURCE_EXHAUSTED


# -------------------------------------------------------------------- store


def test_every_store_operation_counts_its_redis_errors() -> None:
    """The mixins' methods are wrapped once, on `Store` (lemix_redis_errors_total)."""
    ops = [
        (name, method)
        for name, method in inspect.getmembers(Store, inspect.iscoroutinefunction)
        if not name.startswith("_")
    ]
    assert len(ops) > 40
    for name, method in ops:
        inner = getattr(method, "__wrapped__", None)
        assert inner is not None, name
        assert not hasattr(inner, "__wrapped__"), f"{name} is counted twice"
