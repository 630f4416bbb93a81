"""Stop sequences of the OpenAI API, applied to a completion's streamed text.

`stop` (strings) and vLLM's `stop_token_ids` end a choice early with
``finish_reason: "stop"``. The gateway applies them to what it streams:
`StopText` holds back any text that may be the start of a stop string until
the next token settles it, cuts the text where the first stop string begins
(the stop string itself is not returned, as OpenAI's), and says it stopped;
a stop token id ends the output before that token. The HTTP API then closes
the task's stream, which cancels the task at the scheduler with
`STOPPED_REASON`: its record says it was cancelled and why, and the executor
frees its KV at once rather than decoding up to `max_tokens` for nobody.

Pure: no I/O, no tokenizer (the builder decodes, this only reads text).
"""

from __future__ import annotations

from collections.abc import Sequence

# The reason a task gets when a stop sequence ended its completion
# (docs/protocol.md: reasons start with the status name).
STOPPED_REASON = "CANCELLED: a stop sequence ended the completion (stop / stop_token_ids)"
# At most this many stop strings / token ids per request (OpenAI allows 4 strings).
MAX_STOPS = 16
MAX_STOP_CHARS = 256


class StopText:
    """Finds the first of `stops` in text fed in pieces (module doc)."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self.is_stopped = False
        self._held = ""  # text fed but not returned: it may begin a stop string

    def feed(self, text: str, *, is_final: bool) -> str:
        """The part of `held + text` that is safe to send now. After a stop
        string appears, `is_stopped` is True and nothing more is returned."""
        if self.is_stopped:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        starts = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if starts:
            self.is_stopped = True
            self._held = ""
            return buffer[: min(starts)]
        num_held = 0 if is_final else self._num_maybe_stop(buffer)
        self._held = buffer[len(buffer) - num_held :] if num_held else ""
        return buffer[: len(buffer) - num_held]

    def _num_maybe_stop(self, buffer: str) -> int:
        """The length of the longest end of `buffer` that begins a stop string."""
        longest = min(len(buffer), max(len(s) for s in self.stops) - 1)
        for size in range(longest, 0, -1):
            tail = buffer[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
