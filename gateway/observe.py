"""The gateway's Prometheus instrumentation (`lemix.telemetry`), kept out of
the handlers: `@observe_generate` / `@observe_train` wrap the servicer's
methods (under `@handle_errors`, so they see domain errors and aborts before
they become statuses), and `SloCache` keeps the scheduler's SLO at hand.

A request counts once, when it ends, with the outcome `lemix replay` would
give it: completed, rejected (INVALID_ARGUMENT / RESOURCE_EXHAUSTED /
UNAVAILABLE before any token), failed (anything else) or cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc
import grpc.aio
import structlog
from redis.exceptions import RedisError

from lemix import telemetry
from lemix.rpc.errors import status_code_for
from lemix.store import Store

log = structlog.get_logger(__name__)

SLO_REFRESH_S = 5.0  # how often the published SLO is read again (a scheduler may restart)


class SloCache:
    """The SLO the scheduler published in Redis, re-read at most every `refresh_s`."""

    def __init__(self, store: Store, *, refresh_s: float = SLO_REFRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._refresh_s = refresh_s
        self._clock = clock
        self._read_s: float | None = None
        self.current: tuple[float, float] | None = None  # (ttft_s, tbt_s)

    async def refresh(self) -> None:
        """Re-read it when stale; a Redis failure keeps the last value."""
        now_s = self._clock()
        if self._read_s is not None and now_s - self._read_s < self._refresh_s:
            return
        self._read_s = now_s
        try:
            self.current = await self._store.get_slo()
        except (RedisError, OSError) as exc:
            log.warning("gateway.slo_read_failed", error=str(exc))
        telemetry.set_slo(self.current)


class _Observed(Protocol):
    slo: SloCache


def _code_of(exc: BaseException, context: grpc.aio.ServicerContext) -> str:
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    if isinstance(exc, grpc.aio.AbortError):  # the handler aborted with a task's status
        code = context.code()
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    return status_code_for(exc).name


def observe_generate(
    method: Callable[[Any, Any, grpc.aio.ServicerContext], AsyncIterator[Any]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    """Count a Generate stream and time it from the responses it yields
    (`ttft_s` on the first token, `e2e_s` on the final one)."""

    @functools.wraps(method)
    async def wrapper(self: _Observed, request: Any,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await self.slo.refresh()
        ttft_s: float | None = None
        e2e_s: float | None = None
        num_tokens = 0
        code = "OK"
        try:
            async for response in method(self, request, context):
                if response.num_output_tokens > 0 and ttft_s is None:
                    ttft_s = response.ttft_s
                num_tokens = max(num_tokens, response.num_output_tokens)
                if response.is_finished:
                    e2e_s = response.e2e_s
                yield response
        except BaseException as exc:
            code = _code_of(exc, context)
            raise
        finally:
            outcome = telemetry.request_outcome(code, ttft_s is not None)
            telemetry.observe_request("inference", outcome, code)
            is_completed = outcome == telemetry.COMPLETED
            telemetry.observe_inference(ttft_s if is_completed else None,
                                        e2e_s if is_completed else None, num_tokens,
                                        self.slo.current)

    return wrapper


def observe_train(
    method: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    """Count a Train call: its tasks `accepted`, or the call rejected/failed."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            response = await method(self, request, context)
        except BaseException as exc:
            code = _code_of(exc, context)
            telemetry.observe_request("training", telemetry.request_outcome(code, False), code)
            raise
        telemetry.observe_request("training", telemetry.ACCEPTED, "OK",
                                  count=len(response.task_ids))
        return response

    return wrapper
