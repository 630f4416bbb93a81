from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RunProfileRequest(_message.Message):
    __slots__ = ("executor_address", "batch_sizes", "num_tokens", "sum_context_tokens", "num_repeats", "name")
    EXECUTOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUM_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_REPEATS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    executor_address: str
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    sum_context_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_repeats: int
    name: str
    def __init__(self, executor_address: _Optional[str] = ..., batch_sizes: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., sum_context_tokens: _Optional[_Iterable[int]] = ..., num_repeats: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class RunProfileResponse(_message.Message):
    __slots__ = ("profile_json", "fit_report_json")
    PROFILE_JSON_FIELD_NUMBER: _ClassVar[int]
    FIT_REPORT_JSON_FIELD_NUMBER: _ClassVar[int]
    profile_json: str
    fit_report_json: str
    def __init__(self, profile_json: _Optional[str] = ..., fit_report_json: _Optional[str] = ...) -> None: ...
