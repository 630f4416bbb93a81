"""The scheduler service against a real Redis and real gRPC.

The executors are tiny in-test gRPC servers (`FakeExecutor`) that record what
they are sent: a test double of the OTHER service, registered in Redis with a
heartbeat exactly as a real executor registers itself.
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis
from factories import make_profile
from grpc_health.v1 import health_pb2, health_pb2_grpc
from waiting import wait_until

from lemix._proto.lemix.v1 import (
    common_pb2,
    executor_pb2,
    executor_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from lemix.engine_config import default_prefill_token_budget, default_train_slice_s
from lemix.infra.rpc import EXECUTOR_SERVICE
from lemix.infra.rpc.client import channel
from lemix.infra.rpc.convert import task_to_proto
from lemix.infra.rpc.server import start_server, stop_server
from lemix.infra.store.codec import encode_fields
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.server import EmbeddedRedis
from lemix.infra.store.store import Store
from lemix.infra.store.task_fields import task_from_fields, task_to_fields
from lemix.infra.store.task_hash import GATEWAY_ID_METADATA
from lemix.planner.planner import Planner
from lemix.planner.recording import (
    decision_key,
    recorded_decision_keys,
    replay,
    task_from_event,
)
from lemix.planner.registry import build_planner
from lemix.types import Placement, Task, TaskKind, TaskPayload
from services.scheduler.codec import events_from_entries
from services.scheduler.config import SchedulerConfig, env_table, from_env_and_args
from services.scheduler.recovery import START_MARKER
from services.scheduler.service import SchedulerService

REPO = Path(__file__).resolve().parents[3]
PROFILE = make_profile()
TIMEOUT_S = 5.0


# ------------------------------------------------------------------ doubles


class FakeExecutor(executor_pb2_grpc.ExecutorServicer):
    """Records Dispatch/Cancel/SyncWeights; accepts everything.

    It knows neither DispatchStream nor DispatchMany, like an executor older
    than both: the scheduler falls back to one Dispatch per task, so the
    variants below need to override `Dispatch` alone. The stream itself is
    tested in test_dispatcher.py and, with real executors, by tests/faults
    and tests/e2e."""

    def __init__(self) -> None:
        self.dispatched: list[executor_pb2.DispatchRequest] = []
        self.cancelled: list[common_pb2.CancelRequest] = []
        self.syncs: list[executor_pb2.SyncWeightsRequest] = []

    async def Dispatch(
        self, request: executor_pb2.DispatchRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.DispatchResponse:
        self.dispatched.append(request)
        return executor_pb2.DispatchResponse(is_accepted=True)

    async def Cancel(
        self, request: common_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.CancelResponse:
        self.cancelled.append(request)
        return common_pb2.CancelResponse(is_found=request.task_id in self.dispatched_ids)

    async def SyncWeights(
        self, request: executor_pb2.SyncWeightsRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.SyncWeightsResponse:
        self.syncs.append(request)
        return executor_pb2.SyncWeightsResponse()

    @property
    def dispatched_ids(self) -> list[str]:
        return [r.task.task_id for r in self.dispatched]


@dataclass
class Stack:
    """One namespace: a test-side Store, fake executors, the service under test."""

    redis_url: str
    store: Store
    namespace: str
    executors: dict[int, FakeExecutor] = field(default_factory=dict)
    servers: list[Any] = field(default_factory=list)
    services: list[SchedulerService] = field(default_factory=list)
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    def config(self, **overrides: Any) -> SchedulerConfig:
        base: dict[str, Any] = {
            "redis_url": self.redis_url,
            "namespace": self.namespace,
            "policy": "lemix",
            "num_nodes": 2,
            "slo_ttft_s": 1.0,
            "slo_tbt_s": 0.5,
            "node_poll_s": 0.05,
            "read_block_s": 0.1,
            "shutdown_grace_s": 0.5,
            "dispatch_deadline_s": 1.0,
            "consumer": "test-scheduler",
        }
        return SchedulerConfig(**{**base, **overrides})

    async def start_executor(self, node_id: int) -> FakeExecutor:
        fake = FakeExecutor()
        server, port, health = await start_server(
            [(executor_pb2_grpc.add_ExecutorServicer_to_server, fake)],
            "127.0.0.1",
            0,
            service_names=[EXECUTOR_SERVICE],
        )
        self.servers.append((server, health))
        await self.heartbeat(node_id, f"127.0.0.1:{port}")
        self.executors[node_id] = fake
        return fake

    async def heartbeat(self, node_id: int, address: str, ttl_s: float = 30.0) -> None:
        await self.store.put_node_state(
            node_id,
            {
                "node_id": node_id,
                "address": address,
                "is_healthy": True,
                "num_stages": 2,
                "memory_capacity_bytes": 10_000,
            },
            ttl_s=ttl_s,
        )

    async def start_service(self, **overrides: Any) -> SchedulerService:
        service = SchedulerService(self.config(**overrides), profile=PROFILE)
        self.services.append(service)
        await service.start()
        return service

    def stub(self, service: SchedulerService) -> scheduler_pb2_grpc.SchedulerStub:
        ch = channel(service.address)
        self.channels.append(ch)
        return scheduler_pb2_grpc.SchedulerStub(ch)

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()
        for service in self.services:
            await service.stop(grace_s=0.1)
        for server, health in self.servers:
            await stop_server(server, health, grace_s=0.1)


@pytest.fixture
async def stack(redis_server: EmbeddedRedis, redis_client: aioredis.Redis) -> AsyncIterator[Stack]:
    namespace = f"sched-{uuid.uuid4().hex[:8]}"
    s = Stack(redis_server.url, Store(redis_client, RedisKeys(namespace)), namespace)
    try:
        yield s
    finally:
        await s.close()


def inference(
    task_id: str, prompt: int = 40, output: int = 8, seq: int = 0, ids: bool = False
) -> common_pb2.Task:
    payload = TaskPayload(
        prompt_token_ids=tuple(range(prompt)) if ids else (), temperature=0.7, top_p=0.9, seed=11
    )
    return task_to_proto(Task(task_id, TaskKind.INFERENCE, 0.0, prompt, output, seq=seq), payload)


def training(task_id: str, tokens: int = 50, seq: int = 0) -> common_pb2.Task:
    return task_to_proto(
        Task(task_id, TaskKind.TRAINING, 0.0, tokens, 0, seq=seq),
        TaskPayload(reference_token_ids=(1, 2, 3)),
    )


async def submit(
    stub: scheduler_pb2_grpc.SchedulerStub, task: common_pb2.Task, *, gateway_id: str = ""
) -> scheduler_pb2.SubmitResponse:
    """Submit `task`; with `gateway_id`, as that gateway does (its lease covers it)."""
    metadata = ((GATEWAY_ID_METADATA, gateway_id),) if gateway_id else None
    return await stub.Submit(
        scheduler_pb2.SubmitRequest(task=task), timeout=TIMEOUT_S, metadata=metadata
    )


async def end_message(store: Store, task_id: str) -> dict[str, str]:
    """The task's final output message (waits for it)."""
    found: dict[str, str] = {}

    async def is_final() -> bool:
        entries = await store.read_output(task_id)
        if entries and entries[-1][1].get("type") == "end":
            found.update(entries[-1][1])
            return True
        return False

    await wait_until(is_final, what=f"the end message of {task_id}")
    return found


