"""The executor's gRPC servicer: validate -> convert -> delegate to `ExecutorNode`.

No logic lives here. Domain errors (`InvalidArgument`, `ResourceExhausted`,
`Unavailable`) become status codes in `lemix.rpc.errors.handle_errors`, the
one place that maps them.
"""

from __future__ import annotations

import grpc.aio
import structlog

from lemix._proto.lemix.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from lemix.rpc.convert import node_state_to_proto, task_from_proto
from lemix.rpc.errors import InvalidArgument, handle_errors
from services.executor.convert import (
    measure_from_proto,
    measure_to_proto,
    sync_from_proto,
    sync_to_proto,
)
from services.executor.node import ExecutorNode

log = structlog.get_logger(__name__)


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, node: ExecutorNode) -> None:
        self._node = node

    @handle_errors
    async def Dispatch(
        self, request: executor_pb2.DispatchRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.DispatchResponse:
        task, payload = task_from_proto(request.task)
        is_new = self._node.dispatch(task, payload)
        log.debug("executor.dispatched", task_id=task.task_id, is_new=is_new,
                  predicted_response_s=request.predicted_response_s)
        # A duplicate is accepted too: the node already runs (or ran) it.
        return executor_pb2.DispatchResponse(is_accepted=True)

    @handle_errors
    async def Cancel(
        self, request: common_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.CancelResponse:
        if not request.task_id:
            raise InvalidArgument("task_id is empty; name the task to cancel")
        is_found = self._node.cancel(request.task_id)
        log.info("executor.cancel", task_id=request.task_id, is_found=is_found,
                 reason=request.reason)
        return common_pb2.CancelResponse(is_found=is_found)

    @handle_errors
    async def GetNodeState(
        self, request: executor_pb2.GetNodeStateRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.NodeState:
        return node_state_to_proto(self._node.snapshot(), address=self._node.address,
                                   num_stages=self._node.engine.num_stages)

    @handle_errors
    async def SyncWeights(
        self, request: executor_pb2.SyncWeightsRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.SyncWeightsResponse:
        result = await self._node.sync_weights(sync_from_proto(request))
        return sync_to_proto(result)

    @handle_errors
    async def Measure(
        self, request: executor_pb2.MeasureRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.MeasureResponse:
        return measure_to_proto(await self._node.measure(measure_from_proto(request)))
