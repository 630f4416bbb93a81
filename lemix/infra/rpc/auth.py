"""The shared service token on internal RPCs (scheduler, executors, profiler).

One secret per stack, `LEMIX_SERVICE_TOKEN`, given to every service. Servers
built with `start_server(..., service_token=T)` require the metadata
``authorization: Bearer T`` on every call but health checks (probes carry no
token) and answer UNAUTHENTICATED otherwise; clients opened with
`channel(..., service_token=T)` send it. The gateway's own API is public and
checks no token; it only sends one to the scheduler.

Insecure channels cannot carry gRPC call credentials, so the token travels as
plain metadata through client interceptors: it authenticates callers inside
the cluster network, it does not encrypt (no TLS on internal links).

Every service config gets the option (`SERVICE_TOKEN_OPTION`) and its
`service_token` field, checked with `check_service_token`, from
`lemix.infra.config`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from typing import Any

import grpc.aio

from lemix.infra.settings import Option

SERVICE_TOKEN_ENV = "LEMIX_SERVICE_TOKEN"
METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
_SCHEME = "Bearer "
# Long enough that guessing is hopeless; `generate_token` makes 43 characters.
MIN_TOKEN_CHARS = 16

SERVICE_TOKEN_OPTION = Option(
    "service_token",
    "--service-token",
    SERVICE_TOKEN_ENV,
    str,
    'shared secret of the stack\'s internal RPCs, sent as `authorization: Bearer` ("" = '
    "unauthenticated; prefer the variable: flags show in `ps`)",
    "TOKEN",
)

GENERATE_HINT = "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def check_service_token(token: str) -> None:
    """ValueError unless `token` is "" (off) or a usable token: printable
    ASCII (it travels as a metadata value) without spaces, and long enough."""
    if token == "":
        return
    if not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError(
            f"{SERVICE_TOKEN_ENV} must be printable ASCII without spaces; {GENERATE_HINT}"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{SERVICE_TOKEN_ENV} must be at least {MIN_TOKEN_CHARS} characters, "
            f"got {len(token)}; {GENERATE_HINT}"
        )


def generate_token() -> str:
    """A fresh random token (what `lemix up` gives each stack)."""
    return secrets.token_urlsafe(32)


def bearer(token: str) -> str:
    """The `authorization` metadata value that carries `token`."""
    return _SCHEME + token


class TokenCheck:
    """Checks the `authorization` metadata of incoming calls against one token.

    The comparison is constant-time over SHA-256 digests, so neither the
    token's characters nor its length leak through timing.
    """

    def __init__(self, token: str) -> None:
        check_service_token(token)
        if not token:
            raise ValueError("TokenCheck needs a token; an empty one means no check")
        self._expected = _digest(bearer(token))

    def problem(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        """Why a call with `metadata` is refused, or None when it carries the token."""
        values = [value for key, value in metadata or () if key == METADATA_KEY]
        if not values:
            return (
                f"this LeMix service requires the stack's service token: send metadata "
                f"'{METADATA_KEY}: Bearer <token>' (services read it from "
                f"{SERVICE_TOKEN_ENV})"
            )
        if not any(hmac.compare_digest(_digest(value), self._expected) for value in values):
            return (
                f"wrong service token: every service of a stack must be given the same "
                f"{SERVICE_TOKEN_ENV}"
            )
        return None


def _digest(value: str | bytes) -> bytes:
    raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
    return hashlib.sha256(raw).digest()


# ------------------------------------------------------------------ client side


def _with_token(details: grpc.aio.ClientCallDetails, value: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata[METADATA_KEY] = value  # replaces any the caller set
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(_with_token(client_call_details, self._value), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(_with_token(client_call_details, self._value), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(_with_token(client_call_details, self._value), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(_with_token(client_call_details, self._value), request_iterator)


def client_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add `authorization: Bearer <token>` to every call.

    One object per call shape: grpc.aio files each interceptor under the first
    shape it implements, so a single class implementing all four would only
    ever see unary-unary calls.
    """
    check_service_token(token)
    value = bearer(token)
    return [_UnaryUnary(value), _UnaryStream(value), _StreamUnary(value), _StreamStream(value)]
