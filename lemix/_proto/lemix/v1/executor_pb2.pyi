from lemix._proto.lemix.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DispatchRequest(_message.Message):
    __slots__ = ("task", "predicted_response_s", "attempt")
    TASK_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_RESPONSE_S_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.Task
    predicted_response_s: float
    attempt: int
    def __init__(self, task: _Optional[_Union[_common_pb2.Task, _Mapping]] = ..., predicted_response_s: _Optional[float] = ..., attempt: _Optional[int] = ...) -> None: ...

class DispatchResponse(_message.Message):
    __slots__ = ("is_accepted", "is_placement_recorded")
    IS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    IS_PLACEMENT_RECORDED_FIELD_NUMBER: _ClassVar[int]
    is_accepted: bool
    is_placement_recorded: bool
    def __init__(self, is_accepted: _Optional[bool] = ..., is_placement_recorded: _Optional[bool] = ...) -> None: ...

class DispatchManyRequest(_message.Message):
    __slots__ = ("dispatches",)
    DISPATCHES_FIELD_NUMBER: _ClassVar[int]
    dispatches: _containers.RepeatedCompositeFieldContainer[DispatchRequest]
    def __init__(self, dispatches: _Optional[_Iterable[_Union[DispatchRequest, _Mapping]]] = ...) -> None: ...

class DispatchResult(_message.Message):
    __slots__ = ("is_accepted", "error_code", "error_message", "is_placement_recorded")
    IS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    IS_PLACEMENT_RECORDED_FIELD_NUMBER: _ClassVar[int]
    is_accepted: bool
    error_code: str
    error_message: str
    is_placement_recorded: bool
    def __init__(self, is_accepted: _Optional[bool] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., is_placement_recorded: _Optional[bool] = ...) -> None: ...

class DispatchManyResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DispatchResult]
    def __init__(self, results: _Optional[_Iterable[_Union[DispatchResult, _Mapping]]] = ...) -> None: ...

class DispatchStreamRequest(_message.Message):
    __slots__ = ("call_id", "call")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    call: DispatchManyRequest
    def __init__(self, call_id: _Optional[int] = ..., call: _Optional[_Union[DispatchManyRequest, _Mapping]] = ...) -> None: ...

class DispatchStreamResponse(_message.Message):
    __slots__ = ("call_id", "reply", "error_code", "error_message")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    reply: DispatchManyResponse
    error_code: str
    error_message: str
    def __init__(self, call_id: _Optional[int] = ..., reply: _Optional[_Union[DispatchManyResponse, _Mapping]] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ...) -> None: ...

class GetNodeStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SyncWeightsRequest(_message.Message):
    __slots__ = ("direction", "location", "weight_version", "sources")
    class Direction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DIRECTION_UNSPECIFIED: _ClassVar[SyncWeightsRequest.Direction]
        DIRECTION_SAVE: _ClassVar[SyncWeightsRequest.Direction]
        DIRECTION_LOAD: _ClassVar[SyncWeightsRequest.Direction]
        DIRECTION_AVERAGE: _ClassVar[SyncWeightsRequest.Direction]
    DIRECTION_UNSPECIFIED: SyncWeightsRequest.Direction
    DIRECTION_SAVE: SyncWeightsRequest.Direction
    DIRECTION_LOAD: SyncWeightsRequest.Direction
    DIRECTION_AVERAGE: SyncWeightsRequest.Direction
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    direction: SyncWeightsRequest.Direction
    location: str
    weight_version: int
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, direction: _Optional[_Union[SyncWeightsRequest.Direction, str]] = ..., location: _Optional[str] = ..., weight_version: _Optional[int] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...

class SyncWeightsResponse(_message.Message):
    __slots__ = ("duration_s", "num_bytes")
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    duration_s: float
    num_bytes: int
    def __init__(self, duration_s: _Optional[float] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class MeasureRequest(_message.Message):
    __slots__ = ("phase", "stage", "batch_size", "num_tokens", "sum_context_tokens", "num_repeats")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[MeasureRequest.Phase]
        PHASE_FORWARD: _ClassVar[MeasureRequest.Phase]
        PHASE_BACKWARD: _ClassVar[MeasureRequest.Phase]
        PHASE_DECODE: _ClassVar[MeasureRequest.Phase]
    PHASE_UNSPECIFIED: MeasureRequest.Phase
    PHASE_FORWARD: MeasureRequest.Phase
    PHASE_BACKWARD: MeasureRequest.Phase
    PHASE_DECODE: MeasureRequest.Phase
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUM_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_REPEATS_FIELD_NUMBER: _ClassVar[int]
    phase: MeasureRequest.Phase
    stage: int
    batch_size: int
    num_tokens: int
    sum_context_tokens: int
    num_repeats: int
    def __init__(self, phase: _Optional[_Union[MeasureRequest.Phase, str]] = ..., stage: _Optional[int] = ..., batch_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., sum_context_tokens: _Optional[int] = ..., num_repeats: _Optional[int] = ...) -> None: ...

class MeasureResponse(_message.Message):
    __slots__ = ("latency_s", "peak_memory_bytes")
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    latency_s: _containers.RepeatedScalarFieldContainer[float]
    peak_memory_bytes: int
    def __init__(self, latency_s: _Optional[_Iterable[float]] = ..., peak_memory_bytes: _Optional[int] = ...) -> None: ...
