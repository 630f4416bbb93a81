"""Every OpenAI field either works or is refused (issue 11), and CORS.

A field the server does not implement is a 400 naming it (`param`), unless
it carries the value that asks for nothing (``echo: false``, penalties 0);
the stack keeps serving after each refusal. CORS is off by default and, when
origins are allowed, answers preflights before the API key check and tags
every answer, streams included. Real stack: `test_http_api.stack` (Redis,
the scheduler, an emulated executor).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
from test_http_api import MESSAGES, HttpStack, stack  # noqa: F401 - the real stack's fixture

from gateway.openai_convert import BadRequest, parse_chat, parse_completion

MODEL = "lemix"
ORIGIN = "https://app.example"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"5": 10}),
        ("suffix", "end"),
        ("best_of", 2),
        ("include_stop_str_in_output", True),
        ("guided_json", {"type": "object"}),  # unknown to this server altogether
        ("nonsense", 1),
    ],
)
def test_unimplemented_fields_are_refused_naming_them(field: str, value: Any) -> None:
    with pytest.raises(BadRequest, match=f"^{field} is not supported") as info:
        parse_completion({"prompt": "x", field: value}, MODEL)
    assert info.value.param == field


def test_neutral_values_and_metadata_are_accepted() -> None:
    neutral = {
        "echo": False,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "top_k": -1,
        "best_of": 1,
        "user": "u-1",
        "response_format": {"type": "text"},
        "tool_choice": "none",
    }
    parse_completion({"prompt": "x", **neutral}, MODEL)
    parse_chat({"messages": MESSAGES, "logprobs": False, "tools": [], **neutral}, MODEL)
    with pytest.raises(BadRequest, match="^echo is not supported .*only False"):
        parse_chat({"messages": MESSAGES, "echo": 1}, MODEL)  # 1 is not false (chat's echo)
    with pytest.raises(BadRequest) as info:
        parse_completion({"prompt": "x", "messages": MESSAGES}, MODEL)  # chat's field
    assert info.value.param == "messages"
    with pytest.raises(BadRequest) as info:
        parse_chat({"messages": MESSAGES, "tools": [{"type": "function"}]}, MODEL)
    assert info.value.param == "tools"


async def test_refused_fields_are_400_over_http_and_the_stack_serves_on(
    stack: HttpStack,  # noqa: F811 - the fixture imported above
) -> None:
    gateway = await stack.make_gateway()
    url = f"http://{gateway.http_address}/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=30) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, suffix="!")
        assert info.value.status_code == 400
        assert isinstance(info.value.body, dict) and info.value.body["param"] == "suffix"
        with pytest.raises(openai.BadRequestError, match="logit_bias is not supported"):
            await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"logit_bias": {"4": 1}}
            )
        reply = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, user="me", presence_penalty=0
        )
        assert reply.choices[0].finish_reason == "length"


async def test_cors_is_off_by_default_and_allows_only_the_listed_origins(
    stack: HttpStack,  # noqa: F811 - the fixture imported above
) -> None:
    closed = await stack.make_gateway()
    keyed = await stack.make_gateway(cors_allowed_origins=ORIGIN, api_key="sk-k")
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    async with aiohttp.ClientSession() as http:
        async with http.get(
            f"http://{closed.http_address}/version", headers={"Origin": ORIGIN}
        ) as response:
            assert "Access-Control-Allow-Origin" not in response.headers
        async with http.options(
            f"http://{closed.http_address}/v1/completions", headers=preflight
        ) as response:
            assert response.status == 405  # no CORS: no preflight answer

        base = f"http://{keyed.http_address}"
        # A preflight carries no API key: answered before the key check.
        async with http.options(f"{base}/v1/completions", headers=preflight) as response:
            assert response.status == 204
            assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert "Authorization" in response.headers["Access-Control-Allow-Headers"]
        async with http.options(
            f"{base}/v1/completions", headers={**preflight, "Origin": "https://evil.example"}
        ) as response:
            assert "Access-Control-Allow-Origin" not in response.headers
        headers = {"Origin": ORIGIN, "Authorization": "Bearer sk-k"}
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
        async with http.post(f"{base}/v1/completions", json=body, headers=headers) as response:
            assert response.status == 200
            assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert "X-Request-Id" in response.headers["Access-Control-Expose-Headers"]
            assert (await response.text()).endswith("data: [DONE]\n\n")
        async with http.get(f"{base}/v1/models", headers={"Origin": ORIGIN}) as response:
            assert response.status == 401  # CORS does not open the API
            assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
