"""Isolation at the gateway (issue 12), over real gRPC and a real Redis:
admission takes the in-flight slot before any Redis I/O, counters are
batched, stream leases are renewed and dropped, a stream survives a Redis
connection drop, degenerate sampling is refused, and request ids are scoped
per client and checked against the request they were first used for.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis
from gateway_fakes import FakeScheduler, GatewayFactory, Script, TcpProxy, flushed_stats
from redis.exceptions import ConnectionError as RedisConnectionError
from redis_pool import TEST_POOL_SIZE
from waiting import wait_until

from gateway.service import GatewayService
from gateway.upkeep import StreamLeases
from lemix._proto.lemix.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from lemix.infra.rpc.client import channel
from lemix.infra.store.counters import BatchedCounters
from lemix.infra.store.intake import GatewayHold, SubmitOutcome, TaskIdConflict
from lemix.infra.store.server import EmbeddedRedis, find_free_port
from lemix.infra.store.store import Store
from lemix.infra.store.task_fields import task_to_fields
from lemix.infra.store.task_hash import GATEWAY_ID_FIELD, TASK_ID_FIELD
from lemix.tokenizer import emulated_token_id
from lemix.types import Task, TaskKind, TaskPayload

pytestmark = pytest.mark.usefixtures("live_node")

DEADLINE_S = 10.0


def _generate(
    prompt: str = "hello world", max_tokens: int = 4, **kw: Any
) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, **kw)


async def _collect(
    stub: gateway_pb2_grpc.GatewayStub,
    request: gateway_pb2.GenerateRequest,
    metadata: tuple[tuple[str, str], ...] = (),
) -> list[gateway_pb2.GenerateResponse]:
    return [r async for r in stub.Generate(request, timeout=DEADLINE_S, metadata=metadata)]


async def _read_all(call: Any) -> list[gateway_pb2.GenerateResponse]:
    """The rest of a stream whose first message was `read()`."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


async def _commands_processed(store: Store) -> Counter[str]:
    """Calls per Redis command so far (INFO commandstats)."""
    info = await store.client.info("commandstats")
    return Counter(
        {name.removeprefix("cmdstat_"): int(stats["calls"]) for name, stats in info.items()}
    )


# ------------------------------------------------------------------ admission


