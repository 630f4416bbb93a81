"""`gateway.reader.OutputReader`: a few blocking XREADs for every followed
stream, a new one or a wake when a stream is added, against a real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from gateway_fakes import FakeScheduler, GatewayFactory

from gateway.reader import OutputReader
from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc
from lemix.infra.rpc.client import channel
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.store import Store
from lemix.tokenizer import emulated_token_id


@pytest.fixture
def own_store(redis_client: aioredis.Redis) -> Store:
    return Store(redis_client, RedisKeys("readertest"))


async def _wait_blocked(reader: OutputReader) -> None:
    async with asyncio.timeout(5.0):
        while not reader.is_waiting:
            await asyncio.sleep(0.005)


async def test_one_read_serves_every_stream_and_a_wake_adds_one(own_store: Store) -> None:
    store = own_store
    reader = OutputReader(store, "gw-1", block_s=30.0, max_lanes=1)
    reader.start()
    try:
        a = reader.follow("a")
        await _wait_blocked(reader)
        # Added while the read blocks without it: the wake (sent with the
        # lease) makes the reader read again, so "b" is served within ms,
        # not after the 30 s block.
        b = reader.follow("b")
        assert reader.claim_wake()
        c = reader.follow("c")
        assert not reader.claim_wake()  # one wake per blocked read
        await store.renew_gateway_lease("gw-1", wake=True)
        await store.append_outputs_batch([("b", {"n": 1}), ("a", {"n": 1}), ("a", {"n": 2})])
        assert [f["n"] for _, f in await b.next(2.0)] == ["1"]
        await store.append_output("c", {"n": 1})
        assert [f["n"] for _, f in await c.next(2.0)] == ["1"]
        assert [f["n"] for _, f in await a.next(2.0)] == ["1", "2"]
        # Two readers of one task (an idempotent retry) each get every entry.
        again = reader.follow("a")
        await store.wake_reader("gw-1")
        assert [f["n"] for _, f in await again.next(2.0)] == ["1", "2"]
        await store.append_output("a", {"n": 3})
        assert [f["n"] for _, f in await a.next(2.0)] == ["3"]
        assert [f["n"] for _, f in await again.next(2.0)] == ["3"]
        reads_before = reader.num_reads
        with pytest.raises(TimeoutError):
            await b.next(0.05)
        for follower in (a, b, c, again):
            reader.unfollow(follower)
        assert reader.num_streams == 0
        assert reader.num_reads - reads_before <= 2  # no polling while idle
    finally:
        await reader.stop()
    assert reader.last_error is None


async def test_a_redis_error_is_retried_from_the_last_entry(
    own_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = own_store
    reader = OutputReader(store, "gw-2", block_s=30.0)
    real = store.read_outputs
    failures = 2

    async def flaky(*args: object, **kwargs: object) -> object:
        nonlocal failures
        if failures:
            failures -= 1
            raise ConnectionError("Redis went away")
        return await real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "read_outputs", flaky)
    await store.append_output("t", {"n": 1})
    reader.start()
    try:
        follower = reader.follow("t")
        await asyncio.sleep(0.01)
        assert reader.last_error is not None and "went away" in reader.last_error
        assert [f["n"] for _, f in await follower.next(5.0)] == ["1"]
        assert reader.last_error is None
    finally:
        await reader.stop()


async def test_the_wake_stream_expires_with_the_leases_and_is_dropped(own_store: Store) -> None:
    store = own_store
    await store.wake_reader("gw-3")
    wake = store.keys.reader_wake("gw-3")
    assert await store.client.xlen(wake) == 1
    await store.wake_reader("gw-3")
    assert await store.client.xlen(wake) == 1  # one entry, ever
    await store.keep_gateway_lease("gw-3", 3.0)
    assert 0 < await store.client.pttl(wake) <= 3000
    await store.drop_reader_wake("gw-3")
    assert not await store.client.exists(wake)


async def test_two_gateways_serve_one_stack_side_by_side(
    make_gateway: GatewayFactory, fake_scheduler: FakeScheduler, live_node: int
) -> None:
    # Gateways scale out: each reads only the streams it serves (its own
    # reader, its own wake stream) against one scheduler and one Redis.
    gateways = [await make_gateway(), await make_gateway()]
    async with channel(gateways[0].address) as ch0, channel(gateways[1].address) as ch1:
        stubs = [gateway_pb2_grpc.GatewayStub(ch0), gateway_pb2_grpc.GatewayStub(ch1)]

        async def generate(i: int) -> list[int]:
            request = gateway_pb2.GenerateRequest(
                request_id=f"two-{i}", prompt_token_ids=[5, 6], max_tokens=3
            )
            stream = stubs[i % 2].Generate(request, timeout=10.0)
            return [t async for r in stream for t in r.token_ids]

        results = await asyncio.gather(*(generate(i) for i in range(16)))
    assert results == [[emulated_token_id(i) for i in range(3)]] * 16
    assert len(fake_scheduler.submitted) == 16
    readers = [g.servicer.core.reader for g in gateways]
    assert readers[0].owner != readers[1].owner
    assert all(r.num_reads > 0 and r.num_streams == 0 for r in readers)


async def test_an_ended_stream_leaves_the_read_before_its_request_unfollows(
    own_store: Store,
) -> None:
    # A read blocked on finished streams alone would cost the next request a
    # wake and a read more: the reader stops reading a stream once its final
    # message was handed over, and idles without a read when nothing is left.
    store = own_store
    reader = OutputReader(store, "gw-4", block_s=30.0)
    reader.start()
    try:
        a = reader.follow("a")
        await _wait_blocked(reader)
        await store.append_output("a", {"n": 1, "is_final": 1})
        assert [f["n"] for _, f in await a.next(2.0)] == ["1"]
        assert a.is_ended
        async with asyncio.timeout(5.0):
            while reader.is_waiting:
                await asyncio.sleep(0.005)
        b = reader.follow("b")  # "a" is still followed (its request has not unfollowed)
        assert not reader.claim_wake()
        await store.append_output("b", {"n": 1})
        assert [f["n"] for _, f in await b.next(2.0)] == ["1"]
        # A second reader of the ended stream (an idempotent retry) reads it from the start.
        again = reader.follow("a")
        await store.wake_reader("gw-4")
        assert [f["n"] for _, f in await again.next(2.0)] == ["1"]
    finally:
        await reader.stop()
    assert reader.last_error is None


async def _wait_reading(reader: OutputReader, num_lanes: int) -> None:
    async with asyncio.timeout(5.0):
        while reader.num_reading < num_lanes:
            await asyncio.sleep(0.005)


async def test_a_stream_added_while_every_lane_reads_gets_a_lane_until_none_is_left(
    own_store: Store,
) -> None:
    # A new lane (one read) instead of a wake and a read again; lanes other
    # than the first end with their streams; past max_lanes, lane 0 is woken.
    store = own_store
    reader = OutputReader(store, "gw-5", block_s=30.0, max_lanes=2)
    reader.start()
    try:
        a = reader.follow("a")
        await _wait_reading(reader, 1)
        b = reader.follow("b")
        assert not reader.claim_wake()
        assert reader.num_lanes == 2
        await _wait_reading(reader, 2)
        await store.append_output("b", {"n": 1, "is_final": 1})
        assert [f["n"] for _, f in await b.next(2.0)] == ["1"]
        async with asyncio.timeout(5.0):
            while reader.num_lanes > 1:  # lane 1's only stream ended
                await asyncio.sleep(0.005)
        c = reader.follow("c")
        assert not reader.claim_wake() and reader.num_lanes == 2
        await _wait_reading(reader, 2)
        d = reader.follow("d")  # both lanes read: "d" joins lane 0, woken
        assert reader.claim_wake()
        assert not reader.claim_wake()  # one wake per blocked read
        assert reader.num_lanes == 2
        await store.wake_reader("gw-5")
        await store.append_outputs_batch([("d", {"n": 1}), ("c", {"n": 2}), ("a", {"n": 3})])
        assert [f["n"] for _, f in await d.next(2.0)] == ["1"]
        assert [f["n"] for _, f in await c.next(2.0)] == ["2"]
        assert [f["n"] for _, f in await a.next(2.0)] == ["3"]
        for follower in (a, b, c, d):
            reader.unfollow(follower)
        assert reader.num_streams == 0
    finally:
        await reader.stop()
    assert reader.last_error is None and reader.num_lanes == 1
