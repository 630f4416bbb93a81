"""OpenAI sampling defaults (issue 11): `max_tokens` left out is the rest of the
context, and an unseeded sampled request gets a seed of its own. The parsing
is checked pure; the end to end case against the real stack
(`test_http_api.stack`: Redis, the scheduler, an emulated executor).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from test_http_api import MESSAGES, HttpStack, stack  # noqa: F401 - the real stack's fixture

from gateway.openai_convert import BadRequest, chat_prompt, parse_chat, parse_completion
from gateway.validate import validate_generate
from lemix.tokenizer import ApproxTokenizer

MODEL = "lemix"
CONTEXT_TOKENS = 64  # small, so a defaulted max_tokens decodes quickly


def test_max_tokens_left_out_is_0_and_an_explicit_0_is_refused() -> None:
    chat = parse_chat({"messages": MESSAGES}, MODEL)
    completion = parse_completion({"prompt": "hi"}, MODEL)
    assert chat.generate.max_tokens == completion.generate.max_tokens == 0  # "the rest"
    chat = parse_chat({"messages": MESSAGES, "max_completion_tokens": 5}, MODEL)
    assert chat.generate.max_tokens == 5
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(BadRequest, match=rf"{field} must be an integer in \[1, ") as info:
            parse_chat({"messages": MESSAGES, field: 0}, MODEL)
        assert info.value.param == field


def test_a_chat_without_max_tokens_may_use_the_rest_of_the_context() -> None:
    request = parse_chat({"messages": MESSAGES}, MODEL).generate
    task, _ = validate_generate(
        request, tokenizer=ApproxTokenizer(), max_context_tokens=CONTEXT_TOKENS
    )
    assert task.num_prompt_tokens + task.max_output_tokens == CONTEXT_TOKENS


def test_seed_left_out_is_drawn_per_request_and_a_given_seed_is_kept() -> None:
    def seed_of(body: dict[str, Any]) -> int:
        request = parse_completion({"prompt": "hi", "max_tokens": 2, **body}, MODEL).generate
        return validate_generate(request, tokenizer=ApproxTokenizer(), max_context_tokens=64)[
            1
        ].seed

    assert len({seed_of({}) for _ in range(5)}) == 5
    assert seed_of({"seed": 123}) == 123
    assert seed_of({"temperature": 0}) == 0  # greedy ignores it


async def test_http_defaults_end_to_end(
    stack: HttpStack,  # noqa: F811 - the fixture imported above
) -> None:
    gateway = await stack.make_gateway(max_context_tokens=CONTEXT_TOKENS)
    url = f"http://{gateway.http_address}/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=30) as client:
        reply = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert reply.usage is not None and reply.choices[0].finish_reason == "length"
        assert reply.usage.prompt_tokens == len(ApproxTokenizer().encode(chat_prompt(MESSAGES)))
        assert reply.usage.total_tokens == CONTEXT_TOKENS  # not 16: the rest of the context

        with pytest.raises(openai.BadRequestError) as info:  # the prompt fills the context
            await client.completions.create(model=MODEL, prompt="x" * 4 * CONTEXT_TOKENS)
        assert "fills the context limit of 64 tokens" in info.value.message

        # A named, unseeded request retried: the same request (no 409), one answer.
        named = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
        first = await client.completions.create(**named, extra_body={"request_id": "r-1"})
        again = await client.completions.create(**named, extra_body={"request_id": "r-1"})
        assert again.id == first.id and again.choices[0].text == first.choices[0].text