def fresh_planner(config: SchedulerConfig) -> Planner:
    return build_planner(config.policy, config.planner_config(PROFILE), PROFILE, config.memory)


async def read_events(store: Store) -> list[dict[str, Any]]:
    return events_from_entries(await store.read_events())


# ------------------------------------------------------------------ codec + config


def test_task_fields_round_trip() -> None:
    task = Task("t-1", TaskKind.INFERENCE, 2.5, 3, 7, batch_size=1, seq=4)
    payload = TaskPayload(
        prompt_token_ids=(5, 6, 7), temperature=0.7, top_p=0.9, ignore_eos=True, seed=3
    )
    encoded = encode_fields(task_to_fields(task, payload, submit_t=1.0))
    assert encoded["prompt_token_ids"] == "5,6,7" and encoded["kind"] == "inference"
    assert task_from_fields(encoded) == (task, payload)
    assert task_from_fields(encoded, arrival_s=9.0)[0].arrival_s == 9.0
    batch = TaskPayload(prompt_token_ids=(1, 2, 3), sample_lengths=(2, 1), reference_lengths=(1, 0))
    training = Task("t-2", TaskKind.TRAINING, 0.0, 2, batch_size=2)
    assert task_from_fields(encode_fields(task_to_fields(training, batch))) == (training, batch)


def test_config_flags_override_env_and_env_overrides_defaults() -> None:
    env = {"LEMIX_POLICY": "mix-rr", "LEMIX_NUM_NODES": "3", "LEMIX_REDIS_URL": "redis://x:1/0"}
    config = from_env_and_args(["--num-nodes", "5", "--port", "7000"], env)
    assert (config.policy, config.num_nodes, config.port) == ("mix-rr", 5, 7000)
    assert config.redis_url == "redis://x:1/0"
    with pytest.raises(ValueError, match="LEMIX_NUM_NODES"):
        from_env_and_args([], {"LEMIX_NUM_NODES": "many"})
    with pytest.raises(ValueError, match="unknown policy"):
        from_env_and_args(["--policy", "nope"], {})
    assert all(env_var.startswith("LEMIX_") for _, env_var, _ in env_table())


