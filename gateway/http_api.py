"""The gateway's OpenAI-compatible HTTP API (aiohttp), in the gRPC server's
process and event loop.

Routes (docs/api.md shows them in use):

- ``POST /v1/completions``, ``POST /v1/chat/completions``: non-streaming, or
  ``"stream": true`` as server-sent events (``data: {chunk}`` lines, then
  ``data: [DONE]``; ``stream_options.include_usage`` adds a usage chunk).
- ``GET /v1/models`` (and ``/v1/models/{model}``): the served model, with its
  ``max_model_len`` (`gateway.model_limits.context_tokens`).
- ``POST /v1/lemix/train``: training samples -> task ids (LeMix's extension).
- ``GET /v1/lemix/tasks/{id}``: one task's state (`lemix.infra.task_states`), as
  gRPC's GetTask: 404 for an unknown id, 400 for a malformed one.
- ``GET /health``: 200 while serving with a live executor, else 503.
- ``GET /ping``: 200 with an empty body while the process serves HTTP (a
  liveness probe; /health is the readiness one).
- ``GET /version``: ``{"version": <the lemix package's version>}``.
- ``POST /tokenize`` (``{"prompt"}`` or ``{"messages"}``, ``add_special_tokens``)
  -> ``{"count", "max_model_len", "tokens"}``; ``POST /detokenize``
  (``{"tokens"}``) -> ``{"prompt"}``: vLLM's, with the gateway's tokenizer.

A completion's `stop` / `stop_token_ids` end a choice early: the text is cut
(`gateway.openai_stops`) and the task cancelled with `STOPPED_REASON`; `n`
choices run as n tasks read concurrently (`gateway.openai_choices`). CORS
(`gateway.http_cors`) is off unless `cors_allowed_origins` lists origins.
- ``GET /metrics``: Prometheus' default registry (unless
  `is_http_metrics_enabled` is off: then only on the gateway's `metrics_port`).

With API keys (`GatewayConfig.api_key`), every route but /health, /ping,
/version and /metrics needs ``Authorization: Bearer <key>``; otherwise 401
in OpenAI's shape (code ``invalid_api_key``) with ``WWW-Authenticate: Bearer``.
Every response carries ``X-Request-Id`` (the client's, else the completion's
task id, else a fresh one); every 429 and 503 carries ``Retry-After`` (whole
seconds).

Bad input is a 400, never a 500: a body that is not UTF-8 JSON, nests more
than `MAX_JSON_DEPTH` levels or is not an object; a body over the size limit
is a 413. A busy gateway answers 429 with ``Retry-After``. A completion's
``request_id`` (body, or the ``X-Request-Id`` header) is its idempotency key
within the caller's scope (``Authorization: Bearer`` key and ``X-Client-Id``,
hashed: `gateway.validate.client_scope`): the same request again replays its
answer, another request under that id is a 409.

Handlers are thin: `gateway.openai_convert` parses, `gateway.core.GatewayCore`
runs the request exactly as gRPC's Generate/Train would (validation, in-flight
bound, Submit, the Redis output stream), `gateway.openai_responses` builds the
JSON and maps errors. A client that disconnects cancels its task. Completions
and training count in the gateway's metrics exactly as gRPC calls do
(`gateway.observe`, with the gRPC status name as the code).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.config import GatewayConfig
from gateway.core import BUSY_RETRY_AFTER_S, NO_EXECUTOR_MESSAGE, GatewayCore
from gateway.http_cors import Cors, parse_origins
from gateway.model_limits import context_tokens
from gateway.observe import GenerateObservation, SloCache, code_of, observe_training
from gateway.openai_choices import Choices, choice_requests, collect, firsts, merged
from gateway.openai_convert import (
    BadRequest,
    CompletionRequest,
    check_model,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
    parse_train,
    templated_chat_ids,
    use_chat_template,
)
from gateway.openai_responses import (
    CompletionBuilder,
    Json,
    error_for,
    error_for_status,
    model_body,
    models_body,
    unauthorized_body,
)
from gateway.openai_stops import STOPPED_REASON
from gateway.tasks import TaskReader
from gateway.validate import check_token_ids, scope_from_headers
from lemix import __version__
from lemix._proto.lemix.v1 import gateway_pb2
from lemix.infra import telemetry
from lemix.infra.rpc.auth import ApiKeyCheck
from lemix.infra.rpc.errors import ServiceError, Unavailable
from lemix.infra.rpc.server import MAX_MESSAGE_BYTES
from lemix.infra.task_states import task_info_to_dict
from lemix.tokenizer import encode_prompt
from lemix.types import TaskPayload

log = structlog.get_logger(__name__)

# The failure reason a task gets when its HTTP client goes away (docs/protocol.md).
HTTP_GONE_REASON = "CANCELLED: the HTTP client disconnected"
SHUTDOWN_REASON = "CANCELLED: the gateway stopped before the stream ended"
# How often a non-streaming request checks that its client is still there.
_DISCONNECT_POLL_S = 0.1
# A completion's idempotency key when its body has no `request_id` (vLLM's header).
REQUEST_ID_HEADER = "X-Request-Id"
RETRY_AFTER_HEADER = "Retry-After"
# Statuses that say "try again later": they always carry Retry-After.
_RETRY_STATUSES = (429, 503)
# Routes open without an API key: probes, and the metrics Prometheus scrapes
# (the metrics port is open too; neither carries request data).
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
# Where a request keeps its id once known (the completion's task id, or one
# made up); a typed key where aiohttp has them (3.12+: plain strings warn).
_REQUEST_ID_KEY: Any = (
    web.RequestKey("lemix_request_id", str) if hasattr(web, "RequestKey") else "lemix.request_id"
)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Parse = Callable[[Any, str], CompletionRequest]


def _http_code_of(exc: BaseException) -> str:
    """`code_of`, plus aiohttp's own refusals of a request (e.g. a body over
    the size limit), which are the client's: INVALID_ARGUMENT."""
    if isinstance(exc, web.HTTPClientError):
        return "INVALID_ARGUMENT"
    return code_of(exc)


