"""`n` choices of one OpenAI request: one task per choice, their answers merged.

Each choice is an independent sequence: its own `GenerateRequest`, admitted,
submitted and streamed as any other (so each takes an in-flight slot and
counts as a request). `choice_requests` makes the copies: choice i > 0 gets
the `request_id` ``<id>.<i>`` (so a retry of the whole request replays every
choice) and, when the client gave a seed, the seed + i; unseeded choices get
seeds of their own (`gateway.validate.draw_seed`). The prompt is prefilled
once per choice: the engine does not share prefixes between tasks yet.

`Choices` builds the answer (choices in index order, usage summed over them,
the prompt counted once); `collect` and `merged` read the choices' streams
concurrently, for a whole answer or a stream of chunks in arrival order.
Both read each stream to its end (closing one early cancels its task), or
until a stop sequence ends its choice, and on the first failure cancel the
other readers and raise it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from gateway.openai_responses import CompletionBuilder, Json
from lemix._proto.lemix.v1 import gateway_pb2

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


class Choices:
    """The builders of one request's choices, by index."""

    def __init__(self, builders: Sequence[CompletionBuilder]) -> None:
        self.builders = list(builders)

    @property
    def is_stopped_early(self) -> bool:
        return any(b.is_stopped_early for b in self.builders)

    def usage(self) -> Json:
        prompt = self.builders[0].num_prompt_tokens
        completion = sum(b.num_completion_tokens for b in self.builders)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def body(self) -> Json:
        """The whole non-streaming answer."""
        envelope = self.builders[0].body()  # id, object, created, model
        return envelope | {
            "choices": [b.choice() for b in self.builders],
            "usage": self.usage(),
        }

    def usage_chunk(self) -> Json:
        return self.builders[0].usage_chunk() | {"usage": self.usage()}


async def _cancel_all(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel `tasks` and wait until every one has ended. The cancel is
    repeated: on Python 3.11 one that lands while redis-py is inside
    `asyncio.wait_for` can be swallowed, and the reader would go on
    generating for nobody (see `gateway.http_api._run_unless_gone`).

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


async def _first_of_all(awaitables: Sequence[Awaitable[Any]]) -> list[Any]:
    """Run `awaitables` concurrently; their results, or the first exception
    once the others are cancelled and ended."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        await _cancel_all(tasks)


async def firsts(streams: Sequence[Stream]) -> list[gateway_pb2.GenerateResponse]:
    """The first response of every stream, awaited together (a refused
    choice fails the request before anything is sent)."""
    return await _first_of_all([anext(s) for s in streams])


async def collect(streams: Sequence[Stream], choices: Choices, on_stop: Callable[[], None]) -> None:
    """Add every response of every stream to its builder, until each choice
    is done; `on_stop()` when a stop sequence ends one."""

    async def one(stream: Stream, builder: CompletionBuilder) -> None:
        async for response in stream:  # to its end: a stream closed early is a cancel
            builder.add(response)
            if builder.is_stopped_early:
                on_stop()
                return

    await _first_of_all([one(s, b) for s, b in zip(streams, choices.builders, strict=True)])


async def merged(
    streams: Sequence[Stream],
    choices: Choices,
    firsts: Sequence[gateway_pb2.GenerateResponse],
    on_stop: Callable[[], None],
) -> AsyncGenerator[Json, None]:
    """Every choice's chunks (its `first` response, then the rest of its
    stream), in the order they arrive; `on_stop()` when a stop sequence ends
    a choice. Closing it cancels the readers."""
    queue: asyncio.Queue[tuple[Json | None, BaseException | None]] = asyncio.Queue()

    async def one(
        stream: Stream, builder: CompletionBuilder, first: gateway_pb2.GenerateResponse
    ) -> None:
        async def add(response: gateway_pb2.GenerateResponse) -> bool:
            """Queue its chunk; True when a stop sequence ended the choice."""
            chunk = builder.add(response)
            if chunk is not None:
                await queue.put((chunk, None))
            if builder.is_stopped_early:
                on_stop()
            return builder.is_stopped_early

        try:
            if not await add(first):
                async for response in stream:  # to its end, as `collect`
                    if await add(response):
                        break
        except Exception as exc:
            await queue.put((None, exc))
        finally:
            await queue.put((None, None))  # this reader ended

    readers = [
        asyncio.ensure_future(one(s, b, f))
        for s, b, f in zip(streams, choices.builders, firsts, strict=True)
    ]
    try:
        num_running = len(readers)
        while num_running:
            chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                num_running -= 1
            else:
                yield chunk
    finally:
        await _cancel_all(readers)