async def test_a_flood_gets_results_or_resource_exhausted_without_redis_io(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler, store: Store
) -> None:
    num_requests, max_in_flight = 1500, 4
    fake_scheduler.script = Script(is_held=True)  # the admitted ones stream until cancelled
    # Counters are flushed only when asked: any HINCRBY below is per request.
    gateway = await make_gateway(max_in_flight=max_in_flight, stats_flush_s=3600.0)
    async with channel(gateway.address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        before = await _commands_processed(store)
        calls = [
            stub.Generate(_generate(max_tokens=50), timeout=DEADLINE_S) for _ in range(num_requests)
        ]

        async def first_of(call: Any) -> str:
            try:
                response = await call.read()
            except grpc.aio.AioRpcError as err:
                return f"{err.code().name}: {err.details()}"
            return "OK" if response.num_output_tokens == 1 else f"odd {response}"

        outcomes = await asyncio.gather(*(first_of(call) for call in calls))
        during = await _commands_processed(store) - before
        held = [call for call, outcome in zip(calls, outcomes, strict=True) if outcome == "OK"]
        for call in held:
            call.cancel()
        await wait_until(lambda: gateway.servicer.num_in_flight == 0, timeout_s=5.0)

    kinds = Counter(outcome.partition(":")[0] for outcome in outcomes)
    assert kinds == {"OK": max_in_flight, "RESOURCE_EXHAUSTED": num_requests - max_in_flight}
    assert all("server busy" in o and "retry after" in o for o in outcomes if o != "OK")
    # Refusals touched no Redis: the admitted streams' few commands, no counters.
    assert during["hincrby"] == 0, during
    assert sum(during.values()) < 25 * max_in_flight + 50, during
    stats = await flushed_stats(gateway, store)
    assert stats["requests_rejected_busy"] == num_requests - max_in_flight
    assert stats["requests_received"] == num_requests
    assert stats["num_inference"] == max_in_flight


async def test_counters_reach_redis_in_the_background(
    make_gateway: GatewayFactory, store: Store
) -> None:
    gateway = await make_gateway(stats_flush_s=0.05)
    async with channel(gateway.address) as ch:
        await _collect(gateway_pb2_grpc.GatewayStub(ch), _generate())

    async def flushed() -> bool:
        return (await store.get_stats()).get("num_inference") == 1

    await wait_until(flushed, timeout_s=5.0)


# ------------------------------------------------------------------- leases


async def test_the_gateway_lease_is_renewed_while_it_runs_and_dropped_at_stop(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler, store: Store
) -> None:
    ttl_s = 0.6
    fake_scheduler.script = Script(is_held=True)
    gateway = await make_gateway(stream_lease_ttl_s=ttl_s)
    owner = gateway.servicer.core.leases.owner
    lease = store.keys.gateway_lease(owner)
    async with channel(gateway.address) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(
            _generate(request_id="held-1", max_tokens=50), timeout=DEADLINE_S
        )
        assert (await call.read()).num_output_tokens == 1
        # Submit named this gateway, whose one lease covers the stream.
        assert fake_scheduler.gateway_ids == [owner]
        assert await store.client.get(lease) == owner
        # Held for several TTLs: only renewals keep it.
        deadline_s = time.monotonic() + 3 * ttl_s
        while time.monotonic() < deadline_s:
            assert 0 < await store.client.pttl(lease) <= ttl_s * 1000
            await asyncio.sleep(0.05)
        call.cancel()
        await wait_until(lambda: fake_scheduler.cancelled_ids() == ["held-1"], timeout_s=5.0)
    # The stream leaves the live set as its handler unwinds, after the Cancel.
    await wait_until(lambda: gateway.servicer.core.leases.live_ids == [], timeout_s=5.0)
    assert await store.client.exists(lease)  # the gateway runs on: so does its lease
    await gateway.stop()
    assert not await store.client.exists(lease)


async def test_a_completed_stream_writes_no_lease_and_no_expiry_per_request(
    gateway: GatewayService, fake_scheduler: FakeScheduler, store: Store
) -> None:
    async with channel(gateway.address) as ch:
        responses = await _collect(gateway_pb2_grpc.GatewayStub(ch), _generate(request_id="done-1"))
    assert responses[-1].is_finished
    (task_id,) = [task.task_id for task, _ in fake_scheduler.submitted]
    await wait_until(lambda: gateway.servicer.core.leases.live_ids == [], timeout_s=5.0)
    # The scheduler expires the stream when it sees the task end (this one
    # is fake): the gateway leaves it alone.
    assert await store.client.pttl(store.keys.output(task_id)) == -1
    owner = gateway.servicer.core.leases.owner
    leases = [key async for key in store.client.scan_iter(match=store.keys.gateway_lease("*"))]
    assert leases == [store.keys.gateway_lease(owner)]


# ------------------------------------------------------------------- resume


@pytest.fixture
async def redis_proxy(redis_server: EmbeddedRedis) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy(redis_server.host, redis_server.port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


async def test_stream_resumes_from_the_last_entry_after_a_redis_outage(
    redis_proxy: TcpProxy,
    redis_server: EmbeddedRedis,
    make_gateway: GatewayFactory,
    fake_scheduler: FakeScheduler,
) -> None:
    # (redis_proxy first: set up first, so torn down after the gateway stops)
    num_tokens = 30
    fake_scheduler.script = Script(token_delay_s=0.05)  # ~1.5 s of output
    gateway = await make_gateway(
        redis_url=redis_proxy.url_for(redis_server.url), stream_idle_timeout_s=5.0
    )
    responses = []
    async with channel(gateway.address) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(
            _generate(max_tokens=num_tokens), timeout=DEADLINE_S
        )
        responses.append(await call.read())
        # Every gateway connection to Redis drops, and new ones are refused for
        # longer than the client's own one quick retry covers.
        await redis_proxy.cut()
        await asyncio.sleep(0.6)
        await redis_proxy.restore()
        responses += await _read_all(call)
    # The tokens written during the outage come in one response after it.
    ids = [token_id for r in responses for token_id in r.token_ids]
    assert ids == [emulated_token_id(i) for i in range(num_tokens)]  # none skipped or repeated
    counts = [r.num_output_tokens for r in responses if r.token_ids]
    assert counts == sorted(set(counts)) and counts[-1] == num_tokens
    assert responses[-1].is_finished and responses[-1].finish_reason == "length"
    assert fake_scheduler.cancelled == []


async def test_stream_survives_client_kill_of_its_redis_connections(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler, store: Store
) -> None:
    num_tokens = 20
    fake_scheduler.script = Script(token_delay_s=0.05)
    gateway = await make_gateway()
    async with channel(gateway.address) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(
            _generate(max_tokens=num_tokens), timeout=DEADLINE_S
        )
        responses = [await call.read()]
        for _ in range(3):  # the blocked XREAD's connection, again and again
            for client in await store.client.client_list():
                if client.get("cmd") == "xread":
                    await store.client.client_kill_filter(_id=client["id"])
            await asyncio.sleep(0.1)
        responses += await _read_all(call)
    ids = [token_id for r in responses for token_id in r.token_ids]
    assert ids == [emulated_token_id(i) for i in range(num_tokens)]  # none skipped or repeated
    assert responses[-1].is_finished and fake_scheduler.cancelled == []


async def test_redis_down_past_the_idle_timeout_ends_the_stream_unavailable(
    redis_proxy: TcpProxy,
    redis_server: EmbeddedRedis,
    make_gateway: GatewayFactory,
    fake_scheduler: FakeScheduler,
) -> None:
    # (redis_proxy first: set up first, so torn down after the gateway stops)
    fake_scheduler.script = Script(is_held=True)
    gateway = await make_gateway(
        redis_url=redis_proxy.url_for(redis_server.url), stream_idle_timeout_s=0.5
    )
    async with channel(gateway.address) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(
            _generate(request_id="cut-off", max_tokens=50), timeout=DEADLINE_S
        )
        assert (await call.read()).num_output_tokens == 1
        await redis_proxy.cut()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "state store (Redis) unavailable" in (info.value.details() or "")
    assert fake_scheduler.cancelled_ids() == ["cut-off"]  # no executor keeps running it
    await wait_until(lambda: gateway.servicer.num_in_flight == 0, timeout_s=5.0)


# --------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("sampling", "details"),
    [
        (common_pb2.SamplingParams(temperature=1e-300), "must be 0 (greedy) or in [0.01, 100]"),
        (common_pb2.SamplingParams(temperature=1e6), "must be 0 (greedy) or in [0.01, 100]"),
        (common_pb2.SamplingParams(temperature=float("nan")), "must be a finite number"),
        (common_pb2.SamplingParams(top_p=float("inf")), "sampling.top_p must be in (0, 1]"),
    ],
    ids=["tiny-temperature", "huge-temperature", "nan-temperature", "inf-top-p"],
)
async def test_degenerate_sampling_is_invalid_argument(
    gateway: GatewayService,
    stub: gateway_pb2_grpc.GatewayStub,
    fake_scheduler: FakeScheduler,
    sampling: common_pb2.SamplingParams,
    details: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(stub, _generate(sampling=sampling))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert details in (info.value.details() or "")
    assert fake_scheduler.submitted == []
    responses = await _collect(
        stub, _generate(sampling=common_pb2.SamplingParams(temperature=0.01))
    )  # the floor itself is fine
    assert responses[-1].is_finished


async def test_train_limits_are_invalid_argument_naming_the_limit(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler
) -> None:
    gateway = await make_gateway(max_train_samples=8, max_train_batch_size=4)
    samples = [gateway_pb2.TrainSample(query="q", reference="r") for _ in range(9)]
    async with channel(gateway.address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Train(gateway_pb2.TrainRequest(samples=samples), timeout=DEADLINE_S)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "9 samples in one Train call; the limit (max_train_samples) is 8" in (
            info.value.details() or ""
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Train(
                gateway_pb2.TrainRequest(samples=samples[:8], batch_size=5), timeout=DEADLINE_S
            )
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "batch_size 5 exceeds the limit (max_train_batch_size) of 4" in (
            info.value.details() or ""
        )
        assert fake_scheduler.submitted == []
        reply = await stub.Train(
            gateway_pb2.TrainRequest(samples=samples[:8], batch_size=4), timeout=DEADLINE_S
        )
    assert len(reply.task_ids) == 2


# -------------------------------------------------------------- idempotency


async def test_request_id_reused_for_another_prompt_is_already_exists(
    gateway: GatewayService,
    stub: gateway_pb2_grpc.GatewayStub,
    fake_scheduler: FakeScheduler,
    store: Store,
) -> None:
    first = await _collect(stub, _generate("one prompt", request_id="r-1"))
    again = await _collect(stub, _generate("one prompt", request_id="r-1"))

    def ids(responses: list[gateway_pb2.GenerateResponse]) -> list[int]:
        return [token_id for r in responses for token_id in r.token_ids]

    assert ids(again) == ids(first) and ids(first)  # replayed
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(stub, _generate("a longer, different prompt", request_id="r-1"))
    assert info.value.code() is grpc.StatusCode.ALREADY_EXISTS
    assert info.value.details() == (
        "request_id 'r-1' was already used with a different request; use a new id"
    )
    assert fake_scheduler.cancelled == []
    stats = await flushed_stats(gateway, store)
    assert stats["num_inference"] == 1


async def test_a_conflicting_request_leaves_the_original_stream_alone(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler, store: Store
) -> None:
    fake_scheduler.script = Script(is_held=True)
    gateway = await make_gateway(stream_lease_ttl_s=0.6)
    async with channel(gateway.address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        call = stub.Generate(
            _generate("original", request_id="r-2", max_tokens=50), timeout=DEADLINE_S
        )
        assert (await call.read()).num_output_tokens == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _collect(stub, _generate("an impostor prompt", request_id="r-2"))
        assert info.value.code() is grpc.StatusCode.ALREADY_EXISTS
        await asyncio.sleep(0.1)  # a wrongly dropped lease would be gone by now
        owner = gateway.servicer.core.leases.owner
        assert await store.client.exists(store.keys.gateway_lease(owner))
        assert fake_scheduler.cancelled == []
        call.cancel()


async def test_request_ids_are_scoped_per_client(
    gateway: GatewayService, stub: gateway_pb2_grpc.GatewayStub, fake_scheduler: FakeScheduler
) -> None:
    alice = (("x-client-id", "alice"),)
    bob = (("authorization", "Bearer bob-key"),)
    mine = await _collect(stub, _generate("alice's prompt", request_id="same"), alice)
    theirs = await _collect(stub, _generate("bob's different prompt", request_id="same"), bob)
    anonymous = await _collect(stub, _generate("a third prompt here", request_id="same"))
    ids = {mine[-1].request_id, theirs[-1].request_id, anonymous[-1].request_id}
    assert len(ids) == 3 and anonymous[-1].request_id == "same"
    assert all(i.startswith("same@") for i in ids - {"same"})
    assert "bob-key" not in "".join(ids)  # a hash of the key, never the key


async def test_resubmit_at_another_time_is_a_duplicate_not_a_conflict(store: Store) -> None:
    task = Task(
        "t-time", TaskKind.INFERENCE, arrival_s=0.0, num_prompt_tokens=3, max_output_tokens=4
    )
    payload = TaskPayload(prompt_token_ids=(1, 2, 3), temperature=0.7, seed=5)
    assert await store.submit_task(task_to_fields(task, payload, submit_t=100.0))
    assert not await store.submit_task(task_to_fields(task, payload, submit_t=200.0))
    with pytest.raises(TaskIdConflict):
        await store.submit_task(
            task_to_fields(task, TaskPayload(prompt_token_ids=(1, 2, 4), temperature=0.7, seed=5))
        )


async def test_a_dedupe_marker_without_a_hash_reads_as_the_same_request(store: Store) -> None:
    # Written before hashes existed: the entry id alone.
    await store.client.set(store.keys.dedupe("old-1"), "1700000000000-0", px=60_000)
    task = Task("old-1", TaskKind.INFERENCE, 0.0, 3, 4)
    assert not await store.submit_task(task_to_fields(task, TaskPayload()))


# ----------------------------------------------------------------- upkeep


async def test_a_failed_counter_flush_keeps_its_counts(store: Store) -> None:
    dead = aioredis.Redis(
        port=find_free_port(), decode_responses=True, max_connections=TEST_POOL_SIZE
    )  # nothing listens
    try:
        counters = BatchedCounters(Store(dead, store.keys))
        counters.add("requests_received", 3)
        with pytest.raises(RedisConnectionError):
            await counters.flush()
        assert counters.pending == {"requests_received": 3}
    finally:
        await dead.aclose()
    counters = BatchedCounters(store)
    counters.add("requests_received", 3)
    await counters.flush()
    assert counters.pending == {} and (await store.get_stats())["requests_received"] == 3


async def test_a_request_writes_the_lease_only_when_the_loop_has_not_kept_it(
    store: Store,
) -> None:
    now_s = [100.0]
    leases = StreamLeases(store, "gw-fresh", ttl_s=3.0, clock=lambda: now_s[0])
    lease = store.keys.gateway_lease("gw-fresh")

    def write(task_id: str) -> Callable[[float | None], Awaitable[list[SubmitOutcome]]]:
        """The request's one round trip: the lease (when asked for), then its task."""
        task = Task(task_id, TaskKind.INFERENCE, 0.0, 3, 4)
        fields = {**task_to_fields(task, TaskPayload()), GATEWAY_ID_FIELD: "gw-fresh"}
        return lambda ttl_s: store.submit_tasks(
            [fields], hold=GatewayHold("gw-fresh", lease_ttl_s=ttl_s)
        )

    assert await leases.take("a", write("a")) == [SubmitOutcome.ADDED]
    assert await store.client.get(lease) == "gw-fresh"  # never written: written with "a"
    await store.client.delete(lease)  # so a write would show
    now_s[0] += 0.9  # within one renewal interval (1 s): fresh
    await leases.take("b", write("b"))
    assert not await store.client.exists(lease)
    now_s[0] += 0.2  # the loop's renewal is overdue (renewals failing): written again
    await leases.take("c", write("c"))
    assert await store.client.exists(lease)
    await leases.renew()  # the loop renews: fresh from now
    await store.client.delete(lease)
    await leases.take("d", write("d"))
    assert not await store.client.exists(lease)
    assert [f[TASK_ID_FIELD] for _, f in await store.client.xrange(store.keys.intake_stream)] == [
        "a",
        "b",
        "c",
        "d",
    ]
    assert sorted(leases.live_ids) == ["a", "b", "c", "d"]
    for task_id in ("a", "b", "c", "d"):
        leases.release(task_id)
    assert leases.live_ids == []
    await leases.drop()
    assert not leases.is_fresh
