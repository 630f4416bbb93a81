"""`stop` and `stop_token_ids` (and min_tokens, penalties, `n`) over gRPC on
the real tiny model (`torch_stack`): the same stop-string matcher as the HTTP
API (`gateway.grpc_stops`), stop token ids ended by the executor, n choices
(`gateway.grpc_choices`; the rest of n is in test_grpc_choices.py)."""

from __future__ import annotations

import grpc
import pytest
from task_stack import TaskStack, eventually
from torch_stack import torch_stack  # noqa: F401 - the fixture

from gateway.grpc_stops import StopFilter
from gateway.openai_stops import STOPPED_REASON
from lemix._proto.lemix.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from lemix.infra.rpc.client import channel
from lemix.infra.rpc.errors import InvalidArgument

PROMPT = "Once upon a time"


async def _generate(
    stub: gateway_pb2_grpc.GatewayStub, **fields: object
) -> list[gateway_pb2.GenerateResponse]:
    sampling = common_pb2.SamplingParams(ignore_eos=True)
    sampling.MergeFrom(fields.pop("sampling", common_pb2.SamplingParams()))  # type: ignore[arg-type]
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPT,
        max_tokens=16,
        sampling=sampling,
        **fields,  # type: ignore[arg-type]
    )
    return [r async for r in stub.Generate(request)]


def _text(responses: list[gateway_pb2.GenerateResponse]) -> str:
    return "".join(r.text for r in responses)


def _ids(responses: list[gateway_pb2.GenerateResponse]) -> list[int]:
    return [i for r in responses for i in r.token_ids]


def _texts(responses: list[gateway_pb2.GenerateResponse]) -> dict[int, str]:
    """Each choice's text, by `index`."""
    texts: dict[int, str] = {}
    for response in responses:
        texts[response.index] = texts.get(response.index, "") + response.text
    return texts


async def _check_n(stub: gateway_pb2_grpc.GatewayStub, stop: str, expected: str) -> None:
    """`n` on the real model: unseeded sampled choices differ; stop strings
    end each choice alone and cancel its task."""
    sampled = await _generate(stub, n=3, sampling=common_pb2.SamplingParams(temperature=1.0))
    texts = _texts(sampled)
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 3, texts
    assert sorted(r.index for r in sampled if r.is_finished) == [0, 1, 2]
    assert len({r.request_id for r in sampled}) == 3

    stopped = await _generate(stub, n=2, stop=[stop])  # greedy: both choices alike
    assert _texts(stopped) == {0: expected, 1: expected}
    assert sorted((r.index, r.finish_reason) for r in stopped if r.is_finished) == [
        (0, "stop"),
        (1, "stop"),
    ]
    for task_id in {r.request_id for r in stopped}:

        async def is_cancelled(task_id: str = task_id) -> bool:
            info = await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id))
            return bool(info.is_final) and info.reason == STOPPED_REASON

        await eventually(is_cancelled, what=f"stopped choice {task_id}'s record")


def test_bad_stop_strings_are_invalid_argument() -> None:
    for stops, match in ((["a"] * 17, "at most 16"), ([""], r"stop\[0\]"), (["x" * 257], "stop")):
        with pytest.raises(InvalidArgument, match=match):
            StopFilter(stops)


async def test_stop_strings_and_token_ids_over_grpc(
    torch_stack: TaskStack,  # noqa: F811 - the fixture imported above
) -> None:
    async with channel(torch_stack.gateways[0].address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        full = await _generate(stub)
        text, ids = _text(full), _ids(full)
        assert full[-1].finish_reason == "length" and len(ids) == 16 and len(text) > 12

        # A stop string from the middle of the greedy text: cut before it.
        stop = text[6:9]
        stopped = await _generate(stub, stop=[stop, "never appears"])
        assert _text(stopped) == text[: text.index(stop)]
        assert stopped[-1].is_finished and stopped[-1].finish_reason == "stop"
        assert sum(r.is_finished for r in stopped) == 1
        assert ids[: len(_ids(stopped))] == _ids(stopped) and len(_ids(stopped)) < 16
        task_id = stopped[-1].request_id

        async def is_cancelled() -> bool:
            info = await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id))
            return bool(info.is_final) and info.reason == STOPPED_REASON

        await eventually(is_cancelled, what="the stopped task's record")

        # A stop token id: the executor ends the sequence at it (the id is the
        # last output token, as EOS is), even with ignore_eos.
        stop_id = ids[3]
        first = ids.index(stop_id)
        by_id = await _generate(stub, sampling=common_pb2.SamplingParams(stop_token_ids=[stop_id]))
        assert _ids(by_id) == ids[: first + 1] and by_id[-1].finish_reason == "stop"

        # min_tokens holds the stop ids (and EOS) off; penalties change greedy text.
        held = await _generate(
            stub,
            sampling=common_pb2.SamplingParams(
                ignore_eos=False, stop_token_ids=ids[:16], min_tokens=6
            ),
        )
        assert len(_ids(held)) >= 6
        assert not set(_ids(held)[:6]) & set(ids[:16])
        penalised = await _generate(stub, sampling=common_pb2.SamplingParams(presence_penalty=2))
        assert _ids(penalised) != ids

        await _check_n(stub, stop, expected=text[: text.index(stop)])

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _generate(stub, sampling=common_pb2.SamplingParams(min_p=2))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.min_p" in str(info.value.details())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _generate(stub, stop=[""])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
