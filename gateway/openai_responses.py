"""Gateway results -> OpenAI-compatible JSON: completions, stream chunks, errors.

`CompletionBuilder` turns one task's `GenerateResponse`s into a completion
(``cmpl-<task id>``) or chat completion (``chatcmpl-<task id>``), whole or as
stream chunks. Text is the gateway tokenizer's decode of the token ids the
gateway reports, decoded as they stream (`lemix.model.tokenizer.detokenize_new`,
which holds back a token that ends inside a multibyte character).

`error_for` maps what `gateway.core` raises to an HTTP status
and OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``:
it reads the same status codes the gRPC API answers with.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from typing import Any

import grpc
import structlog

from gateway.convert import TaskEnded
from gateway.openai_stops import StopText
from lemix._proto.lemix.v1 import gateway_pb2
from lemix.infra.rpc.errors import ServiceError
from lemix.model.tokenizer import detokenize_new
from lemix.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

Json = dict[str, Any]

# gRPC status -> (HTTP status, OpenAI error type); any other status is a 500.
_HTTP_BY_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),  # request_id reused
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
}
_SERVER_ERROR = (500, "server_error")
_TYPE_BY_HTTP = dict(_HTTP_BY_STATUS.values())


# ------------------------------------------------------------------ errors


def error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> Json:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_for(exc: Exception) -> tuple[int, Json]:
    """(HTTP status, body) for an exception a request raised. Domain errors and
    failed tasks keep their message; anything else is a logged 500 with an id."""
    if isinstance(exc, TaskEnded):
        code, message = exc.code, exc.details
    elif isinstance(exc, ServiceError):
        code, message = exc.code, str(exc) or exc.code.name
    else:
        error_id = uuid.uuid4().hex[:12]
        log.error(
            "http.internal_error",
            error_id=error_id,
            error=f"{type(exc).__name__}: {exc}",
            exc_info=exc,
        )
        message = f"internal error {type(exc).__name__} (error_id={error_id})"
        return 500, error_body(message, _SERVER_ERROR[1], code="internal")
    status, error_type = _HTTP_BY_STATUS.get(code, _SERVER_ERROR)
    openai_code = getattr(exc, "openai_code", None) or code.name.lower()
    return status, error_body(
        message, error_type, param=getattr(exc, "param", None), code=openai_code
    )


def unauthorized_body(message: str) -> Json:
    """A 401's body, as OpenAI answers a missing or wrong API key."""
    return error_body(message, "invalid_request_error", code="invalid_api_key")


def error_for_status(status: int, message: str) -> Json:
    """The body for an HTTP-level error (unknown route, bad method, bad JSON)."""
    return error_body(message, _TYPE_BY_HTTP.get(status, "invalid_request_error"))


# ----------------------------------------------------------------- models


def model_body(served_model: str, created: int, max_model_len: int) -> Json:
    """One model; `max_model_len` is the context limit requests are checked
    against (prompt + max_tokens), as vLLM reports it."""
    return {
        "id": served_model,
        "object": "model",
        "created": created,
        "owned_by": "lemix",
        "max_model_len": max_model_len,
    }


def models_body(served_model: str, created: int, max_model_len: int) -> Json:
    """GET /v1/models: the one model this gateway serves."""
    return {"object": "list", "data": [model_body(served_model, created, max_model_len)]}


# ------------------------------------------------------------ completions


