from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_KIND_UNSPECIFIED: _ClassVar[TaskKind]
    TASK_KIND_INFERENCE: _ClassVar[TaskKind]
    TASK_KIND_TRAINING: _ClassVar[TaskKind]

class TaskStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATUS_UNSPECIFIED: _ClassVar[TaskStatus]
    TASK_STATUS_COMPLETED: _ClassVar[TaskStatus]
    TASK_STATUS_REJECTED: _ClassVar[TaskStatus]
    TASK_STATUS_FAILED: _ClassVar[TaskStatus]
TASK_KIND_UNSPECIFIED: TaskKind
TASK_KIND_INFERENCE: TaskKind
TASK_KIND_TRAINING: TaskKind
TASK_STATUS_UNSPECIFIED: TaskStatus
TASK_STATUS_COMPLETED: TaskStatus
TASK_STATUS_REJECTED: TaskStatus
TASK_STATUS_FAILED: TaskStatus

class Task(_message.Message):
    __slots__ = ("task_id", "kind", "arrival_s", "num_prompt_tokens", "max_output_tokens", "batch_size", "seq", "prompt_token_ids", "reference_token_ids", "sampling", "sample_lengths", "reference_lengths")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    kind: TaskKind
    arrival_s: float
    num_prompt_tokens: int
    max_output_tokens: int
    batch_size: int
    seq: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    reference_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    sample_lengths: _containers.RepeatedScalarFieldContainer[int]
    reference_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, task_id: _Optional[str] = ..., kind: _Optional[_Union[TaskKind, str]] = ..., arrival_s: _Optional[float] = ..., num_prompt_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., batch_size: _Optional[int] = ..., seq: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., reference_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., sample_lengths: _Optional[_Iterable[int]] = ..., reference_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "ignore_eos", "seed", "top_logprobs", "prompt_logprobs", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    ignore_eos: bool
    seed: int
    top_logprobs: int
    prompt_logprobs: int
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., ignore_eos: _Optional[bool] = ..., seed: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NodeState(_message.Message):
    __slots__ = ("node_id", "now_s", "num_running", "num_waiting", "sum_context_tokens", "kv_used_bytes", "memory_capacity_bytes", "busy_fraction", "num_training_updates", "is_healthy", "address", "num_stages", "max_remaining_decode_tokens")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NOW_S_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    SUM_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAINING_UPDATES_FIELD_NUMBER: _ClassVar[int]
    IS_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_REMAINING_DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    node_id: int
    now_s: float
    num_running: int
    num_waiting: int
    sum_context_tokens: int
    kv_used_bytes: int
    memory_capacity_bytes: int
    busy_fraction: float
    num_training_updates: int
    is_healthy: bool
    address: str
    num_stages: int
    max_remaining_decode_tokens: int
    def __init__(self, node_id: _Optional[int] = ..., now_s: _Optional[float] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., sum_context_tokens: _Optional[int] = ..., kv_used_bytes: _Optional[int] = ..., memory_capacity_bytes: _Optional[int] = ..., busy_fraction: _Optional[float] = ..., num_training_updates: _Optional[int] = ..., is_healthy: _Optional[bool] = ..., address: _Optional[str] = ..., num_stages: _Optional[int] = ..., max_remaining_decode_tokens: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("task_id", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    reason: str
    def __init__(self, task_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("is_found",)
    IS_FOUND_FIELD_NUMBER: _ClassVar[int]
    is_found: bool
    def __init__(self, is_found: _Optional[bool] = ...) -> None: ...
