"""End to end with a service token: real processes from `lemix.stack.launcher.Stack`,
every one given the same LEMIX_SERVICE_TOKEN. Work flows gateway -> scheduler
-> executor, and profiler -> executor, while a caller without the token is
refused by every internal service."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import grpc.aio
import pytest

from lemix._proto.lemix.v1 import (
    executor_pb2,
    executor_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    profiler_pb2,
    profiler_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from lemix.infra.rpc.client import channel
from lemix.stack.launcher import Stack, StackConfig
from lemix.stack.process import ServiceProcess

TIME_SCALE = 0.05
TOKEN = "e2e-stack-service-token-0123456789"
DEADLINE_S = 30.0


def _address(stack: Stack, name: str) -> str:
    child = stack.child(name)
    assert isinstance(child, ServiceProcess), name
    return child.address


async def test_a_stack_with_a_token_serves_and_refuses_strangers(tmp_path: Path) -> None:
    config = StackConfig(
        num_nodes=1,
        gateway_port=0,
        time_scale=TIME_SCALE,
        log_dir=tmp_path / "logs",
        namespace="e2e-token",
        extra_env={"LEMIX_SERVICE_TOKEN": TOKEN},
    )
    async with Stack(config) as stack:
        # gateway -> scheduler -> executor, each leg carrying the token.
        async with channel(stack.gateway_address) as ch:
            messages = [
                m
                async for m in gateway_pb2_grpc.GatewayStub(ch).Generate(
                    gateway_pb2.GenerateRequest(prompt_token_ids=[1] * 20, max_tokens=4),
                    timeout=DEADLINE_S,
                )
            ]
        assert messages[-1].is_finished and messages[-1].num_output_tokens == 4

        executor = _address(stack, "executor-0")
        calls = {
            "scheduler": lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).GetState(
                scheduler_pb2.GetStateRequest(), timeout=DEADLINE_S
            ),
            "executor-0": lambda ch: executor_pb2_grpc.ExecutorStub(ch).GetNodeState(
                executor_pb2.GetNodeStateRequest(), timeout=DEADLINE_S
            ),
            "profiler": lambda ch: profiler_pb2_grpc.ProfilerStub(ch).RunProfile(
                profiler_pb2.RunProfileRequest(executor_address=executor, name="x"),
                timeout=DEADLINE_S,
            ),
        }
        for name, call in calls.items():
            async with channel(_address(stack, name)) as stranger:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(stranger)
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED, name
        async with channel(_address(stack, "scheduler"), service_token=TOKEN) as ch:
            state = await calls["scheduler"](ch)
            assert state.policy == "lemix"

        # profiler -> executor: a small grid, measured and fitted.
        async with channel(_address(stack, "profiler"), service_token=TOKEN) as ch:
            reply = await profiler_pb2_grpc.ProfilerStub(ch).RunProfile(
                profiler_pb2.RunProfileRequest(
                    executor_address=executor,
                    batch_sizes=[1, 2, 4, 8],
                    num_tokens=[64, 128, 256, 512, 1024],
                    sum_context_tokens=[256, 1024, 4096, 16384, 65536],
                    num_repeats=1,
                    name="e2e-token",
                ),
                timeout=DEADLINE_S,
            )
        assert json.loads(reply.profile_json)["name"] == "e2e-token"
        assert stack.failed_child() is None
