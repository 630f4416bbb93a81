"""Domain errors and the gRPC status codes they map to (and back).

Service code raises the exceptions below; servicer methods wear
`@handle_errors` (or wrap their body in `async with map_errors(context)`), which
aborts the call with the matching status. Anything else is a bug: it is logged
with its traceback and the caller gets INTERNAL with an id to find that log
line, never the exception text (the gateway faces users).

A plain `ValueError` is deliberately *not* INVALID_ARGUMENT: it may come from a
bug deep inside; code that validates caller input raises `InvalidArgument`
(itself a ValueError, and what `lemix.infra.rpc.convert` raises).
"""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import grpc
import grpc.aio
import structlog

log = structlog.get_logger(__name__)


class ServiceError(Exception):
    """Base of the domain errors that cross a service boundary as a status code.

    The message is sent to the caller: make it say what to change.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN


class InvalidArgument(ServiceError, ValueError):
    """The request is malformed or out of range; retrying it unchanged fails again."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(ServiceError):
    """No room now (queue full) or ever (KV can never fit); see the message."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    """A dependency (executor, Redis, scheduler) cannot be reached; retry later."""

    code = grpc.StatusCode.UNAVAILABLE


class NotFound(ServiceError):
    """The named task, node or profile does not exist."""

    code = grpc.StatusCode.NOT_FOUND


_ERROR_BY_CODE: dict[grpc.StatusCode, type[ServiceError]] = {
    cls.code: cls for cls in (InvalidArgument, ResourceExhausted, Unavailable, NotFound)
}


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """The status a servicer answers with when `exc` escapes it."""
    if isinstance(exc, ServiceError):
        return exc.code
    return grpc.StatusCode.INTERNAL


def error_from_rpc(err: grpc.aio.AioRpcError) -> Exception:
    """The domain error for a failed outgoing call, so a service can re-raise it.

    DEADLINE_EXCEEDED reads as `Unavailable` (the peer did not answer in time);
    codes with no domain meaning come back as the `AioRpcError` itself.
    """
    code = err.code()
    details = err.details() or code.name
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return Unavailable(f"deadline exceeded: {details}")
    cls = _ERROR_BY_CODE.get(code)
    return cls(details) if cls is not None else err


def status_for(exc: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    """The status and message a servicer answers `exc` with (an unexpected
    error is logged with an id the message names, its details withheld)."""
    code = status_code_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        error_id = uuid.uuid4().hex[:12]
        log.error(
            "rpc.internal_error",
            method=method,
            error_id=error_id,
            error=f"{type(exc).__name__}: {exc}",
            exc_info=exc,
        )
        return code, f"internal error {type(exc).__name__} (error_id={error_id})"
    log.info("rpc.error", method=method, code=code.name, message=str(exc))
    return code, str(exc) or code.name


async def abort_for(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    """Abort the call with the status for `exc` (always raises)."""
    await context.abort(*status_for(exc, method))


@asynccontextmanager
async def map_errors(context: grpc.aio.ServicerContext, method: str = "?") -> AsyncIterator[None]:
    """`async with map_errors(context):` aborts with the mapped status on error.

    `context.abort`'s own AbortError and cancellation (a BaseException) pass
    through untouched.
    """
    try:
        yield
    except grpc.aio.AbortError:
        raise
    except Exception as exc:
        await abort_for(context, exc, method)


F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(fn: F) -> F:
    """Decorate a servicer method (unary `async def` or server-streaming
    async generator) so domain errors become status codes."""
    method = fn.__qualname__
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream_wrapper(
            self: Any, request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            async with map_errors(context, method):
                async for item in fn(self, request, context):
                    yield item

        return stream_wrapper  # type: ignore[return-value]

    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"handle_errors needs an async servicer method, got {method}")

    @functools.wraps(fn)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with map_errors(context, method):
            return await fn(self, request, context)

    return unary_wrapper  # type: ignore[return-value]
