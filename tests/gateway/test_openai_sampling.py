"""vLLM's sampling fields through the official `openai` client on the real
tiny model (`torch_stack`): top_k, min_p, presence/frequency/repetition
penalties, min_tokens; out-of-range values are 400 naming the field (and
INVALID_ARGUMENT over gRPC: `gateway.validate`)."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
from task_stack import TaskStack
from torch_stack import MODEL, openai_client, torch_stack  # noqa: F401 - the fixture

from gateway.openai_convert import BadRequest, parse_completion
from gateway.validate import validate_generate
from lemix._proto.lemix.v1 import common_pb2, gateway_pb2
from lemix.infra.rpc.convert import task_from_proto, task_to_proto
from lemix.infra.rpc.errors import InvalidArgument
from lemix.infra.store.codec import encode_value
from lemix.infra.store.task_fields import task_from_fields, task_to_fields
from lemix.tokenizer import ApproxTokenizer

PROMPT = "Once upon a time"
FIXED = {"ignore_eos": True}  # every choice runs to max_tokens unless said otherwise


async def _post(stack: TaskStack, path: str, body: dict[str, object]) -> dict[str, object]:
    url = f"http://{stack.gateways[0].http_address}{path}"
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
        answer: dict[str, object] = await response.json()
        return answer


def test_fields_parse_onto_sampling_params() -> None:
    body = {
        "prompt": "x",
        "top_k": 5,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.2,
        "min_tokens": 3,
        "stop_token_ids": [7, 9],
    }
    s = parse_completion(body, MODEL).generate.sampling
    assert (s.top_k, s.min_p, s.presence_penalty, s.frequency_penalty) == (5, 0.1, 0.5, -1.0)
    assert (s.repetition_penalty, s.min_tokens, list(s.stop_token_ids)) == (1.2, 3, [7, 9])
    off = parse_completion({"prompt": "x", "top_k": -1}, MODEL).generate.sampling
    assert (off.top_k, off.repetition_penalty) == (0, 1.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1),
        ("min_tokens", -1),
        ("min_tokens", "3"),
    ],
)
def test_out_of_range_values_are_400_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(BadRequest) as info:
        parse_completion({"prompt": "x", field: value}, MODEL)
    assert info.value.param == field


@pytest.mark.parametrize(
    ("sampling", "match"),
    [
        (common_pb2.SamplingParams(min_p=2), "sampling.min_p"),
        (common_pb2.SamplingParams(presence_penalty=-5), "sampling.presence_penalty"),
        (common_pb2.SamplingParams(frequency_penalty=float("nan")), "sampling.frequency_penalty"),
        (common_pb2.SamplingParams(repetition_penalty=-1), "sampling.repetition_penalty"),
        (common_pb2.SamplingParams(min_tokens=9), r"sampling.min_tokens \(9\)"),
        (common_pb2.SamplingParams(stop_token_ids=[5000]), "sampling.stop_token_ids"),
    ],
)
def test_grpc_requests_out_of_range_are_invalid_argument(
    sampling: common_pb2.SamplingParams, match: str
) -> None:
    request = gateway_pb2.GenerateRequest(prompt="a b", max_tokens=4, sampling=sampling)
    with pytest.raises(InvalidArgument, match=match):
        validate_generate(
            request, tokenizer=ApproxTokenizer(), max_context_tokens=64, vocab_size=1000
        )


def test_the_fields_travel_through_proto_and_the_intake_codec() -> None:
    sampling = common_pb2.SamplingParams(
        temperature=0.5,
        top_k=4,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.3,
        min_tokens=2,
        stop_token_ids=[11, 12],
    )
    request = gateway_pb2.GenerateRequest(prompt="a b", max_tokens=4, sampling=sampling)
    task, payload = validate_generate(request, tokenizer=ApproxTokenizer(), max_context_tokens=64)
    assert (payload.top_k, payload.min_tokens, payload.stop_token_ids) == (4, 2, (11, 12))
    assert task_from_proto(task_to_proto(task, payload)) == (task, payload)
    fields = {k: encode_value(v) for k, v in task_to_fields(task, payload).items()}
    assert task_from_fields(fields) == (task, payload)  # as Redis stores them
    # Unset: repetition_penalty 0 on the wire reads as 1 (off), and a plain
    # payload's record gains no new fields.
    plain_task, plain = validate_generate(
        gateway_pb2.GenerateRequest(prompt="a", max_tokens=2),
        tokenizer=ApproxTokenizer(),
        max_context_tokens=64,
    )
    assert plain.repetition_penalty == 1.0
    assert not {"top_k", "min_p", "min_tokens", "stop_token_ids"} & set(
        task_to_fields(plain_task, plain)
    )


async def test_sampling_fields_over_http_on_the_real_model(
    torch_stack: TaskStack,  # noqa: F811 - the fixture imported above
) -> None:
    async with openai_client(torch_stack) as client:

        async def complete(**fields: Any) -> openai.types.Completion:
            extra = {**FIXED, **fields.pop("extra", {})}
            return await client.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=fields.pop("max_tokens", 12),
                extra_body=extra,
                **fields,
            )

        greedy = (await complete(temperature=0)).choices[0].text
        # top_k 1 is greedy whatever the temperature and seed.
        top1 = await complete(temperature=1.5, seed=5, extra={"top_k": 1})
        assert top1.choices[0].text == greedy
        # min_p 1 keeps only the most likely token: greedy too.
        top_min_p = await complete(temperature=1.5, seed=5, extra={"min_p": 1.0})
        assert top_min_p.choices[0].text == greedy

        # Penalties act on greedy decoding too (vLLM's): the greedy text
        # repeats itself (" int pol int pol ..."), each penalty changes it;
        # a seed alone reproduces a sampled text.
        assert len(set(greedy.split())) < len(greedy.split())
        for extra in (
            {"frequency_penalty": 2.0},
            {"presence_penalty": 2.0},
            {"repetition_penalty": 1.8},
        ):
            penalised = await complete(temperature=0, extra=extra)
            assert penalised.choices[0].text != greedy, extra
        plain = (await complete(temperature=1.0, seed=42)).choices[0].text
        assert (await complete(temperature=1.0, seed=42)).choices[0].text == plain

        # A huge repetition penalty: no output token repeats a prompt token or
        # an earlier output token (echo + logprobs list both as the model's tokens).
        def tokens(reply: openai.types.Completion) -> tuple[list[str], list[str]]:
            logprobs = reply.choices[0].logprobs
            assert logprobs is not None and logprobs.tokens is not None
            num_prompt = len(logprobs.tokens) - (
                reply.usage.completion_tokens if reply.usage else 0
            )
            return logprobs.tokens[:num_prompt], logprobs.tokens[num_prompt:]

        base_prompt, base_out = tokens(await complete(temperature=0, echo=True, logprobs=0))
        assert set(base_out) & set(base_prompt) or len(set(base_out)) < len(base_out)
        prompt_tokens, out = tokens(
            await complete(temperature=0, echo=True, logprobs=0, extra={"repetition_penalty": 1e6})
        )
        assert prompt_tokens == base_prompt and len(out) == 12
        assert not set(out) & set(prompt_tokens) and len(set(out)) == len(out)

        # min_tokens with EOS live (no ignore_eos): every token of the greedy
        # text is a stop token id, so without min_tokens the choice ends at once.
        tokenized = await _post(
            torch_stack, "/tokenize", {"prompt": greedy, "add_special_tokens": False}
        )
        ids = tokenized["tokens"][:16]  # type: ignore[index]
        stops = {"ignore_eos": False, "stop_token_ids": ids}
        early = await complete(temperature=0, extra=stops)
        assert early.choices[0].finish_reason == "stop"
        assert early.usage is not None and early.usage.completion_tokens <= 2
        held = await complete(temperature=0, extra={**stops, "min_tokens": 6})
        assert held.usage is not None and held.usage.completion_tokens >= 6

        # Out of range over HTTP: 400 naming the field; the stack serves on.
        bad: list[tuple[dict[str, Any], str]] = [({"min_p": 3}, "min_p"), ({"top_k": -5}, "top_k")]
        for extra, param in bad:
            with pytest.raises(openai.BadRequestError) as info:
                await complete(extra=extra)
            assert isinstance(info.value.body, dict) and info.value.body["param"] == param
        with pytest.raises(openai.BadRequestError, match=r"sampling.min_tokens \(20\)"):
            await complete(max_tokens=4, extra={"min_tokens": 20})
        assert (await complete(max_tokens=2)).choices[0].finish_reason == "length"
