"""The shared service token on internal RPCs (scheduler, executors, profiler).

One secret per stack, `LEMIX_SERVICE_TOKEN`, given to every service. Servers
built with `start_server(..., service_token=T)` require the metadata
``authorization: Bearer T`` on every call but health checks (probes carry no
token) and answer UNAUTHENTICATED otherwise; clients opened with
`channel(..., service_token=T)` send it. The gateway's own API checks no
service token (it sends one to the scheduler); it may require API keys.

Insecure channels cannot carry gRPC call credentials, so the token travels as
plain metadata through client interceptors: it authenticates callers inside
the cluster network, it does not encrypt (no TLS on internal links).

Every service config gets the option (`SERVICE_TOKEN_OPTION`) and its
`service_token` field, checked with `check_service_token`, from
`lemix.infra.config`.

The gateway's public API can require API keys the same way (`--api-key`,
`LEMIX_API_KEY`, one or several comma-separated): `ApiKeyCheck` checks them,
over gRPC metadata (`lemix.infra.rpc.guard.RequireApiKey`) and over HTTP's
``Authorization: Bearer`` header (`gateway.http_api`); `channel(...,
api_key=K)` sends one. Both checks are a `BearerCheck`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Sequence
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


class BearerCheck:
    """Checks ``Bearer <key>`` credentials against a set of accepted keys.

    The comparison is constant-time over SHA-256 digests, and every accepted
    key is compared, so neither a key's characters, its length nor which key
    matched leak through timing. Subclasses word the refusals.
    """

    missing_message = "this service requires a bearer token"
    wrong_message = "wrong bearer token"

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys or any(not key for key in keys):
            raise ValueError(f"{type(self).__name__} needs keys; none means no check")
        self._expected = [_digest(key) for key in keys]

    def is_key(self, key: str | bytes) -> bool:
        """Whether `key` (the credential, without its scheme) is accepted."""
        digest = _digest(key)
        matches = [hmac.compare_digest(digest, expected) for expected in self._expected]
        return any(matches)

    def problem(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        """Why a call with `metadata` is refused, or None when it carries a key."""
        values = [value for key, value in metadata or () if key == METADATA_KEY]
        if not values:
            return self.missing_message
        if not any([self.is_key(_credential(value)) for value in values]):
            return self.wrong_message
        return None


def _credential(value: str | bytes) -> str | bytes:
    """What follows the ``Bearer `` scheme; the whole value (never a match:
    keys have no spaces) without it."""
    raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
    prefix = _SCHEME.encode()
    return raw[len(prefix) :] if raw.startswith(prefix) else b" " + raw


class TokenCheck(BearerCheck):
    """Checks the `authorization` metadata of incoming calls against the service token."""

    missing_message = (
        f"this LeMix service requires the stack's service token: send metadata "
        f"'{METADATA_KEY}: Bearer <token>' (services read it from {SERVICE_TOKEN_ENV})"
    )
    wrong_message = (
        f"wrong service token: every service of a stack must be given the same {SERVICE_TOKEN_ENV}"
    )

    def __init__(self, token: str) -> None:
        check_service_token(token)
        if not token:
            raise ValueError("TokenCheck needs a token; an empty one means no check")
        super().__init__([token])


# ------------------------------------------------------------------ API keys


API_KEY_ENV = "LEMIX_API_KEY"
API_KEY_SEPARATOR = ","


def parse_api_keys(text: str) -> tuple[str, ...]:
    """The keys in `text` ("" = none; several separated by commas, blanks
    around them ignored). ValueError for a key that cannot travel as a
    metadata value or header: it must be printable ASCII without spaces. The
    message never quotes a key."""
    if not text.strip():
        return ()
    keys = tuple(part.strip() for part in text.split(API_KEY_SEPARATOR))
    for number, key in enumerate(keys, start=1):
        if not key:
            raise ValueError(
                f"{API_KEY_ENV} has an empty key (number {number}): separate several "
                f"keys with single commas"
            )
        if not key.isascii() or not key.isprintable() or " " in key:
            raise ValueError(
                f"{API_KEY_ENV}: key number {number} must be printable ASCII without "
                f"spaces; {GENERATE_HINT}"
            )
    return keys


class ApiKeyCheck(BearerCheck):
    """Checks a public API call's key (gRPC metadata or the HTTP header)."""

    missing_message = (
        f"this gateway requires an API key: send metadata '{METADATA_KEY}: Bearer "
        f"<key>' (HTTP: the header 'Authorization: Bearer <key>')"
    )
    wrong_message = "invalid API key: the key sent is not one this gateway accepts"

    def __init__(self, keys: Sequence[str]) -> None:
        for key in keys:  # as parsed: one key per item
            parse_api_keys(key)
        super().__init__(keys)

    def http_problem(self, authorization: str | None) -> str | None:
        """Why an HTTP request with this ``Authorization`` header is refused,
        or None. The scheme is case-insensitive (RFC 7235)."""
        if not authorization:
            return "this gateway requires an API key: send the header 'Authorization: Bearer <key>'"
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not self.is_key(key.strip()):
            return self.wrong_message
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
    """Interceptors that add `authorization: Bearer <token>` to every call
    (the service token).

    One object per call shape: grpc.aio files each interceptor under the first
    shape it implements, so a single class implementing all four would only
    ever see unary-unary calls.
    """
    check_service_token(token)
    return _bearer_interceptors(bearer(token))


def api_key_interceptors(key: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that send one public API key, as `client_interceptors` does."""
    if len(parse_api_keys(key)) != 1:
        raise ValueError("a client sends one API key (no commas)")
    return _bearer_interceptors(bearer(key.strip()))


def _bearer_interceptors(value: str) -> list[grpc.aio.ClientInterceptor]:
    return [_UnaryUnary(value), _UnaryStream(value), _StreamUnary(value), _StreamStream(value)]
