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

Handlers are thin: `gateway.http_body` reads the JSON, `gateway.openai_convert`
parses it, `gateway.core.GatewayCore` runs the request exactly as gRPC's
Generate/Train would (validation, in-flight bound, Submit, the Redis output
stream), `gateway.openai_responses` builds the JSON and maps errors,
`gateway.http_middleware` adds the headers, the API key check and the error
answers, `gateway.http_sse` streams. A client that disconnects cancels its
task. Completions and training count in the gateway's metrics exactly as gRPC
calls do (`gateway.observe`, with the gRPC status name as the code).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.admission import NO_EXECUTOR_MESSAGE, NO_SCHEDULER_MESSAGE
from gateway.config import GatewayConfig
from gateway.core import GatewayCore
from gateway.http_body import read_json
from gateway.http_cors import Cors, parse_origins
from gateway.http_middleware import (
    REQUEST_ID_HEADER,
    REQUEST_ID_KEY,
    common_headers,
    http_code_of,
    openai_errors,
    require_api_key,
)
from gateway.http_sse import HTTP_GONE_REASON, SseStreams, gone_reason, run_unless_gone
from gateway.model_limits import context_tokens
from gateway.observe import GenerateObservation, SloCache, observe_training
from gateway.openai_choices import Choices, choice_requests, collect
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
from gateway.openai_responses import CompletionBuilder, model_body, models_body
from gateway.tasks import TaskReader
from gateway.validate import check_token_ids, scope_from_headers
from lemix import __version__
from lemix.infra import telemetry
from lemix.infra.rpc.auth import ApiKeyCheck
from lemix.infra.rpc.errors import ServiceError
from lemix.infra.rpc.server import MAX_MESSAGE_BYTES
from lemix.infra.task_states import task_info_to_dict
from lemix.tokenizer import encode_prompt
from lemix.types import TaskPayload

Parse = Callable[[Any, str], CompletionRequest]


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
        self._sse = SseStreams(config.shutdown_grace_s)

    def app(self) -> web.Application:
        middlewares: list[Middleware] = [common_headers]  # outermost: sees every answer
        cors = Cors(parse_origins(self.config.cors_allowed_origins))
        if cors.origins:  # preflights are answered before the API key check
            middlewares.append(cors.middleware)
        if self._key_check is not None:
            middlewares.append(require_api_key(self._key_check))
        middlewares.append(openai_errors)
        app = web.Application(middlewares=middlewares, client_max_size=MAX_MESSAGE_BYTES)
        app.on_shutdown.append(self._sse.on_shutdown)
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
        parsed = parse_tokenize(await read_json(request), self.config.served_model_name)
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
        ids = parse_detokenize(await read_json(request), self.config.served_model_name)
        limits = await self.core.model_limits.get()
        check_token_ids(ids, limits.vocab_size, "tokens")
        return web.json_response({"prompt": self.core.tokenizer.decode(ids)})

    async def _max_len(self) -> int:
        """The context limit requests are checked against (`gateway.model_limits`)."""
        limits = await self.core.model_limits.get()
        return context_tokens(self.config.max_context_tokens, limits)

    async def train(self, request: web.Request) -> web.Response:
        task_ids = await observe_training(
            self._train(request), len, http_code_of, model_name=self.config.served_model_name
        )
        return web.json_response({"object": "lemix.train", "task_ids": task_ids})

    async def task(self, request: web.Request) -> web.Response:
        info = await self._tasks.get(request.match_info["task_id"])
        return web.json_response({"object": "lemix.task", **task_info_to_dict(info)})

    async def health(self, request: web.Request) -> web.Response:
        if not self._is_serving():
            return web.json_response({"status": "stopping"}, status=503)
        try:
            liveness = await self.core.liveness()
        except ServiceError as exc:  # Redis unreachable
            return web.json_response({"status": "unavailable", "reason": str(exc)}, status=503)
        for is_live, reason in (
            (liveness.has_executor, NO_EXECUTOR_MESSAGE),
            (liveness.has_scheduler, NO_SCHEDULER_MESSAGE),
        ):
            if not is_live:
                return web.json_response({"status": "unavailable", "reason": reason}, status=503)
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
            self._slo, http_code_of, model_name=self.config.served_model_name
        ) as observation:
            return await self._run(request, parse, received_s, observation)

    async def _run(
        self,
        request: web.Request,
        parse: Parse,
        received_s: float,
        observation: GenerateObservation,
    ) -> web.StreamResponse:
        parsed = parse(await read_json(request), self.config.served_model_name)
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
        request[REQUEST_ID_KEY] = admitted[0][0].task_id  # echoed unless the client sent its own
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
        # cancelled at once (with the reason of `gone_reason`).
        async with contextlib.AsyncExitStack() as exits:
            streams = [
                await exits.enter_async_context(
                    contextlib.aclosing(
                        observation.watch(
                            self.core.generate(
                                task,
                                payload,
                                received_s=received_s,
                                gone_reason=gone_reason(builder, self._sse.is_shutting_down),
                            )
                        )
                    )
                )
                for (task, payload), builder in zip(admitted, choices.builders, strict=True)
            ]
            if parsed.is_stream:
                return await self._sse.stream(request, parsed, choices, streams, on_stop)
            if not await run_unless_gone(request, collect(streams, choices, on_stop)):
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

    async def _train(self, request: web.Request) -> list[str]:
        return await self.core.train(
            parse_train(await read_json(request)), scope=scope_from_headers(request.headers)
        )


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
