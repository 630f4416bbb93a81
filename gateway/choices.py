"""`n` choices of one Generate request, whatever its protocol: one task per
choice, their response streams read concurrently.

Each choice is an independent sequence: its own `GenerateRequest`, admitted,
submitted and streamed as any other (so each takes an in-flight slot and
counts as a request). `choice_requests` makes the copies: choice i > 0 gets
the `request_id` ``<id>.<i>`` (so a retry of the whole request replays every
choice) and, when the client gave a seed, the seed + i; unseeded choices get
seeds of their own (`gateway.validate.draw_seed`, from each choice's task
id when named). The prompt is prefilled once per choice: the engine does not
share prefixes between tasks yet.

`firsts` awaits every stream's first response (so a refused choice fails the
request before anything is sent); `merge` reads the streams concurrently and
yields their items tagged with the stream's index, in arrival order. Both
cancel the other readers on the first failure and raise it. The callers wrap
the streams: the OpenAI API builds chunks (`gateway.openai_choices`), gRPC
tags `GenerateResponse.index` and applies stop strings (`gateway.grpc_choices`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from lemix._proto.lemix.v1 import gateway_pb2

T = TypeVar("T")
Stream = AsyncIterator[gateway_pb2.GenerateResponse]
_SEED_MASK = (1 << 64) - 1
_CANCEL_REPEAT_S = 0.1  # how often a reader that outlives its cancel is cancelled again


def choice_requests(
    request: gateway_pb2.GenerateRequest, n: int
) -> list[gateway_pb2.GenerateRequest]:
    """`n` requests for `n` choices of `request` (module doc)."""
    requests = [request]
    for i in range(1, n):
        copy = gateway_pb2.GenerateRequest()
        copy.CopyFrom(request)
        if request.request_id:
            copy.request_id = f"{request.request_id}.{i}"
        if request.sampling.seed:
            copy.sampling.seed = (request.sampling.seed + i) & _SEED_MASK or 1
        requests.append(copy)
    return requests


async def cancel_all(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel `tasks` and wait until every one has ended. The cancel is
    repeated: on Python 3.11 one that lands while redis-py is inside
    `asyncio.wait_for` can be swallowed, and the reader would go on
    generating for nobody (see `gateway.http_sse.run_unless_gone`).

    Being cancelled itself (the caller's cancel, repeated the same way) does
    not stop the wait: the readers must be gone before their streams are
    closed; the cancel is raised once they are."""
    pending = {t for t in tasks if not t.done()}
    is_cancelled = False
    while pending:
        for task in pending:
            task.cancel()
        try:
            await asyncio.wait(pending, timeout=_CANCEL_REPEAT_S)
        except asyncio.CancelledError:
            is_cancelled = True
        pending = {t for t in pending if not t.done()}
    for task in tasks:  # read their outcomes: no "exception never retrieved"
        if not task.cancelled():
            task.exception()
    if is_cancelled:
        raise asyncio.CancelledError


async def all_or_first_error(awaitables: Sequence[Awaitable[Any]]) -> list[Any]:
    """Run `awaitables` concurrently; their results, or the first exception
    once the others are cancelled and ended."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        await cancel_all(tasks)


async def firsts(streams: Sequence[Stream]) -> list[gateway_pb2.GenerateResponse]:
    """The first response of every stream, awaited together (a refused
    choice fails the request before anything is sent)."""
    return await all_or_first_error([anext(s) for s in streams])


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncGenerator[T, None]:
    """`first`, then the items of `rest` (a stream whose first item was
    taken by `firsts`). Closing it does not close `rest`."""
    yield first
    async for item in rest:
        yield item


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """(index of its stream, item) for every item of every stream, in the
    order they arrive; the streams are read concurrently, each to its end.
    The first failure of a stream cancels the other readers and is raised.
    Closing it cancels the readers; the streams are the caller's to close.

    The queue is unbounded: a reader never waits for the consumer, so a
    cancel always finds it in its stream (its task's output is bounded by
    max_tokens anyway)."""
    queue: asyncio.Queue[tuple[int, T] | BaseException | None] = asyncio.Queue()

    async def read(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)  # this reader ended

    readers = [asyncio.ensure_future(read(i, s)) for i, s in enumerate(streams)]
    try:
        num_running = len(readers)
        while num_running:
            entry = await queue.get()
            if isinstance(entry, BaseException):
                raise entry
            if entry is None:
                num_running -= 1
            else:
                yield entry
    finally:
        await cancel_all(readers)
