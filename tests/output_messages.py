"""Reading output streams in tests: which token counts a task's messages add."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def token_numbers(messages: Iterable[Mapping[str, str]]) -> list[int]:
    """The token counts the messages add, in order: every token message's,
    and an end's when it carries tokens beyond them (a completed task's last
    tokens ride on its end message, docs/protocol.md)."""
    numbers: list[int] = []
    for m in messages:
        n = int(m["n"])
        if m["type"] == "token" or (m["type"] == "end" and n > max(numbers, default=0)):
            numbers.append(n)
    return numbers
