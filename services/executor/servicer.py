"""The executor's gRPC servicer: validate -> convert -> delegate to `ExecutorNode`.

No logic lives here. Domain errors (`InvalidArgument`, `ResourceExhausted`,
`Unavailable`) become status codes in `lemix.infra.rpc.errors.handle_errors`, which
maps them. SyncWeights' location (and an average's sources) are checked
here, before the node sees them: they must lie under the weight-sync directory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc.aio
import structlog

from lemix._proto.lemix.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from lemix.infra.rpc.convert import node_state_to_proto
from lemix.infra.rpc.errors import InvalidArgument, handle_errors, status_for
from services.executor.convert import (
    dispatch_from_proto,
    measure_from_proto,
    measure_to_proto,
    sync_from_proto,
    sync_to_proto,
)
from services.executor.node import ExecutorNode
from services.executor.weights import confine_location

log = structlog.get_logger(__name__)


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, node: ExecutorNode, *, weight_sync_dir: str | Path) -> None:
        self._node = node
        self._weight_sync_dir = weight_sync_dir  # SyncWeights' locations must be under it

    @handle_errors
    async def Dispatch(
        self, request: executor_pb2.DispatchRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.DispatchResponse:
        await self._dispatch(request)
        # A duplicate is accepted too: the node already runs (or ran) it.
        return executor_pb2.DispatchResponse(
            is_accepted=True, is_placement_recorded=self._node.records_placement
        )

    async def _dispatch(self, request: executor_pb2.DispatchRequest) -> None:
        spec = dispatch_from_proto(request)
        is_new = await self._node.accept(spec.task, spec.payload, spec.attempt)
        log.debug(
            "executor.dispatched",
            task_id=spec.task.task_id,
            attempt=spec.attempt,
            is_new=is_new,
            predicted_response_s=request.predicted_response_s,
        )

    @handle_errors
    async def DispatchMany(
        self, request: executor_pb2.DispatchManyRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.DispatchManyResponse:
        if not request.dispatches:
            raise InvalidArgument("DispatchManyRequest.dispatches is empty; send at least one")
        results = []
        for dispatch in request.dispatches:
            try:
                await self._dispatch(dispatch)
            except Exception as exc:  # this task's refusal, as its own Dispatch's status
                code, message = status_for(exc, "ExecutorServicer.DispatchMany")
                results.append(
                    executor_pb2.DispatchResult(error_code=code.name, error_message=message)
                )
            else:
                results.append(
                    executor_pb2.DispatchResult(
                        is_accepted=True, is_placement_recorded=self._node.records_placement
                    )
                )
        return executor_pb2.DispatchManyResponse(results=results)

    @handle_errors
    async def Cancel(
        self, request: common_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.CancelResponse:
        if not request.task_id:
            raise InvalidArgument("task_id is empty; name the task to cancel")
        is_found = self._node.cancel(request.task_id, request.reason)
        log.info(
            "executor.cancel", task_id=request.task_id, is_found=is_found, reason=request.reason
        )
        return common_pb2.CancelResponse(is_found=is_found)

    @handle_errors
    async def GetNodeState(
        self, request: executor_pb2.GetNodeStateRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.NodeState:
        return node_state_to_proto(
            self._node.snapshot(),
            address=self._node.address,
            num_stages=self._node.engine.num_stages,
        )

    @handle_errors
    async def SyncWeights(
        self, request: executor_pb2.SyncWeightsRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.SyncWeightsResponse:
        spec = sync_from_proto(request)
        root = self._weight_sync_dir
        spec = dataclasses.replace(
            spec,
            location=confine_location(spec.location, root),
            sources=tuple(confine_location(s, root) for s in spec.sources),
        )
        result = await self._node.sync_weights(spec)
        return sync_to_proto(result)

    @handle_errors
    async def Measure(
        self, request: executor_pb2.MeasureRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.MeasureResponse:
        return measure_to_proto(await self._node.measure(measure_from_proto(request)))
