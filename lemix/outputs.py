"""Output-stream fields shared by the executor's Redis sink and the gateway.

docs/protocol.md ("Flow of one inference request") fixes the messages; this module
writes and reads the optional fields a real model adds:
the token ids of a `token`/`end` message and the `end` message's finish reason,
and, when a request asked for them, its tokens' log-probabilities
(`LOGPROBS_FIELD`, one entry per id of the `ids` field).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

TOKEN_IDS_FIELD = "ids"  # comma-separated ids of the tokens a message adds
FINISH_REASON_FIELD = "finish_reason"  # on `end`: one of FINISH_REASONS
FINISH_LENGTH = "length"  # produced max_tokens
FINISH_STOP = "stop"  # ended earlier (EOS or a stop condition)
FINISH_REASONS = frozenset({FINISH_LENGTH, FINISH_STOP})


def format_token_ids(ids: Iterable[int]) -> str:
    """``"12,7,9005"``: the `ids` field for the new tokens of one message."""
    return ",".join(str(int(i)) for i in ids)


def parse_token_ids(text: str) -> tuple[int, ...]:
    """The ids of an `ids` field; ``""`` is no ids.

    Raises ValueError naming the field for anything but comma-separated
    non-negative decimal integers.
    """
    if not text:
        return ()
    try:
        ids = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"field {TOKEN_IDS_FIELD!r} is not comma-separated ids: {text!r:.80}"
        ) from None
    if any(i < 0 for i in ids):
        raise ValueError(f"field {TOKEN_IDS_FIELD!r} has a negative id: {text!r:.80}")
    return ids


# One entry per id of TOKEN_IDS_FIELD, ";"-separated: the token's logprob,
# then "|id:logprob" for each of the top tokens (``-0.5|7:-0.5|3:-1.25``).
LOGPROBS_FIELD = "logprobs"
# On the first token message: the prompt's tokens' entries (from the second
# token on), same format, when the request asked for them.
PROMPT_LOGPROBS_FIELD = "prompt_logprobs"
MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability and the top tokens' (best first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def format_logprobs(entries: Iterable[TokenLogprob]) -> str:
    """The `LOGPROBS_FIELD` text of `entries` (floats exactly, by repr)."""
    return ";".join(
        "|".join([repr(e.logprob), *(f"{i}:{lp!r}" for i, lp in e.top)]) for e in entries
    )


def parse_logprobs(text: str) -> tuple[TokenLogprob, ...]:
    """The entries of a `LOGPROBS_FIELD`; ``""`` is none. ValueError naming
    the field for anything else (a logprob is a number <= 0, -inf allowed)."""
    if not text:
        return ()
    entries = []
    try:
        for part in text.split(";"):
            first, *tops = part.split("|")
            top = []
            for item in tops:
                token_id, _, value = item.partition(":")
                top.append((int(token_id), float(value)))
            entries.append(TokenLogprob(float(first), tuple(top)))
    except ValueError:
        raise ValueError(f"field {LOGPROBS_FIELD!r} is malformed: {text!r:.80}") from None
    for entry in entries:
        values = [entry.logprob, *(lp for _, lp in entry.top)]
        if any(math.isnan(v) or v > 0 for v in values) or any(i < 0 for i, _ in entry.top):
            raise ValueError(f"field {LOGPROBS_FIELD!r} has an impossible value: {text!r:.80}")
    return tuple(entries)
