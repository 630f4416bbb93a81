"""Restart a crashed child with backoff, and give up on a crash loop.

`lemix up` runs every service (and its embedded Redis) under `supervise`:
when one exits on its own it is restarted, on the *same* address (the
launcher fixes every port once, at start), after a delay that doubles with
each crash in a row (`RestartPolicy`), and the stack gives up only when a
child crashes `max_crashes` times within `crash_window_s`. The bookkeeping
(`CrashHistory`) is pure: it takes the time as an argument, so its tests need
no clock and no processes.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart a crashed child, and when to stop trying."""

    initial_backoff_s: float = 0.5  # delay before the first restart of a crash series
    max_backoff_s: float = 10.0  # the doubling stops here
    # A child that stayed up this long before crashing starts a new series
    # (its next restart waits initial_backoff_s again).
    reset_after_s: float = 30.0
    max_crashes: int = 5  # this many crashes ...
    crash_window_s: float = 60.0  # ... within this window: give up

    def __post_init__(self) -> None:
        if self.initial_backoff_s <= 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                "restart backoff needs 0 < initial_backoff_s <= max_backoff_s, got "
                f"{self.initial_backoff_s} and {self.max_backoff_s}"
            )
        if self.reset_after_s <= 0 or self.crash_window_s <= 0:
            raise ValueError("reset_after_s and crash_window_s must be > 0")
        if self.max_crashes < 1:
            raise ValueError(f"max_crashes must be >= 1, got {self.max_crashes}")


class CrashHistory:
    """One child's crashes: the delay before its next restart, or give up."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._crash_times_s: deque[float] = deque()
        self._num_in_a_row = 0
        self._started_at_s: float | None = None

    @property
    def num_recent_crashes(self) -> int:
        """Crashes inside the window as of the last `on_crash`."""
        return len(self._crash_times_s)

    def on_start(self, now_s: float) -> None:
        """The child is up (serving) again at `now_s`."""
        self._started_at_s = now_s

    def on_crash(self, now_s: float) -> float | None:
        """Record a crash at `now_s`; the delay (s) before restarting, or None
        when the child crashed `max_crashes` times within `crash_window_s`."""
        p = self.policy
        if self._started_at_s is not None and now_s - self._started_at_s >= p.reset_after_s:
            self._num_in_a_row = 0
        self._started_at_s = None  # a failed restart is not an uptime
        self._num_in_a_row += 1
        self._crash_times_s.append(now_s)
        while self._crash_times_s and now_s - self._crash_times_s[0] > p.crash_window_s:
            self._crash_times_s.popleft()
        if len(self._crash_times_s) >= p.max_crashes:
            return None
        return min(p.max_backoff_s, p.initial_backoff_s * 2.0 ** (self._num_in_a_row - 1))


class Restartable(Protocol):
    """A child `supervise` can watch and bring back."""

    @property
    def name(self) -> str: ...

    @property
    def log_path(self) -> Path: ...

    async def wait_exit(self) -> int:
        """Return its exit status once it is not running (at once if it is not)."""
        ...

    async def restart(self) -> None:
        """Start it again on the same address; return once it serves.

        Raises if it does not come up; it is then not running (and counts as
        another crash). A cancelled restart leaves no process behind.
        """
        ...


def describe_exit(code: int) -> str:
    """`exit code 3` or `killed by SIGKILL` (asyncio/subprocess's negative codes)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


async def supervise(
    child: Restartable,
    policy: RestartPolicy,
    report: Callable[[str], None],
    on_restarted: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Restart `child` each time it exits, until cancelled (the stack stops).

    Returns the give-up message once `child` crashed `policy.max_crashes`
    times within `policy.crash_window_s` (the caller then fails the stack).
    `report` gets one line per crash and restart (exit status, delay, log
    path); `on_restarted` runs after each successful restart.
    """
    history = CrashHistory(policy)
    history.on_start(clock())
    while True:
        code = await child.wait_exit()
        delay_s = history.on_crash(clock())
        if delay_s is None:
            message = (
                f"{child.name} crashed {history.num_recent_crashes} times within "
                f"{policy.crash_window_s:g} s (last: {describe_exit(code)}); giving up; "
                f"see its log {child.log_path}"
            )
            report(message)
            return message
        report(
            f"{child.name} exited ({describe_exit(code)}); restarting in {delay_s:g} s; "
            f"log: {child.log_path}"
        )
        await asyncio.sleep(delay_s)
        try:
            await child.restart()
        except Exception as exc:  # did not come up: another crash, with backoff
            report(f"{child.name} did not restart: {exc}")
            continue
        history.on_start(clock())
        on_restarted()
        report(f"{child.name} restarted")
