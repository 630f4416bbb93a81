"""The executor's gRPC servicer: validate -> convert -> delegate to `ExecutorNode`.

No logic lives here. Domain errors (`InvalidArgument`, `ResourceExhausted`,
`Unavailable`) become status codes in `lemix.infra.rpc.errors.handle_errors`, which
maps them. SyncWeights' location (and an average's sources) are checked
here, before the node sees them: they must lie under the weight-sync directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
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
        # Set once the node stops: open DispatchStreams answer what they read
        # and end, so the server's stop does not wait out its grace for them.
        self._is_ending_streams = asyncio.Event()

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
        return await self._dispatch_many(request)

    async def _dispatch_many(
        self, request: executor_pb2.DispatchManyRequest
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
    async def DispatchStream(
        self,
        requests: AsyncIterator[executor_pb2.DispatchStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Each request a DispatchMany, answered as it finishes (they run
        concurrently: one waiting for a stale attempt to leave holds up no
        other). Ends when the caller closes its side or the node stops, once
        what was read is answered."""
        writing = asyncio.Lock()  # one write at a time on the stream
        calls: set[asyncio.Task[None]] = set()

        async def answer(request: executor_pb2.DispatchStreamRequest) -> None:
            reply = await self._stream_call(request)
            try:
                async with writing:
                    await context.write(reply)
            except Exception as exc:  # the stream is gone: its caller counts the call unanswered
                log.info(
                    "executor.dispatch_stream_write_failed", error=f"{type(exc).__name__}: {exc}"
                )

        async def read() -> None:
            async for request in requests:
                call = asyncio.create_task(answer(request))
                calls.add(call)
                call.add_done_callback(calls.discard)

        reading = asyncio.create_task(read())
        ending = asyncio.create_task(self._is_ending_streams.wait())
        try:
            await asyncio.wait((reading, ending), return_when=asyncio.FIRST_COMPLETED)
            if reading.done():
                reading.result()  # a malformed request: the stream's error
            else:  # the node stops: read no more
                reading.cancel()
            while calls:
                await asyncio.gather(*calls)
        finally:
            for task in (reading, ending, *calls):
                task.cancel()

    async def _stream_call(
        self, request: executor_pb2.DispatchStreamRequest
    ) -> executor_pb2.DispatchStreamResponse:
        try:
            if not request.call_id:
                raise InvalidArgument("DispatchStreamRequest.call_id is 0; number calls from 1")
            reply = await self._dispatch_many(request.call)
        except Exception as exc:  # the call's own status; the stream goes on
            code, message = status_for(exc, "ExecutorServicer.DispatchStream")
            return executor_pb2.DispatchStreamResponse(
                call_id=request.call_id, error_code=code.name, error_message=message
            )
        return executor_pb2.DispatchStreamResponse(call_id=request.call_id, reply=reply)

    def end_streams(self) -> None:
        """The node stops: every open DispatchStream answers what it read and ends."""
        self._is_ending_streams.set()

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
