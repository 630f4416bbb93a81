"""OpenAI-compatible JSON <-> the gateway's requests, in one module.

Requests become the same `GenerateRequest` / `TrainRequest` messages the gRPC
API takes, so `gateway.validate` checks both alike; this module checks only
what JSON adds (types, OpenAI-only fields). Every problem raises
`BadRequest` (an `InvalidArgument`: 400) naming the field in `param`; an
unknown model raises `ModelNotFound` (404).

`request_id` (a string, as vLLM's) is the request's idempotency key, as
`GenerateRequest.request_id`; the HTTP API also takes it from an
``X-Request-Id`` header.

Defaults follow OpenAI's and vLLM's: `temperature` 1, `top_p` 1; `max_tokens`
(or `max_completion_tokens`) left out means the rest of the context (the
context limit less the prompt: it becomes `GenerateRequest.max_tokens` 0, which
gateway.validate resolves once the prompt is tokenized; a 0 sent on purpose is
refused); `seed` left out (or 0) means a random seed per request
(gateway.validate draws it). One prompt per request; `n` choices
(`gateway.openai_choices`); `stop` and vLLM's `stop_token_ids`
(`gateway.openai_stops`); vLLM's `top_k`, `min_p`, `presence_penalty`,
`frequency_penalty`, `repetition_penalty` and `min_tokens`
(`lemix.model.sampling`; out of range: a 400 naming the field). Every other
field is refused with a 400 naming it (`param`), unless it carries the value
that asks for nothing (``echo: false``, ...: `_NEUTRAL`); `user` is accepted
as metadata.

Chat messages become one prompt through the checkpoint's own chat template
when its tokenizer has one (``chat_template`` in a model directory's tokenizer
config, applied by `transformers`' ``apply_chat_template`` with the generation
prompt; the text is encoded as the template wrote it, no BOS added:
`use_chat_template`), else through the fallback template, `chat_prompt`::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n

(one ``<|{role}|>`` header line per message, then the assistant's header the
model continues from; encoded with BOS first, as a completion's prompt).
Roles: system, developer, user, assistant; content is a string or a list of
``{"type": "text", "text": ...}`` parts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.openai_stops import MAX_STOP_CHARS, MAX_STOPS
from gateway.validate import MAX_PENALTY, MAX_REPETITION_PENALTY
from lemix._proto.lemix.v1 import common_pb2, gateway_pb2
from lemix.infra.rpc.errors import InvalidArgument, NotFound
from lemix.outputs import MAX_TOP_LOGPROBS
from lemix.tokenizer import Tokenizer, render_chat

# `max_tokens` left out: GenerateRequest's 0, "the rest of the context".
DEFAULT_MAX_TOKENS = 0
CHAT_ROLES = ("system", "developer", "user", "assistant")
_MAX_U32 = (1 << 32) - 1
_MAX_U64 = (1 << 64) - 1
# Fields that work. Anything else is refused with a 400 naming it (unless it
# is in `_NEUTRAL` with a value that asks for nothing): a client must never
# believe a field took effect when it did not.
_COMMON_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stream",
        "stream_options",
        "n",
        "stop",
        "request_id",  # vLLM's: the idempotency key
        "ignore_eos",  # vLLM's
        "stop_token_ids",  # vLLM's
        "user",  # OpenAI's end-user id for abuse monitoring: metadata, nothing to do
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",  # vLLM's
        "top_k",  # vLLM's (-1 / 0: off)
        "min_p",  # vLLM's
        "min_tokens",  # vLLM's
    }
)
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
# Fields not implemented, accepted only with these values (they ask for the
# behaviour we have); any other value is a 400.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),  # chat's: completions implement it
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "include_stop_str_in_output": (None, False),  # vLLM's
    "skip_special_tokens": (None, True),  # vLLM's
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),  # meaningless without tools
    "response_format": (None, {"type": "text"}),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
MAX_CHOICES = 16  # `n`: each choice is a task of its own

Json = dict[str, Any]


class BadRequest(InvalidArgument):
    """An `InvalidArgument` whose OpenAI error names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(NotFound):
    """The request names a model this gateway does not serve."""

    param = "model"
    openai_code = "model_not_found"


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed /v1/completions or /v1/chat/completions body."""

    generate: gateway_pb2.GenerateRequest  # what gateway.core admits and runs
    is_chat: bool
    is_stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    n: int = 1  # choices: independent sequences, one task each
    stop: tuple[str, ...] = ()  # stop strings (`gateway.openai_stops`)
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: token ids that end a choice
    is_echo: bool = False  # completions' echo: the prompt comes first (with its logprobs)
    is_prompt_only: bool = False  # echo with max_tokens 0: no generated token returned
    messages: tuple[dict[str, str], ...] = ()  # chat's, checked (`use_chat_template`)


# ------------------------------------------------------------------ fields


def _int(body: Mapping[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be an integer in [{lo}, {hi}], got {value!r}", name)
    return value


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a number, got {value!r}", name)
    return float(value)


def _in_range(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = _number(body, name, default)
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be in [{lo:g}, {hi:g}], got {value:g}", name)
    return value


def _request_id(body: Mapping[str, Any]) -> str:
    """The optional idempotency key (vLLM's `request_id`); its form is checked
    by gateway.validate."""
    value = body.get("request_id")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadRequest(f"request_id must be a string, got {value!r}", "request_id")
    return value


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}", name)
    return value


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise BadRequest(f"{where} must be a JSON object, got {type(value).__name__}", where)
    return value


def _token_ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= _MAX_U32 for i in value
    ):
        raise BadRequest(f"{where} must be a list of token ids (integers >= 0)", where)
    return value


def check_model(body: Mapping[str, Any], served_model: str) -> None:
    """`model` may be left out; if given it must be the one this gateway serves."""
    model = body.get("model")
    if model is None:
        return
    if model != served_model:
        raise ModelNotFound(
            f"the model {model!r} does not exist; this server serves "
            f"{served_model!r} (see GET /v1/models)"
        )


def _is_neutral(value: Any, neutrals: tuple[Any, ...]) -> bool:
    # By type too: True == 1, but `echo: 1` is not `echo: false`.
    return any(
        value is n or (type(value) is type(n) and value == n) or (n is None and value is None)
        for n in neutrals
    )


def _check_supported(body: Mapping[str, Any], accepted: frozenset[str]) -> None:
    """A 400 naming the first field that is neither implemented nor neutral."""
    for name, value in body.items():
        if name in accepted:
            continue
        neutrals = _NEUTRAL.get(name)
        if neutrals is None:
            raise BadRequest(
                f"{name} is not supported by this server (not a field it implements); leave it out",
                name,
            )
        if not _is_neutral(value, neutrals):
            shown = " or ".join(repr(n) for n in neutrals if n is not None) or "null"
            raise BadRequest(
                f"{name} is not supported by this server (only {shown}); leave it out", name
            )


def _stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    """`stop`: a string or a list of strings (each non-empty)."""
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise BadRequest(
            f"stop must be a string or a list of at most {MAX_STOPS} strings of 1 to "
            f"{MAX_STOP_CHARS} characters",
            "stop",
        )
    return tuple(stops)


def _stop_token_ids(body: Mapping[str, Any]) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    ids = _token_ids(value, "stop_token_ids")
    if len(ids) > MAX_STOPS:
        raise BadRequest(f"stop_token_ids may list at most {MAX_STOPS} ids", "stop_token_ids")
    return tuple(ids)


# ---------------------------------------------------------------- requests


def _top_logprobs(body: Mapping[str, Any], *, is_chat: bool) -> int | None:
    """How many top tokens' logprobs to return with each token's; None: no
    logprobs. Completions: ``logprobs: k``; chat: ``logprobs: true`` and
    ``top_logprobs: k`` (0 when left out)."""
    if not is_chat:
        if body.get("logprobs") is None:
            return None
        return _int(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if not _bool(body, "logprobs"):
        if body.get("top_logprobs") is not None:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)


def _sampling(body: Mapping[str, Any], *, is_chat: bool = False) -> common_pb2.SamplingParams:
    # Range checks (temperature 0 or in [0.01, 100]) are gateway.validate's, for
    # both APIs; only top_p 0 is checked here: over gRPC it means "off" (proto3
    # cannot tell it from unset), but in JSON a 0 was sent on purpose.
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1] (1 = off), got {top_p:g}", "top_p")
    sampling = common_pb2.SamplingParams(
        temperature=_number(body, "temperature", 1.0),
        top_p=top_p,
        ignore_eos=_bool(body, "ignore_eos"),  # vLLM's extension
        seed=_int(body, "seed", 0, 0, _MAX_U64),  # 0: none given, one is drawn
    )
    top_logprobs = _top_logprobs(body, is_chat=is_chat)
    if top_logprobs is not None:
        sampling.top_logprobs = top_logprobs
    _penalties(body, sampling)
    return sampling


def _penalties(body: Mapping[str, Any], sampling: common_pb2.SamplingParams) -> None:
    """vLLM's filters and penalties onto `sampling`, range-checked here too so
    the 400 names the field (`param`); gateway.validate checks the same ranges
    for both APIs. top_k -1 is vLLM's "off" (0 on the wire); a
    repetition_penalty of 0 is refused (over gRPC 0 means unset)."""
    sampling.top_k = max(0, _int(body, "top_k", 0, -1, _MAX_U32))
    sampling.min_p = _in_range(body, "min_p", 0.0, 0.0, 1.0)
    for name in ("presence_penalty", "frequency_penalty"):
        setattr(sampling, name, _in_range(body, name, 0.0, -MAX_PENALTY, MAX_PENALTY))
    repetition = _in_range(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY)
    if repetition <= 0:
        raise BadRequest(
            f"repetition_penalty must be > 0 (1 = off), got {repetition:g}", "repetition_penalty"
        )
    sampling.repetition_penalty = repetition
    sampling.min_tokens = _int(body, "min_tokens", 0, 0, _MAX_U32)
    sampling.stop_token_ids.extend(_stop_token_ids(body))


def _max_tokens(body: Mapping[str, Any]) -> int:
    name = "max_tokens"
    if body.get("max_completion_tokens") is not None:  # chat's newer name for it
        name = "max_completion_tokens"
    return _int(body, name, DEFAULT_MAX_TOKENS, 1, _MAX_U32)


def _parse(body: Any, served_model: str, accepted: frozenset[str]) -> Mapping[str, Any]:
    """The body as an object, checked for model and unsupported fields."""
    body = _object(body, "the request body")
    check_model(body, served_model)
    _check_supported(body, accepted)
    options = body.get("stream_options")
    if options is not None:
        _object(options, "stream_options")
    return body


def _request(
    body: Mapping[str, Any], generate: gateway_pb2.GenerateRequest, *, is_chat: bool
) -> CompletionRequest:
    """The fields both endpoints share, around their `generate`."""
    return CompletionRequest(
        generate,
        is_chat=is_chat,
        is_stream=_bool(body, "stream"),
        include_usage=_bool(body.get("stream_options") or {}, "include_usage"),
        n=_int(body, "n", 1, 1, MAX_CHOICES),
        stop=_stops(body),
        stop_token_ids=_stop_token_ids(body),
    )


def parse_completion(body: Any, served_model: str) -> CompletionRequest:
    """A /v1/completions body: `prompt` is a string or a list of token ids
    (or a one-element list of either)."""
    body = _parse(body, served_model, _COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise BadRequest(
                "batched prompts are not supported: send one prompt per request", "prompt"
            )
        prompt = prompt[0]
    is_echo = _bool(body, "echo")
    # echo with max_tokens 0 (lm-eval-harness' log-likelihood): the prompt
    # alone. The engine always decodes one token: it runs and is not returned.
    is_prompt_only = is_echo and _is_exactly(body.get("max_tokens"), 0)
    request = gateway_pb2.GenerateRequest(
        max_tokens=1 if is_prompt_only else _max_tokens(body),
        sampling=_sampling(body),
        request_id=_request_id(body),
    )
    if is_echo and request.sampling.HasField("top_logprobs"):
        request.sampling.prompt_logprobs = request.sampling.top_logprobs
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, list):
        request.prompt_token_ids.extend(_token_ids(prompt, "prompt"))
    elif prompt is not None:
        raise BadRequest("prompt must be a string or a list of token ids", "prompt")
    parsed = _request(body, request, is_chat=False)
    return dataclasses.replace(parsed, is_echo=is_echo, is_prompt_only=is_prompt_only)


def _is_exactly(value: Any, number: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value == number


def _content(message: Mapping[str, Any], where: str) -> str:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = [_object(part, f"{where}.content[]") for part in content]
        if all(part.get("type") == "text" and isinstance(part.get("text"), str) for part in parts):
            return "".join(part["text"] for part in parts)
    raise BadRequest(f"{where}.content must be a string or a list of text parts", where)


def chat_messages(messages: Any) -> tuple[dict[str, str], ...]:
    """`messages` checked, as ``{"role", "content"}`` with text content."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    checked = []
    for i, raw in enumerate(messages):
        where = f"messages[{i}]"
        message = _object(raw, where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise BadRequest(
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                f"{where}.role",
            )
        checked.append({"role": str(role), "content": _content(message, where)})
    return tuple(checked)


def chat_prompt(messages: Any) -> str:
    """The prompt for a chat with the fallback template (module docstring)."""
    lines = [f"<|{m['role']}|>\n{m['content']}\n" for m in chat_messages(messages)]
    return "".join(lines) + "<|assistant|>\n"


def templated_chat_ids(
    tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]]
) -> list[int] | None:
    """The prompt ids of a chat through the checkpoint's own chat template
    (`lemix.tokenizer.render_chat`), encoded as the template wrote them (no
    BOS added: the template writes its own); None when the tokenizer has no
    template (`chat_prompt`'s fallback applies). A template that refuses the
    messages (e.g. roles that do not alternate) is a 400 on `messages`."""
    try:
        text = render_chat(tokenizer, messages)
    except ValueError as exc:
        raise BadRequest(str(exc), "messages") from None
    return None if text is None else tokenizer.encode(text)


