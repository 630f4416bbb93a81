"""`GatewayServicer`: the public gRPC API's handlers. Thin (STYLE rule 7):
every request goes to `gateway.core.GatewayCore` (validation, admission,
Submit, the Redis output stream, cancellation), which the OpenAI-compatible
HTTP API (`gateway.http_api`) shares; Generate's n choices and stop strings
are `gateway.grpc_choices`. Domain errors become status codes in
`lemix.infra.rpc.errors` via `@handle_errors`; a task's failure arrives as
`TaskEnded`, whose code `gateway.convert.status_for_reason` chose. Task
lookups (GetTask, WatchTasks, AuditTasks) go to `gateway.tasks.TaskReader`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

import grpc.aio

from gateway.convert import TaskEnded
from gateway.core import GatewayCore
from gateway.grpc_choices import generate_choices
from gateway.observe import SloCache, observe_generate, observe_train
from gateway.tasks import TaskReader
from gateway.validate import scope_from_headers
from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc
from lemix.infra import telemetry
from lemix.infra.rpc.errors import handle_errors

# A context with less than this left has passed its deadline.
_DEADLINE_SLACK_S = 0.01


def _gone_reason(context: grpc.aio.ServicerContext) -> str:
    """Why a stream's client went away, as a docs/protocol.md failure reason."""
    remaining_s = context.time_remaining()
    if remaining_s is not None and remaining_s <= _DEADLINE_SLACK_S:
        return "DEADLINE_EXCEEDED: the client's deadline passed"
    return "CANCELLED: the client cancelled the call"


def _scope(context: grpc.aio.ServicerContext) -> str:
    """The caller's idempotency scope, from its metadata (`gateway.validate`)."""
    return scope_from_headers(
        {str(key): str(value) for key, value in context.invocation_metadata() or ()}
    )


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Generate / Train / GetStats over a `GatewayCore`; GetTask / WatchTasks /
    AuditTasks over a `gateway.tasks.TaskReader` of the same store."""

    def __init__(self, core: GatewayCore, slo: SloCache | None = None) -> None:
        self.core = core
        self.tasks = TaskReader(core.store)
        # What `@observe_generate` judges requests by (shared with the HTTP API).
        self.slo = slo or SloCache(core.store)
        self.model_name = core.config.served_model_name  # the metrics' model_name label
        telemetry.set_in_flight_source(lambda: self.core.num_in_flight)

    @property
    def num_in_flight(self) -> int:
        """Generate streams (gRPC and HTTP) holding a slot right now."""
        return self.core.num_in_flight

    @handle_errors
    @observe_generate
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        responses = generate_choices(
            self.core,
            request,
            scope=_scope(context),
            received_s=self.core.clock(),
            gone_reason=lambda: _gone_reason(context),
        )
        try:
            # aclosing: a client that goes away closes the choices' streams
            # now, so their tasks are cancelled and their slots released.
            async with contextlib.aclosing(responses):
                async for response in responses:
                    yield response
        except TaskEnded as end:
            await context.abort(end.code, end.details)

    @handle_errors
    @observe_train
    async def Train(
        self, request: gateway_pb2.TrainRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.TrainResponse:
        task_ids = await self.core.train(request, scope=_scope(context))
        return gateway_pb2.TrainResponse(task_ids=task_ids)

    @handle_errors
    async def GetStats(
        self, request: gateway_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.Stats:
        return await self.core.stats()

    @handle_errors
    async def GetTask(
        self, request: gateway_pb2.GetTaskRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.TaskInfo:
        return await self.tasks.get(request.task_id)

    @handle_errors
    async def WatchTasks(
        self, request: gateway_pb2.WatchTasksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[gateway_pb2.TaskInfo, None]:
        updates = self.tasks.watch(request, context.time_remaining)
        async with contextlib.aclosing(updates):
            async for info in updates:
                yield info

    @handle_errors
    async def AuditTasks(
        self, request: gateway_pb2.AuditRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AuditReply:
        return await self.tasks.audit(request)