class CompletionBuilder:
    """One request's completion, built from its task's responses.

    `add(response)` returns the stream chunk for it (None when it adds no
    text and does not finish); `body()` is the whole non-streaming answer.
    """

    def __init__(
        self,
        *,
        is_chat: bool,
        task_id: str,
        model: str,
        created: int,
        num_prompt_tokens: int,
        tokenizer: Tokenizer,
        index: int = 0,
        stop: Sequence[str] = (),
        stop_token_ids: Collection[int] = (),
        is_logprobs: bool = False,
        echo: tuple[str, Sequence[int]] | None = None,
        is_prompt_only: bool = False,
    ) -> None:
        self.is_chat = is_chat
        self.index = index  # the choice's index (`n` > 1: one builder per choice)
        self.id = ("chatcmpl-" if is_chat else "cmpl-") + task_id
        self.model = model
        self.created = created
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = 0
        self.finish_reason: str | None = None
        self._tokenizer = tokenizer
        self._ids: list[int] = []  # every output id so far
        self._num_detokenized = 0  # leading ids of _ids whose text is in _texts
        self._texts: list[str] = []
        self._stop_text = StopText(stop)
        self._stop_token_ids = frozenset(stop_token_ids)
        # True when a stop sequence ended the choice before its task ended:
        # the caller stops reading (and so cancels the task, `openai_stops`).
        self.is_stopped_early = False
        # `logprobs` asked for: each token's, from the responses (torch backend).
        self.is_logprobs = is_logprobs
        self._logprobs: list[Json] = []  # the choice's entries so far, OpenAI's shape
        self._text_offset = 0  # completions' text_offset of the next token
        # Completions' echo: (the prompt's text, its ids), sent before the output.
        self._echo = echo
        self._is_echo_sent = False
        # echo with max_tokens 0: the one token the engine decodes is not returned.
        self._is_prompt_only = is_prompt_only

    @property
    def is_done(self) -> bool:
        """The choice has its finish_reason: nothing more is added."""
        return self.finish_reason is not None

    def add(self, response: gateway_pb2.GenerateResponse) -> Json | None:
        if self.is_done:
            return None
        is_first = not self._texts
        token_ids = [] if self._is_prompt_only else list(response.token_ids)
        is_stop_token = False
        for i, token_id in enumerate(token_ids):
            if token_id in self._stop_token_ids:  # ends the output before it
                token_ids, is_stop_token = token_ids[:i], True
                break
        self.num_completion_tokens += len(token_ids) + is_stop_token
        self._ids.extend(token_ids)
        echo_text, logprobs = self._echoed(response)
        logprobs += self._new_logprobs(token_ids, response.logprobs[: len(token_ids)])
        is_final = response.is_finished or is_stop_token
        text, self._num_detokenized = detokenize_new(
            self._tokenizer, self._ids, self._num_detokenized, is_final=is_final
        )
        text = echo_text + self._stop_text.feed(text, is_final=is_final)
        if is_stop_token or self._stop_text.is_stopped:
            self.finish_reason = "stop"
            self.is_stopped_early = not response.is_finished
        elif response.is_finished:
            self.finish_reason = response.finish_reason or "stop"
        if text:
            self._texts.append(text)
        if not text and not self.is_done and not logprobs:
            return None
        if self.is_chat:
            delta: Json = {"role": "assistant", "content": text} if is_first else {"content": text}
            choice: Json = {"index": self.index, "delta": delta}
        else:
            choice = {"index": self.index, "text": text}
        choice |= {"logprobs": self._logprobs_body(logprobs), "finish_reason": self.finish_reason}
        return self._envelope(chunk=True) | {"choices": [choice]}

    def usage(self) -> Json:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
        }

    def usage_chunk(self) -> Json:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        return self._envelope(chunk=True) | {"choices": [], "usage": self.usage()}

    def body(self) -> Json:
        return self._envelope(chunk=False) | {"choices": [self.choice()], "usage": self.usage()}

    def choice(self) -> Json:
        """The whole choice, for a non-streaming answer."""
        text = "".join(self._texts)
        if self.is_chat:
            choice: Json = {"index": self.index, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": self.index, "text": text}
        logprobs = self._logprobs_body(self._logprobs)
        return choice | {"logprobs": logprobs, "finish_reason": self.finish_reason}

    # ---------------------------------------------------------- logprobs

    def _echoed(self, response: gateway_pb2.GenerateResponse) -> tuple[str, list[Json]]:
        """The prompt's text and logprob entries, once, with the first response
        (the prompt's first token has no logprob: nothing comes before it)."""
        if self._echo is None or self._is_echo_sent:
            return "", []
        self._is_echo_sent = True
        text, ids = self._echo
        if not self.is_logprobs:
            return text, []
        if len(response.prompt_logprobs) != max(0, len(ids) - 1):
            raise ServiceError(
                f"echo with logprobs: the executor sent {len(response.prompt_logprobs)} "
                f"prompt logprobs for a prompt of {len(ids)} tokens"
            )
        entries: list[Json] = [{"token": self._token_text(ids[0]), "logprob": None, "top": None}]
        entries += [
            {
                "token": self._token_text(token_id),
                "logprob": entry.logprob,
                "top": [(self._token_text(t.token_id), t.logprob) for t in entry.top],
            }
            for token_id, entry in zip(ids[1:], response.prompt_logprobs, strict=True)
        ]
        self._logprobs.extend(entries)
        return text, entries

    def _new_logprobs(
        self, token_ids: Sequence[int], entries: Sequence[gateway_pb2.TokenLogprob]
    ) -> list[Json]:
        """The OpenAI entries of new tokens (kept for the whole choice too)."""
        if not self.is_logprobs:
            return []
        if len(entries) != len(token_ids):  # the backend produced none (emulated)
            raise ServiceError(
                f"logprobs were asked for but the executor sent {len(entries)} for "
                f"{len(token_ids)} tokens: only a real model (torch backend) has them"
            )
        new = [
            {
                "token": self._token_text(token_id),
                "logprob": entry.logprob,
                "top": [(self._token_text(t.token_id), t.logprob) for t in entry.top],
            }
            for token_id, entry in zip(token_ids, entries, strict=True)
        ]
        self._logprobs.extend(new)
        return new

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def _logprobs_body(self, entries: list[Json]) -> Json | None:
        """`entries` in the endpoint's shape: chat's ``content`` list, or the
        completions' parallel lists (``text_offset`` counts from the choice's start)."""
        if not self.is_logprobs:
            return None
        if self.is_chat:
            return {
                "content": [
                    {
                        "token": e["token"],
                        "logprob": e["logprob"],
                        "bytes": list(e["token"].encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": lp, "bytes": list(t.encode())}
                            for t, lp in e["top"]
                        ],
                    }
                    for e in entries
                ],
                "refusal": None,
            }
        # Offsets of the whole choice: from 0; of a chunk: where its tokens start.
        start = 0 if entries is self._logprobs else self._text_offset
        offsets = []
        for e in entries:
            offsets.append(start)
            start += len(e["token"])
        if entries is not self._logprobs:
            self._text_offset = start
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else dict(e["top"]) for e in entries],
            "text_offset": offsets,
        }

    def _envelope(self, *, chunk: bool) -> Json:
        if self.is_chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}