def retry_after(seconds: float) -> str:
    """A ``Retry-After`` value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


def request_id_of(request: web.Request) -> str:
    """The id a response echoes in ``X-Request-Id``: the client's header,
    else the completion's task id, else one made up for this request."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given:
        return given
    if _REQUEST_ID_KEY not in request:
        request[_REQUEST_ID_KEY] = uuid.uuid4().hex
    return str(request[_REQUEST_ID_KEY])


@web.middleware
async def _common_headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """``X-Request-Id`` on every response, ``Retry-After`` on every 429 and 503
    (a streamed response sets its own before its headers go out)."""
    response = await handler(request)
    if not response.prepared:
        response.headers.setdefault(REQUEST_ID_HEADER, request_id_of(request))
        if response.status in _RETRY_STATUSES:
            response.headers.setdefault(RETRY_AFTER_HEADER, retry_after(BUSY_RETRY_AFTER_S))
    return response


def require_api_key(check: ApiKeyCheck) -> Middleware:
    """401 for a request to a route outside `OPEN_PATHS` without an accepted
    ``Authorization: Bearer <key>``; the key itself is never logged."""

    @web.middleware
    async def require(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        problem = check.http_problem(request.headers.get("Authorization"))
        if problem is None:
            return await handler(request)
        log.info("http.unauthenticated", path=request.path, reason=problem.split(":")[0])
        return web.json_response(
            unauthorized_body(problem), status=401, headers={"WWW-Authenticate": "Bearer"}
        )

    return require


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
        if isinstance(exc, web.HTTPRequestEntityTooLarge):  # its text names both sizes
            message = f"{exc.text}; send a smaller body (split a Train call's samples)"
        body = error_for_status(exc.status, message)
        return web.json_response(body, status=exc.status, headers=headers)
    except Exception as exc:
        status, body = error_for(exc)
        log.info("http.error", path=request.path, status=status, message=body["error"]["message"])
        # 429 (busy, or a task refused for lack of room), 503: when to try again.
        seconds = getattr(exc, "retry_after_s", BUSY_RETRY_AFTER_S)
        retry = {RETRY_AFTER_HEADER: retry_after(seconds)}
        return web.json_response(
            body, status=status, headers=retry if status in _RETRY_STATUSES else None
        )


# A body may nest at most this deep (ours nest 4: body, messages, message,
# content parts). Deeper is refused before parsing: `json.loads` recurses, and
# a few thousand levels exhaust the interpreter's stack (a 500, not a 400).
MAX_JSON_DEPTH = 32
# A JSON string (skipped whole, brackets inside it are text) or a bracket.
_JSON_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def _is_nested_deeper(text: str, max_depth: int) -> bool:
    """Whether `text` opens more than `max_depth` arrays/objects at once;
    stops at the first level too deep."""
    depth = 0
    for match in _JSON_STRING_OR_BRACKET.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > max_depth:
                return True
        elif token in ("]", "}"):
            depth -= 1
    return False


async def _json(request: web.Request) -> Any:
    """The body, parsed; `BadRequest` for anything that is not JSON within
    `MAX_JSON_DEPTH` (the parsers check it is an object)."""
    try:
        text = await request.text()
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not UTF-8 text: {exc}") from None
    if _is_nested_deeper(text, MAX_JSON_DEPTH):
        raise BadRequest(
            f"the request body nests arrays/objects more than {MAX_JSON_DEPTH} "
            "levels deep; no field of this API needs that"
        )
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, too-long ints
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


async def _run_unless_gone(request: web.Request, work: Awaitable[None]) -> bool:
    """Run `work` (reading a non-streaming request's answer); False (it was
    cancelled) when the client disconnected first.

    aiohttp's handler cancellation alone is not enough: on Python 3.11 a
    cancel that lands while redis-py is inside `asyncio.wait_for` can be
    swallowed, leaving a non-streaming request generating for nobody. So the
    transport is polled too, and the cancel repeated until the work ends.
    """
    task = asyncio.ensure_future(work)
    is_gone = False
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            transport = request.transport
            if not task.done() and (transport is None or transport.is_closing()):
                is_gone = True
                break
    finally:
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
    if is_gone:
        return False
    task.result()  # its error, if it failed
    return True


async def _send(stream: web.StreamResponse, body: Json) -> None:
    await stream.write(f"data: {json.dumps(body)}\n\n".encode())


def _gone_reason(
    builder: CompletionBuilder, is_shutting_down: Callable[[], bool]
) -> Callable[[], str]:
    """Why a choice's task is cancelled when its stream is closed early."""

    def reason() -> str:
        if builder.is_stopped_early:
            return STOPPED_REASON
        return SHUTDOWN_REASON if is_shutting_down() else HTTP_GONE_REASON

    return reason


class HttpApi:
    """The routes over one `GatewayCore`; `is_serving()` is False while stopping."""

    def __init__(
        self,
        core: GatewayCore,
        config: GatewayConfig,
        is_serving: Callable[[], bool],
        *,
        slo: SloCache | None = None,
    ) -> None:
        self.core = core
        self.config = config
        self._is_serving = is_serving
        self._slo = slo or SloCache(core.store)  # what completions are judged by
        self._created = int(time.time())  # the model's `created`: when this gateway started
        self._tasks = TaskReader(core.store)
        keys = config.api_keys
        self._key_check = ApiKeyCheck(keys) if keys else None
        # One event per open SSE stream: set when the server stops past its
        # drain grace, so the stream ends itself with an error event.
        self._open_streams: set[asyncio.Event] = set()
        self._is_shutting_down = False

    def is_shutting_down(self) -> bool:
        return self._is_shutting_down

    async def _on_shutdown(self, app: web.Application) -> None:
        """aiohttp's shutdown signal (before it cancels handlers): streams get
        the drain grace to finish, then the rest are told and ended."""
        give_up_s = time.monotonic() + max(self.config.shutdown_grace_s - _SHUTDOWN_WRITE_S, 0.0)
        while self._open_streams and time.monotonic() < give_up_s:
            await asyncio.sleep(0.05)
        self._is_shutting_down = True
        for stopping in list(self._open_streams):
            stopping.set()

    def app(self) -> web.Application:
        middlewares: list[Middleware] = [_common_headers]  # outermost: sees every answer
        cors = Cors(parse_origins(self.config.cors_allowed_origins))
        if cors.origins:  # preflights are answered before the API key check
            middlewares.append(cors.middleware)
        if self._key_check is not None:
            middlewares.append(require_api_key(self._key_check))
        middlewares.append(_openai_errors)
        app = web.Application(middlewares=middlewares, client_max_size=MAX_MESSAGE_BYTES)
        app.on_shutdown.append(self._on_shutdown)
        if cors.origins:
            app.on_response_prepare.append(cors.on_response_prepare)
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model}", self.model),
                web.post("/v1/lemix/train", self.train),
                # `.+`: a client's request_id may contain "/" (it is checked, not routed)
                web.get("/v1/lemix/tasks/{task_id:.+}", self.task),
                web.get("/health", self.health),
                web.get("/ping", self.ping),
                web.post("/ping", self.ping),  # as vLLM (SageMaker's probe)
                web.get("/version", self.version),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
            ]
        )
        if self.config.is_http_metrics_enabled:
            app.router.add_get("/metrics", self.metrics)
        return app

    # ============================================================== handlers

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parse_chat)

    async def models(self, request: web.Request) -> web.Response:
        body = models_body(self.config.served_model_name, self._created, await self._max_len())
        return web.json_response(body)

    async def model(self, request: web.Request) -> web.Response:
        check_model({"model": request.match_info["model"]}, self.config.served_model_name)
        body = model_body(self.config.served_model_name, self._created, await self._max_len())
        return web.json_response(body)

    async def tokenize(self, request: web.Request) -> web.Response:
        """The ids a completion's prompt (or a chat's messages) becomes."""
        parsed = parse_tokenize(await _json(request), self.config.served_model_name)
        tokenizer = self.core.tokenizer
        templated = templated_chat_ids(tokenizer, parsed.messages) if parsed.messages else None
        if templated is not None:  # as the chat endpoint prompts: the template's own BOS
            ids = templated
        elif parsed.add_special_tokens:
            ids = encode_prompt(tokenizer, parsed.text)  # BOS first, as a completion's
        else:
            ids = tokenizer.encode(parsed.text)
        body = {"count": len(ids), "max_model_len": await self._max_len(), "tokens": ids}
        return web.json_response(body)

    async def detokenize(self, request: web.Request) -> web.Response:
        """The text of token ids (400 for an id outside the model's vocabulary)."""
        ids = parse_detokenize(await _json(request), self.config.served_model_name)
        limits = await self.core.model_limits.get()
        check_token_ids(ids, limits.vocab_size, "tokens")
        return web.json_response({"prompt": self.core.tokenizer.decode(ids)})

    async def _max_len(self) -> int:
        """The context limit requests are checked against (`gateway.model_limits`)."""
        limits = await self.core.model_limits.get()
        return context_tokens(self.config.max_context_tokens, limits)

    async def train(self, request: web.Request) -> web.Response:
        task_ids = await observe_training(
            self._train(request), len, _http_code_of, model_name=self.config.served_model_name
        )
        return web.json_response({"object": "lemix.train", "task_ids": task_ids})

    async def task(self, request: web.Request) -> web.Response:
        info = await self._tasks.get(request.match_info["task_id"])
        return web.json_response({"object": "lemix.task", **task_info_to_dict(info)})

    async def health(self, request: web.Request) -> web.Response:
        if not self._is_serving():
            return web.json_response({"status": "stopping"}, status=503)
        try:
            is_live = await self.core.has_live_executor()
        except ServiceError as exc:  # Redis unreachable
            return web.json_response({"status": "unavailable", "reason": str(exc)}, status=503)
        if not is_live:
            return web.json_response(
                {"status": "unavailable", "reason": NO_EXECUTOR_MESSAGE}, status=503
            )
        return web.json_response({"status": "ok"})

    async def ping(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(telemetry.registry_for("gateway")),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    # ============================================================ completions

    async def _complete(self, request: web.Request, parse: Parse) -> web.StreamResponse:
        received_s = self.core.clock()
        async with GenerateObservation(
            self._slo, _http_code_of, model_name=self.config.served_model_name
        ) as observation:
            return await self._run(request, parse, received_s, observation)

    async def _run(
        self,
        request: web.Request,
        parse: Parse,
        received_s: float,
        observation: GenerateObservation,
    ) -> web.StreamResponse:
        parsed = parse(await _json(request), self.config.served_model_name)
        use_chat_template(parsed, self.core.tokenizer)  # a chat: the checkpoint's template
        generate = parsed.generate
        if not generate.request_id:  # the body's request_id wins over the header
            generate.request_id = request.headers.get(REQUEST_ID_HEADER, "")
        scope = scope_from_headers(request.headers)
        is_logprobs = generate.sampling.HasField("top_logprobs")
        if is_logprobs and not (await self.core.model_limits.get()).is_known:
            raise BadRequest(
                "logprobs need a real model: no executor here runs one (the emulated "
                "backend generates counts, not tokens); leave logprobs out",
                "logprobs",
            )
        admitted = [
            await self.core.admit(choice, scope=scope)
            for choice in choice_requests(generate, parsed.n)
        ]
        for task, _ in admitted:
            observation.on_admitted(task.num_prompt_tokens)
        request[_REQUEST_ID_KEY] = admitted[0][0].task_id  # echoed unless the client sent its own
        created = int(time.time())
        choices = Choices(
            [
                CompletionBuilder(
                    is_chat=parsed.is_chat,
                    task_id=admitted[0][0].task_id,
                    model=self.config.served_model_name,
                    created=created,
                    num_prompt_tokens=task.num_prompt_tokens,
                    tokenizer=self.core.tokenizer,
                    index=index,
                    stop=parsed.stop,
                    stop_token_ids=parsed.stop_token_ids,
                    is_logprobs=is_logprobs,
                    echo=self._echo(parsed, payload),
                    is_prompt_only=parsed.is_prompt_only,
                )
                for index, (task, payload) in enumerate(admitted)
            ]
        )

        def on_stop() -> None:
            observation.on_stopped_early(self.core.clock() - received_s)

        # aclosing: a disconnect (the handler is cancelled), a failed write or
        # a stop sequence closes the core's streams now, so their tasks are
        # cancelled at once (with the reason of `_gone_reason`).
        async with contextlib.AsyncExitStack() as exits:
            streams = [
                await exits.enter_async_context(
                    contextlib.aclosing(
                        observation.watch(
                            self.core.generate(
                                task,
                                payload,
                                received_s=received_s,
                                gone_reason=_gone_reason(builder, self.is_shutting_down),
                            )
                        )
                    )
                )
                for (task, payload), builder in zip(admitted, choices.builders, strict=True)
            ]
            if parsed.is_stream:
                return await self._stream(request, parsed, choices, streams, on_stop)
            if not await _run_unless_gone(request, collect(streams, choices, on_stop)):
                # Recorded like aiohttp's own handler cancellation.
                raise asyncio.CancelledError(HTTP_GONE_REASON)
            return web.json_response(choices.body())

    def _echo(
        self, parsed: CompletionRequest, payload: TaskPayload
    ) -> tuple[str, tuple[int, ...]] | None:
        """(text, ids) of the prompt a completion with `echo` returns first."""
        if not parsed.is_echo:
            return None
        generate = parsed.generate
        text = generate.prompt or self.core.tokenizer.decode(generate.prompt_token_ids)
        return text, payload.prompt_token_ids

    async def _stream(
        self,
        request: web.Request,
        parsed: CompletionRequest,
        choices: Choices,
        streams: Sequence[AsyncIterator[gateway_pb2.GenerateResponse]],
        on_stop: Callable[[], None],
    ) -> web.StreamResponse:
        # The first responses come before any byte is sent, so a request refused
        # (invalid, overload, no executor, rejected task) still gets its status.
        first = await firsts(streams)
        stream = web.StreamResponse(
            headers={**_SSE_HEADERS, REQUEST_ID_HEADER: request_id_of(request)}
        )
        await stream.prepare(request)
        stopping = asyncio.Event()
        self._open_streams.add(stopping)
        forward = asyncio.create_task(
            self._forward(stream, parsed, choices, streams, first, on_stop)
        )
        stop_wait = asyncio.create_task(stopping.wait())
        try:
            await asyncio.wait({forward, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if not forward.done():  # the server stops past its drain grace
                forward.cancel()
                with contextlib.suppress(BaseException):
                    await forward
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(_send_shutdown(stream), _SHUTDOWN_WRITE_S)
                return stream
            forward.result()  # its error, if it ended with one
        except ConnectionError:  # the client went away: closing `streams` cancels the tasks
            return stream
        except Exception as exc:  # the status line is sent: the error goes as an event
            await _send(stream, error_for(exc)[1])
        finally:
            self._open_streams.discard(stopping)
            stop_wait.cancel()
            if not forward.done():  # this handler was cancelled (the client left)
                forward.cancel()
                with contextlib.suppress(BaseException):
                    await forward
        # The client may go right after the last chunk: not an error of ours.
        with contextlib.suppress(ConnectionError):
            await stream.write(b"data: [DONE]\n\n")
            await stream.write_eof()
        return stream

    async def _forward(
        self,
        stream: web.StreamResponse,
        parsed: CompletionRequest,
        choices: Choices,
        streams: Sequence[AsyncIterator[gateway_pb2.GenerateResponse]],
        first: Sequence[gateway_pb2.GenerateResponse],
        on_stop: Callable[[], None],
    ) -> None:
        """Every chunk of the merged choices, then the usage chunk if asked."""
        async with contextlib.aclosing(merged(streams, choices, first, on_stop)) as chunks:
            async for chunk in chunks:
                await _send(stream, chunk)
        if parsed.include_usage:
            await _send(stream, choices.usage_chunk())

    async def _train(self, request: web.Request) -> list[str]:
        return await self.core.train(
            parse_train(await _json(request)), scope=scope_from_headers(request.headers)
        )


_SHUTDOWN_WRITE_S = 1.0  # the most a stopping server spends telling one stream


async def _send_shutdown(stream: web.StreamResponse) -> None:
    """An error event (UNAVAILABLE: retry elsewhere or later), then [DONE]."""
    error = Unavailable("the gateway is shutting down; retry the request")
    await _send(stream, error_for(error)[1])
    await stream.write(b"data: [DONE]\n\n")
    await stream.write_eof()


# ------------------------------------------------------------------ server


async def start_http(
    app: web.Application,
    host: str,
    port: int,
    *,
    shutdown_timeout_s: float,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0 = a free port); the runner and the bound port.
    `ssl_context` (`lemix.infra.rpc.tls.ServerTls.ssl_context`) serves HTTPS only;
    None, plain HTTP. Raises OSError when the address cannot be bound."""
    # handler_cancellation: a client that disconnects cancels its handler (and
    # so its task); aiohttp's default since 3.9 is to let the handler run on.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])
