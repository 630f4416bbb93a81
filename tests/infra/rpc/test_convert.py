"""lemix.infra.rpc.convert: lossless round trips, and bad wire values -> ValueError."""

from __future__ import annotations

import math

import pytest

from lemix._proto.lemix.v1 import common_pb2, executor_pb2, gateway_pb2, scheduler_pb2
from lemix.infra.rpc import (
    EXECUTOR_SERVICE,
    GATEWAY_SERVICE,
    PROFILER_SERVICE,
    SCHEDULER_SERVICE,
    convert,
)
from lemix.infra.rpc.errors import InvalidArgument
from lemix.types import NodeSnapshot, Task, TaskKind, TaskPayload, TaskStatus


def _inference(**kw: object) -> Task:
    args: dict[str, object] = dict(
        task_id="req-1",
        kind=TaskKind.INFERENCE,
        arrival_s=12.5,
        num_prompt_tokens=4,
        max_output_tokens=16,
        seq=7,
    )
    args.update(kw)
    return Task(**args)  # type: ignore[arg-type]


def _wire_task(**kw: object) -> common_pb2.Task:
    msg = convert.task_to_proto(_inference())
    for name, value in kw.items():
        setattr(msg, name, value)
    return msg


# ---------------------------------------------------------------- round trips


def test_inference_task_round_trips_with_payload() -> None:
    task = _inference()
    payload = TaskPayload(
        prompt_token_ids=(1, 2, 3, 2**32 - 1),
        reference_token_ids=(9, 8),
        temperature=0.7,
        top_p=0.9,
        ignore_eos=True,
        seed=2**64 - 1,
    )
    msg = convert.task_to_proto(task, payload)
    # Through bytes, as on the wire.
    back = convert.task_from_proto(common_pb2.Task.FromString(msg.SerializeToString()))
    assert back == (task, payload)


def test_training_task_round_trips_without_payload() -> None:
    task = Task("train-3", TaskKind.TRAINING, 0.0, num_prompt_tokens=512, batch_size=8, seq=2**40)
    msg = convert.task_to_proto(task)
    assert not msg.HasField("sampling")
    assert convert.task_from_proto(msg) == (task, TaskPayload())


def test_multi_sample_training_payload_round_trips() -> None:
    task = Task("train-4", TaskKind.TRAINING, 0.0, num_prompt_tokens=3, batch_size=2)
    payload = TaskPayload(
        prompt_token_ids=(5, 6, 7, 8, 9), sample_lengths=(3, 2), reference_lengths=(1, 2)
    )
    msg = convert.task_to_proto(task, payload)
    back = convert.task_from_proto(common_pb2.Task.FromString(msg.SerializeToString()))
    assert back == (task, payload)


def test_task_nested_in_service_messages() -> None:
    task = _inference()
    request = scheduler_pb2.SubmitRequest(task=convert.task_to_proto(task))
    dispatch = executor_pb2.DispatchRequest(task=request.task, predicted_response_s=0.25)
    assert convert.task_from_proto(dispatch.task)[0] == task


def test_proto3_zeros_read_as_domain_defaults() -> None:
    msg = _wire_task(batch_size=0)
    msg.sampling.temperature = 0.5  # top_p left 0 = unset
    task, payload = convert.task_from_proto(msg)
    assert task.batch_size == 1
    assert payload.top_p == 1.0 and payload.temperature == 0.5


def test_node_state_round_trips() -> None:
    snapshot = NodeSnapshot(
        node_id=3,
        now_s=101.25,
        num_running=5,
        num_waiting=2,
        sum_context_tokens=4096,
        max_remaining_decode_tokens=77,
        kv_used_bytes=3 * 2**40,
        memory_capacity_bytes=80 * 2**30,
        busy_fraction=0.625,
        num_training_updates=12,
        is_healthy=False,
    )
    msg = convert.node_state_to_proto(snapshot, address="10.0.0.3:50061", num_stages=4)
    wire = common_pb2.NodeState.FromString(msg.SerializeToString())
    assert convert.node_state_from_proto(wire) == convert.NodeInfo(snapshot, "10.0.0.3:50061", 4)


def test_node_states_in_stats() -> None:
    snapshots = [NodeSnapshot(node_id=i, now_s=1.0) for i in range(3)]
    stats = gateway_pb2.Stats(nodes=[convert.node_state_to_proto(s) for s in snapshots])
    assert [convert.node_state_from_proto(n).snapshot for n in stats.nodes] == snapshots


@pytest.mark.parametrize("kind", list(TaskKind))
def test_task_kind_both_ways(kind: TaskKind) -> None:
    assert convert.task_kind_from_proto(convert.task_kind_to_proto(kind)) is kind


@pytest.mark.parametrize("status", [*TaskStatus, None])
def test_task_status_both_ways(status: TaskStatus | None) -> None:
    assert convert.task_status_from_proto(convert.task_status_to_proto(status)) is status


