"""Stop strings for the gRPC `Generate` stream (`GenerateRequest.stop`).

The same `gateway.openai_stops.StopText` the HTTP API applies, on the
`GenerateResponse.text` the core streams: text that may begin a stop string
is held back, the text is cut where the first stop string begins, and that
message becomes the last (``is_finished``, ``finish_reason: "stop"``).
`gateway.grpc_choices` then closes that choice's stream from the core, which
cancels its task with `STOPPED_REASON`. Stop token ids need nothing here: the executor ends the
sequence at them (`SamplingParams.stop_token_ids`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from gateway.openai_stops import MAX_STOP_CHARS, MAX_STOPS, StopText
from lemix._proto.lemix.v1 import gateway_pb2
from lemix.infra.rpc.errors import InvalidArgument


def check_stops(stops: Sequence[str]) -> tuple[str, ...]:
    """`GenerateRequest.stop`, checked (InvalidArgument naming the field)."""
    if len(stops) > MAX_STOPS:
        raise InvalidArgument(f"stop may list at most {MAX_STOPS} strings, got {len(stops)}")
    for i, stop in enumerate(stops):
        if not 0 < len(stop) <= MAX_STOP_CHARS:
            raise InvalidArgument(
                f"stop[{i}] must be 1 to {MAX_STOP_CHARS} characters, got {len(stop)}"
            )
    return tuple(stops)


class StopFilter:
    """Applies stop strings to one Generate stream (module doc)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._text = StopText(check_stops(stops))
        self.is_stopped_early = False  # a stop string ended it before its task ended

    async def apply(
        self, responses: AsyncIterator[gateway_pb2.GenerateResponse]
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """`responses` with the stops applied; ends at the first stop."""
        async for response in responses:
            response.text = self._text.feed(response.text, is_final=response.is_finished)
            if self._text.is_stopped:
                self.is_stopped_early = not response.is_finished
                response.is_finished = True
                response.finish_reason = "stop"
                yield response
                return
            yield response
