"""The one protobuf <-> domain conversion module (STYLE: protobuf only at the edge).

Servicers call `*_from_proto` on what arrives and `*_to_proto` on what leaves;
everything between works on `lemix.types`. Bad values raise `InvalidArgument`
(a `ValueError`) with a message the caller can act on, so a servicer wearing
`lemix.infra.rpc.errors.handle_errors` answers INVALID_ARGUMENT without extra code.

proto3 cannot tell an unset scalar from its zero, so a few zeros mean "unset"
and read as the domain default: `Task.batch_size` 0 -> 1,
`SamplingParams.top_p` 0 -> 1.0 (off) and `SamplingParams.repetition_penalty`
0 -> 1.0 (off). Everything else is taken literally.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lemix._proto.lemix.v1 import common_pb2
from lemix.infra.rpc.errors import InvalidArgument
from lemix.types import NodeSnapshot, Task, TaskKind, TaskPayload, TaskStatus

_U32 = 32  # bits of a uint32 wire field
_U64 = 64  # bits of a uint64 wire field

_KIND_TO_PROTO: dict[TaskKind, common_pb2.TaskKind] = {
    TaskKind.INFERENCE: common_pb2.TASK_KIND_INFERENCE,
    TaskKind.TRAINING: common_pb2.TASK_KIND_TRAINING,
}
_KIND_FROM_PROTO: dict[int, TaskKind] = {v: k for k, v in _KIND_TO_PROTO.items()}

_STATUS_TO_PROTO: dict[TaskStatus, common_pb2.TaskStatus] = {
    TaskStatus.COMPLETED: common_pb2.TASK_STATUS_COMPLETED,
    TaskStatus.REJECTED: common_pb2.TASK_STATUS_REJECTED,
    TaskStatus.FAILED: common_pb2.TASK_STATUS_FAILED,
}
_STATUS_FROM_PROTO: dict[int, TaskStatus] = {v: k for k, v in _STATUS_TO_PROTO.items()}


# ------------------------------------------------------------------ helpers


def _uint(what: str, value: int, bits: int) -> int:
    """`value` if it fits an unsigned wire field of `bits` bits."""
    if not 0 <= value < 1 << bits:
        raise InvalidArgument(f"{what} must be in [0, 2^{bits}), got {value}")
    return value


def _finite(what: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(f"{what} must be a finite number, got {value}")
    return value


def _kind_name(value: int) -> str:
    try:
        return common_pb2.TaskKind.Name(value)
    except ValueError:  # proto3 enums are open: any number can arrive
        return f"unknown value {value}"


# -------------------------------------------------------------------- enums


def task_kind_to_proto(kind: TaskKind) -> common_pb2.TaskKind:
    """`lemix.types.TaskKind` -> `lemix.v1.TaskKind` number."""
    return _KIND_TO_PROTO[kind]


def task_kind_from_proto(value: int) -> TaskKind:
    """`lemix.v1.TaskKind` number -> `TaskKind`; UNSPECIFIED or unknown raises."""
    kind = _KIND_FROM_PROTO.get(value)
    if kind is None:
        raise InvalidArgument(
            f"task kind {_kind_name(value)} is not a task kind; "
            "set TASK_KIND_INFERENCE or TASK_KIND_TRAINING"
        )
    return kind


def task_status_to_proto(status: TaskStatus | None) -> common_pb2.TaskStatus:
    """`TaskStatus` (None = not finished) -> `lemix.v1.TaskStatus` number."""
    return common_pb2.TASK_STATUS_UNSPECIFIED if status is None else _STATUS_TO_PROTO[status]


def task_status_from_proto(value: int) -> TaskStatus | None:
    """`lemix.v1.TaskStatus` number -> `TaskStatus`; UNSPECIFIED -> None."""
    if value == common_pb2.TASK_STATUS_UNSPECIFIED:
        return None
    status = _STATUS_FROM_PROTO.get(value)
    if status is None:
        raise InvalidArgument(
            f"task status {value} is unknown; expected one of "
            + ", ".join(common_pb2.TaskStatus.Name(v) for v in sorted(_STATUS_FROM_PROTO))
        )
    return status


# -------------------------------------------------------------------- tasks


def task_to_proto(task: Task, payload: TaskPayload | None = None) -> common_pb2.Task:
    """A planner task (and, for real backends, its tokens and sampling) -> wire."""
    where = f"task {task.task_id!r}"
    msg = common_pb2.Task(
        task_id=task.task_id,
        kind=task_kind_to_proto(task.kind),
        arrival_s=_finite(f"{where}: arrival_s", task.arrival_s),
        num_prompt_tokens=_uint(f"{where}: num_prompt_tokens", task.num_prompt_tokens, _U32),
        max_output_tokens=_uint(f"{where}: max_output_tokens", task.max_output_tokens, _U32),
        batch_size=_uint(f"{where}: batch_size", task.batch_size, _U32),
        seq=_uint(f"{where}: seq", task.seq, _U64),
    )
    if payload is not None:
        for name in ("prompt_token_ids", "reference_token_ids"):
            ids = getattr(payload, name)
            if ids and max(ids) >= 1 << _U32:
                raise InvalidArgument(f"{where}: {name} must be < 2^32, got {max(ids)}")
        msg.prompt_token_ids.extend(payload.prompt_token_ids)
        msg.reference_token_ids.extend(payload.reference_token_ids)
        msg.sample_lengths.extend(payload.sample_lengths)
        msg.reference_lengths.extend(payload.reference_lengths)
        msg.sampling.CopyFrom(
            common_pb2.SamplingParams(
                temperature=payload.temperature,
                top_p=payload.top_p,
                ignore_eos=payload.ignore_eos,
                seed=_uint(f"{where}: seed", payload.seed, _U64),
            )
        )
        if payload.top_logprobs >= 0:
            msg.sampling.top_logprobs = payload.top_logprobs
        if payload.prompt_logprobs >= 0:
            msg.sampling.prompt_logprobs = payload.prompt_logprobs
        sampling = msg.sampling
        sampling.top_k, sampling.min_p = payload.top_k, payload.min_p
        sampling.presence_penalty = payload.presence_penalty
        sampling.frequency_penalty = payload.frequency_penalty
        sampling.repetition_penalty = payload.repetition_penalty
        sampling.min_tokens = payload.min_tokens
        sampling.stop_token_ids.extend(payload.stop_token_ids)
    return msg


def task_from_proto(msg: common_pb2.Task) -> tuple[Task, TaskPayload]:
    """Wire -> (planner task, payload). Unset sampling reads as `TaskPayload()`
    defaults; raises `InvalidArgument` on anything a planner could not place."""
    if not msg.task_id:
        raise InvalidArgument("task.task_id is empty; every task needs a unique id")
    where = f"task {msg.task_id!r}"
    try:
        kind = task_kind_from_proto(msg.kind)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: {exc}") from None
    sampling = msg.sampling
    try:
        task = Task(
            task_id=msg.task_id,
            kind=kind,
            arrival_s=_finite(f"{where}: arrival_s", msg.arrival_s),
            num_prompt_tokens=msg.num_prompt_tokens,
            max_output_tokens=msg.max_output_tokens,
            batch_size=msg.batch_size or 1,
            seq=msg.seq,
        )
        payload = TaskPayload(
            prompt_token_ids=tuple(msg.prompt_token_ids),
            reference_token_ids=tuple(msg.reference_token_ids),
            sample_lengths=tuple(msg.sample_lengths),
            reference_lengths=tuple(msg.reference_lengths),
            temperature=_finite(f"{where}: sampling.temperature", sampling.temperature),
            top_p=sampling.top_p or 1.0,
            ignore_eos=sampling.ignore_eos,
            seed=sampling.seed,
            top_logprobs=sampling.top_logprobs if sampling.HasField("top_logprobs") else -1,
            prompt_logprobs=(
                sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else -1
            ),
            top_k=sampling.top_k,
            min_p=_finite(f"{where}: sampling.min_p", sampling.min_p),
            presence_penalty=_finite(
                f"{where}: sampling.presence_penalty", sampling.presence_penalty
            ),
            frequency_penalty=_finite(
                f"{where}: sampling.frequency_penalty", sampling.frequency_penalty
            ),
            repetition_penalty=sampling.repetition_penalty or 1.0,
            min_tokens=sampling.min_tokens,
            stop_token_ids=tuple(sampling.stop_token_ids),
        )
    except InvalidArgument:
        raise
    except ValueError as exc:
        # The domain types name the field; prefix the task unless they already did.
        text = str(exc)
        raise InvalidArgument(text if text.startswith("task ") else f"{where}: {text}") from None
    num_ids = len(payload.prompt_token_ids)
    if kind is TaskKind.INFERENCE and num_ids and num_ids != task.num_prompt_tokens:
        raise InvalidArgument(
            f"{where}: {num_ids} prompt_token_ids but num_prompt_tokens="
            f"{task.num_prompt_tokens}; they must agree (or send no token ids)"
        )
    return task, payload


# -------------------------------------------------------------------- nodes


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A node's state as the wire carries it: the planner's snapshot plus where
    its executor listens and how many pipeline stages it runs."""

    snapshot: NodeSnapshot
    address: str = ""  # host:port of the executor's gRPC server
    num_stages: int = 0  # 0 = not reported


