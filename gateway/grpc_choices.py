"""`GenerateRequest.n` for the gRPC `Generate` stream: n choices of one
request, their messages merged into one stream tagged with
`GenerateResponse.index`.

The fan-out is the OpenAI API's (`gateway.choices`): one task per choice from
`choice_requests` (ids ``<id>.<i>``, seed + i, or a seed of its own), every
choice's first message awaited before any is sent (`firsts`: a refused choice
fails the call with its status, as one choice would), then the streams read
concurrently (`merge`). What is gRPC's: each choice has its own stop strings
(`gateway.grpc_stops.StopFilter`) and, when one stops early, its task's stream
is closed at once (cancelled with `STOPPED_REASON`) while the others go on;
each choice is one sequence in the call's metrics (`gateway.observe`).

A failure of one choice cancels the others with `SIBLING_FAILED_REASON` and
ends the call with that failure; a call that ends (client gone, deadline)
closes every choice's stream, which cancels their tasks with the reason the
caller's `gone_reason()` gives. n = 1 reads its one stream directly: no
reader tasks, no change from a request without n.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable

from gateway.choices import choice_requests, firsts, merge, prepend
from gateway.core import GatewayCore
from gateway.grpc_stops import StopFilter
from gateway.observe import note_admitted, watch_choice
from gateway.openai_convert import MAX_CHOICES
from gateway.openai_stops import STOPPED_REASON
from lemix._proto.lemix.v1 import gateway_pb2
from lemix.infra.rpc.errors import InvalidArgument

Responses = AsyncGenerator[gateway_pb2.GenerateResponse, None]
# The reason a choice's task is cancelled with when another choice of its
# request failed (docs/protocol.md: reasons start with the status name).
SIBLING_FAILED_REASON = "CANCELLED: another choice of the request failed"


def check_num_choices(n: int) -> int:
    """`GenerateRequest.n` as a count of choices (0 = 1); InvalidArgument over
    `MAX_CHOICES` (the HTTP API's limit too)."""
    if n > MAX_CHOICES:
        raise InvalidArgument(f"n may be at most {MAX_CHOICES}, got {n}")
    return max(n, 1)


class _Failure:
    """Set when a choice of the request fails: the others are cancelled for it."""

    def __init__(self) -> None:
        self.is_set = False


async def _choice(
    index: int, responses: Responses, stops: StopFilter, failure: _Failure
) -> Responses:
    """One choice's messages: stop strings applied, tagged with `index`; its
    task's stream is closed as soon as the choice ends (a stop string then
    cancels the task)."""
    async with contextlib.aclosing(responses):
        try:
            async for response in stops.apply(responses):
                response.index = index
                yield response
        except Exception:
            failure.is_set = True  # before the merge cancels the other choices
            raise


async def generate_choices(
    core: GatewayCore,
    request: gateway_pb2.GenerateRequest,
    *,
    scope: str,
    received_s: float,
    gone_reason: Callable[[], str],
) -> Responses:
    """The messages of `request`'s n choices (module doc). Raises what
    `GatewayCore.admit` / `generate` raise (InvalidArgument for a bad n or
    stop before any task is admitted)."""
    num_choices = check_num_choices(request.n)
    stops = [StopFilter(request.stop) for _ in range(num_choices)]  # checked before admission
    admitted = [
        await core.admit(choice, scope=scope) for choice in choice_requests(request, num_choices)
    ]
    for task, _ in admitted:
        note_admitted(task.num_prompt_tokens)
    failure = _Failure()

    def reason_of(stop: StopFilter) -> Callable[[], str]:
        def reason() -> str:
            if stop.is_stopped_early:
                return STOPPED_REASON
            return SIBLING_FAILED_REASON if failure.is_set else gone_reason()

        return reason

    # Every stream is closed on the way out (a failure, the client gone, or
    # the end): closing one cancels its task if it has not ended.
    async with contextlib.AsyncExitStack() as exits:
        streams = [
            await exits.enter_async_context(
                contextlib.aclosing(
                    watch_choice(
                        _choice(
                            index,
                            core.generate(
                                task, payload, received_s=received_s, gone_reason=reason_of(stop)
                            ),
                            stop,
                            failure,
                        )
                    )
                )
            )
            for index, ((task, payload), stop) in enumerate(zip(admitted, stops, strict=True))
        ]
        if num_choices == 1:
            async for response in streams[0]:
                yield response
            return
        tagged = merge([prepend(f, s) for f, s in zip(await firsts(streams), streams, strict=True)])
        async with contextlib.aclosing(tagged):
            async for _, response in tagged:
                yield response