def test_the_planner_models_the_executors_engine_from_the_shared_variables() -> None:
    # The executors' engine v2 variables reach the scheduler's planner config,
    # resolved against the profile the same way the executors resolve them.
    env = {
        "LEMIX_NUM_MICRO_BATCHES": "auto",
        "LEMIX_PREFILL_TOKEN_BUDGET": "auto",
        "LEMIX_TRAIN_SLICE_S": "0.02",
        "LEMIX_BATCH_CAP": "micro-batch",
        "LEMIX_MAX_BATCH_SIZE": "16",
    }
    planner = from_env_and_args([], env).planner_config(PROFILE)
    assert planner.num_micro_batches == PROFILE.num_stages
    assert planner.prefill_token_budget == default_prefill_token_budget(PROFILE)
    assert planner.max_training_slice_s == 0.02
    assert planner.max_running_per_node == 16 * PROFILE.num_stages
    default = SchedulerConfig().planner_config(PROFILE)  # engine v2
    assert default.num_micro_batches == PROFILE.num_stages
    assert default.prefill_token_budget == default_prefill_token_budget(PROFILE)
    assert default.max_training_slice_s == default_train_slice_s(PROFILE)
    assert default.is_batch_cap_per_micro_batch
    v1_env = {
        "LEMIX_NUM_MICRO_BATCHES": "1",
        "LEMIX_PREFILL_TOKEN_BUDGET": "off",
        "LEMIX_TRAIN_SLICE_S": "off",
    }
    v1 = from_env_and_args([], v1_env).planner_config(PROFILE)
    assert (v1.num_micro_batches, v1.prefill_token_budget, v1.max_training_slice_s) == (
        1,
        None,
        None,
    )
    assert v1.max_running_per_node == v1.max_batch_size
    with pytest.raises(ValueError, match="LEMIX_BATCH_CAP"):
        from_env_and_args([], {"LEMIX_BATCH_CAP": "sometimes"})
    with pytest.raises(ValueError, match="num_micro_batches"):
        SchedulerConfig(num_micro_batches=-1)


def test_homed_training_and_admission_reach_the_planner_from_the_environment() -> None:
    env = {
        "LEMIX_NUM_NODES": "4",
        "LEMIX_TRAIN_RATE": "0.3",
        "LEMIX_TRAINING_NODES": "auto",
        "LEMIX_ADMISSION": "cluster",
    }
    planner = from_env_and_args([], env).planner_config(PROFILE)
    assert planner.num_training_nodes == 1 and planner.training_node_ids == (3,)
    assert planner.is_admission_cluster_wide
    default = SchedulerConfig().planner_config(PROFILE)
    assert default.num_training_nodes is None and not default.is_admission_cluster_wide
    with pytest.raises(ValueError, match="training nodes"):
        from_env_and_args([], {**env, "LEMIX_TRAINING_NODES": "9"})
    with pytest.raises(ValueError, match="admission"):
        from_env_and_args([], {**env, "LEMIX_ADMISSION": "everywhere"})


def test_derived_slo_uses_compute_slo() -> None:
    from lemix.slo import SloConfig, compute_slo

    config = SchedulerConfig(slo_multiplier=3.0, slo_prompt_tokens=100, slo_output_tokens=40)
    reference = [Task("r", TaskKind.INFERENCE, 0.0, 100, 40)]
    assert config.slo(PROFILE) == compute_slo(PROFILE, reference, SloConfig(3.0))
    assert SchedulerConfig().slo(PROFILE) == compute_slo(PROFILE, [], SloConfig())
    assert SchedulerConfig(slo_ttft_s=2.0, slo_tbt_s=0.1).slo(PROFILE).ttft_s == 2.0


def test_help_exits_zero() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.scheduler", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "LEMIX_REDIS_URL" in result.stdout


# ------------------------------------------------------------------ intake → dispatch


async def test_submit_dispatches_the_task_to_the_live_executor(stack: Stack) -> None:
    fake = await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1)
    stub = stack.stub(service)
    reply = await submit(stub, inference("r1", prompt=6, ids=True))
    assert reply.task_id == "r1" and not reply.is_duplicate
    await wait_until(lambda: fake.dispatched_ids == ["r1"], what="dispatch")
    sent = fake.dispatched[0].task
    assert list(sent.prompt_token_ids) == list(range(6))
    assert sent.sampling.temperature == 0.7 and sent.sampling.seed == 11
    assert sent.kind == common_pb2.TASK_KIND_INFERENCE and sent.max_output_tokens == 8
    await wait_until(lambda: _state_is(stack.store, "r1", "placed"), what="placed state")
    assert (await stack.store.get_task_state("r1"))["node_id"] == "0"
    state = await stub.GetState(scheduler_pb2.GetStateRequest(), timeout=TIMEOUT_S)
    assert (state.policy, state.num_placed, state.num_rejected) == ("lemix", 1, 0)
    assert [n.node_id for n in state.nodes] == [0] and state.nodes[0].address
    await wait_until(lambda: _pending_is(stack.store, 0), what="acked")


async def test_get_state_leaves_out_a_node_whose_heartbeat_is_malformed(stack: Stack) -> None:
    await stack.start_executor(0)
    # Node 1 heartbeats with a counter no executor writes (lemix.infra.store.heartbeat).
    await stack.store.put_node_state(
        1, {"address": "127.0.0.1:1", "num_running": "many"}, ttl_s=30.0
    )
    service = await stack.start_service(num_nodes=2)
    state = await stack.stub(service).GetState(scheduler_pb2.GetStateRequest(), timeout=TIMEOUT_S)
    assert [n.node_id for n in state.nodes] == [0]