def use_chat_template(parsed: CompletionRequest, tokenizer: Tokenizer) -> None:
    """A chat's prompt becomes its template's token ids when the checkpoint
    has a template (`templated_chat_ids`); else it stays `chat_prompt`'s text."""
    if not parsed.is_chat or not parsed.messages:
        return
    ids = templated_chat_ids(tokenizer, parsed.messages)
    if ids is not None:
        parsed.generate.ClearField("prompt")
        parsed.generate.prompt_token_ids[:] = ids


def parse_chat(body: Any, served_model: str) -> CompletionRequest:
    """A /v1/chat/completions body."""
    body = _parse(body, served_model, _CHAT_FIELDS)
    messages = chat_messages(body.get("messages"))
    request = gateway_pb2.GenerateRequest(
        prompt=chat_prompt(list(messages)),  # the fallback; see use_chat_template
        max_tokens=_max_tokens(body),
        sampling=_sampling(body, is_chat=True),
        request_id=_request_id(body),
    )
    return dataclasses.replace(_request(body, request, is_chat=True), messages=messages)


@dataclass(frozen=True)
class TokenizeRequest:
    """A /tokenize body (vLLM's): `prompt` text, or chat `messages` as the
    chat endpoint would prompt the model with them."""

    text: str
    add_special_tokens: bool  # BOS first, as a completion's prompt gets it
    messages: tuple[dict[str, str], ...] = ()  # chat's: the template may apply


