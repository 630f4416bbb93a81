"""The executor service end to end: real Redis, real gRPC on free ports, the
emulated backend at 50x speed on a small profile."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis
from factories import make_profile, make_request, make_tiny_memory_profile, make_training
from grpc_health.v1 import health_pb2, health_pb2_grpc
from waiting import wait_until

from lemix._proto.lemix.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from lemix.infra.rpc import EXECUTOR_SERVICE
from lemix.infra.rpc.client import DEFAULT_DEADLINE_S, channel
from lemix.infra.rpc.convert import task_to_proto
from lemix.infra.store.codec import Entry, Fields
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.server import EmbeddedRedis
from lemix.infra.store.store import Store
from lemix.profile import Profile, save_profile
from lemix.types import Task
from services.executor.config import ExecutorConfig
from services.executor.service import ExecutorService

REPO = Path(__file__).resolve().parents[3]
TIME_SCALE = 0.02  # 50x faster than the profile
WAIT_S = 10.0  # upper bound on any wait below; normal runs take milliseconds


def small_profile() -> Profile:
    """make_profile's timing (prefill 0.001 s/token, decode step 0.01 s per
    stage), with room for long requests: 1 GB GPUs, 1 MB of weights per stage
    (a 1 s weight transfer over the 1 MB/s host link)."""
    return make_profile(capacity_bytes=10**9, weight_bytes=10**6, name="executor-test")


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    save_profile(small_profile(), path)
    return path


@pytest.fixture
def weight_sync_dir(tmp_path: Path) -> Path:
    return tmp_path / "weights"


@pytest.fixture
def make_config(
    redis_server: EmbeddedRedis, profile_path: Path, weight_sync_dir: Path
) -> Callable[..., ExecutorConfig]:
    namespace = f"test-{uuid.uuid4().hex[:8]}"

    def make(**overrides: object) -> ExecutorConfig:
        config = ExecutorConfig(
            node_id=3,
            redis_url=redis_server.url,
            namespace=namespace,
            profile_path=profile_path,
            time_scale=TIME_SCALE,
            heartbeat_s=0.05,
            node_ttl_s=0.5,
            shutdown_grace_s=1.0,
            weight_sync_dir=str(weight_sync_dir),
        )
        return replace(config, **overrides)  # type: ignore[arg-type]

    return make


@pytest.fixture
async def store(redis_client: aioredis.Redis, make_config: Callable[..., ExecutorConfig]) -> Store:
    return Store(redis_client, RedisKeys(make_config().namespace))


@pytest.fixture
async def service(make_config: Callable[..., ExecutorConfig]) -> AsyncIterator[ExecutorService]:
    svc = ExecutorService(make_config())
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop(grace_s=0.5)


@pytest.fixture
async def stub(service: ExecutorService) -> AsyncIterator[executor_pb2_grpc.ExecutorStub]:
    async with channel(service.address) as ch:
        yield executor_pb2_grpc.ExecutorStub(ch)


# ------------------------------------------------------------------ helpers


async def dispatch(stub: executor_pb2_grpc.ExecutorStub, task: Task) -> None:
    reply = await stub.Dispatch(
        executor_pb2.DispatchRequest(task=task_to_proto(task)), timeout=DEFAULT_DEADLINE_S
    )
    assert reply.is_accepted


async def read_until_end(store: Store, task_id: str) -> list[Fields]:
    """Every output message of `task_id`, through its `end`."""
    messages: list[Fields] = []
    last_id = "0-0"
    async with asyncio.timeout(WAIT_S):
        while not messages or messages[-1].get("type") != "end":
            entries = await store.read_output(task_id, last_id, block_ms=200)
            for entry_id, fields in entries:
                messages.append(fields)
                last_id = entry_id
    return messages


async def first_message(store: Store, task_id: str) -> Fields:
    async with asyncio.timeout(WAIT_S):
        while True:
            entries = await store.read_output(task_id, "0-0", block_ms=200, count=1)
            if entries:
                return entries[0][1]


async def wait_completion(store: Store, task_id: str) -> Fields:
    last_id = "0-0"
    async with asyncio.timeout(WAIT_S):
        while True:
            entries: list[Entry] = await store.read_completions(last_id, block_ms=200)
            for entry_id, fields in entries:
                last_id = entry_id
                if fields["task_id"] == task_id:
                    return fields


async def wait_stats(store: Store, name: str) -> dict[str, int]:
    async with asyncio.timeout(WAIT_S):
        while name not in (stats := await store.get_stats()):
            await asyncio.sleep(0.01)
    return stats


async def node_state(stub: executor_pb2_grpc.ExecutorStub) -> common_pb2.NodeState:
    return await stub.GetNodeState(executor_pb2.GetNodeStateRequest(), timeout=DEFAULT_DEADLINE_S)


# ------------------------------------------------------------------ tasks


async def test_inference_streams_every_token_then_ends(
    service: ExecutorService, stub: executor_pb2_grpc.ExecutorStub, store: Store
) -> None:
    await dispatch(stub, make_request("inf-a", 0.0, 50, 8))
    messages = await read_until_end(store, "inf-a")
    *tokens, end = messages
    assert tokens[0]["first"] == "1" and tokens[0]["version"] == "0"
    # The last token rides on the end message (one stream entry, not two).
    assert [int(m["n"]) for m in tokens] == list(range(1, 8))
    assert all(m["type"] == "token" and m["node"] == "3" for m in tokens)
    assert end["type"] == "end" and end["status"] == "completed"
    assert end["n"] == "8" and end["is_final"] == "1" and end["reason"] == ""
    completion = await wait_completion(store, "inf-a")
    assert completion["status"] == "completed" and completion["node_id"] == "3"
    state = await store.get_task_state("inf-a")
    assert state["status"] == "completed" and state["num_output_tokens"] == "8"
    # Counters reach Redis with the executor's next heartbeat; the token the
    # end carried counts too.
    stats = await wait_stats(store, "num_completed_inference")
    assert stats["tokens_generated"] == 8 and stats["num_completed_inference"] == 1


async def test_duplicate_dispatch_runs_once(
    service: ExecutorService, stub: executor_pb2_grpc.ExecutorStub, store: Store
) -> None:
    task = make_request("inf-dup", 0.0, 20, 5)
    await dispatch(stub, task)
    await dispatch(stub, task)  # a redelivery: accepted, not run again
    messages = await read_until_end(store, "inf-dup")
    # Once: tokens 1-4, then the end carrying token 5.
    assert [m["n"] for m in messages] == ["1", "2", "3", "4", "5"]
    assert [m["type"] for m in messages] == ["token"] * 4 + ["end"]
    node = service.node
    assert node is not None
    # The end message is written before the node lets the task go.
    await wait_until(lambda: node.held_task("inf-dup") is None, what="inf-dup released")
    await dispatch(stub, task)  # also once it has finished
    # A run would have been queued before the reply: the node holds nothing.
    assert node.held_task("inf-dup") is None
    state = await node_state(stub)
    assert state.num_running == state.num_waiting == 0
    assert len(await store.read_output("inf-dup")) == 5


async def test_training_completes_and_counts_an_update(
    service: ExecutorService, stub: executor_pb2_grpc.ExecutorStub, store: Store
) -> None:
    assert (await node_state(stub)).num_training_updates == 0
    await dispatch(stub, make_training("trn-a", 0.0, 40))
    completion = await wait_completion(store, "trn-a")
    assert completion["status"] == "completed"
    end = (await read_until_end(store, "trn-a"))[-1]
    assert end["status"] == "completed" and end["n"] == "0"
    state = await node_state(stub)
    assert state.num_training_updates == 1
    assert (await wait_stats(store, "num_completed_training"))["num_completed_training"] == 1


async def test_cancel_ends_a_long_request(
    service: ExecutorService, stub: executor_pb2_grpc.ExecutorStub, store: Store
) -> None:
    await dispatch(stub, make_request("inf-long", 0.0, 50, 100_000))
    await first_message(store, "inf-long")  # it is decoding now
    reply = await stub.Cancel(
        common_pb2.CancelRequest(task_id="inf-long", reason="client gone"),
        timeout=DEFAULT_DEADLINE_S,
    )
    assert reply.is_found
    end = (await read_until_end(store, "inf-long"))[-1]
    assert end["status"] == "failed" and end["reason"].startswith("CANCELLED")
    assert 1 <= int(end["n"]) < 100_000
    completion = await wait_completion(store, "inf-long")
    assert completion["status"] == "failed" and completion["reason"].startswith("CANCELLED")
    again = await stub.Cancel(
        common_pb2.CancelRequest(task_id="inf-long"), timeout=DEFAULT_DEADLINE_S
    )
    assert not again.is_found
    state = await node_state(stub)
    assert state.num_running == 0 and state.kv_used_bytes == 0


async def test_requeued_training_can_be_dispatched_again(
    make_config: Callable[..., ExecutorConfig], store: Store, tmp_path: Path
) -> None:
    # 800 B per stage for KV and activations, 1 B per token: a 600-token
    # request leaves no room for a 400-token training task, which is handed
    # back after T_max (no offload) and must run when re-dispatched later.
    path = tmp_path / "tiny.json"
    save_profile(make_tiny_memory_profile(), path)
    svc = ExecutorService(make_config(profile_path=path, is_offload_enabled=False, max_wait_s=0.1))
    await svc.start()
    try:
        async with channel(svc.address) as ch:
            stub = executor_pb2_grpc.ExecutorStub(ch)
            await dispatch(stub, make_request("inf-big", 0.0, 100, 500))
            await first_message(store, "inf-big")
            await dispatch(stub, make_training("trn-r", 0.0, 400))
            completion = await wait_completion(store, "trn-r")
            assert completion["status"] == "requeued" and completion["reason"]
            assert (await store.get_task_state("trn-r")) == {}  # not final: no end
            assert (await read_until_end(store, "inf-big"))[-1]["status"] == "completed"
            await dispatch(stub, make_training("trn-r", 0.0, 400))
            assert (await read_until_end(store, "trn-r"))[-1]["status"] == "completed"
    finally:
        await svc.stop(grace_s=0.1)


# ------------------------------------------------------------------ errors


async def test_invalid_dispatch_is_invalid_argument_and_the_node_keeps_serving(
    service: ExecutorService, stub: executor_pb2_grpc.ExecutorStub, store: Store
) -> None:
    bad = common_pb2.Task(
        task_id="inf-bad",
        kind=common_pb2.TASK_KIND_INFERENCE,
        num_prompt_tokens=10,
        max_output_tokens=0,
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Dispatch(executor_pb2.DispatchRequest(task=bad), timeout=DEFAULT_DEADLINE_S)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "max_output_tokens" in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Cancel(common_pb2.CancelRequest(), timeout=DEFAULT_DEADLINE_S)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    # Still serving: health says so and the next task runs.
    async with channel(service.address) as ch:
        health = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=EXECUTOR_SERVICE), timeout=DEFAULT_DEADLINE_S
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    await dispatch(stub, make_request("inf-ok", 0.0, 10, 2))
    assert (await read_until_end(store, "inf-ok"))[-1]["status"] == "completed"


async def test_task_that_can_never_fit_is_resource_exhausted(
    service: ExecutorService, stub: executor_pb2_grpc.ExecutorStub
) -> None:
    huge = make_request("inf-huge", 0.0, 1_000_000_000, 1)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await dispatch(stub, huge)
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await node_state(stub)).num_waiting == 0


async def test_dispatch_many_takes_each_task_as_its_own_dispatch(
    service: ExecutorService, stub: executor_pb2_grpc.ExecutorStub, store: Store
) -> None:
    bad = common_pb2.Task(
        task_id="inf-bad", kind=common_pb2.TASK_KIND_INFERENCE, num_prompt_tokens=10
    )
    requests = [
        executor_pb2.DispatchRequest(task=task_to_proto(make_request("inf-a", 0.0, 10, 2))),
        executor_pb2.DispatchRequest(task=bad),  # max_output_tokens 0
        executor_pb2.DispatchRequest(task=task_to_proto(make_request("inf-huge", 0.0, 10**9, 1))),
        executor_pb2.DispatchRequest(task=task_to_proto(make_request("inf-b", 0.0, 10, 3))),
    ]
    reply = await stub.DispatchMany(
        executor_pb2.DispatchManyRequest(dispatches=requests), timeout=DEFAULT_DEADLINE_S
    )
    results = [(r.is_accepted, r.error_code) for r in reply.results]
    assert results == [
        (True, ""),
        (False, "INVALID_ARGUMENT"),
        (False, "RESOURCE_EXHAUSTED"),
        (True, ""),
    ]
    assert "max_output_tokens" in reply.results[1].error_message
    for task_id in ("inf-a", "inf-b"):  # the refusals between them hurt neither
        assert (await read_until_end(store, task_id))[-1]["status"] == "completed"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.DispatchMany(executor_pb2.DispatchManyRequest(), timeout=DEFAULT_DEADLINE_S)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def _stream_call(call_id: int, *tasks: common_pb2.Task) -> executor_pb2.DispatchStreamRequest:
    dispatches = [executor_pb2.DispatchRequest(task=t) for t in tasks]
    return executor_pb2.DispatchStreamRequest(
        call_id=call_id, call=executor_pb2.DispatchManyRequest(dispatches=dispatches)
    )


async def test_dispatch_stream_answers_each_call_by_its_id_and_a_bad_call_ends_nothing(
    service: ExecutorService, stub: executor_pb2_grpc.ExecutorStub, store: Store
) -> None:
    bad = common_pb2.Task(
        task_id="inf-bad", kind=common_pb2.TASK_KIND_INFERENCE, num_prompt_tokens=10
    )
    call = stub.DispatchStream()
    await call.write(_stream_call(7, task_to_proto(make_request("inf-s1", 0.0, 10, 2)), bad))
    await call.write(_stream_call(8))  # no dispatches
    await call.write(_stream_call(0, task_to_proto(make_request("inf-s2", 0.0, 10, 2))))  # no id
    await call.write(_stream_call(9, task_to_proto(make_request("inf-s3", 0.0, 10, 2))))
    async with asyncio.timeout(WAIT_S):
        replies = {r.call_id: r for r in [await call.read() for _ in range(4)]}
    assert sorted(replies) == [0, 7, 8, 9]
    assert [(r.is_accepted, r.error_code) for r in replies[7].reply.results] == [
        (True, ""),
        (False, "INVALID_ARGUMENT"),
    ]
    assert replies[8].error_code == "INVALID_ARGUMENT" and "empty" in replies[8].error_message
    assert replies[0].error_code == "INVALID_ARGUMENT" and "call_id" in replies[0].error_message
    assert [r.is_accepted for r in replies[9].reply.results] == [True]
    for task_id in ("inf-s1", "inf-s3"):
        assert (await read_until_end(store, task_id))[-1]["status"] == "completed"
    assert await store.read_output("inf-s2", "0-0", block_ms=None) == []  # never taken
    await call.done_writing()  # the caller closes its side: the stream ends cleanly
    async with asyncio.timeout(WAIT_S):
        assert await call.read() is grpc.aio.EOF
    assert await call.code() is grpc.StatusCode.OK


async def test_open_dispatch_streams_end_when_the_node_stops(
    make_config: Callable[..., ExecutorConfig],
) -> None:
    # A held-open stream would otherwise be cut (CANCELLED) only once the
    # server's stop grace ran out; the node ends it itself, answered.
    svc = ExecutorService(make_config())
    await svc.start()
    async with channel(svc.address) as ch:
        call = executor_pb2_grpc.ExecutorStub(ch).DispatchStream()
        await call.write(_stream_call(1, task_to_proto(make_request("inf-o", 0.0, 10, 2))))
        async with asyncio.timeout(WAIT_S):
            assert (await call.read()).reply.results[0].is_accepted
        await svc.stop(grace_s=0.5)
        async with asyncio.timeout(WAIT_S):
            assert await call.read() is grpc.aio.EOF
        assert await call.code() is grpc.StatusCode.OK


async def test_dispatch_while_stopping_is_unavailable(
    service: ExecutorService, stub: executor_pb2_grpc.ExecutorStub
) -> None:
    assert service.node is not None
    service.node.begin_stop()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await dispatch(stub, make_request("inf-late", 0.0, 10, 2))
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_stop_ends_held_work_unavailable(
    make_config: Callable[..., ExecutorConfig], store: Store
) -> None:
    svc = ExecutorService(make_config())
    await svc.start()
    async with channel(svc.address) as ch:
        stub = executor_pb2_grpc.ExecutorStub(ch)
        await dispatch(stub, make_request("inf-cut", 0.0, 50, 100_000))
        await first_message(store, "inf-cut")
        await svc.stop(grace_s=0.1)
    end = (await read_until_end(store, "inf-cut"))[-1]
    assert end["status"] == "failed" and end["reason"].startswith("UNAVAILABLE")
    assert (await wait_completion(store, "inf-cut"))["status"] == "failed"


# ------------------------------------------------------------------ node state


async def test_heartbeat_advertises_the_node_and_withdraws_on_stop(
    make_config: Callable[..., ExecutorConfig], store: Store
) -> None:
    svc = ExecutorService(make_config(advertise_host="executor-3.internal"))
    await svc.start()
    try:
        assert svc.address == f"executor-3.internal:{svc.bound_port}"
        states = await store.get_node_states()
        assert set(states) == {3}
        fields = states[3]
        assert fields["address"] == svc.address
        assert fields["is_healthy"] == "1" and fields["num_stages"] == "2"
        assert int(fields["memory_capacity_bytes"]) == 900_000_000
        first_now = float(fields["now_s"])

        async def has_beaten_again() -> bool:
            return float((await store.get_node_states())[3]["now_s"]) > first_now

        await wait_until(has_beaten_again, what="a later heartbeat")
    finally:
        await svc.stop(grace_s=0.1)
    async with asyncio.timeout(WAIT_S):
        while await store.get_node_states():
            await asyncio.sleep(0.02)


async def test_get_node_state_reports_the_engine(
    service: ExecutorService, stub: executor_pb2_grpc.ExecutorStub, store: Store
) -> None:
    state = await node_state(stub)
    assert state.node_id == 3 and state.num_stages == 2 and state.is_healthy
    assert state.address == service.address
    assert state.memory_capacity_bytes == 900_000_000
    await dispatch(stub, make_request("inf-run", 0.0, 100, 100_000))
    await first_message(store, "inf-run")
    state = await node_state(stub)
    assert state.num_running == 1
    assert state.sum_context_tokens >= 101
    assert state.kv_used_bytes == 4 * (100 + 100_000)  # reserved for the whole request
    assert 0 < state.max_remaining_decode_tokens < 100_000
    assert 0.0 < state.busy_fraction <= 1.0


# ------------------------------------------------------------------ profiling, weights


async def test_measure_returns_the_profile_latency_within_noise(
    make_config: Callable[..., ExecutorConfig],
) -> None:
    profile = small_profile()
    svc = ExecutorService(make_config(latency_noise_cv=0.05, seed=11))
    await svc.start()
    try:
        async with channel(svc.address) as ch:
            stub = executor_pb2_grpc.ExecutorStub(ch)
            cases = [
                (
                    executor_pb2.MeasureRequest.PHASE_FORWARD,
                    profile.ours.forward_s(1, 2, 100),
                    10**6 + 4 * 2 * 100,
                ),
                (
                    executor_pb2.MeasureRequest.PHASE_BACKWARD,
                    profile.ours.backward_s(1, 2, 100),
                    10**6 + 4 * 2 * 100,
                ),
                (
                    executor_pb2.MeasureRequest.PHASE_DECODE,
                    profile.ours.decode_step_s(1, 2, 300),
                    10**6 + 4 * 300,
                ),
            ]
            for phase, expected_s, peak_bytes in cases:
                reply = await stub.Measure(
                    executor_pb2.MeasureRequest(
                        phase=phase,
                        stage=1,
                        batch_size=2,
                        num_tokens=100,
                        sum_context_tokens=300,
                        num_repeats=400,
                    ),
                    timeout=DEFAULT_DEADLINE_S,
                )
                assert len(reply.latency_s) == 400
                assert statistics.fmean(reply.latency_s) == pytest.approx(expected_s, rel=0.02)
                assert all(0.7 * expected_s < x < 1.4 * expected_s for x in reply.latency_s)
                assert statistics.stdev(reply.latency_s) > 0  # the noise is there
                assert reply.peak_memory_bytes == peak_bytes
            for bad in (
                executor_pb2.MeasureRequest(stage=0, num_tokens=10),  # no phase
                executor_pb2.MeasureRequest(phase=1, stage=2, num_tokens=10),
                executor_pb2.MeasureRequest(phase=1, stage=0, num_tokens=0),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Measure(bad, timeout=DEFAULT_DEADLINE_S)
                assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await svc.stop(grace_s=0.1)


async def test_sync_weights_load_sets_the_served_version(
    service: ExecutorService,
    stub: executor_pb2_grpc.ExecutorStub,
    store: Store,
    weight_sync_dir: Path,
) -> None:
    location = str(weight_sync_dir / "node3-v7")
    save = await stub.SyncWeights(
        executor_pb2.SyncWeightsRequest(
            direction=executor_pb2.SyncWeightsRequest.DIRECTION_SAVE, location=location
        ),
        timeout=DEFAULT_DEADLINE_S,
    )
    # 1 MB per stage over a 1 MB/s link, stages in parallel: 1 profile second.
    assert save.num_bytes == 2 * 10**6
    assert 1.0 <= save.duration_s < 5.0
    await dispatch(stub, make_request("inf-v0", 0.0, 10, 1))
    assert (await first_message(store, "inf-v0"))["version"] == "0"
    load = await stub.SyncWeights(
        executor_pb2.SyncWeightsRequest(
            direction=executor_pb2.SyncWeightsRequest.DIRECTION_LOAD,
            location=location,
            weight_version=7,
        ),
        timeout=DEFAULT_DEADLINE_S,
    )
    assert load.num_bytes == 2 * 10**6 and load.duration_s >= 1.0
    await dispatch(stub, make_request("inf-v7", 0.0, 10, 3))
    first = await first_message(store, "inf-v7")
    assert first["first"] == "1" and first["version"] == "7"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SyncWeights(executor_pb2.SyncWeightsRequest(), timeout=DEFAULT_DEADLINE_S)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_sync_weights_outside_the_sync_dir_is_refused(
    service: ExecutorService,
    stub: executor_pb2_grpc.ExecutorStub,
    weight_sync_dir: Path,
    tmp_path: Path,
) -> None:
    """Anyone reaching the port could otherwise overwrite served weights or
    write files anywhere the executor may: every escape is INVALID_ARGUMENT,
    whether by absolute path, `..`, or a symlink planted inside the dir."""
    outside = tmp_path / "outside"
    outside.mkdir()
    weight_sync_dir.mkdir()
    (weight_sync_dir / "link").symlink_to(outside, target_is_directory=True)
    root = weight_sync_dir.resolve()
    escapes = [
        "/etc/lemix",
        str(outside),
        f"{weight_sync_dir}/../outside",
        "../outside",
        f"{weight_sync_dir}/link/v1",
        f"{weight_sync_dir}x/v1",
    ]
    for direction in (
        executor_pb2.SyncWeightsRequest.DIRECTION_SAVE,
        executor_pb2.SyncWeightsRequest.DIRECTION_LOAD,
    ):
        for location in escapes:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.SyncWeights(
                    executor_pb2.SyncWeightsRequest(
                        direction=direction, location=location, weight_version=1
                    ),
                    timeout=DEFAULT_DEADLINE_S,
                )
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, location
            assert f"location must be under {root}" in (info.value.details() or ""), location
    assert list(outside.iterdir()) == []
    # A path that wanders but stays inside is fine (and so is a relative one).
    for location in (f"{weight_sync_dir}/a/../node3-v1", "node3-v1"):
        reply = await stub.SyncWeights(
            executor_pb2.SyncWeightsRequest(
                direction=executor_pb2.SyncWeightsRequest.DIRECTION_SAVE, location=location
            ),
            timeout=DEFAULT_DEADLINE_S,
        )
        assert reply.num_bytes == 2 * 10**6, location


async def test_sync_weights_average_confines_every_source(
    service: ExecutorService,
    stub: executor_pb2_grpc.ExecutorStub,
    weight_sync_dir: Path,
) -> None:
    """Replica sync's AVERAGE reads each source: one outside the directory is
    refused like a location; no sources at all is refused too."""
    average = executor_pb2.SyncWeightsRequest.DIRECTION_AVERAGE
    own = f"{weight_sync_dir}/replicas/node0"
    for sources in ([own, "/etc/lemix"], [own, "../outside"], []):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SyncWeights(
                executor_pb2.SyncWeightsRequest(direction=average, location=own, sources=sources),
                timeout=DEFAULT_DEADLINE_S,
            )
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, sources
    # Emulated: the stages are occupied for reading every replica, two here.
    reply = await stub.SyncWeights(
        executor_pb2.SyncWeightsRequest(
            direction=average, location=own, sources=[own, f"{weight_sync_dir}/replicas/node1"]
        ),
        timeout=DEFAULT_DEADLINE_S,
    )
    assert reply.num_bytes == 2 * 2 * 10**6  # both replicas' weights


async def test_service_token_is_required_except_for_health(
    make_config: Callable[..., ExecutorConfig],
) -> None:
    token = "executor-test-token-0123456789abcdef"
    svc = ExecutorService(make_config(service_token=token))
    await svc.start()
    try:
        async with channel(svc.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await executor_pb2_grpc.ExecutorStub(ch).GetNodeState(
                    executor_pb2.GetNodeStateRequest(), timeout=DEFAULT_DEADLINE_S
                )
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert "LEMIX_SERVICE_TOKEN" in (info.value.details() or "")
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=EXECUTOR_SERVICE), timeout=DEFAULT_DEADLINE_S
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        async with channel(svc.address, service_token=token) as ch:
            state = await executor_pb2_grpc.ExecutorStub(ch).GetNodeState(
                executor_pb2.GetNodeStateRequest(), timeout=DEFAULT_DEADLINE_S
            )
            assert state.node_id == 3
    finally:
        await svc.stop(grace_s=0.1)


# ------------------------------------------------------------------ config


def test_config_reads_env_and_flags_with_flags_winning(tmp_path: Path) -> None:
    env = {
        "LEMIX_NODE_ID": "5",
        "LEMIX_REDIS_URL": "redis://r:6380/1",
        "LEMIX_TIME_SCALE": "0.5",
        "LEMIX_OFFLOAD": "false",
        "LEMIX_JOIN_WINDOW_S": "",
        "LEMIX_LOG_FORMAT": "json",
        "LEMIX_PROFILE": str(tmp_path / "p.json"),
    }
    config = ExecutorConfig.from_env_and_args(["--node-id", "6", "--port", "7001"], env=env)
    assert config.node_id == 6 and config.port == 7001
    assert config.redis_url == "redis://r:6380/1" and config.time_scale == 0.5
    assert config.is_offload_enabled is False and config.join_window_s is None
    assert config.log_format == "json" and config.profile_path == tmp_path / "p.json"
    assert config.heartbeat_ttl_s == pytest.approx(1.5)  # 3 x the 0.5 s default
    engine = config.engine_config(make_profile())
    assert engine.emit_tokens and not engine.memory.is_offload_enabled
    assert ExecutorConfig.from_env_and_args(["--offload"], env=env).is_offload_enabled
    assert config.service_token == "" and config.weight_sync_dir == "/tmp/lemix-weights"
    token = "from-the-environment-0123456789"
    secured = ExecutorConfig.from_env_and_args(
        [],
        env={
            **env,
            "LEMIX_SERVICE_TOKEN": token,
            "LEMIX_WEIGHT_SYNC_DIR": "/var/lib/lemix/weights",
        },
    )
    assert secured.service_token == token and secured.weight_sync_dir == "/var/lib/lemix/weights"
    assert token not in repr(secured)  # configs get logged; the secret must not be


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"LEMIX_NODE_ID": "x"}, "LEMIX_NODE_ID"),
        ([], {"LEMIX_OFFLOAD": "maybe"}, "LEMIX_OFFLOAD"),
        (["--time-scale", "0"], {}, "time_scale"),
        (["--backend", "tpu"], {}, "backend"),
        (["--backend", "torch", "--time-scale", "0.5"], {}, "time_scale"),
        (["--heartbeat-s", "1", "--node-ttl-s", "0.5"], {}, "node_ttl_s"),
        (["--kappa", "1.5"], {}, "kappa"),
        (["--redis-url", "localhost:6379"], {}, "redis_url"),
        (["--namespace", "a b"], {}, "namespace"),
        ([], {"LEMIX_SERVICE_TOKEN": "short"}, "LEMIX_SERVICE_TOKEN must be at least 16"),
        (["--weight-sync-dir", ""], {}, "weight_sync_dir"),
    ],
)
def test_config_rejects_bad_values(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExecutorConfig.from_env_and_args(argv, env=env)


# ------------------------------------------------------------------ the process


def _subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEMIX_")}
    env.update(extra)
    return env


def test_help_exits_zero() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.executor", "--help"],
        cwd=REPO,
        env=_subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "--redis-url" in result.stdout and "LEMIX_REDIS_URL" in result.stdout


def test_bad_setting_exits_two() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.executor", "--time-scale", "-1"],
        cwd=REPO,
        env=_subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "time_scale" in result.stderr


async def _spawn(config: ExecutorConfig) -> tuple[asyncio.subprocess.Process, str]:
    """Start `python -m services.executor` from env vars; return it and its address."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.executor",
        "--node-id",
        str(config.node_id),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_subprocess_env(
            LEMIX_REDIS_URL=config.redis_url,
            LEMIX_NAMESPACE=config.namespace,
            LEMIX_PROFILE=str(config.profile_path),
            LEMIX_TIME_SCALE=str(TIME_SCALE),
            LEMIX_HEARTBEAT_S="0.05",
            LEMIX_NODE_TTL_S="0.3",
            LEMIX_LOG_FORMAT="json",
        ),
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode()
    prefix = f"SERVING executor node={config.node_id} address="
    assert line.startswith(prefix), line
    address, *rest = line[len(prefix) :].split()
    assert rest and rest[0].startswith("metrics="), line  # the CLI serves metrics on a free port
    return proc, address


async def test_process_serves_until_sigterm_and_exits_zero(
    make_config: Callable[..., ExecutorConfig], store: Store
) -> None:
    proc, address = await _spawn(make_config(node_id=4))
    try:
        assert (await store.get_node_states())[4]["address"] == address
        async with channel(address) as ch:
            stub = executor_pb2_grpc.ExecutorStub(ch)
            await dispatch(stub, make_request("inf-proc", 0.0, 20, 4))
        assert (await read_until_end(store, "inf-proc"))[-1]["status"] == "completed"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, stderr.decode()
    logs = [json.loads(line) for line in stderr.decode().splitlines() if line.strip()]
    assert any(entry["event"] == "executor.stopped" for entry in logs)
    assert 4 not in await store.get_node_states()


async def test_killed_process_node_state_expires(
    make_config: Callable[..., ExecutorConfig], store: Store
) -> None:
    proc, _ = await _spawn(make_config(node_id=5))
    assert 5 in await store.get_node_states()
    proc.kill()  # no goodbye: only the heartbeat TTL (0.3 s) tells
    await proc.wait()
    async with asyncio.timeout(WAIT_S):
        while 5 in await store.get_node_states():
            await asyncio.sleep(0.05)