async def _state_is(store: Store, task_id: str, status: str) -> bool:
    return (await store.get_task_state(task_id)).get("status") == status


async def test_duplicate_submit_is_reported_and_dispatched_once(stack: Stack) -> None:
    fake = await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1)
    stub = stack.stub(service)
    assert not (await submit(stub, inference("dup"))).is_duplicate
    assert (await submit(stub, inference("dup"))).is_duplicate
    await wait_until(lambda: fake.dispatched_ids == ["dup"], what="dispatch")
    assert (await submit(stub, inference("dup"))).is_duplicate
    # The intake is in order: once a later task is dispatched, a second "dup"
    # would have been too.
    await submit(stub, inference("after"))
    await wait_until(lambda: "after" in fake.dispatched_ids, what="the later dispatch")
    assert fake.dispatched_ids == ["dup", "after"]


async def test_invalid_task_is_invalid_argument_and_the_service_stays_healthy(stack: Stack) -> None:
    fake = await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1)
    stub = stack.stub(service)
    bad = [
        common_pb2.Task(task_id="x", kind=common_pb2.TASK_KIND_UNSPECIFIED, num_prompt_tokens=1),
        common_pb2.Task(
            task_id="",
            kind=common_pb2.TASK_KIND_INFERENCE,
            num_prompt_tokens=1,
            max_output_tokens=1,
        ),
        common_pb2.Task(
            task_id="has space",
            kind=common_pb2.TASK_KIND_INFERENCE,
            num_prompt_tokens=1,
            max_output_tokens=1,
        ),
        common_pb2.Task(
            task_id="z",
            kind=common_pb2.TASK_KIND_INFERENCE,
            num_prompt_tokens=0,
            max_output_tokens=1,
        ),
    ]
    for task in bad:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await submit(stub, task)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, task
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Submit(scheduler_pb2.SubmitRequest(), timeout=TIMEOUT_S)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    for gateway_id in ("has space", "g" * 201):  # a gateway names itself with a short token
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await submit(stub, inference("named"), gateway_id=gateway_id)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, gateway_id
    health = health_pb2_grpc.HealthStub(stack.channels[-1])
    check = await health.Check(
        health_pb2.HealthCheckRequest(service="lemix.v1.Scheduler"), timeout=TIMEOUT_S
    )
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    await submit(stub, inference("ok"))
    await wait_until(lambda: fake.dispatched_ids == ["ok"], what="dispatch after bad input")


async def test_no_live_executor_ends_the_task_unavailable(stack: Stack) -> None:
    service = await stack.start_service(num_nodes=1)
    stub = stack.stub(service)
    await submit(stub, inference("lonely"))
    end = await end_message(stack.store, "lonely")
    assert end["status"] in ("failed", "rejected") and end["reason"].startswith("UNAVAILABLE")
    assert end["type"] == "end" and end["is_final"] == "1"
    state = await stack.store.get_task_state("lonely")
    assert state["is_final"] == "1" and state["reason"].startswith("UNAVAILABLE")


async def test_unreachable_executor_fails_the_task_unavailable(stack: Stack) -> None:
    from lemix.infra.store.server import find_free_port

    await stack.heartbeat(0, f"127.0.0.1:{find_free_port()}")  # nobody listens there
    service = await stack.start_service(num_nodes=1, dispatch_deadline_s=0.5, dispatch_retry_s=0.3)
    stub = stack.stub(service)
    await submit(stub, inference("gone"))
    end = await end_message(stack.store, "gone")
    # Moved off the dead node, and with no other node: rejected, with the reason.
    assert end["status"] == "rejected" and end["reason"].startswith("UNAVAILABLE")
    assert service.live_node_ids == []
    # The executor comes back (a new heartbeat, a new address): after the
    # pause the node gets work again.
    fake = await stack.start_executor(0)
    await wait_until(lambda: service.live_node_ids == [0], what="node 0 re-admitted")
    await submit(stub, inference("back"))
    await wait_until(lambda: fake.dispatched_ids == ["back"], what="dispatch after re-admit")


async def test_too_big_task_is_rejected_resource_exhausted(stack: Stack) -> None:
    await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1)
    await submit(stack.stub(service), inference("huge", prompt=5_000))
    end = await end_message(stack.store, "huge")
    assert end["status"] == "rejected" and end["reason"].startswith("RESOURCE_EXHAUSTED")


async def test_node_appearing_later_gets_work(stack: Stack) -> None:
    service = await stack.start_service(num_nodes=1)
    fake = await stack.start_executor(0)  # heartbeat after the scheduler started
    await wait_until(lambda: service.live_node_ids == [0], what="node 0 up")
    await submit(stack.stub(service), inference("late"))
    await wait_until(lambda: fake.dispatched_ids == ["late"], what="dispatch")


# ------------------------------------------------------------------ completions


