"""`logprobs` / `top_logprobs` (issue 11) through the official `openai` client
on the real tiny model: each token's log-probability is the model's own
log-softmax (a direct forward of the same weights, within 1e-4), the top
tokens are the model's best, and streaming returns the same numbers.
"""

from __future__ import annotations

import math

import openai
import pytest
import torch
from task_stack import TaskStack
from test_http_api import HttpStack, stack  # noqa: F401 - the emulated stack's fixture
from torch_stack import MODEL, openai_client, torch_stack  # noqa: F401 - the fixture

from gateway.openai_convert import BadRequest, parse_chat, parse_completion
from lemix.infra.rpc import convert as rpc_convert
from lemix.infra.store.codec import encode_value
from lemix.infra.store.task_fields import task_from_fields, task_to_fields
from lemix.outputs import TokenLogprob, format_logprobs, parse_logprobs
from lemix.types import Task, TaskKind, TaskPayload

PROMPT_IDS = [1, 57, 300, 12, 999, 4]
NUM_TOKENS = 5
TOLERANCE = 1e-4


def test_the_wire_field_round_trips_and_bad_text_is_refused() -> None:
    entries = (TokenLogprob(-0.25, ((7, -0.25), (3, -1.5))), TokenLogprob(-3.0))
    assert parse_logprobs(format_logprobs(entries)) == entries
    for bad in ("x", "-1|a:1", "0.5"):
        with pytest.raises(ValueError, match="logprobs"):
            parse_logprobs(bad)


def test_logprobs_fields_parse() -> None:
    sampling = parse_completion({"prompt": "x", "logprobs": 3}, MODEL).generate.sampling
    assert sampling.HasField("top_logprobs") and sampling.top_logprobs == 3
    assert not parse_completion({"prompt": "x"}, MODEL).generate.sampling.HasField("top_logprobs")
    messages = [{"role": "user", "content": "x"}]
    chat = parse_chat({"messages": messages, "logprobs": True}, MODEL).generate.sampling
    assert chat.HasField("top_logprobs") and chat.top_logprobs == 0
    with pytest.raises(BadRequest, match="top_logprobs needs logprobs"):
        parse_chat({"messages": messages, "top_logprobs": 2}, MODEL)
    with pytest.raises(BadRequest) as info:
        parse_completion({"prompt": "x", "logprobs": 21}, MODEL)
    assert info.value.param == "logprobs"


def _greedy_with_logprobs(served: TaskStack, num_top: int) -> list[tuple[float, list[float]]]:
    """(each token's logprob, the top logprobs) of a greedy continuation, by a
    direct full forward of the executor's own weights (no cache, no batching)."""
    staged = served.executors[0].node.backend.staged  # type: ignore[union-attr]
    ids = list(PROMPT_IDS)
    out = []
    for _ in range(NUM_TOKENS):
        logprobs = torch.log_softmax(staged.logits(ids)[-1].float(), dim=-1)
        token = int(torch.argmax(logprobs))
        out.append((float(logprobs[token]), torch.topk(logprobs, num_top).values.tolist()))
        ids.append(token)
    return out


async def test_logprobs_match_the_models_own_log_softmax(
    torch_stack: TaskStack,  # noqa: F811 - the fixture imported above
) -> None:
    expected = _greedy_with_logprobs(torch_stack, 3)
    async with openai_client(torch_stack) as client:
        reply = await client.completions.create(
            model=MODEL,
            prompt=PROMPT_IDS,
            max_tokens=NUM_TOKENS,
            temperature=0,
            logprobs=3,
            extra_body={"ignore_eos": True},
        )
        logprobs = reply.choices[0].logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None
        assert len(logprobs.token_logprobs) == NUM_TOKENS
        for i, (logprob, top_logprobs) in enumerate(expected):
            assert abs(logprobs.token_logprobs[i] - logprob) < TOLERANCE, (i, logprobs)
            top = logprobs.top_logprobs[i]  # type: ignore[index] - {token text: logprob}
            # The model's 3 best (their texts differ, so none collapses in the dict).
            assert sorted(top.values(), reverse=True) == pytest.approx(top_logprobs, abs=TOLERANCE)
            assert max(top.values()) == pytest.approx(logprob, abs=TOLERANCE)  # greedy: the best
        assert logprobs.text_offset[0] == 0  # type: ignore[index]
        tokenizer_text = "".join(logprobs.tokens)  # type: ignore[arg-type]
        assert tokenizer_text == reply.choices[0].text

        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPT_IDS,
            max_tokens=NUM_TOKENS,
            temperature=0,
            logprobs=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streamed = [
            lp
            async for chunk in stream
            for choice in chunk.choices
            if choice.logprobs is not None
            for lp in choice.logprobs.token_logprobs or []
        ]
        assert streamed == logprobs.token_logprobs

        chat = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            logprobs=True,
            top_logprobs=2,
            extra_body={"ignore_eos": True},
        )
        content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None and len(content) == 4
        assert all(c.logprob <= 0 and len(c.top_logprobs) == 2 for c in content)
        assert "".join(c.token for c in content) == chat.choices[0].message.content
        assert all(math.isfinite(t.logprob) for c in content for t in c.top_logprobs)


