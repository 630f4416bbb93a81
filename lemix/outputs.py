"""Output-stream fields shared by the executor's Redis sink and the gateway.

docs/protocol.md ("Flow of one inference request") fixes the messages; this module
writes and reads the optional fields a real model adds:
the token ids of a `token`/`end` message and the `end` message's finish reason.
"""

from __future__ import annotations

from collections.abc import Iterable

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
