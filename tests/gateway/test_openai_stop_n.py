"""`stop`, `stop_token_ids` and `n` (issue 11) through the official `openai`
client, on the real tiny model (torch executor, real tokens): the pure stop
matcher first, then the stack.
"""

from __future__ import annotations

import aiohttp
import pytest
from task_stack import TaskStack, eventually
from torch_stack import MODEL, openai_client, torch_stack  # noqa: F401 - the fixture

from gateway.openai_convert import BadRequest, parse_chat, parse_completion
from gateway.openai_stops import STOPPED_REASON, StopText

PROMPT = "Once upon a time"


def _feed_all(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopText(stops)
    out = [matcher.feed(p, is_final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return "".join(out), matcher.is_stopped


def test_stop_text_cuts_at_the_first_stop_across_pieces_and_holds_back_prefixes() -> None:
    matcher = StopText(["END", "\n\n"])
    assert matcher.feed("hello E", is_final=False) == "hello "  # "E" may begin "END"
    assert matcher.feed("N", is_final=False) == ""
    assert matcher.feed("Dgame", is_final=False) == "" and matcher.is_stopped
    assert matcher.feed("more", is_final=True) == ""
    assert _feed_all(["END"], ["a", "EN", "x", "b"]) == ("aENxb", False)  # released
    assert _feed_all(["END"], ["a", "EN"]) == ("aEN", False)  # the final piece flushes
    assert _feed_all(["ab", "b"], ["xab"]) == ("x", True)  # the earliest start wins
    assert _feed_all([], ["a", "b"]) == ("ab", False)


def test_stop_fields_parse_and_bad_ones_are_400() -> None:
    request = parse_completion({"prompt": "x", "stop": "\n", "stop_token_ids": [2]}, MODEL)
    assert request.stop == ("\n",) and request.stop_token_ids == (2,)
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 3}, MODEL).n == 3
    for body, param in [
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"n": 17}, "n"),
    ]:
        with pytest.raises(BadRequest) as info:
            parse_completion({"prompt": "x", **body}, MODEL)
        assert info.value.param == param


async def _post(stack: TaskStack, path: str, body: dict[str, object]) -> dict[str, object]:
    url = f"http://{stack.gateways[0].http_address}{path}"
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
        answer: dict[str, object] = await response.json()
        answer["status"] = response.status
        return answer


async def test_tokenize_and_detokenize_round_trip(
    torch_stack: TaskStack,  # noqa: F811 - the fixture imported above
) -> None:
    text = "Hello, tokens!"
    plain = await _post(torch_stack, "/tokenize", {"prompt": text, "add_special_tokens": False})
    with_bos = await _post(torch_stack, "/tokenize", {"model": MODEL, "prompt": text})
    assert plain["status"] == with_bos["status"] == 200
    assert with_bos["max_model_len"] == 2048
    ids = plain["tokens"]
    assert isinstance(ids, list) and plain["count"] == len(ids) > 0
    assert with_bos["tokens"][1:] == ids  # type: ignore[index] - BOS first, as a prompt gets
    back = await _post(torch_stack, "/detokenize", {"tokens": ids})
    assert back == {"prompt": text, "status": 200}
    chat = await _post(torch_stack, "/tokenize", {"messages": [{"role": "user", "content": text}]})
    assert chat["count"] > plain["count"]  # type: ignore[operator] - the template's tokens
    bad = await _post(torch_stack, "/detokenize", {"tokens": [1, 10**6]})
    assert bad["status"] == 400 and "tokens[1] = 1000000" in bad["error"]["message"]  # type: ignore[index]
    bad = await _post(torch_stack, "/tokenize", {"prompt": text, "truncate": 3})
    assert bad["status"] == 400 and bad["error"]["param"] == "truncate"  # type: ignore[index]


async def _task_state(stack: TaskStack, task_id: str) -> dict[str, object]:
    url = f"http://{stack.gateways[0].http_address}/v1/lemix/tasks/{task_id}"
    state: dict[str, object] = {}
    async with aiohttp.ClientSession() as http:

        async def is_final() -> bool:
            async with http.get(url) as response:
                state.update(await response.json())
            return bool(state["is_final"])

        await eventually(is_final, what=f"task {task_id} to end")
    return state


async def test_stop_strings_and_token_ids_end_the_choice(
    torch_stack: TaskStack,  # noqa: F811 - the fixture imported above
) -> None:
    async with openai_client(torch_stack) as client:
        # The model's own greedy text, then a stop string from its middle.
        full = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        text = full.choices[0].text
        assert full.choices[0].finish_reason == "length" and len(text) > 12
        stop = text[6:9]
        expected = text[: text.index(stop)]
        stopped = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stop=[stop],
            extra_body={"ignore_eos": True},
        )
        assert stopped.choices[0].text == expected
        assert stopped.choices[0].finish_reason == "stop"
        assert 0 < stopped.usage.completion_tokens < 24  # type: ignore[union-attr]
        # The task's record says what happened: cancelled by the stop, not "completed".
        state = await _task_state(torch_stack, stopped.id.removeprefix("cmpl-"))
        assert state["state"] == "cancelled" and state["reason"] == STOPPED_REASON

        # Streaming: the same text, no byte of the stop string sent.
        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stop=stop,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

        # A stop token id: the output ends before that token.
        ids = (
            await _post(torch_stack, "/tokenize", {"prompt": text, "add_special_tokens": False})
        )["tokens"]
        by_token = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True, "stop_token_ids": [ids[3]]},
        )
        assert by_token.choices[0].finish_reason == "stop"
        assert text.startswith(by_token.choices[0].text)
        assert len(by_token.choices[0].text) < len(text)

        # The stack still serves a plain request afterwards.
        after = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert after.choices[0].finish_reason in ("length", "stop")


async def test_n_returns_n_independent_choices(
    torch_stack: TaskStack,  # noqa: F811 - the fixture imported above
) -> None:
    async with openai_client(torch_stack) as client:
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a story."}],
            n=3,
            max_tokens=8,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in reply.choices] == [0, 1, 2]
        texts = [c.message.content for c in reply.choices]
        assert len(set(texts)) == 3, texts  # unseeded: a seed of its own each
        assert reply.usage is not None and reply.usage.completion_tokens == 3 * 8

        seeded = [
            await client.completions.create(
                model=MODEL,
                prompt=PROMPT,
                n=2,
                max_tokens=6,
                seed=7,
                extra_body={"ignore_eos": True},
            )
            for _ in range(2)
        ]
        first, again = ([c.text for c in s.choices] for s in seeded)
        assert first == again and first[0] != first[1]  # seeds 7 and 8, both reproducible

        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            n=2,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
        by_index = {0: "", 1: ""}
        for chunk in chunks:
            for choice in chunk.choices:
                by_index[choice.index] += choice.text
        assert all(by_index.values())
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
