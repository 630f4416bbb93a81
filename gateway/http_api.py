"""The gateway's OpenAI-compatible HTTP API (aiohttp), in the gRPC server's
process and event loop.

Routes (README "API" shows them in use):

- ``POST /v1/completions``, ``POST /v1/chat/completions``: non-streaming, or
  ``"stream": true`` as server-sent events (``data: {chunk}`` lines, then
  ``data: [DONE]``; ``stream_options.include_usage`` adds a usage chunk).
- ``GET /v1/models`` (and ``/v1/models/{model}``): the served model.
- ``POST /v1/lemix/train``: training samples -> task ids (LeMix's extension).
- ``GET /health``: 200 while serving with a live executor, else 503.
- ``GET /metrics``: Prometheus' default registry.

Handlers are thin: `gateway.openai_convert` parses, `gateway.core.GatewayCore`
runs the request exactly as gRPC's Generate/Train would (validation, in-flight
bound, Submit, the Redis output stream), `gateway.openai_responses` builds the
JSON and maps errors. A client that disconnects cancels its task. Completions
and training count in the gateway's metrics exactly as gRPC calls do
(`gateway.observe`, with the gRPC status name as the code).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from gateway.config import GatewayConfig
from gateway.core import NO_EXECUTOR_MESSAGE, GatewayCore
from gateway.observe import GenerateObservation, SloCache, code_of, observe_training
from gateway.openai_convert import (
    BadRequest,
    CompletionRequest,
    check_model,
    parse_chat,
    parse_completion,
    parse_train,
)
from gateway.openai_responses import (
    CompletionBuilder,
    Json,
    error_for,
    error_for_status,
    model_body,
    models_body,
)
from lemix._proto.lemix.v1 import gateway_pb2
from lemix.rpc.errors import ServiceError
from lemix.rpc.server import MAX_MESSAGE_BYTES

log = structlog.get_logger(__name__)

# The failure reason a task gets when its HTTP client goes away (PROTOCOL.md).
HTTP_GONE_REASON = "CANCELLED: the HTTP client disconnected"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Parse = Callable[[Any, str], CompletionRequest]


def _http_code_of(exc: BaseException) -> str:
    """`code_of`, plus aiohttp's own refusals of a request (e.g. a body over
    the size limit), which are the client's: INVALID_ARGUMENT."""
    if isinstance(exc, web.HTTPClientError):
        return "INVALID_ARGUMENT"
    return code_of(exc)


@web.middleware
async def _openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure answers in OpenAI's error shape; the server keeps serving."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        message = f"{exc.reason}: {request.method} {request.path}"
        body = error_for_status(exc.status, message)
        return web.json_response(body, status=exc.status, headers=headers)
    except Exception as exc:
        status, body = error_for(exc)
        log.info("http.error", path=request.path, status=status, message=body["error"]["message"])
        return web.json_response(body, status=status)


async def _json(request: web.Request) -> Any:
    try:
        return json.loads(await request.text())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


async def _send(stream: web.StreamResponse, body: Json) -> None:
    await stream.write(f"data: {json.dumps(body)}\n\n".encode())


async def _send_chunk(stream: web.StreamResponse, builder: CompletionBuilder,
                      response: gateway_pb2.GenerateResponse) -> None:  # fmt: skip
    chunk = builder.add(response)
    if chunk is not None:
        await _send(stream, chunk)


