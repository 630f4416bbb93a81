"""The profiler's gRPC servicer: convert -> delegate to `ProfilerCore` -> convert.

Domain errors become status codes in `lemix.infra.rpc.errors.handle_errors`.
"""

from __future__ import annotations

import grpc.aio

from lemix._proto.lemix.v1 import profiler_pb2, profiler_pb2_grpc
from lemix.infra.rpc.errors import handle_errors
from profiler.convert import job_from_proto, run_to_proto
from profiler.core import ProfilerCore


class ProfilerServicer(profiler_pb2_grpc.ProfilerServicer):
    def __init__(self, core: ProfilerCore) -> None:
        self._core = core

    @handle_errors
    async def RunProfile(
        self, request: profiler_pb2.RunProfileRequest, context: grpc.aio.ServicerContext
    ) -> profiler_pb2.RunProfileResponse:
        return run_to_proto(await self._core.run(job_from_proto(request)))