async def test_requeued_training_is_dispatched_again(stack: Stack) -> None:
    fake = await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1)
    await submit(stack.stub(service), training("t1"))
    await wait_until(lambda: fake.dispatched_ids == ["t1"], what="first dispatch")
    assert list(fake.dispatched[0].task.reference_token_ids) == [1, 2, 3]
    await stack.store.append_completion(
        {"task_id": "t1", "node_id": 0, "status": "requeued", "reason": ""}
    )
    await wait_until(lambda: fake.dispatched_ids == ["t1", "t1"], what="second dispatch")
    assert list(fake.dispatched[1].task.reference_token_ids) == [1, 2, 3]  # payload kept
    # A redelivered (stale) report for another node changes nothing.
    await stack.store.append_completion(
        {"task_id": "t1", "node_id": 1, "status": "completed", "reason": ""}
    )
    await stack.store.append_completion(
        {"task_id": "t1", "node_id": 0, "status": "completed", "reason": ""}
    )
    await wait_until(lambda: not service.core.knows("t1"), what="t1 finished")
    assert service._payloads == {}
    cursor = await stack.store.get_completions_cursor()
    assert cursor != "0-0"


async def test_replica_sync_saves_then_averages_on_every_training_node(stack: Stack) -> None:
    fakes = [await stack.start_executor(0), await stack.start_executor(1)]
    service = await stack.start_service(
        policy="mix-rr", replica_sync_every_tasks=2, weight_sync_dir="/w"
    )
    await wait_until(lambda: service.live_node_ids == [0, 1], what="both nodes up")
    stub = stack.stub(service)
    for i in range(2):
        await submit(stub, training(f"t{i}", seq=i))
    await wait_until(
        lambda: sorted(fakes[0].dispatched_ids + fakes[1].dispatched_ids) == ["t0", "t1"],
        what="both dispatched",
    )
    for fake, node_id in ((fakes[0], 0), (fakes[1], 1)):
        for task_id in fake.dispatched_ids:
            await stack.store.append_completion(
                {"task_id": task_id, "node_id": node_id, "status": "completed", "reason": ""}
            )
    await wait_until(lambda: all(len(f.syncs) == 2 for f in fakes), what="save + average")
    request = executor_pb2.SyncWeightsRequest
    for node_id, fake in enumerate(fakes):
        save, average = fake.syncs
        assert save.direction == request.DIRECTION_SAVE
        assert save.location == f"/w/replicas/node{node_id}"
        assert average.direction == request.DIRECTION_AVERAGE
        assert average.location == save.location
        assert list(average.sources) == ["/w/replicas/node0", "/w/replicas/node1"]


async def test_completion_without_task_id_is_skipped_unread(stack: Stack) -> None:
    fake = await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1)
    await submit(stack.stub(service), training("t1"))
    await wait_until(lambda: fake.dispatched_ids == ["t1"], what="dispatch")
    # No task id: skipped before its numbers are read, so a bad one is harmless.
    await stack.store.append_completion({"node_id": "x", "attempt": "?", "status": "completed"})
    await stack.store.append_completion(
        {"task_id": "t1", "node_id": 0, "status": "completed", "reason": ""}
    )
    await wait_until(lambda: not service.core.knows("t1"), what="t1 finished")


async def test_malformed_completion_is_skipped_and_later_ones_apply(stack: Stack) -> None:
    fake = await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1)
    await submit(stack.stub(service), training("t1"))
    await submit(stack.stub(service), training("t2"))
    await wait_until(lambda: fake.dispatched_ids == ["t1", "t2"], what="dispatch")
    # t1's entry can never be decoded; it must not hold t2's behind it.
    await stack.store.append_completion(
        {"task_id": "t1", "node_id": "zero", "status": "completed", "reason": ""}
    )
    await stack.store.append_completion(
        {"task_id": "t2", "node_id": 0, "status": "completed", "reason": ""}
    )
    await wait_until(lambda: not service.core.knows("t2"), what="t2 finished")
    assert service.core.knows("t1")


# ------------------------------------------------- tasks a gateway writes itself


async def _write_as_gateway(store: Store, task_id: str, gateway_id: str = "") -> None:
    """Write a task to the intake as a gateway does (no Submit RPC)."""
    fields = task_to_fields(Task(task_id, TaskKind.INFERENCE, 0.0, 40, 8), TaskPayload())
    if gateway_id:
        fields["gateway_id"] = gateway_id
    assert await store.submit_task(fields)


async def test_a_task_the_gateway_wrote_is_taken_as_it_is_and_older_ones_checked(
    stack: Stack,
) -> None:
    fake = await stack.start_executor(0)
    await _write_as_gateway(stack.store, "before")  # before this scheduler read the stream
    service = await stack.start_service(num_nodes=1)
    await _write_as_gateway(stack.store, "after")
    await wait_until(lambda: sorted(fake.dispatched_ids) == ["after", "before"], what="dispatch")
    attempts = {r.task.task_id: r.attempt for r in fake.dispatched}
    # Taken as it is: the attempt number the submit wrote. Checked (a
    # predecessor might have marked it cancelled): numbered again.
    assert attempts == {"after": 1, "before": 2}
    for task_id, attempt in attempts.items():
        assert (await stack.store.get_task_state(task_id))["attempt"] == str(attempt)
    await wait_until(lambda: _pending_is(stack.store, 0), what="both acked")
    assert service.core.num_tasks == 2