def parse_tokenize(body: Any, served_model: str) -> TokenizeRequest:
    body = _object(body, "the request body")
    check_model(body, served_model)
    _check_supported(body, frozenset({"model", "prompt", "messages", "add_special_tokens"}))
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadRequest("send prompt (a string) or messages, one of them", "prompt")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise BadRequest("add_special_tokens must be true or false", "add_special_tokens")
    if messages is not None:
        checked = chat_messages(messages)
        return TokenizeRequest(chat_prompt(list(checked)), special, checked)
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string", "prompt")
    return TokenizeRequest(prompt, special)


def parse_detokenize(body: Any, served_model: str) -> list[int]:
    """A /detokenize body (vLLM's): ``{"tokens": [ids]}``."""
    body = _object(body, "the request body")
    check_model(body, served_model)
    _check_supported(body, frozenset({"model", "tokens"}))
    return _token_ids(body.get("tokens"), "tokens")


def _sample(raw: Any, where: str) -> gateway_pb2.TrainSample:
    sample = _object(raw, where)
    texts = {}
    for name in ("sample_id", "query", "reference"):
        value = sample.get(name) or ""
        if not isinstance(value, str):
            raise BadRequest(f"{where}.{name} must be a string", f"{where}.{name}")
        texts[name] = value
    token_ids = sample.get("token_ids") or []
    return gateway_pb2.TrainSample(
        **texts,
        token_ids=_token_ids(token_ids, f"{where}.token_ids"),
        num_reference_tokens=_int(sample, "num_reference_tokens", 0, 0, _MAX_U32),
    )


def parse_train(body: Any) -> gateway_pb2.TrainRequest:
    """A /v1/lemix/train body: ``{"samples": [{"query", "reference"} | {"token_ids",
    "num_reference_tokens"}, ...], "batch_size": 1}`` (`sample_id` optional)."""
    body = _object(body, "the request body")
    samples = body.get("samples")
    if not isinstance(samples, list):
        raise BadRequest("samples must be a list of {query, reference} objects", "samples")
    return gateway_pb2.TrainRequest(
        samples=[_sample(s, f"samples[{i}]") for i, s in enumerate(samples)],
        batch_size=_int(body, "batch_size", 1, 1, _MAX_U32),
    )
