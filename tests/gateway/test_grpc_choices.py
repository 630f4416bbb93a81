"""`GenerateRequest.n` over gRPC (`gateway.grpc_choices`): real gRPC, real
Redis, the fake scheduler playing each choice's task. Texts on the real
model are in test_grpc_stop.py (the emulated executor sends stand-in ids).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
import pytest
from gateway_fakes import FakeScheduler, Script
from prometheus_client import REGISTRY

from gateway.choices import merge
from gateway.grpc_choices import SIBLING_FAILED_REASON
from gateway.service import GatewayService
from lemix._proto.lemix.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from lemix.tokenizer import emulated_token_id

pytestmark = pytest.mark.usefixtures("live_node")

DEADLINE_S = 10.0
SAMPLED = common_pb2.SamplingParams(temperature=1.0)


def _request(n: int, max_tokens: int = 3, **kw: Any) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt="hello world", max_tokens=max_tokens, n=n, **kw)


async def _collect(
    stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest
) -> list[gateway_pb2.GenerateResponse]:
    return [r async for r in stub.Generate(request, timeout=DEADLINE_S)]


def _by_index(responses: list[gateway_pb2.GenerateResponse]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for response in responses:
        tokens.setdefault(response.index, []).extend(response.token_ids)
    return tokens


async def _eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_n_choices_each_stream_to_their_end_with_their_index(
    stub: gateway_pb2_grpc.GatewayStub, fake_scheduler: FakeScheduler
) -> None:
    seeded = common_pb2.SamplingParams(temperature=0.7, seed=5)
    responses = await _collect(stub, _request(3, request_id="multi", sampling=seeded))

    finals = {r.index: r for r in responses if r.is_finished}
    assert sorted(finals) == [0, 1, 2] and sum(r.is_finished for r in responses) == 3
    assert _by_index(responses) == {i: [emulated_token_id(t) for t in range(3)] for i in range(3)}
    assert {i: r.request_id for i, r in finals.items()} == {
        0: "multi",
        1: "multi.1",
        2: "multi.2",
    }
    assert all(r.num_output_tokens == 3 and r.finish_reason == "length" for r in finals.values())
    seeds = {task.task_id: payload.seed for task, payload in fake_scheduler.submitted}
    assert seeds == {"multi": 5, "multi.1": 6, "multi.2": 7}

    # n = 0 and n = 1 are one choice, index 0.
    for n in (0, 1):
        one = await _collect(stub, _request(n))
        assert {r.index for r in one} == {0} and one[-1].is_finished


async def test_unseeded_choices_get_seeds_and_ids_of_their_own(
    stub: gateway_pb2_grpc.GatewayStub, fake_scheduler: FakeScheduler
) -> None:
    responses = await _collect(stub, _request(3, sampling=SAMPLED))
    ids = {r.request_id for r in responses if r.is_finished}
    assert len(ids) == 3 and all(i.startswith("inf-") for i in ids)
    seeds = [payload.seed for _, payload in fake_scheduler.submitted]
    assert len(seeds) == 3 and len(set(seeds)) == 3 and 0 not in seeds


async def test_n_over_the_limit_is_invalid_argument(
    gateway: GatewayService, stub: gateway_pb2_grpc.GatewayStub, fake_scheduler: FakeScheduler
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(stub, _request(17))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "n may be at most 16, got 17"
    assert fake_scheduler.submitted == []
    most = await _collect(stub, _request(16, max_tokens=1))  # the limit itself is served
    assert sorted(r.index for r in most if r.is_finished) == list(range(16))
    assert gateway.servicer.num_in_flight == 0


async def test_a_retry_with_the_same_request_id_replays_every_choice(
    stub: gateway_pb2_grpc.GatewayStub, fake_scheduler: FakeScheduler
) -> None:
    # Unseeded and sampled: each choice's seed derives from its task id, so the
    # retry is the same request (no ALREADY_EXISTS) and is not run again.
    request = _request(2, max_tokens=4, request_id="again", sampling=SAMPLED)
    first = await _collect(stub, request)
    retry = await _collect(stub, request)
    assert _by_index(retry) == _by_index(first) and len(_by_index(first)) == 2
    assert {r.request_id for r in retry} == {"again", "again.1"}
    payloads = {task.task_id: payload for task, payload in fake_scheduler.submitted}
    assert len(fake_scheduler.submitted) == 2 == len(payloads)  # the retry wrote nothing new
    assert payloads["again"].seed != payloads["again.1"].seed

    # Another request under that id is refused.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(stub, _request(2, max_tokens=5, request_id="again"))
    assert info.value.code() is grpc.StatusCode.ALREADY_EXISTS


async def test_a_failed_choice_cancels_the_others_and_ends_the_call(
    gateway: GatewayService, stub: gateway_pb2_grpc.GatewayStub, fake_scheduler: FakeScheduler
) -> None:
    fake_scheduler.script = Script(token_delay_s=0.05)
    fake_scheduler.task_scripts["f.1"] = Script(
        num_tokens=2, token_delay_s=0.05, end_status="failed", end_reason="UNAVAILABLE: node gone"
    )
    received: list[gateway_pb2.GenerateResponse] = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in stub.Generate(
            _request(3, max_tokens=200, request_id="f"), timeout=DEADLINE_S
        ):
            received.append(response)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == "node gone"
    assert {r.index for r in received} == {0, 1, 2}  # it failed after the first tokens
    await _eventually(lambda: gateway.servicer.num_in_flight == 0)
    assert sorted(fake_scheduler.cancelled) == [
        ("f", SIBLING_FAILED_REASON),
        ("f.2", SIBLING_FAILED_REASON),
    ]


async def test_a_choice_refused_before_its_first_token_fails_the_call_before_any_message(
    gateway: GatewayService, stub: gateway_pb2_grpc.GatewayStub, fake_scheduler: FakeScheduler
) -> None:
    fake_scheduler.script = Script(token_delay_s=0.05)
    fake_scheduler.task_scripts["r.2"] = Script(
        num_tokens=0, end_status="rejected", end_reason="RESOURCE_EXHAUSTED: no node fits it"
    )
    call = stub.Generate(_request(3, max_tokens=200, request_id="r"), timeout=DEADLINE_S)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()  # the first read already fails: nothing was sent
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    await _eventually(lambda: gateway.servicer.num_in_flight == 0)
    await _eventually(lambda: len(fake_scheduler.cancelled) == 2)
    assert sorted(fake_scheduler.cancelled_ids()) == ["r", "r.1"]


async def test_client_cancel_cancels_every_choice(
    gateway: GatewayService, stub: gateway_pb2_grpc.GatewayStub, fake_scheduler: FakeScheduler
) -> None:
    fake_scheduler.script = Script(token_delay_s=0.05)
    call = stub.Generate(_request(2, max_tokens=200, request_id="c"), timeout=DEADLINE_S)
    seen = {(await call.read()).index for _ in range(4)}
    assert seen == {0, 1}
    call.cancel()
    await _eventually(lambda: len(fake_scheduler.cancelled) == 2)
    await _eventually(lambda: gateway.servicer.num_in_flight == 0)
    assert sorted(fake_scheduler.cancelled) == [
        ("c", "CANCELLED: the client cancelled the call"),
        ("c.1", "CANCELLED: the client cancelled the call"),
    ]


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model_name": "lemix", **labels}) or 0.0


def _counts() -> dict[str, float]:
    """The gateway metrics this process has recorded so far (the default registry)."""
    return {
        "completed": _sample(
            "lemix_gateway_requests_total", kind="inference", outcome="completed", code="OK"
        ),
        "tokens": _sample("lemix_gateway_output_tokens_total"),
        "itl": _sample("lemix_gateway_itl_seconds_count"),
        "length": _sample("lemix_gateway_finish_reasons_total", finish_reason="length"),
        "ttft": _sample("lemix_gateway_ttft_seconds_count"),
    }


async def test_each_choice_counts_its_own_tokens_gaps_and_finish(
    stub: gateway_pb2_grpc.GatewayStub,
) -> None:
    before = _counts()
    responses = await _collect(stub, _request(3, max_tokens=4))
    assert sum(len(r.token_ids) for r in responses) == 3 * 4
    after = _counts()
    assert {name: after[name] - before[name] for name in after} == {
        "completed": 1,  # one request
        "tokens": 3 * 4,
        "itl": 3 * (4 - 1),  # gaps within each choice, not across them
        "length": 3,  # one finish per choice
        "ttft": 1,
    }


async def test_merge_tags_items_and_raises_the_first_failure() -> None:
    async def items(values: list[int], fail: bool = False) -> Any:
        for value in values:
            await asyncio.sleep(0)
            yield value
        if fail:
            raise RuntimeError("boom")

    tagged = [entry async for entry in merge([items([1, 2]), items([3])])]
    assert sorted(tagged) == [(0, 1), (0, 2), (1, 3)]
    assert [v for i, v in tagged if i == 0] == [1, 2]  # each stream's order is kept

    endless_closed = asyncio.Event()

    async def endless() -> Any:
        try:
            while True:
                await asyncio.sleep(0.01)
                yield 0
        finally:
            endless_closed.set()

    with pytest.raises(RuntimeError, match="boom"):
        async for _ in merge([endless(), items([1], fail=True)]):
            pass
    assert endless_closed.is_set()  # its reader was cancelled before the error came out