async def test_a_task_taken_as_it_is_whose_gateway_holds_no_lease_is_cancelled(
    stack: Stack,
) -> None:
    fake = await stack.start_executor(0)
    await stack.start_service(num_nodes=1, lease_check_s=0.05)
    await _write_as_gateway(stack.store, "orphan", gateway_id="gw-gone")
    await wait_until(lambda: fake.dispatched_ids == ["orphan"], what="dispatch")
    # Nobody reads its output: the lease watch finds that out and cancels it.
    await wait_until(
        lambda: (
            [(c.task_id, c.reason) for c in fake.cancelled]
            == [("orphan", "the gateway streaming this request is gone")]
        ),
        what="the orphan cancelled",
    )


# ------------------------------------------------------------------ cancel


@pytest.mark.parametrize("is_written_by_gateway", [False, True])
async def test_cancel_before_placement_ends_cancelled_without_dispatch(
    stack: Stack, is_written_by_gateway: bool
) -> None:
    """Submitted through the scheduler's RPC, or written to the intake by a
    gateway (taken as it is unless the scheduler was told to check it)."""
    fake = await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1)
    stub = stack.stub(service)

    async def write(task_id: str) -> None:
        if is_written_by_gateway:
            await _write_as_gateway(stack.store, task_id)
        else:
            await submit(stub, inference(task_id))

    # The gateway's deadline fired before the task reached the intake loop.
    reply = await stub.Cancel(
        common_pb2.CancelRequest(task_id="c1", reason="deadline"), timeout=TIMEOUT_S
    )
    assert not reply.is_found
    await write("c1")
    end = await end_message(stack.store, "c1")
    assert end["status"] == "failed" and end["reason"].startswith("CANCELLED")
    await write("c2")
    await wait_until(lambda: fake.dispatched_ids == ["c2"], what="next task dispatched")
    assert "c1" not in fake.dispatched_ids


async def test_cancel_between_the_intake_read_and_the_core_ends_the_task(stack: Stack) -> None:
    """The intake read the entry (no cancel marker yet) and waits for the
    core (busy: its lock held, as by a Dispatch round); the Cancel lands
    then. The task is ended cancelled when the core takes it, never placed."""
    fake = await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1)
    stub = stack.stub(service)
    async with service.core._lock:
        await _write_as_gateway(stack.store, "c3")
        await wait_until(lambda: service._has_unacked_intake, what="intake read the entry")
        reply = await stub.Cancel(
            common_pb2.CancelRequest(task_id="c3", reason="client left"), timeout=TIMEOUT_S
        )
        assert reply.is_found
    end = await end_message(stack.store, "c3")
    assert end["status"] == "failed" and end["reason"] == "CANCELLED: client left"
    await _write_as_gateway(stack.store, "c4")
    await wait_until(lambda: fake.dispatched_ids == ["c4"], what="next task dispatched")
    assert not service.core.knows("c3")


async def test_cancel_after_placement_goes_to_the_executor(stack: Stack) -> None:
    fake = await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1)
    stub = stack.stub(service)
    await submit(stub, inference("p1"))
    await wait_until(lambda: fake.dispatched_ids == ["p1"], what="dispatch")
    reply = await stub.Cancel(
        common_pb2.CancelRequest(task_id="p1", reason="client left"), timeout=TIMEOUT_S
    )
    assert reply.is_found
    assert [(c.task_id, c.reason) for c in fake.cancelled] == [("p1", "client left")]


# ------------------------------------------------------------------ deferred training

# SLOs so tight that any training would hurt the next request: training waits
# in the planner until it ages (max_defer_s), then the timer loop releases it.
DEFERRING = {"slo_ttft_s": 0.001, "slo_tbt_s": 0.001, "max_defer_s": 0.4, "defer_recheck_s": 0.1}


async def test_deferred_training_is_released_by_the_timer(stack: Stack) -> None:
    fake = await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1, **DEFERRING)
    stub = stack.stub(service)
    await submit(stub, inference("load"))
    await wait_until(lambda: fake.dispatched_ids == ["load"], what="inference dispatch")
    await submit(stub, training("slow"))
    await wait_until(lambda: service.core.knows("slow"), what="training taken in")
    state = await stub.GetState(scheduler_pb2.GetStateRequest(), timeout=TIMEOUT_S)
    assert state.num_deferred == 1 and "slow" not in fake.dispatched_ids
    await wait_until(lambda: "slow" in fake.dispatched_ids, what="aged release")
    assert service.core.planner.planner.num_aged_releases == 1


