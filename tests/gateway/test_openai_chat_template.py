"""Chat prompts through the checkpoint's own chat template, or the fallback.

A model directory whose tokenizer config carries a ``chat_template`` is built
locally (the stack's byte-level BPE wrapped in `transformers`'
``PreTrainedTokenizerFast``, no hub); the gateway loads it and the executors
keep the plain BPE of the same vocabulary. Both paths are checked end to end
with the official `openai` client on the real tiny model: the chat reply is
the completion of exactly the prompt ids the template (or the fallback) gives.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from task_stack import TaskStack
from torch_stack import MODEL, TOKENIZER, openai_client, start_torch_stack, torch_stack  # noqa: F401

from gateway.openai_convert import BadRequest, chat_prompt, parse_chat, templated_chat_ids
from lemix.infra.store.server import EmbeddedRedis
from lemix.model.tokenizer import BPETokenizer, HFTokenizer, load_tokenizer
from lemix.tokenizer import ApproxTokenizer, encode_prompt, render_chat

# Llama-2-like: BOS, one bracketed header per message, EOS after each; a
# developer message is refused by the template itself.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'developer' %}{{ raise_exception('no developer messages') }}{% endif %}"
    "[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me a story."},
]
RENDERED = "<s>[SYSTEM] You are terse.</s>[USER] Tell me a story.</s>[ASSISTANT] "


def _model_dir(tmp: Path, *, template: str | None) -> Path:
    """A model directory with the stack's BPE vocabulary and `template`."""
    from transformers import PreTrainedTokenizerFast

    bpe = load_tokenizer(TOKENIZER)
    assert isinstance(bpe, BPETokenizer)
    bpe._tokenizer.save(str(tmp / "tokenizer.json"))
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp / "tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    if template is not None:
        hf.chat_template = template
    path = tmp / ("templated" if template else "plain")
    hf.save_pretrained(path)
    return path


def test_render_chat_uses_the_template_only_when_there_is_one(tmp_path: Path) -> None:
    templated = load_tokenizer(str(_model_dir(tmp_path, template=TEMPLATE)))
    plain = load_tokenizer(str(_model_dir(tmp_path, template=None)))
    assert isinstance(templated, HFTokenizer) and isinstance(plain, HFTokenizer)
    assert render_chat(templated, MESSAGES) == RENDERED
    ids = templated_chat_ids(templated, MESSAGES)
    assert ids is not None and ids[0] == templated.bos_id and ids.count(templated.bos_id) == 1
    assert templated.decode(ids) == templated.decode(templated.encode(RENDERED))
    for tokenizer in (plain, load_tokenizer(TOKENIZER), ApproxTokenizer()):
        assert render_chat(tokenizer, MESSAGES) is None
        assert templated_chat_ids(tokenizer, MESSAGES) is None
    with pytest.raises(BadRequest, match="no developer messages") as info:
        templated_chat_ids(templated, [{"role": "developer", "content": "x"}])
    assert info.value.param == "messages"


def test_parse_chat_keeps_the_checked_messages_and_the_fallback_prompt() -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    parsed = parse_chat({"messages": parts}, MODEL)
    assert parsed.messages == ({"role": "user", "content": "ab"},)
    assert parsed.generate.prompt == "<|user|>\nab\n<|assistant|>\n" == chat_prompt(parts)


async def _tokenize(stack: TaskStack, body: dict[str, Any]) -> list[int]:
    url = f"http://{stack.gateways[0].http_address}/tokenize"
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        ids: list[int] = (await response.json())["tokens"]
        return ids


async def _chat_equals_completion_of(stack: TaskStack, ids: list[int]) -> None:
    """The chat reply is the greedy completion of exactly `ids`."""
    async with openai_client(stack) as client:
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        completion = await client.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert chat.usage is not None and chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == completion.choices[0].text


@pytest.fixture
async def templated_stack(
    redis_server: EmbeddedRedis, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[TaskStack]:
    path = _model_dir(tmp_path, template=TEMPLATE)
    namespace = f"tmpl-{request.node.name[:40]}"
    stack = await start_torch_stack(redis_server.url, namespace, gateway_tokenizer=str(path))
    try:
        yield stack
    finally:
        await stack.close()


async def test_chat_goes_through_the_checkpoints_template(templated_stack: TaskStack) -> None:
    tokenizer = load_tokenizer(TOKENIZER)
    expected = tokenizer.encode(RENDERED)  # the template's own BOS, none added
    assert await _tokenize(templated_stack, {"messages": MESSAGES}) == expected
    await _chat_equals_completion_of(templated_stack, expected)
    async with openai_client(templated_stack) as client:
        with pytest.raises(openai.BadRequestError, match="no developer messages") as info:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "developer", "content": "x"}], max_tokens=2
            )
        assert isinstance(info.value.body, dict) and info.value.body["param"] == "messages"


async def test_chat_without_a_template_uses_the_fallback(
    torch_stack: TaskStack,  # noqa: F811 - the fixture imported above
) -> None:
    expected = encode_prompt(load_tokenizer(TOKENIZER), chat_prompt(MESSAGES))  # BOS first
    assert await _tokenize(torch_stack, {"messages": MESSAGES}) == expected
    await _chat_equals_completion_of(torch_stack, expected)
