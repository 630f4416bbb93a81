"""`wait_until`: poll a condition instead of sleeping and then asserting it."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

DEFAULT_TIMEOUT_S = 10.0


async def wait_until(
    predicate: Callable[[], Awaitable[object] | object],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    what: str = "condition",
    poll_s: float = 0.01,
) -> None:
    """Return once `predicate()` (sync, or returning an awaitable) is truthy;
    fail the test after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(poll_s)
