"""The HTTP API's middlewares: headers on every answer, the API key, errors.

- `common_headers` (outermost): ``X-Request-Id`` on every response (the
  client's, else the completion's task id, else a fresh one), ``Retry-After``
  (whole seconds) on every 429 and 503.
- `require_api_key`: with API keys, every route outside `OPEN_PATHS` needs
  ``Authorization: Bearer <key>``; otherwise 401 in OpenAI's shape (code
  ``invalid_api_key``) with ``WWW-Authenticate: Bearer``.
- `openai_errors` (innermost): every failure answers in OpenAI's error shape
  (`gateway.openai_responses.error_for` maps domain errors to statuses); the
  server keeps serving.

CORS (`gateway.http_cors`) sits between the first two when it is on.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.admission import BUSY_RETRY_AFTER_S
from gateway.observe import code_of
from gateway.openai_responses import error_for, error_for_status, unauthorized_body
from lemix.infra.rpc.auth import ApiKeyCheck

log = structlog.get_logger(__name__)

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
REQUEST_ID_KEY: Any = (
    web.RequestKey("lemix_request_id", str) if hasattr(web, "RequestKey") else "lemix.request_id"
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def http_code_of(exc: BaseException) -> str:
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
    if REQUEST_ID_KEY not in request:
        request[REQUEST_ID_KEY] = uuid.uuid4().hex
    return str(request[REQUEST_ID_KEY])


@web.middleware
async def common_headers(request: web.Request, handler: Handler) -> web.StreamResponse:
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
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
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
