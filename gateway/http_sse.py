"""A completion's answer to an HTTP client that may go away.

- `SseStreams.stream`: ``"stream": true`` as server-sent events
  (``data: {chunk}`` lines, then ``data: [DONE]``; ``include_usage`` adds a
  usage chunk). The first responses are awaited before any byte is sent, so a
  refused request still gets its status; after that an error is an event. A
  server that stops gives open streams its drain grace, then ends each with an
  UNAVAILABLE error event (`SseStreams.on_shutdown`).
- `run_unless_gone`: a non-streaming answer, read while watching that the
  client is still connected.

A client that disconnects cancels its tasks, with the reason `gone_reason`
gives (`HTTP_GONE_REASON`, `SHUTDOWN_REASON` or a stop's `STOPPED_REASON`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from aiohttp import web

from gateway.http_middleware import REQUEST_ID_HEADER, request_id_of
from gateway.openai_choices import Choices, firsts, merged
from gateway.openai_convert import CompletionRequest
from gateway.openai_responses import CompletionBuilder, Json, error_for
from gateway.openai_stops import STOPPED_REASON
from lemix._proto.lemix.v1 import gateway_pb2
from lemix.infra.rpc.errors import Unavailable

# The failure reason a task gets when its HTTP client goes away (docs/protocol.md).
HTTP_GONE_REASON = "CANCELLED: the HTTP client disconnected"
SHUTDOWN_REASON = "CANCELLED: the gateway stopped before the stream ended"
# How often a non-streaming request checks that its client is still there.
_DISCONNECT_POLL_S = 0.1
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_SHUTDOWN_WRITE_S = 1.0  # the most a stopping server spends telling one stream


async def run_unless_gone(request: web.Request, work: Awaitable[None]) -> bool:
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


def gone_reason(
    builder: CompletionBuilder, is_shutting_down: Callable[[], bool]
) -> Callable[[], str]:
    """Why a choice's task is cancelled when its stream is closed early."""

    def reason() -> str:
        if builder.is_stopped_early:
            return STOPPED_REASON
        return SHUTDOWN_REASON if is_shutting_down() else HTTP_GONE_REASON

    return reason


async def _send(stream: web.StreamResponse, body: Json) -> None:
    await stream.write(f"data: {json.dumps(body)}\n\n".encode())


async def _send_shutdown(stream: web.StreamResponse) -> None:
    """An error event (UNAVAILABLE: retry elsewhere or later), then [DONE]."""
    error = Unavailable("the gateway is shutting down; retry the request")
    await _send(stream, error_for(error)[1])
    await stream.write(b"data: [DONE]\n\n")
    await stream.write_eof()


class SseStreams:
    """The SSE streams of one HTTP API, and which are open (for shutdown)."""

    def __init__(self, shutdown_grace_s: float) -> None:
        self._shutdown_grace_s = shutdown_grace_s
        # One event per open SSE stream: set when the server stops past its
        # drain grace, so the stream ends itself with an error event.
        self._open_streams: set[asyncio.Event] = set()
        self._is_shutting_down = False

    def is_shutting_down(self) -> bool:
        return self._is_shutting_down

    async def on_shutdown(self, app: web.Application) -> None:
        """aiohttp's shutdown signal (before it cancels handlers): streams get
        the drain grace to finish, then the rest are told and ended."""
        give_up_s = time.monotonic() + max(self._shutdown_grace_s - _SHUTDOWN_WRITE_S, 0.0)
        while self._open_streams and time.monotonic() < give_up_s:
            await asyncio.sleep(0.05)
        self._is_shutting_down = True
        for stopping in list(self._open_streams):
            stopping.set()

    async def stream(
        self,
        request: web.Request,
        parsed: CompletionRequest,
        choices: Choices,
        streams: Sequence[AsyncIterator[gateway_pb2.GenerateResponse]],
        on_stop: Callable[[], None],
    ) -> web.StreamResponse:
        """Answer `request` with the merged `streams` of its choices as SSE."""
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
