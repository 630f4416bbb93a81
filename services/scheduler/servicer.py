"""The Scheduler gRPC servicer: validate -> convert -> delegate -> map errors.

Every method wears `handle_errors` (`lemix.infra.rpc.errors`), which turns domain
errors into status codes (`InvalidArgument` -> INVALID_ARGUMENT, `Unavailable` -> UNAVAILABLE, ...).
The work happens in `SchedulerService`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc.aio
import structlog

from lemix._proto.lemix.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from lemix.infra.rpc.convert import task_from_proto
from lemix.infra.rpc.errors import InvalidArgument, handle_errors
from lemix.infra.store.heartbeat import node_states_from_heartbeats
from lemix.infra.store.task_hash import GATEWAY_ID_METADATA

if TYPE_CHECKING:
    from services.scheduler.service import SchedulerService

log = structlog.get_logger(__name__)

# A gateway id is a short name (`gateway.core.new_gateway_id`); longer is refused.
MAX_GATEWAY_ID_CHARS = 200


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, service: SchedulerService) -> None:
        self._service = service

    @handle_errors
    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitResponse:
        if not request.HasField("task"):
            raise InvalidArgument("SubmitRequest.task is missing")
        task, payload = task_from_proto(request.task)
        # The streaming gateway names itself in metadata (no proto field):
        # its lease then covers the task (`LeaseWatch`).
        gateway_id = ""
        for key, value in context.invocation_metadata() or ():
            if key == GATEWAY_ID_METADATA:
                gateway_id = str(value)
        if gateway_id and (
            len(gateway_id) > MAX_GATEWAY_ID_CHARS
            or not gateway_id.isprintable()
            or any(ch.isspace() for ch in gateway_id)
        ):
            raise InvalidArgument(f"metadata {GATEWAY_ID_METADATA} is not a valid gateway id")
        is_new = await self._service.submit(task, payload, gateway_id=gateway_id)
        return scheduler_pb2.SubmitResponse(task_id=task.task_id, is_duplicate=not is_new)

    @handle_errors
    async def Cancel(
        self, request: common_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.CancelResponse:
        is_found = await self._service.cancel(request.task_id, request.reason)
        return common_pb2.CancelResponse(is_found=is_found)

    @handle_errors
    async def GetState(
        self, request: scheduler_pb2.GetStateRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerState:
        snapshot = await self._service.snapshot()
        nodes, bad = node_states_from_heartbeats(snapshot.nodes)
        for node_id, error in bad.items():  # left out: one bad hash must not hide the others
            log.warning("bad_node_state", node_id=node_id, error=error)
        return scheduler_pb2.SchedulerState(
            policy=snapshot.policy,
            num_placed=snapshot.num_placed,
            num_deferred=snapshot.num_deferred,
            num_rejected=snapshot.num_rejected,
            nodes=nodes,
        )
