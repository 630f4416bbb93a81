from lemix._proto.lemix.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.Task
    def __init__(self, task: _Optional[_Union[_common_pb2.Task, _Mapping]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("task_id", "is_duplicate")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    IS_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    is_duplicate: bool
    def __init__(self, task_id: _Optional[str] = ..., is_duplicate: _Optional[bool] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerState(_message.Message):
    __slots__ = ("policy", "num_placed", "num_deferred", "num_rejected", "nodes")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    NUM_PLACED_FIELD_NUMBER: _ClassVar[int]
    NUM_DEFERRED_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    policy: str
    num_placed: int
    num_deferred: int
    num_rejected: int
    nodes: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeState]
    def __init__(self, policy: _Optional[str] = ..., num_placed: _Optional[int] = ..., num_deferred: _Optional[int] = ..., num_rejected: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[_common_pb2.NodeState, _Mapping]]] = ...) -> None: ...
