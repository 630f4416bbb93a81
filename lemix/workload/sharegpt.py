"""ShareGPT conversations, stream-parsed.

The file is one top-level JSON array of
`{"id": ..., "conversations": [{"from": "human" | "gpt", "value": ...}, ...]}`
and can be hundreds of MB, often cut off mid-object when downloaded partially.
We read it in chunks and decode one element at a time with
`json.JSONDecoder.raw_decode`, so memory stays at about one conversation and
a truncated tail yields every complete conversation and then stops.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

CHUNK_CHARS = 1 << 16
HUMAN_ROLES = frozenset({"human", "user"})
MODEL_ROLES = frozenset({"gpt", "chatgpt", "assistant"})


class _ChunkReader:
    """A growable text window over a file, for incremental raw_decode."""

    def __init__(self, f: TextIO, chunk_chars: int) -> None:
        self._f = f
        self._chunk = chunk_chars
        self.buf = ""
        self.pos = 0
        self.is_eof = False

    def read_more(self, min_chars: int = 0) -> bool:
        """Append at least one chunk (or `min_chars`); False at end of file."""
        if self.is_eof:
            return False
        if self.pos > self._chunk:  # drop consumed text so memory stays bounded
            self.buf, self.pos = self.buf[self.pos :], 0
        data = self._f.read(max(self._chunk, min_chars))
        if not data:
            self.is_eof = True
            return False
        self.buf += data
        return True

    def skip(self, chars: str) -> str | None:
        """Advance past `chars`; return the next character, None at end of file."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in chars:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.read_more():
                return None


def iter_sharegpt_conversations(
    path: str | Path, *, chunk_chars: int = CHUNK_CHARS
) -> Iterator[dict[str, Any]]:
    """Yield each complete top-level element (a conversation dict) in order.

    Stops cleanly when the file ends inside an element (truncated download).
    Raises ValueError if the file is not a JSON array, an element is not an
    object, or an element is malformed (not merely cut off by the file's end).
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        r = _ChunkReader(f, chunk_chars)
        if r.skip(" \t\r\n\ufeff") != "[":
            raise ValueError(f"{path}: expected a top-level JSON array")
        r.pos += 1
        while True:
            nxt = r.skip(" \t\r\n,")
            if nxt is None or nxt == "]":
                return
            obj = _decode_next(decoder, r, path)
            if obj is None:  # the file ends inside this element
                return
            if not isinstance(obj, dict):
                raise ValueError(f"{path}: array element is not an object: {obj!r:.80}")
            yield obj


def _decode_next(decoder: json.JSONDecoder, r: _ChunkReader, path: str | Path) -> Any | None:
    """Decode the element at r.pos, reading more until it is complete.

    An object cannot decode early (it needs its closing brace), so a failure
    means "read more". Reads grow geometrically, so a long element costs
    O(n log n) re-decoding, not O(n²). At end of file the failure is either
    a truncated tail (None) or a malformed element (ValueError).
    """
    want = 0
    while True:
        try:
            obj, end = decoder.raw_decode(r.buf, r.pos)
        except json.JSONDecodeError as e:
            want = max(2 * want, len(r.buf) - r.pos)
            if r.read_more(want):
                continue
            if _is_truncation(e, r.buf):
                return None
            raise ValueError(f"{path}: malformed JSON at char {e.pos} of window: {e.msg}") from e
        r.pos = end
        return obj


def _is_truncation(e: json.JSONDecodeError, buf: str) -> bool:
    """Whether a decode error at end of file comes from the text running out.

    Running out shows as an unterminated string (which then reaches the end)
    or an error within a token's length of the end ("tru", "1.", "\\u12").
    """
    return e.msg.startswith("Unterminated string") or e.pos >= len(buf.rstrip()) - 8


def conversation_pairs(conv: dict[str, Any]) -> list[tuple[str, str]]:
    """(prompt, reply) for each human turn directly followed by a model turn.

    Turns with an empty or non-string value are skipped as pairs.
    """
    turns = conv.get("conversations")
    if not isinstance(turns, list):
        return []
    pairs: list[tuple[str, str]] = []
    for ask, answer in zip(turns, turns[1:], strict=False):
        if not (isinstance(ask, dict) and isinstance(answer, dict)):
            continue
        if ask.get("from") in HUMAN_ROLES and answer.get("from") in MODEL_ROLES:
            prompt, reply = ask.get("value"), answer.get("value")
            if isinstance(prompt, str) and isinstance(reply, str) and prompt and reply:
                pairs.append((prompt, reply))
    return pairs


def read_sharegpt_pairs(
    path: str | Path, *, max_pairs: int | None = None, chunk_chars: int = CHUNK_CHARS
) -> list[tuple[str, str]]:
    """All (prompt, reply) pairs of the file's complete conversations, in order."""
    pairs: list[tuple[str, str]] = []
    for conv in iter_sharegpt_conversations(path, chunk_chars=chunk_chars):
        pairs.extend(conversation_pairs(conv))
        if max_pairs is not None and len(pairs) >= max_pairs:
            return pairs[:max_pairs]
    return pairs