class HttpApi:
    """The routes over one `GatewayCore`; `is_serving()` is False while stopping."""

    def __init__(self, core: GatewayCore, config: GatewayConfig, is_serving: Callable[[], bool],
                 *, slo: SloCache | None = None) -> None:  # fmt: skip
        self.core = core
        self.config = config
        self._is_serving = is_serving
        self._slo = slo or SloCache(core.store)  # what completions are judged by
        self._created = int(time.time())  # the model's `created`: when this gateway started

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_openai_errors], client_max_size=MAX_MESSAGE_BYTES)
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}", self.model),
            web.post("/v1/lemix/train", self.train),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ])  # fmt: skip
        return app

    # ============================================================== handlers

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parse_chat)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(models_body(self.config.served_model_name, self._created))

    async def model(self, request: web.Request) -> web.Response:
        check_model({"model": request.match_info["model"]}, self.config.served_model_name)
        return web.json_response(model_body(self.config.served_model_name, self._created))

    async def train(self, request: web.Request) -> web.Response:
        task_ids = await observe_training(self._train(request), len, _http_code_of)
        return web.json_response({"object": "lemix.train", "task_ids": task_ids})

    async def health(self, request: web.Request) -> web.Response:
        if not self._is_serving():
            return web.json_response({"status": "stopping"}, status=503)
        try:
            is_live = await self.core.has_live_executor()
        except ServiceError as exc:  # Redis unreachable
            return web.json_response({"status": "unavailable", "reason": str(exc)}, status=503)
        if not is_live:
            return web.json_response({"status": "unavailable", "reason": NO_EXECUTOR_MESSAGE},
                                     status=503)  # fmt: skip
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})  # fmt: skip

    # ============================================================ completions

    async def _complete(self, request: web.Request, parse: Parse) -> web.StreamResponse:
        received_s = self.core.clock()
        async with GenerateObservation(self._slo, _http_code_of) as observation:
            return await self._run(request, parse, received_s, observation)

    async def _run(self, request: web.Request, parse: Parse, received_s: float,
                   observation: GenerateObservation) -> web.StreamResponse:  # fmt: skip
        parsed = parse(await _json(request), self.config.served_model_name)
        task, payload = await self.core.admit(parsed.generate)
        builder = CompletionBuilder(
            is_chat=parsed.is_chat, task_id=task.task_id, model=self.config.served_model_name,
            created=int(time.time()), num_prompt_tokens=task.num_prompt_tokens,
            tokenizer=self.core.tokenizer,
        )  # fmt: skip
        responses = observation.watch(self.core.generate(
            task, payload, received_s=received_s, gone_reason=lambda: HTTP_GONE_REASON
        ))  # fmt: skip
        # aclosing: a disconnect (the handler is cancelled) or a failed write
        # closes the core's stream now, so the task is cancelled at once.
        async with contextlib.aclosing(responses):
            if parsed.is_stream:
                return await self._stream(request, parsed, builder, responses)
            async for response in responses:
                builder.add(response)
            return web.json_response(builder.body())

    async def _stream(
        self,
        request: web.Request,
        parsed: CompletionRequest,
        builder: CompletionBuilder,
        responses: AsyncIterator[gateway_pb2.GenerateResponse],
    ) -> web.StreamResponse:
        # The first response comes before any byte is sent, so a request refused
        # (invalid, overload, no executor, rejected task) still gets its status.
        first = await anext(responses)
        stream = web.StreamResponse(headers=_SSE_HEADERS)
        await stream.prepare(request)
        try:
            await _send_chunk(stream, builder, first)
            async for response in responses:
                await _send_chunk(stream, builder, response)
            if parsed.include_usage:
                await _send(stream, builder.usage_chunk())
        except ConnectionError:  # the client went away: closing `responses` cancels its task
            return stream
        except Exception as exc:  # the status line is sent: the error goes as an event
            await _send(stream, error_for(exc)[1])
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    async def _train(self, request: web.Request) -> list[str]:
        return await self.core.train(parse_train(await _json(request)))


# ------------------------------------------------------------------ server


async def start_http(app: web.Application, host: str, port: int, *,
                     shutdown_timeout_s: float) -> tuple[web.AppRunner, int]:  # fmt: skip
    """Serve `app` on host:port (0 = a free port); the runner and the bound port.
    Raises OSError when the address cannot be bound."""
    # handler_cancellation: a client that disconnects cancels its handler (and
    # so its task); aiohttp's default since 3.9 is to let the handler run on.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])
