from lemix._proto.lemix.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATE_UNKNOWN: _ClassVar[TaskState]
    TASK_STATE_QUEUED: _ClassVar[TaskState]
    TASK_STATE_PLACED: _ClassVar[TaskState]
    TASK_STATE_RUNNING: _ClassVar[TaskState]
    TASK_STATE_COMPLETED: _ClassVar[TaskState]
    TASK_STATE_FAILED: _ClassVar[TaskState]
    TASK_STATE_REJECTED: _ClassVar[TaskState]
    TASK_STATE_CANCELLED: _ClassVar[TaskState]
TASK_STATE_UNKNOWN: TaskState
TASK_STATE_QUEUED: TaskState
TASK_STATE_PLACED: TaskState
TASK_STATE_RUNNING: TaskState
TASK_STATE_COMPLETED: TaskState
TASK_STATE_FAILED: TaskState
TASK_STATE_REJECTED: TaskState
TASK_STATE_CANCELLED: TaskState

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "max_tokens", "sampling", "reference", "stop", "n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: _common_pb2.SamplingParams
    reference: str
    stop: _containers.RepeatedScalarFieldContainer[str]
    n: int
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., reference: _Optional[str] = ..., stop: _Optional[_Iterable[str]] = ..., n: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "is_finished", "finish_reason", "ttft_s", "e2e_s", "node_id", "num_output_tokens", "inference_loss", "weight_version", "logprobs", "prompt_logprobs", "index", "reference_accuracy")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_LOSS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    is_finished: bool
    finish_reason: str
    ttft_s: float
    e2e_s: float
    node_id: int
    num_output_tokens: int
    inference_loss: float
    weight_version: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    reference_accuracy: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., is_finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., node_id: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., inference_loss: _Optional[float] = ..., weight_version: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., reference_accuracy: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TrainSample(_message.Message):
    __slots__ = ("sample_id", "query", "reference", "token_ids", "num_reference_tokens")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_REFERENCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    query: str
    reference: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_reference_tokens: int
    def __init__(self, sample_id: _Optional[str] = ..., query: _Optional[str] = ..., reference: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_reference_tokens: _Optional[int] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("samples", "batch_size")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[TrainSample]
    batch_size: int
    def __init__(self, samples: _Optional[_Iterable[_Union[TrainSample, _Mapping]]] = ..., batch_size: _Optional[int] = ...) -> None: ...

class TrainResponse(_message.Message):
    __slots__ = ("task_ids",)
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Stats(_message.Message):
    __slots__ = ("num_inference", "num_training", "num_completed_inference", "num_completed_training", "num_rejected", "num_failed", "num_in_flight", "nodes", "num_deferred_training")
    NUM_INFERENCE_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPLETED_INFERENCE_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPLETED_TRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_DEFERRED_TRAINING_FIELD_NUMBER: _ClassVar[int]
    num_inference: int
    num_training: int
    num_completed_inference: int
    num_completed_training: int
    num_rejected: int
    num_failed: int
    num_in_flight: int
    nodes: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeState]
    num_deferred_training: int
    def __init__(self, num_inference: _Optional[int] = ..., num_training: _Optional[int] = ..., num_completed_inference: _Optional[int] = ..., num_completed_training: _Optional[int] = ..., num_rejected: _Optional[int] = ..., num_failed: _Optional[int] = ..., num_in_flight: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[_common_pb2.NodeState, _Mapping]]] = ..., num_deferred_training: _Optional[int] = ...) -> None: ...

class GetTaskRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class WatchTasksRequest(_message.Message):
    __slots__ = ("task_ids", "poll_interval_s", "timeout_s")
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    POLL_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    poll_interval_s: float
    timeout_s: float
    def __init__(self, task_ids: _Optional[_Iterable[str]] = ..., poll_interval_s: _Optional[float] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class TaskInfo(_message.Message):
    __slots__ = ("task_id", "kind", "state", "reason", "node_id", "submitted_at_s", "queued_at_s", "placed_at_s", "finished_at_s", "num_output_tokens", "training_loss", "weight_version", "inference_loss", "is_final")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_AT_S_FIELD_NUMBER: _ClassVar[int]
    PLACED_AT_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_S_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_LOSS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_LOSS_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    kind: _common_pb2.TaskKind
    state: TaskState
    reason: str
    node_id: int
    submitted_at_s: float
    queued_at_s: float
    placed_at_s: float
    finished_at_s: float
    num_output_tokens: int
    training_loss: float
    weight_version: int
    inference_loss: float
    is_final: bool
    def __init__(self, task_id: _Optional[str] = ..., kind: _Optional[_Union[_common_pb2.TaskKind, str]] = ..., state: _Optional[_Union[TaskState, str]] = ..., reason: _Optional[str] = ..., node_id: _Optional[int] = ..., submitted_at_s: _Optional[float] = ..., queued_at_s: _Optional[float] = ..., placed_at_s: _Optional[float] = ..., finished_at_s: _Optional[float] = ..., num_output_tokens: _Optional[int] = ..., training_loss: _Optional[float] = ..., weight_version: _Optional[int] = ..., inference_loss: _Optional[float] = ..., is_final: _Optional[bool] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ("min_age_s", "limit")
    MIN_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    min_age_s: float
    limit: int
    def __init__(self, min_age_s: _Optional[float] = ..., limit: _Optional[int] = ...) -> None: ...

class AuditReply(_message.Message):
    __slots__ = ("tasks", "num_scanned", "is_truncated")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCANNED_FIELD_NUMBER: _ClassVar[int]
    IS_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[TaskInfo]
    num_scanned: int
    is_truncated: bool
    def __init__(self, tasks: _Optional[_Iterable[_Union[TaskInfo, _Mapping]]] = ..., num_scanned: _Optional[int] = ..., is_truncated: _Optional[bool] = ...) -> None: ...
