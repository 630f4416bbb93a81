"""The gateway's Prometheus instrumentation (`lemix.infra.telemetry`), kept out of
the handlers and shared by both protocols: `GenerateObservation` and
`observe_training` count a request whichever API it came in by (the gRPC
servicer through `@observe_generate` / `@observe_train`, the HTTP API
directly), and `SloCache` keeps the scheduler's SLO at hand.

A request counts once, when it ends, with the outcome `lemix replay` would
give it: completed, rejected (INVALID_ARGUMENT / RESOURCE_EXHAUSTED /
UNAVAILABLE before any token), failed (anything else) or cancelled. Its
`code` label is the gRPC status name, also for HTTP requests: each protocol
passes a `CodeOf` that maps what ended the request to that name (`code_of`
is the protocol-independent part).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any, Protocol, TypeVar

import grpc
import grpc.aio
import structlog
from redis.exceptions import RedisError

from gateway.convert import TaskEnded
from lemix._proto.lemix.v1 import gateway_pb2
from lemix.infra import telemetry
from lemix.infra.rpc.errors import status_code_for
from lemix.infra.store.store import Store

log = structlog.get_logger(__name__)

SLO_REFRESH_S = 5.0  # how often the published SLO is read again (a scheduler may restart)

T = TypeVar("T")
# What ended a request -> the gRPC status name it counts under.
CodeOf = Callable[[BaseException], str]


class SloCache:
    """The SLO the scheduler published in Redis, re-read at most every `refresh_s`."""

    def __init__(
        self,
        store: Store,
        *,
        refresh_s: float = SLO_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
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


def code_of(exc: BaseException) -> str:
    """The status name of a request `exc` ended: CANCELLED when its caller went
    away, a failed task's code, else what `lemix.infra.rpc.errors` maps `exc` to."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    if isinstance(exc, TaskEnded):
        return exc.code.name
    return status_code_for(exc).name


# The observation of the Generate call running in this task, for code that
# admits and reads its tasks inside a `@observe_generate` handler
# (`note_admitted`, `watch_choice`).
_CURRENT: contextvars.ContextVar[GenerateObservation | None] = contextvars.ContextVar(
    "lemix_generate_observation", default=None
)


def details_of(exc: BaseException) -> str:
    """The text a request's end carries (a failed task's details)."""
    return exc.details if isinstance(exc, TaskEnded) else str(exc)


def note_admitted(num_prompt_tokens: int) -> None:
    """A task of the Generate call observed in this task was admitted."""
    observation = _CURRENT.get()
    if observation is not None:
        observation.on_admitted(num_prompt_tokens)


def watch_choice(
    responses: AsyncGenerator[gateway_pb2.GenerateResponse, None],
) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
    """`responses`, one output sequence (a choice) of the Generate call
    observed in this task, watched by its observation (as is when none)."""
    observation = _CURRENT.get()
    return responses if observation is None else observation.watch(responses)


