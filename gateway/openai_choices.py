"""`n` choices of one OpenAI request: their answers built and merged.

The transport-neutral part (one task per choice, `choice_requests`, reading
the streams concurrently, `firsts` and `merge`) is `gateway.choices`, which
gRPC's Generate shares (`gateway.grpc_choices`).

`Choices` builds the answer (choices in index order, usage summed over them,
the prompt counted once); `collect` and `merged` read the choices' streams
concurrently, for a whole answer or a stream of chunks in arrival order.
Both read each stream to its end (closing one early cancels its task), or
until a stop sequence ends its choice (that stream is closed at once: its
task is cancelled then, not when the last choice ends), and on the first
failure cancel the other readers and raise it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence

from gateway.choices import Stream, all_or_first_error, choice_requests, firsts, merge, prepend
from gateway.openai_responses import CompletionBuilder, Json
from lemix._proto.lemix.v1 import gateway_pb2

# Re-exported: the HTTP API takes the whole fan-out from here.
__all__ = ["Choices", "choice_requests", "collect", "firsts", "merged"]


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


async def collect(streams: Sequence[Stream], choices: Choices, on_stop: Callable[[], None]) -> None:
    """Add every response of every stream to its builder, until each choice
    is done; `on_stop()` when a stop sequence ends one."""

    async def one(stream: Stream, builder: CompletionBuilder) -> None:
        async for response in stream:  # to its end: a stream closed early is a cancel
            builder.add(response)
            if builder.is_stopped_early:
                on_stop()
                await _close(stream)  # its task is cancelled now, not with the request
                return

    await all_or_first_error([one(s, b) for s, b in zip(streams, choices.builders, strict=True)])


async def merged(
    streams: Sequence[Stream],
    choices: Choices,
    firsts: Sequence[gateway_pb2.GenerateResponse],
    on_stop: Callable[[], None],
) -> AsyncGenerator[Json, None]:
    """Every choice's chunks (its `first` response, then the rest of its
    stream), in the order they arrive; `on_stop()` when a stop sequence ends
    a choice. Closing it cancels the readers."""

    async def chunks(
        stream: Stream, builder: CompletionBuilder, first: gateway_pb2.GenerateResponse
    ) -> AsyncGenerator[Json, None]:
        async for response in prepend(first, stream):  # to its end, as `collect`
            chunk = builder.add(response)
            if chunk is not None:
                yield chunk
            if builder.is_stopped_early:
                on_stop()
                await _close(stream)  # as `collect`
                return

    tagged = merge(
        [chunks(s, b, f) for s, b, f in zip(streams, choices.builders, firsts, strict=True)]
    )
    async with contextlib.aclosing(tagged):
        async for _, chunk in tagged:
            yield chunk


async def _close(stream: Stream) -> None:
    """Close a choice's stream (an async generator: closing it cancels the
    choice's task with its stream's gone reason, here the stop's)."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