async def test_cancel_of_deferred_training_ends_it_and_it_never_runs(stack: Stack) -> None:
    fake = await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1, **DEFERRING)
    stub = stack.stub(service)
    await submit(stub, inference("load"))
    await wait_until(lambda: fake.dispatched_ids == ["load"], what="inference dispatch")
    await submit(stub, training("doomed"))
    await wait_until(lambda: service.core.knows("doomed"), what="training taken in")
    # A reason that already carries the code (the gateway's, for a stop
    # sequence) is not prefixed twice.
    request = common_pb2.CancelRequest(task_id="doomed", reason="CANCELLED: not needed")
    reply = await stub.Cancel(request, timeout=TIMEOUT_S)
    assert reply.is_found
    end = await end_message(stack.store, "doomed")
    assert end["status"] == "failed" and end["reason"] == "CANCELLED: not needed"
    await wait_until(lambda: not service.core.knows("doomed"), what="dropped at its release")
    assert fake.dispatched_ids == ["load"]
    assert service.core.num_deferred == 0


# ------------------------------------------------------------------ restart + parity


def planner_state(planner: Planner, now_s: float) -> dict[str, Any]:
    """What decides future placements, with expired backward windows pruned alike."""
    views = []
    for view in planner.views:
        v = view.copy()
        v.prune(now_s)
        views.append(
            (
                v.forward_end_s,
                [w.task_id for w in v.windows],
                v.last_arrival_s,
                v.num_lengths,
                v.length_mean,
                sorted(v.requests),
                sorted(v.training_tasks),
                v.num_placed,
                v.num_training_updates,
            )
        )
    return {
        "views": views,
        "deferred": planner.num_deferred,
        "outstanding": {t: planner.node_of(t) for t in planner._task_node},
    }


async def run_some_tasks(stack: Stack, service: SchedulerService) -> None:
    stub = stack.stub(service)
    for i in range(5):
        await submit(stub, inference(f"r{i}", prompt=30 + 20 * i, output=6, seq=i))
    await submit(stub, training("t0", seq=9))
    ids = {f"r{i}" for i in range(5)} | {"t0"}
    await wait_until(
        lambda: {t for f in stack.executors.values() for t in f.dispatched_ids} >= ids,
        what="all dispatched",
    )
    node = service.core.node_of("r1")
    await stack.store.append_completion(
        {"task_id": "r1", "node_id": node, "status": "completed", "reason": ""}
    )
    await wait_until(lambda: not service.core.knows("r1"), what="r1 finished")


async def test_restart_replays_the_log_into_the_same_planner(stack: Stack) -> None:
    await stack.start_executor(0)
    await stack.start_executor(1)
    old = await stack.start_service()
    await run_some_tasks(stack, old)
    await old.stop()
    old_planner = old.core.planner.planner

    new = await stack.start_service()
    new_planner = new.core.planner.planner
    now_s = new.clock()
    assert planner_state(new_planner, now_s) == planner_state(old_planner, now_s)
    assert {t for t in (f"r{i}" for i in range(5)) if new.core.knows(t)} == {"r0", "r2", "r3", "r4"}
    assert new.core.num_placed == old.core.num_placed == 6

    # A new task: the restarted planner decides what the old one would have.
    twin = copy.deepcopy(old_planner)
    await submit(stack.stub(new), inference("after", prompt=77, seq=20))
    await wait_until(lambda: new.core.node_of("after") is not None, what="placement")
    await new.events.flush()  # logged before its intake entry is acked, not before placement
    events = await read_events(stack.store)
    submitted = [
        e for e in events if e.get("input") == "submit" and e["task"]["task_id"] == "after"
    ][0]
    twin.submit(task_from_event(submitted["task"]), submitted["now_s"])
    decisions = twin.plan(submitted["now_s"])
    placement = [d for d in decisions if isinstance(d, Placement)]
    assert [(p.task_id, p.node_id) for p in placement] == [("after", new.core.node_of("after"))]

    # A completion the new scheduler reads for a task the old one placed.
    node = new.core.node_of("r0")
    await stack.store.append_completion(
        {"task_id": "r0", "node_id": node, "status": "completed", "reason": ""}
    )
    await wait_until(lambda: not new.core.knows("r0"), what="r0 finished after restart")

    # PARITY: the whole log (both runs) replayed into a fresh planner.
    await new.snapshot()  # flushes the events
    events = await read_events(stack.store)
    assert sum(START_MARKER in e for e in events) == 2
    replayed = [decision_key(d) for d in replay(events, fresh_planner(new.config))]
    recorded = recorded_decision_keys(events)
    assert replayed == recorded and len(recorded) >= 7


async def test_restart_keeps_the_payload_of_deferred_work(stack: Stack) -> None:
    # The intake entry is deleted once acked: a restarted scheduler finds the
    # payload (token ids, sampling) of work it may dispatch again in the task hash.
    await stack.start_executor(0)
    old = await stack.start_service(num_nodes=1)
    await submit(stack.stub(old), training("tk"))
    await wait_until(lambda: stack.executors[0].dispatched_ids == ["tk"], what="dispatch")
    await old.stop()
    new = await stack.start_service(num_nodes=1)
    assert new.core.knows("tk")
    assert new._payloads["tk"].reference_token_ids == (1, 2, 3)
    await stack.store.append_completion(
        {"task_id": "tk", "node_id": 0, "status": "requeued", "reason": ""}
    )
    await wait_until(
        lambda: stack.executors[0].dispatched_ids == ["tk", "tk"], what="redispatch after restart"
    )
    assert list(stack.executors[0].dispatched[1].task.reference_token_ids) == [1, 2, 3]


