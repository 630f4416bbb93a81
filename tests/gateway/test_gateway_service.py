"""The gateway end to end: real gRPC, real Redis, a fake scheduler/executor.

Every error case also checks that the gateway still reports SERVING and
serves a good request afterwards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
import pytest
from gateway_fakes import (
    FAKE_NODE_ID,
    FAKE_WEIGHT_VERSION,
    FakeScheduler,
    GatewayFactory,
    Script,
    flushed_stats,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.service import GatewayService
from lemix._proto.lemix.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from lemix.infra.rpc import GATEWAY_SERVICE
from lemix.infra.rpc.client import channel
from lemix.infra.rpc.server import MAX_MESSAGE_BYTES
from lemix.infra.store.store import Store
from lemix.infra.store.task_fields import task_from_fields
from lemix.tokenizer import ApproxTokenizer, emulated_token_id
from lemix.types import TaskKind

pytestmark = pytest.mark.usefixtures("live_node")

DEADLINE_S = 10.0


def _generate(
    prompt: str = "hello world", max_tokens: int = 4, **kw: Any
) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, **kw)


async def _collect(
    stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest
) -> list[gateway_pb2.GenerateResponse]:
    return [r async for r in stub.Generate(request, timeout=DEADLINE_S)]


async def _status_of(
    stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(stub, request)
    return info.value


async def _assert_still_serving(gateway: GatewayService) -> None:
    """Health says SERVING and a good request streams to its end."""
    async with channel(gateway.address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=GATEWAY_SERVICE), timeout=DEADLINE_S
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        responses = await _collect(gateway_pb2_grpc.GatewayStub(ch), _generate(max_tokens=3))
    assert responses[-1].is_finished and responses[-1].num_output_tokens == 3
    assert gateway.servicer.num_in_flight == 0


async def _eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------ streaming


async def test_generate_streams_max_tokens_then_a_final_message(
    gateway: GatewayService,
    stub: gateway_pb2_grpc.GatewayStub,
    fake_scheduler: FakeScheduler,
    store: Store,
) -> None:
    responses = await _collect(stub, _generate("hello world", max_tokens=5))

    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == [emulated_token_id(i) for i in range(5)]
    assert all(r.text == "" for r in responses)
    first, final = responses[0], responses[-1]
    assert first.ttft_s > 0 and first.node_id == FAKE_NODE_ID
    # Each response's count is the tokens so far (messages read together come as one).
    counts = [r.num_output_tokens for r in responses if r.token_ids]
    assert counts == sorted(set(counts)) and counts[0] == 1
    assert final.is_finished and final.finish_reason == "length"
    assert not any(r.is_finished for r in responses[:-1])
    assert final.num_output_tokens == 5 and final.node_id == FAKE_NODE_ID
    assert final.e2e_s >= first.ttft_s and final.weight_version == FAKE_WEIGHT_VERSION
    assert {r.request_id for r in responses} == {final.request_id}

    ((task, payload),) = fake_scheduler.submitted
    assert task.task_id == final.request_id and task.task_id.startswith("inf-")
    assert task.kind is TaskKind.INFERENCE and task.max_output_tokens == 5
    assert task.num_prompt_tokens == len(ApproxTokenizer().encode("hello world")) == 3
    assert payload.prompt_token_ids == ()  # emulated: approx ids are not sent
    assert (await flushed_stats(gateway, store))["num_inference"] == 1


async def test_request_id_names_the_task_and_token_ids_pass_through(
    stub: gateway_pb2_grpc.GatewayStub, fake_scheduler: FakeScheduler
) -> None:
    request = gateway_pb2.GenerateRequest(
        request_id="client-42",
        prompt_token_ids=[5, 6, 7, 8],
        max_tokens=2,
        sampling=common_pb2.SamplingParams(temperature=0.7, top_p=0.9, seed=11),
    )
    responses = await _collect(stub, request)
    assert responses[-1].request_id == "client-42" and responses[-1].is_finished
    ((task, payload),) = fake_scheduler.submitted
    assert task.task_id == "client-42" and task.num_prompt_tokens == 4
    assert payload.prompt_token_ids == (5, 6, 7, 8)
    assert (payload.temperature, payload.top_p, payload.seed) == (0.7, 0.9, 11)


# ------------------------------------------------------------ invalid input


@pytest.mark.parametrize(
    ("request_", "details"),
    [
        (
            gateway_pb2.GenerateRequest(max_tokens=4),
            "prompt is empty: send prompt text or prompt_token_ids",
        ),
        (
            gateway_pb2.GenerateRequest(prompt_token_ids=[1] * 4096),
            "the prompt (4096 tokens) fills the context limit of 4096 tokens",
        ),
        (
            gateway_pb2.GenerateRequest(prompt_token_ids=[1] * 4000, max_tokens=100),
            "prompt (4000 tokens) + max_tokens (100) = 4100 tokens exceeds the context limit "
            "of 4096 tokens",
        ),
        (
            _generate(sampling=common_pb2.SamplingParams(temperature=-0.5)),
            "sampling.temperature must be a finite number >= 0",
        ),
        (_generate(sampling=common_pb2.SamplingParams(top_p=1.5)), "sampling.top_p must be"),
        (_generate(request_id="has space"), "request_id must not contain whitespace"),
    ],
    ids=[
        "empty-prompt",
        "prompt-fills-context",
        "over-context",
        "temperature",
        "top-p",
        "request-id",
    ],
)
async def test_invalid_requests_are_invalid_argument(
    gateway: GatewayService,
    stub: gateway_pb2_grpc.GatewayStub,
    fake_scheduler: FakeScheduler,
    store: Store,
    request_: gateway_pb2.GenerateRequest,
    details: str,
) -> None:
    err = await _status_of(stub, request_)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert details in (err.details() or "")
    assert fake_scheduler.submitted == []
    assert (await flushed_stats(gateway, store))["requests_rejected_invalid"] == 1
    await _assert_still_serving(gateway)


async def test_oversize_message_is_refused_by_grpc(
    gateway: GatewayService, raw_channel: grpc.aio.Channel, fake_scheduler: FakeScheduler
) -> None:
    stub = gateway_pb2_grpc.GatewayStub(raw_channel)
    err = await _status_of(stub, _generate("x" * (MAX_MESSAGE_BYTES + 1024)))
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert fake_scheduler.submitted == []
    await _assert_still_serving(gateway)


# ---------------------------------------------------------------- admission


async def test_in_flight_over_the_bound_is_resource_exhausted(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler
) -> None:
    gateway = await make_gateway(max_in_flight=1)
    fake_scheduler.script = Script(is_held=True)
    async with channel(gateway.address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        held = stub.Generate(_generate(max_tokens=50), timeout=DEADLINE_S)
        first = await held.read()
        assert first.token_ids and gateway.servicer.num_in_flight == 1

        err = await _status_of(stub, _generate())
        assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.details() == (
            "server busy: 1 requests in flight (limit 1); retry after 1 s with backoff"
        )

        held.cancel()
        await _eventually(lambda: gateway.servicer.num_in_flight == 0)
        assert first.request_id in fake_scheduler.cancelled_ids()
    fake_scheduler.script = Script()
    await _assert_still_serving(gateway)


async def test_no_live_executor_is_unavailable(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler, store: Store
) -> None:
    await store.client.delete(store.keys.node_heartbeat(FAKE_NODE_ID))
    gateway = await make_gateway()
    async with channel(gateway.address) as ch:
        err = await _status_of(gateway_pb2_grpc.GatewayStub(ch), _generate())
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert err.details() == "no live executor: start one with `lemix up` or check the executors"
    assert fake_scheduler.submitted == []
    await store.put_node_state(FAKE_NODE_ID, {"address": "127.0.0.1:1"}, ttl_s=60.0)
    await _assert_still_serving(gateway)


async def test_live_executor_answer_is_cached_for_node_check_s(
    make_gateway: GatewayFactory, store: Store
) -> None:
    gateway = await make_gateway(node_check_s=60.0)
    await _assert_still_serving(gateway)  # caches "live"
    await store.client.delete(store.keys.node_heartbeat(FAKE_NODE_ID))
    await _assert_still_serving(gateway)  # still cached


async def test_no_live_scheduler_is_unavailable_and_writes_nothing(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler, store: Store
) -> None:
    gateway = await make_gateway()
    await fake_scheduler.stop_reading()
    await store.drop_scheduler_alive()  # as a scheduler does when it stops
    async with channel(gateway.address) as ch:
        err = await _status_of(gateway_pb2_grpc.GatewayStub(ch), _generate())
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert err.details() == ("no live scheduler: start one with `lemix up` or check the scheduler")
    assert await store.read_intake_entries() == []
    assert gateway.servicer.num_in_flight == 0


async def test_intake_write_deadline_is_unavailable_and_cancels_the_task(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler, store: Store
) -> None:
    gateway = await make_gateway(submit_deadline_s=0.2)
    await store.client.execute_command("CLIENT", "PAUSE", 1000, "WRITE")  # Redis stalls writes
    async with channel(gateway.address) as ch:
        err = await _status_of(gateway_pb2_grpc.GatewayStub(ch), _generate())
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert "did not take the request within 0.2 s" in (err.details() or "")
    # The write may have landed after all: the gateway cancels the task.
    await _eventually(lambda: len(fake_scheduler.cancelled) == 1)
    assert gateway.servicer.num_in_flight == 0


# ------------------------------------------------------------- task failures


@pytest.mark.parametrize(
    ("reason", "code", "details"),
    [
        (
            "RESOURCE_EXHAUSTED: needs 9 GiB of KV; a node has 8",
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "needs 9 GiB of KV; a node has 8",
        ),
        ("UNAVAILABLE: no live executor", grpc.StatusCode.UNAVAILABLE, "no live executor"),
        ("INVALID_ARGUMENT: prompt too long", grpc.StatusCode.INVALID_ARGUMENT, "prompt too long"),
        ("stage 1 crashed", grpc.StatusCode.INTERNAL, "stage 1 crashed"),
    ],
)
async def test_rejected_task_aborts_with_the_reason_prefix(
    gateway: GatewayService,
    stub: gateway_pb2_grpc.GatewayStub,
    fake_scheduler: FakeScheduler,
    reason: str,
    code: grpc.StatusCode,
    details: str,
) -> None:
    fake_scheduler.script = Script(num_tokens=0, end_status="rejected", end_reason=reason)
    err = await _status_of(stub, _generate())
    assert err.code() is code and err.details() == details
    assert fake_scheduler.cancelled == []  # it ended: nothing to cancel
    fake_scheduler.script = Script()
    await _assert_still_serving(gateway)


async def test_failure_mid_stream_after_tokens(
    gateway: GatewayService, stub: gateway_pb2_grpc.GatewayStub, fake_scheduler: FakeScheduler
) -> None:
    fake_scheduler.script = Script(
        num_tokens=2, end_status="failed", end_reason="UNAVAILABLE: node 7 went away"
    )
    call = stub.Generate(_generate(max_tokens=6), timeout=DEADLINE_S)
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in call:
            received.append(response)
    assert sum(len(r.token_ids) for r in received) == 2  # the tokens before the failure
    assert received[-1].num_output_tokens == 2
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == "node 7 went away"
    fake_scheduler.script = Script()
    await _assert_still_serving(gateway)


async def test_silent_task_times_out_unavailable_and_is_cancelled(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler
) -> None:
    gateway = await make_gateway(stream_idle_timeout_s=0.3)
    fake_scheduler.script = Script(is_held=True)
    async with channel(gateway.address) as ch:
        err = await _status_of(gateway_pb2_grpc.GatewayStub(ch), _generate())
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert "produced no output for 0.3 s" in (err.details() or "")
    await _eventually(lambda: len(fake_scheduler.cancelled) == 1)
    assert gateway.servicer.num_in_flight == 0


# --------------------------------------------------------------- cancellation


async def test_client_cancel_mid_stream_cancels_the_task(
    gateway: GatewayService, stub: gateway_pb2_grpc.GatewayStub, fake_scheduler: FakeScheduler
) -> None:
    fake_scheduler.script = Script(token_delay_s=0.05)
    call = stub.Generate(_generate(max_tokens=200), timeout=DEADLINE_S)
    first = await call.read()
    second = await call.read()
    assert second.num_output_tokens == 2
    call.cancel()

    await _eventually(lambda: first.request_id in fake_scheduler.cancelled_ids())
    await _eventually(lambda: gateway.servicer.num_in_flight == 0)
    ((task_id, reason),) = fake_scheduler.cancelled
    assert task_id == first.request_id and reason.startswith("CANCELLED: ")
    fake_scheduler.script = Script()
    await _assert_still_serving(gateway)


async def test_client_deadline_mid_stream_cancels_the_task(
    gateway: GatewayService, stub: gateway_pb2_grpc.GatewayStub, fake_scheduler: FakeScheduler
) -> None:
    fake_scheduler.script = Script(is_held=True)
    call = stub.Generate(_generate(max_tokens=50), timeout=0.5)
    first = await call.read()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED

    await _eventually(lambda: first.request_id in fake_scheduler.cancelled_ids())
    await _eventually(lambda: gateway.servicer.num_in_flight == 0)
    ((_, reason),) = fake_scheduler.cancelled
    assert reason.startswith("DEADLINE_EXCEEDED: ")
    fake_scheduler.script = Script()
    await _assert_still_serving(gateway)


# -------------------------------------------------------------------- train


def _samples(n: int, *, with_ids: bool = False) -> list[gateway_pb2.TrainSample]:
    return [
        gateway_pb2.TrainSample(
            sample_id=f"s{i}" if with_ids else "", query="q" * (4 * (i + 1)), reference="abcd"
        )
        for i in range(n)
    ]


async def test_train_returns_ids_only_once_every_task_is_in_the_intake(
    gateway: GatewayService,
    stub: gateway_pb2_grpc.GatewayStub,
    fake_scheduler: FakeScheduler,
    store: Store,
) -> None:
    await fake_scheduler.stop_reading()  # the entries stay where the reply found them
    reply = await stub.Train(
        gateway_pb2.TrainRequest(samples=_samples(5), batch_size=2), timeout=DEADLINE_S
    )
    stored = {f["task_id"]: f for _, f in await store.read_intake_entries()}

    assert len(reply.task_ids) == 3 and len(set(reply.task_ids)) == 3
    assert all(task_id.startswith("trn-") for task_id in reply.task_ids)
    assert sorted(stored) == sorted(reply.task_ids)  # durable before the reply
    batches = [task_from_fields(stored[t])[0] for t in reply.task_ids]
    assert [t.batch_size for t in batches] == [2, 2, 1]
    # Samples are query (4, 8, ..., 20 bytes) + 4 bytes: 2..6 tokens; a batch is its longest.
    assert [t.num_prompt_tokens for t in batches] == [3, 5, 6]
    assert all(t.kind is TaskKind.TRAINING for t in batches)
    assert (await flushed_stats(gateway, store))["num_training"] == 3


async def test_train_with_sample_ids_is_idempotent(
    gateway: GatewayService,
    stub: gateway_pb2_grpc.GatewayStub,
    fake_scheduler: FakeScheduler,
    store: Store,
) -> None:
    request = gateway_pb2.TrainRequest(samples=_samples(3, with_ids=True))
    first = await stub.Train(request, timeout=DEADLINE_S)
    again = await stub.Train(request, timeout=DEADLINE_S)
    assert list(first.task_ids) == list(again.task_ids)
    await fake_scheduler.settle()
    assert len(fake_scheduler.submitted) == 3  # the resubmits were duplicates: not written
    assert (await flushed_stats(gateway, store))["num_training"] == 3


@pytest.mark.parametrize(
    ("request_", "details"),
    [
        (gateway_pb2.TrainRequest(), "no samples: send at least one TrainSample"),
        (
            gateway_pb2.TrainRequest(samples=[gateway_pb2.TrainSample(sample_id="a")]),
            "samples[0] is empty",
        ),
    ],
)
async def test_train_invalid_is_invalid_argument(
    stub: gateway_pb2_grpc.GatewayStub,
    fake_scheduler: FakeScheduler,
    request_: gateway_pb2.TrainRequest,
    details: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Train(request_, timeout=DEADLINE_S)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert details in (info.value.details() or "")
    assert fake_scheduler.submitted == []


# -------------------------------------------------------------------- stats


async def test_get_stats_reports_counters_nodes_and_in_flight(
    stub: gateway_pb2_grpc.GatewayStub, store: Store
) -> None:
    await _collect(stub, _generate(max_tokens=2))
    await store.incr_stat("num_completed_inference")  # the scheduler's counter
    stats = await stub.GetStats(gateway_pb2.GetStatsRequest(), timeout=DEADLINE_S)
    assert stats.num_inference == 1 and stats.num_completed_inference == 1
    assert stats.num_in_flight == 0
    (node,) = stats.nodes
    assert node.node_id == FAKE_NODE_ID and node.address == "127.0.0.1:1"
    assert node.num_stages == 2 and node.is_healthy and node.memory_capacity_bytes == 8 << 30


# ----------------------------------------------------------------- shutdown


async def test_stop_lets_in_flight_streams_finish(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler
) -> None:
    gateway = await make_gateway(shutdown_grace_s=5.0)
    fake_scheduler.script = Script(token_delay_s=0.05)
    async with channel(gateway.address) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(
            _generate(max_tokens=10), timeout=DEADLINE_S
        )
        first = await call.read()
        stopping = asyncio.create_task(gateway.stop())
        rest = []
        while (response := await call.read()) is not grpc.aio.EOF:
            rest.append(response)
        await stopping
    assert first.num_output_tokens == 1 and rest[-1].is_finished
    assert rest[-1].num_output_tokens == 10 and fake_scheduler.cancelled == []


async def test_stop_past_the_grace_cancels_the_held_tasks(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler
) -> None:
    gateway = await make_gateway(shutdown_grace_s=0.2)
    fake_scheduler.script = Script(is_held=True)
    async with channel(gateway.address) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(_generate(), timeout=DEADLINE_S)
        first = await call.read()
        await gateway.stop()
        with pytest.raises(grpc.aio.AioRpcError):
            await call.read()
    assert first.request_id in fake_scheduler.cancelled_ids()
    assert gateway.servicer.num_in_flight == 0
