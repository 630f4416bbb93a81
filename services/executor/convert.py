"""Protobuf <-> domain for the executor-only messages (Dispatch, Measure, SyncWeights).

Tasks and node states convert in `lemix.infra.rpc.convert`, shared by every service;
this module adds what only the executor speaks. Bad values raise
`InvalidArgument`. As in `lemix.infra.rpc.convert`, a proto3 zero that can only mean
"unset" reads as the default: `batch_size` 0 -> 1, `num_repeats` 0 -> 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from lemix._proto.lemix.v1 import executor_pb2
from lemix.infra.rpc.convert import task_from_proto
from lemix.infra.rpc.errors import InvalidArgument
from lemix.types import Task, TaskPayload

MAX_MEASURE_REPEATS = 10_000  # one Measure call; the profiler loops for more


class MeasurePhase(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    DECODE = "decode"


class SyncDirection(StrEnum):
    SAVE = "save"
    LOAD = "load"
    AVERAGE = "average"  # replica sync (`lemix.planner.replica_sync`)


@dataclass(frozen=True, slots=True)
class MeasureSpec:
    """One profiling point: `num_repeats` runs of `phase` on `stage`."""

    phase: MeasurePhase
    stage: int
    batch_size: int  # C, sequences
    num_tokens: int  # forward/backward: tokens per sequence
    sum_context_tokens: int  # decode: KV tokens over the batch
    num_repeats: int


@dataclass(frozen=True, slots=True)
class MeasureResult:
    latency_s: tuple[float, ...]  # one per repeat
    peak_memory_bytes: int  # on the measured stage's GPU


@dataclass(frozen=True, slots=True)
class WeightSyncSpec:
    direction: SyncDirection
    location: str  # file path or URL of the weights ("" = backend default)
    weight_version: int  # LOAD: updates contained in the loaded weights
    # AVERAGE: the saved replicas to average (`location` is this node's own save)
    sources: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class WeightSyncResult:
    duration_s: float  # profile seconds from the request to the last stage done
    num_bytes: int  # weight bytes moved, all stages


@dataclass(frozen=True, slots=True)
class DispatchSpec:
    """One placement to run: the task, its payload, and its attempt number
    (the fencing token, docs/protocol.md; 0: sent without one)."""

    task: Task
    payload: TaskPayload
    attempt: int


def dispatch_from_proto(msg: executor_pb2.DispatchRequest) -> DispatchSpec:
    task, payload = task_from_proto(msg.task)
    return DispatchSpec(task, payload, int(msg.attempt))


_PHASES = {
    executor_pb2.MeasureRequest.PHASE_FORWARD: MeasurePhase.FORWARD,
    executor_pb2.MeasureRequest.PHASE_BACKWARD: MeasurePhase.BACKWARD,
    executor_pb2.MeasureRequest.PHASE_DECODE: MeasurePhase.DECODE,
}
_DIRECTIONS = {
    executor_pb2.SyncWeightsRequest.DIRECTION_SAVE: SyncDirection.SAVE,
    executor_pb2.SyncWeightsRequest.DIRECTION_LOAD: SyncDirection.LOAD,
    executor_pb2.SyncWeightsRequest.DIRECTION_AVERAGE: SyncDirection.AVERAGE,
}


def measure_from_proto(msg: executor_pb2.MeasureRequest) -> MeasureSpec:
    phase = _PHASES.get(msg.phase)
    if phase is None:
        raise InvalidArgument(
            f"measure phase {msg.phase} is not a phase; set PHASE_FORWARD, PHASE_BACKWARD "
            "or PHASE_DECODE"
        )
    if phase is not MeasurePhase.DECODE and msg.num_tokens == 0:
        raise InvalidArgument(f"measure {phase}: num_tokens must be > 0")
    num_repeats = msg.num_repeats or 1
    if num_repeats > MAX_MEASURE_REPEATS:
        raise InvalidArgument(
            f"num_repeats must be <= {MAX_MEASURE_REPEATS}, got {num_repeats}; call again for more"
        )
    return MeasureSpec(
        phase, msg.stage, msg.batch_size or 1, msg.num_tokens, msg.sum_context_tokens, num_repeats
    )


def measure_to_proto(result: MeasureResult) -> executor_pb2.MeasureResponse:
    return executor_pb2.MeasureResponse(
        latency_s=result.latency_s, peak_memory_bytes=result.peak_memory_bytes
    )


def sync_from_proto(msg: executor_pb2.SyncWeightsRequest) -> WeightSyncSpec:
    direction = _DIRECTIONS.get(msg.direction)
    if direction is None:
        raise InvalidArgument(
            f"sync direction {msg.direction} is not a direction; set DIRECTION_SAVE, "
            "DIRECTION_LOAD or DIRECTION_AVERAGE"
        )
    sources = tuple(msg.sources)
    if direction is SyncDirection.AVERAGE and not (sources and msg.location):
        raise InvalidArgument(
            "DIRECTION_AVERAGE needs sources (the saved replicas) and location (this node's save)"
        )
    return WeightSyncSpec(direction, msg.location, msg.weight_version, sources)


def sync_to_proto(result: WeightSyncResult) -> executor_pb2.SyncWeightsResponse:
    return executor_pb2.SyncWeightsResponse(
        duration_s=result.duration_s, num_bytes=result.num_bytes
    )
