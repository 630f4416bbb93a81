"""Server interceptors every LeMix gRPC server runs (see `lemix.infra.rpc.server.start_server`).

- `MalformedRequests`: a request body that does not parse as the method's
  message is answered INVALID_ARGUMENT, naming the message. Left to gRPC, the
  parser's DecodeError escapes as UNKNOWN ("Unexpected DecodeError"), which
  reads as a server bug and tells the caller nothing.
- `RequireServiceToken`: every call but health checks must carry the stack's
  service token (`lemix.infra.rpc.auth`); others are answered UNAUTHENTICATED
  before their request is parsed or reaches a servicer.
- `RequireApiKey`: the same on the gateway's public server, for its API keys;
  health checks and reflection stay open.

Both rebuild the method handler gRPC found, with the same shape (unary or
streaming on each side), around a wrapped deserializer or behaviour.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
import structlog

from lemix.infra.rpc.auth import ApiKeyCheck, BearerCheck, TokenCheck

log = structlog.get_logger(__name__)

# Probes (kubelet, compose, `lemix up`) carry no token; health says nothing secret.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
# On the public gateway, reflection too: it lists the API, which the protos
# publish anyway, and lets grpcurl find the methods before it is given a key.
PUBLIC_OPEN_METHOD_PREFIXES = (
    *OPEN_METHOD_PREFIXES,
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]
# (request or request iterator, context) -> what the behaviour is given instead
Prepare = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]

_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _behaviour(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    shape = (handler.request_streaming, handler.response_streaming)
    return {
        (False, False): handler.unary_unary,
        (False, True): handler.unary_stream,
        (True, False): handler.stream_unary,
        (True, True): handler.stream_stream,
    }[shape]


def _rebuild(
    handler: grpc.RpcMethodHandler,
    behaviour: Callable[..., Any],
    request_deserializer: Callable[[bytes], Any] | None,
) -> grpc.RpcMethodHandler:
    factory = _FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return factory(
        behaviour,
        request_deserializer=request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _around(behaviour: Callable[..., Any], prepare: Prepare) -> Callable[..., Any]:
    """`behaviour` called with `await prepare(arg, context)` in place of its argument.

    Keeps its kind, which is how grpc.aio runs it: an async generator streams
    what it yields, a coroutine returns (or writes through `context.write`).
    A synchronous behaviour (thread-pool servers, none in LeMix) is left as is.
    """
    if inspect.isasyncgenfunction(behaviour):

        async def stream(arg: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            # aclosing: when gRPC drops this generator, the servicer's closes
            # at once and its `finally` (in-flight slots, cancels) runs now.
            items = behaviour(await prepare(arg, context), context)
            async with contextlib.aclosing(items):
                async for item in items:
                    yield item

        return stream
    if inspect.iscoroutinefunction(behaviour):

        async def call(arg: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behaviour(await prepare(arg, context), context)

        return call
    return behaviour


# ------------------------------------------------------------------ malformed requests


@dataclass(frozen=True, slots=True)
class _Malformed:
    """What the tolerant deserializer hands on in place of a message it could not parse."""

    message: str


def _message_name(deserializer: Callable[[bytes], Any]) -> str:
    # Generated handlers pass `SomeRequest.FromString`, bound to the message class.
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    return str(getattr(descriptor, "full_name", "") or "request message")


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    name = _message_name(deserializer)

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, or a custom parser's error
            return _Malformed(
                f"malformed {name}: the request body does not parse "
                f"({type(exc).__name__}: {exc}); send a serialized {name}"
            )

    return parse


async def _reject_malformed(request: Any, context: grpc.aio.ServicerContext) -> Any:
    if isinstance(request, _Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
    return request


async def _checked(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
) -> AsyncIterator[Any]:
    async for request in requests:
        yield await _reject_malformed(request, context)


async def _reject_malformed_stream(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
) -> AsyncIterator[Any]:
    return _checked(requests, context)


def reject_malformed(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler`, answering INVALID_ARGUMENT to a request body that does not parse."""
    if handler.request_deserializer is None:  # raw bytes: nothing to parse
        return handler
    prepare = _reject_malformed_stream if handler.request_streaming else _reject_malformed
    return _rebuild(
        handler, _around(_behaviour(handler), prepare), _tolerant(handler.request_deserializer)
    )


class MalformedRequests(grpc.aio.ServerInterceptor):
    """Malformed protobuf -> INVALID_ARGUMENT on every method of the server."""

    def __init__(self) -> None:
        # method -> (the handler gRPC found, its wrapped twin); handlers are built
        # once per server, so each method is wrapped once, not once per call.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Continuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = reject_malformed(handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


# ------------------------------------------------------------------ service token


def _denied(handler: grpc.RpcMethodHandler, problem: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s shape that aborts UNAUTHENTICATED without
    parsing the request or running the servicer."""

    async def deny(arg: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    # A coroutine serves every shape: grpc.aio awaits it, and it ends the call.
    return _rebuild(handler, deny, lambda data: None)


class RequireBearer(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries a key `check` accepts; methods
    under `open_prefixes` stay open."""

    def __init__(self, check: BearerCheck, open_prefixes: tuple[str, ...]) -> None:
        self._check = check
        self._open_prefixes = open_prefixes

    async def intercept_service(
        self,
        continuation: Continuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self._open_prefixes):
            return handler
        problem = self._check.problem(handler_call_details.invocation_metadata)
        if problem is None:
            return handler
        log.warning("rpc.unauthenticated", method=method, reason=problem.split(":")[0])
        return _denied(handler, problem)


class RequireServiceToken(RequireBearer):
    """UNAUTHENTICATED unless the call carries the service token (health stays open)."""

    def __init__(self, token: str) -> None:
        super().__init__(TokenCheck(token), OPEN_METHOD_PREFIXES)


class RequireApiKey(RequireBearer):
    """UNAUTHENTICATED unless the call carries one of `keys` (health and
    reflection stay open)."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        super().__init__(ApiKeyCheck(keys), PUBLIC_OPEN_METHOD_PREFIXES)