async def test_restart_with_another_policy_is_refused(stack: Stack) -> None:
    old = await stack.start_service(num_nodes=1)
    await old.stop()
    service = SchedulerService(stack.config(num_nodes=1, policy="mix-rr"), profile=PROFILE)
    stack.services.append(service)
    with pytest.raises(ValueError, match="policy"):
        await service.start()


async def test_entries_left_pending_by_a_dead_scheduler_are_reclaimed(stack: Stack) -> None:
    fake = await stack.start_executor(0)
    store = stack.store
    await store.ensure_group()
    await store.submit_task(
        task_to_fields(Task("orphan", TaskKind.INFERENCE, 0.0, 10, 2), TaskPayload())
    )
    assert await store.read_intake("dead-scheduler", block_ms=None)  # read, never acked
    assert await store.pending_count() == 1
    await stack.start_service(num_nodes=1)
    await wait_until(lambda: fake.dispatched_ids == ["orphan"], what="reclaimed dispatch")
    await wait_until(lambda: _pending_is(store, 0), what="ack")


async def _pending_is(store: Store, n: int) -> bool:
    return await store.pending_count() == n


async def test_intake_acks_wait_to_be_shared_and_go_once_due(stack: Stack) -> None:
    fake = await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1, intake_ack_delay_s=0.5)
    stub = stack.stub(service)
    await submit(stub, inference("a1"))
    await wait_until(lambda: fake.dispatched_ids == ["a1"], what="a1 dispatched")
    await submit(stub, inference("a2"))
    await wait_until(lambda: fake.dispatched_ids == ["a1", "a2"], what="a2 dispatched")
    # Both handled, neither acked yet: their acks wait to go together.
    assert await stack.store.pending_count() == 2
    # Once due they ride on a read (every 0.1 s here, with nothing to read).
    await wait_until(lambda: _pending_is(stack.store, 0), timeout_s=3.0, what="acked")


async def test_intake_entries_are_acked_only_after_the_events_they_caused_are_stored(
    stack: Stack,
) -> None:
    """Write-ahead: an acked entry's submit and placement are in the event
    log, so a restart never meets a task that is gone from the intake and
    unknown to the log. The acks wait for the log's own store (its
    coalescing, made long here) rather than forcing one."""
    fake = await stack.start_executor(0)
    service = await stack.start_service(num_nodes=1, intake_ack_delay_s=0.05)
    service.events.coalesce_s = 60.0
    await asyncio.sleep(0.1)  # the start's events went out with the old coalescing
    stub = stack.stub(service)
    await submit(stub, inference("w1"))
    await wait_until(lambda: fake.dispatched_ids == ["w1"], what="w1 dispatched")

    def logged_w1(events: list[dict[str, Any]]) -> bool:
        return any(e.get("input") == "submit" and e["task"]["task_id"] == "w1" for e in events)

    await asyncio.sleep(0.5)  # the ack delay and several reads
    assert await stack.store.pending_count() == 1  # not acked: its events are not stored
    assert not logged_w1(await read_events(stack.store))
    await service.events.flush()
    await wait_until(lambda: _pending_is(stack.store, 0), timeout_s=3.0, what="acked")
    logged = await read_events(stack.store)
    assert logged_w1(logged)
    assert any(e.get("output", {}).get("task_id") == "w1" for e in logged)


# ------------------------------------------------------------------ Redis down


async def test_submit_answers_unavailable_when_redis_is_down(stack: Stack) -> None:
    with EmbeddedRedis() as own:
        service = SchedulerService(
            replace(stack.config(num_nodes=1), redis_url=own.url), profile=PROFILE
        )
        stack.services.append(service)
        await service.start()
        stub = stack.stub(service)
        await submit(stub, inference("before"))
    # `own` is stopped here.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await submit(stub, inference("after"))
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------------ the process


async def test_process_prints_serving_and_stops_cleanly_on_sigterm(
    redis_server: EmbeddedRedis,
) -> None:
    env = {
        **os.environ,
        "LEMIX_REDIS_URL": redis_server.url,
        "LEMIX_NAMESPACE": f"proc-{uuid.uuid4().hex[:8]}",
        "LEMIX_READ_BLOCK_S": "0.1",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.scheduler",
        "--port",
        "0",
        "--num-nodes",
        "1",
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("SERVING scheduler address=127.0.0.1:"), line
        address, *rest = line.split("address=", 1)[1].split()
        assert rest and rest[0].startswith("metrics=127.0.0.1:"), line  # --metrics-port 0
        async with channel(address) as ch:
            state = await scheduler_pb2_grpc.SchedulerStub(ch).GetState(
                scheduler_pb2.GetStateRequest(), timeout=TIMEOUT_S
            )
        assert state.policy == "lemix"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