def test_every_domain_enum_member_has_a_wire_value() -> None:
    kinds = {convert.task_kind_to_proto(k) for k in TaskKind}
    statuses = {convert.task_status_to_proto(s) for s in TaskStatus}
    assert len(kinds) == len(TaskKind) and common_pb2.TASK_KIND_UNSPECIFIED not in kinds
    assert len(statuses) == len(TaskStatus)
    assert common_pb2.TASK_STATUS_UNSPECIFIED not in statuses


def test_service_name_constants_match_the_protos() -> None:
    from lemix._proto.lemix.v1 import profiler_pb2

    names = {
        GATEWAY_SERVICE: gateway_pb2.DESCRIPTOR.services_by_name["Gateway"],
        SCHEDULER_SERVICE: scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"],
        EXECUTOR_SERVICE: executor_pb2.DESCRIPTOR.services_by_name["Executor"],
        PROFILER_SERVICE: profiler_pb2.DESCRIPTOR.services_by_name["Profiler"],
    }
    for name, service in names.items():
        assert service.full_name == name


# -------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"task_id": ""}, "task_id is empty"),
        ({"kind": common_pb2.TASK_KIND_UNSPECIFIED}, "TASK_KIND_UNSPECIFIED is not a task kind"),
        ({"kind": 42}, "unknown value 42"),
        ({"max_output_tokens": 0}, "inference needs max_output_tokens > 0"),
        ({"num_prompt_tokens": 0}, "num_prompt_tokens must be > 0"),
        ({"arrival_s": math.nan}, "arrival_s must be a finite number"),
        ({"arrival_s": math.inf}, "arrival_s must be a finite number"),
    ],
)
def test_bad_task_fields_raise_value_error(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        convert.task_from_proto(_wire_task(**fields))
    # InvalidArgument, so a servicer answers INVALID_ARGUMENT.
    assert isinstance(info.value, InvalidArgument)
    if fields.get("task_id") != "":
        assert "req-1" in str(info.value)  # names the task


@pytest.mark.parametrize(
    ("sampling", "match"),
    [
        ({"temperature": -0.5}, "temperature must be finite and >= 0"),
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_p": -0.1}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_sampling_raises_value_error(sampling: dict[str, float], match: str) -> None:
    msg = _wire_task()
    for name, value in sampling.items():
        setattr(msg.sampling, name, value)
    with pytest.raises(InvalidArgument, match=match):
        convert.task_from_proto(msg)


def test_prompt_ids_must_match_prompt_length_for_inference() -> None:
    msg = _wire_task()
    msg.prompt_token_ids.extend([1, 2, 3])  # num_prompt_tokens is 4
    with pytest.raises(ValueError, match="3 prompt_token_ids but num_prompt_tokens=4"):
        convert.task_from_proto(msg)


@pytest.mark.parametrize(
    ("task", "payload", "match"),
    [
        (_inference(seq=-1), None, r"seq must be in \[0, 2\^64\)"),
        (_inference(num_prompt_tokens=2**32), None, r"num_prompt_tokens must be in \[0, 2\^32\)"),
        (_inference(arrival_s=math.inf), None, "arrival_s must be a finite number"),
        (_inference(), TaskPayload(prompt_token_ids=(2**32,)), "prompt_token_ids must be < 2"),
        (_inference(), TaskPayload(seed=2**64), r"seed must be in \[0, 2\^64\)"),
    ],
)
def test_unrepresentable_domain_values_raise_value_error(
    task: Task, payload: TaskPayload | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        convert.task_to_proto(task, payload)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"prompt_token_ids": (1, -2)}, "prompt_token_ids must be >= 0"),
    ],
)
def test_task_payload_validates(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TaskPayload(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("snapshot", "kwargs", "match"),
    [
        (NodeSnapshot(node_id=-1, now_s=0.0), {}, r"node_id must be in \[0, 2\^32\)"),
        (NodeSnapshot(node_id=0, now_s=0.0, kv_used_bytes=-5), {}, "kv_used_bytes"),
        (NodeSnapshot(node_id=0, now_s=math.nan), {}, "now_s must be a finite number"),
        (NodeSnapshot(node_id=0, now_s=0.0, busy_fraction=-0.1), {}, "busy_fraction"),
        (NodeSnapshot(node_id=0, now_s=0.0), {"num_stages": -1}, "num_stages"),
    ],
)
def test_bad_node_snapshot_raises_value_error(
    snapshot: NodeSnapshot, kwargs: dict[str, int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        convert.node_state_to_proto(snapshot, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["now_s", "busy_fraction"])
def test_non_finite_node_state_from_wire_raises(field: str) -> None:
    msg = common_pb2.NodeState(node_id=2)
    setattr(msg, field, math.inf)
    with pytest.raises(InvalidArgument, match=f"node 2: {field} must be a finite number"):
        convert.node_state_from_proto(msg)


def test_unknown_task_status_raises() -> None:
    with pytest.raises(ValueError, match="task status 9 is unknown; expected one of"):
        convert.task_status_from_proto(9)