def node_state_to_proto(
    snapshot: NodeSnapshot, *, address: str = "", num_stages: int = 0
) -> common_pb2.NodeState:
    """An executor's snapshot (and how to reach it) -> wire."""
    where = f"node {snapshot.node_id}"
    busy = _finite(f"{where}: busy_fraction", snapshot.busy_fraction)
    if busy < 0:
        raise InvalidArgument(f"{where}: busy_fraction must be >= 0, got {busy}")
    u32 = {
        "node_id": snapshot.node_id,
        "num_running": snapshot.num_running,
        "num_waiting": snapshot.num_waiting,
        "max_remaining_decode_tokens": snapshot.max_remaining_decode_tokens,
    }
    u64 = {
        "sum_context_tokens": snapshot.sum_context_tokens,
        "kv_used_bytes": snapshot.kv_used_bytes,
        "memory_capacity_bytes": snapshot.memory_capacity_bytes,
        "num_training_updates": snapshot.num_training_updates,
    }
    return common_pb2.NodeState(
        now_s=_finite(f"{where}: now_s", snapshot.now_s),
        busy_fraction=busy,
        is_healthy=snapshot.is_healthy,
        address=address,
        num_stages=_uint(f"{where}: num_stages", num_stages, _U32),
        **{k: _uint(f"{where}: {k}", v, _U32) for k, v in u32.items()},
        **{k: _uint(f"{where}: {k}", v, _U64) for k, v in u64.items()},
    )


def node_state_from_proto(msg: common_pb2.NodeState) -> NodeInfo:
    """Wire -> `NodeInfo`; raises `InvalidArgument` on non-finite times or a
    negative/non-finite busy fraction."""
    where = f"node {msg.node_id}"
    busy = _finite(f"{where}: busy_fraction", msg.busy_fraction)
    if busy < 0:
        raise InvalidArgument(f"{where}: busy_fraction must be >= 0, got {busy}")
    snapshot = NodeSnapshot(
        node_id=msg.node_id,
        now_s=_finite(f"{where}: now_s", msg.now_s),
        num_running=msg.num_running,
        num_waiting=msg.num_waiting,
        sum_context_tokens=msg.sum_context_tokens,
        max_remaining_decode_tokens=msg.max_remaining_decode_tokens,
        kv_used_bytes=msg.kv_used_bytes,
        memory_capacity_bytes=msg.memory_capacity_bytes,
        busy_fraction=busy,
        num_training_updates=msg.num_training_updates,
        is_healthy=msg.is_healthy,
    )
    return NodeInfo(snapshot=snapshot, address=msg.address, num_stages=msg.num_stages)
