"""CORS for the HTTP API: browsers on the allowed origins may call it.

Off by default (`GatewayConfig.cors_allowed_origins` ""): no CORS header is
ever sent, so a browser page on another origin cannot read an answer. With
origins listed (comma-separated, or ``*`` for any), a request whose
``Origin`` is allowed gets ``Access-Control-Allow-Origin`` (that origin,
with ``Vary: Origin``) and the headers a client reads exposed
(``X-Request-Id``, ``Retry-After``); a preflight (``OPTIONS`` with
``Access-Control-Request-Method``) from it is answered 204 here, before the
API key check: browsers send no credentials on a preflight. No cookies are
used, so credentials are never allowed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ANY_ORIGIN = "*"
_ALLOWED_METHODS = "GET, POST, OPTIONS"
_ALLOWED_HEADERS = "Authorization, Content-Type, X-Request-Id, X-Client-Id"
_EXPOSED_HEADERS = "X-Request-Id, Retry-After"
_PREFLIGHT_MAX_AGE_S = 600


def parse_origins(text: str) -> frozenset[str]:
    """The allowed origins of a comma-separated list; ValueError for one that
    is not ``*`` or ``scheme://host[:port]``."""
    origins = frozenset(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for origin in origins:
        if origin != ANY_ORIGIN and "://" not in origin:
            raise ValueError(
                f"cors_allowed_origins: {origin!r} is not an origin "
                "(scheme://host[:port], or * for any)"
            )
    return origins


class Cors:
    """CORS for `origins`: `middleware` answers preflights (outermost, before
    the API key check); `on_response_prepare` adds the headers to every
    answer, streams included, just before they go out."""

    def __init__(self, origins: frozenset[str]) -> None:
        self.origins = origins

    def allowed(self, origin: str | None) -> str | None:
        """What ``Access-Control-Allow-Origin`` says to `origin`; None: nothing."""
        if not origin:
            return None
        if ANY_ORIGIN in self.origins:
            return ANY_ORIGIN
        return origin if origin in self.origins else None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        is_preflight = (
            request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers
        )
        if not is_preflight or self.allowed(request.headers.get("Origin")) is None:
            return await handler(request)
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Methods": _ALLOWED_METHODS,
                "Access-Control-Allow-Headers": _ALLOWED_HEADERS,
                "Access-Control-Max-Age": str(_PREFLIGHT_MAX_AGE_S),
            },
        )

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = self.allowed(request.headers.get("Origin"))
        if origin is None:
            return
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = _EXPOSED_HEADERS
        if origin != ANY_ORIGIN:
            response.headers["Vary"] = "Origin"
