"""A request body as JSON: a 400 (`BadRequest`), never a 500, for bad input.

A body that is not UTF-8, nests more than `MAX_JSON_DEPTH` levels or is not
JSON is refused here; the parsers (`gateway.openai_convert`) check it is an
object. aiohttp itself answers 413 for a body over the size limit.
"""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from gateway.openai_convert import BadRequest

# A body may nest at most this deep (ours nest 4: body, messages, message,
# content parts). Deeper is refused before parsing: `json.loads` recurses, and
# a few thousand levels exhaust the interpreter's stack (a 500, not a 400).
MAX_JSON_DEPTH = 32
# A JSON string (skipped whole, brackets inside it are text) or a bracket.
_JSON_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def _is_nested_deeper(text: str, max_depth: int) -> bool:
    """Whether `text` opens more than `max_depth` arrays/objects at once;
    stops at the first level too deep."""
    depth = 0
    for match in _JSON_STRING_OR_BRACKET.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > max_depth:
                return True
        elif token in ("]", "}"):
            depth -= 1
    return False


async def read_json(request: web.Request) -> Any:
    """The body, parsed; `BadRequest` for anything that is not JSON within
    `MAX_JSON_DEPTH` (the parsers check it is an object)."""
    try:
        text = await request.text()
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not UTF-8 text: {exc}") from None
    if _is_nested_deeper(text, MAX_JSON_DEPTH):
        raise BadRequest(
            f"the request body nests arrays/objects more than {MAX_JSON_DEPTH} "
            "levels deep; no field of this API needs that"
        )
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, too-long ints
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