class GenerateObservation:
    """One inference request's metrics, recorded once when it ends:

        async with GenerateObservation(slo, code_of, model_name=name) as observation:
            ...                                   # parse, admit: errors count too
            observation.on_admitted(task.num_prompt_tokens)
            async for response in observation.watch(responses):
                ...

    It ends with the exception that leaves the `async with`, else the one that
    ended a `watch` (a caller that handles it, like an SSE stream sending it as
    an event, still has it counted), else OK. Times come from the responses
    (`ttft_s` on the first token, `e2e_s` on the final one); each `watch` is
    one output sequence (an OpenAI choice): its token gaps (ITL, on `clock`)
    and its finish reason count per sequence.
    """

    def __init__(
        self,
        slo: SloCache,
        code_of: CodeOf = code_of,
        *,
        model_name: str = "",
        details_of: Callable[[BaseException], str] = details_of,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._slo = slo
        self._code_of = code_of
        self._details_of = details_of
        self._clock = clock
        self.model_name = model_name
        self._code = "OK"
        self._details = ""
        self._ttft_s: float | None = None
        self._e2e_s: float | None = None
        self._num_tokens = 0  # over every watched sequence
        self._longest = 0  # tokens of its longest sequence (for the mean TBT)
        self._is_stopped_early = False
        self._token: contextvars.Token[GenerateObservation | None] | None = None

    def on_admitted(self, num_prompt_tokens: int) -> None:
        """One of its tasks was admitted with this prompt."""
        telemetry.observe_prompt_tokens(self.model_name, num_prompt_tokens)

    def on_stopped_early(self, e2e_s: float) -> None:
        """A stop sequence ended the request before its task did
        (`gateway.openai_stops`): it completed, so closing its streams next
        is not a cancel."""
        self._is_stopped_early = True
        self._e2e_s = e2e_s

    async def __aenter__(self) -> GenerateObservation:
        self._token = _CURRENT.set(self)
        await self._slo.refresh()
        return self

    async def watch(
        self, responses: AsyncGenerator[gateway_pb2.GenerateResponse, None]
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """`responses` (one sequence), observed; closing this closes `responses` at once."""
        num_tokens = 0  # of this sequence so far
        last_token_s: float | None = None  # when its latest token arrived
        finish_reason = "abort"  # unless a final message or a stop sequence ends it
        async with contextlib.aclosing(responses):
            try:
                async for response in responses:
                    num_new = response.num_output_tokens - num_tokens
                    if num_new > 0:
                        now_s = self._clock()
                        if self._ttft_s is None:
                            self._ttft_s = response.ttft_s
                        if last_token_s is None:  # the first token has no gap; the
                            # others in its message came with it
                            telemetry.observe_token_gaps(self.model_name, 0.0, num_new - 1)
                        else:
                            telemetry.observe_token_gaps(
                                self.model_name, now_s - last_token_s, num_new
                            )
                        last_token_s = now_s
                        num_tokens += num_new
                        self._num_tokens += num_new
                        self._longest = max(self._longest, num_tokens)
                    if response.is_finished:
                        self._e2e_s = response.e2e_s
                        finish_reason = response.finish_reason or "unknown"
                    yield response
            except BaseException as exc:
                if self._is_stopped_early and isinstance(exc, GeneratorExit):
                    finish_reason = "stop"
                else:
                    self._code = self._code_of(exc)
                    self._details = self._details_of(exc)
                raise
            finally:
                telemetry.observe_finish(self.model_name, finish_reason)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            with contextlib.suppress(ValueError):  # closed from another context
                _CURRENT.reset(self._token)
        code, details = (
            (self._code, self._details)
            if exc is None
            else (self._code_of(exc), self._details_of(exc))
        )
        outcome = telemetry.request_outcome(code, self._ttft_s is not None)
        telemetry.observe_request("inference", outcome, code, model_name=self.model_name)
        is_completed = outcome == telemetry.COMPLETED
        telemetry.observe_inference(
            self._ttft_s if is_completed else None,
            self._e2e_s if is_completed else None,
            self._longest,
            self._slo.current,
            model_name=self.model_name,
            num_output_tokens=self._num_tokens,
            is_client_fault=telemetry.is_client_fault(code, details),
        )


async def observe_training(
    call: Awaitable[T],
    num_tasks: Callable[[T], int],
    code_of: CodeOf = code_of,
    *,
    model_name: str = "",
) -> T:
    """Await one Train call and count it: its `num_tasks(result)` tasks
    `accepted`, or the call rejected/failed/cancelled."""
    try:
        result = await call
    except BaseException as exc:
        code = code_of(exc)
        outcome = telemetry.request_outcome(code, False)
        telemetry.observe_request("training", outcome, code, model_name=model_name)
        raise
    telemetry.observe_request(
        "training", telemetry.ACCEPTED, "OK", count=num_tasks(result), model_name=model_name
    )
    return result


# ---------------------------------------------------------------- gRPC


class _Observed(Protocol):
    slo: SloCache
    model_name: str  # the served model name, the metrics' `model_name` label


def _grpc_code_of(context: grpc.aio.ServicerContext) -> CodeOf:
    def code(exc: BaseException) -> str:
        if isinstance(exc, grpc.aio.AbortError):  # the handler aborted with a task's status
            status = context.code()
            return status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
        return code_of(exc)

    return code


def _grpc_details_of(context: grpc.aio.ServicerContext) -> Callable[[BaseException], str]:
    def details(exc: BaseException) -> str:
        if isinstance(exc, grpc.aio.AbortError):
            return str(context.details() or "")
        return details_of(exc)

    return details


def observe_generate(
    method: Callable[[Any, Any, grpc.aio.ServicerContext], AsyncGenerator[Any, None]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    """Count a servicer's Generate stream (`GenerateObservation`); wear it under
    `@handle_errors`, so it sees domain errors and aborts before they become
    statuses. The handler passes each of its output sequences (one per
    choice) through `watch_choice`: a merged stream of several choices is
    not one sequence's tokens."""

    @functools.wraps(method)
    async def wrapper(
        self: _Observed, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async with GenerateObservation(
            self.slo,
            _grpc_code_of(context),
            model_name=self.model_name,
            details_of=_grpc_details_of(context),
        ):
            responses = method(self, request, context)
            async with contextlib.aclosing(responses):
                async for response in responses:
                    yield response

    return wrapper


def observe_train(
    method: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    """Count a servicer's Train call (`observe_training`), under `@handle_errors`."""

    @functools.wraps(method)
    async def wrapper(self: _Observed, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await observe_training(
            method(self, request, context),
            lambda response: len(response.task_ids),
            _grpc_code_of(context),
            model_name=self.model_name,
        )

    return wrapper