async def test_logprobs_without_a_real_model_are_400(
    stack: HttpStack,  # noqa: F811 - the fixture imported above
) -> None:
    gateway = await stack.make_gateway()
    url = f"http://{gateway.http_address}/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=30) as client:
        with pytest.raises(openai.BadRequestError, match="logprobs need a real model"):
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=1)
        reply = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert reply.choices[0].logprobs is None


async def test_echo_returns_the_prompts_logprobs_as_lm_eval_asks(
    torch_stack: TaskStack,  # noqa: F811 - the fixture imported above
) -> None:
    """lm-eval-harness' log-likelihood request: ``echo=True, logprobs=1,
    max_tokens=0`` returns the prompt's per-token logprobs, equal to a direct
    forward of the same weights within 1e-4, and no generated token."""
    staged = torch_stack.executors[0].node.backend.staged  # type: ignore[union-attr]
    logprobs = torch.log_softmax(staged.logits(PROMPT_IDS).float(), dim=-1)
    expected = [float(logprobs[i, t]) for i, t in enumerate(PROMPT_IDS[1:])]
    async with openai_client(torch_stack) as client:
        for max_tokens in (0, 1):
            reply = await client.completions.create(
                model=MODEL,
                prompt=PROMPT_IDS,
                max_tokens=max_tokens,
                echo=True,
                logprobs=1,
                temperature=0,
            )
            choice = reply.choices[0]
            assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
            got = choice.logprobs.token_logprobs
            assert got[0] is None  # the first token has no context
            assert len(got) == len(PROMPT_IDS) + max_tokens
            for i, want in enumerate(expected):
                assert abs(got[i + 1] - want) < TOLERANCE, (i, got[i + 1], want)
            prompt_text = "".join(choice.logprobs.tokens[: len(PROMPT_IDS)])  # type: ignore[index]
            assert choice.text.startswith(prompt_text)
            assert reply.usage is not None and reply.usage.completion_tokens == max_tokens
        # Echo of a text prompt: the text comes back first, then the output.
        reply = await client.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=3, echo=True, temperature=0
        )
        assert reply.choices[0].text.startswith("Once upon")
        assert reply.choices[0].logprobs is None


@pytest.mark.parametrize(("top", "prompt"), [(-1, -1), (0, -1), (3, 2)])
def test_logprob_requests_survive_every_hop_and_absent_stays_absent(top: int, prompt: int) -> None:
    """Gateway -> scheduler (gRPC), the intake's Redis hash, scheduler ->
    executor (gRPC): the payload's logprob asks arrive as sent; a request
    without them writes no field (older records read the same)."""
    task = Task("t-1", TaskKind.INFERENCE, 0.0, num_prompt_tokens=2, max_output_tokens=3)
    payload = TaskPayload(prompt_token_ids=(1, 2), top_logprobs=top, prompt_logprobs=prompt)
    assert rpc_convert.task_from_proto(rpc_convert.task_to_proto(task, payload))[1] == payload
    fields = task_to_fields(task, payload)
    assert ("top_logprobs" in fields) == (top >= 0)
    stored = {k: encode_value(v) for k, v in fields.items()}
    assert task_from_fields(stored)[1] == payload
