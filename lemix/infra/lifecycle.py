"""One start/stop shape for every service process.

A service starts its parts one at a time and registers each with its
`Lifecycle` as soon as it is up. `stop` then takes them down in the same
shape in every service:

1. **refuse**: the `on_stopping` hooks, in the order registered (health
   checks answer NOT_SERVING, new work is refused);
2. **work**, newest first: what is in hand (loops, a node's stages,
   heartbeats, event flushes) gets `grace_s` to finish;
3. **servers**, together: calls in flight get their grace, then the
   listeners close. After the work, so calls (a Cancel, a state query) are
   still answered while it drains, though the servers started last;
4. **clients**, newest first: connections (Redis, channels) close last,
   since the steps above still use them.

`Service` is the base the four services share: `start()` runs the subclass's
`_start()` and, when a step fails, stops whatever had been registered (grace
0) before re-raising; `stop(grace_s)` runs once (a second call waits for the
first, then returns), also on a service that never started.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger(__name__)

# A part's stop: given the grace (seconds), it returns once the part is down.
StopFn = Callable[[float], Awaitable[None]]


class Lifecycle:
    """The parts of one service, registered as they start (module docstring)."""

    def __init__(self, label: str) -> None:
        self.label = label  # names the service in logs
        self._stopping: list[Callable[[], Awaitable[None] | None]] = []
        self._work: list[tuple[str, StopFn]] = []
        self._servers: list[tuple[str, StopFn]] = []
        self._clients: list[tuple[str, Callable[[], Awaitable[None]]]] = []

    def on_stopping(self, hook: Callable[[], Awaitable[None] | None]) -> None:
        """Call `hook` (sync or async) first thing on stop: refuse new work."""
        self._stopping.append(hook)

    def add_work(self, name: str, stop: StopFn) -> None:
        """Work in hand (a loop, a driver): `stop(grace_s)` lets it finish, then ends it."""
        self._work.append((name, stop))

    def add_server(self, name: str, stop: StopFn) -> None:
        """A listener: `stop(grace_s)` lets calls in flight finish, then closes it."""
        self._servers.append((name, stop))

    def add_client(self, name: str, close: Callable[[], Awaitable[None]]) -> None:
        """A connection to close last."""
        self._clients.append((name, close))

    async def stop(self, grace_s: float) -> None:
        """Take every registered part down (module docstring) and forget it.

        A part whose stop fails is logged and the rest still stop; the first
        such error is raised at the end.
        """
        hooks, self._stopping = self._stopping, []
        work, self._work = self._work, []
        servers, self._servers = self._servers, []
        clients, self._clients = self._clients, []
        errors: list[Exception] = []
        for hook in hooks:
            await self._run("refuse", errors, _call(hook))
        for name, stop in reversed(work):
            await self._run(name, errors, stop(grace_s))
        if servers:
            results = await asyncio.gather(
                *(stop(grace_s) for _, stop in servers), return_exceptions=True
            )
            for (name, _), result in zip(servers, results, strict=True):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                if isinstance(result, BaseException):
                    self._failed(name, result, errors)
        for name, close in reversed(clients):
            await self._run(name, errors, close())
        if errors:
            raise errors[0]

    async def _run(self, name: str, errors: list[Exception], step: Awaitable[None]) -> None:
        try:
            await step
        except Exception as exc:
            self._failed(name, exc, errors)

    def _failed(self, name: str, exc: BaseException, errors: list[Exception]) -> None:
        log.error("stop_step_failed", service=self.label, part=name, exc_info=exc)
        if isinstance(exc, Exception):
            errors.append(exc)
        else:  # KeyboardInterrupt, SystemExit: not ours to swallow
            raise exc


async def _call(hook: Callable[[], Awaitable[None] | None]) -> None:
    result = hook()
    if inspect.isawaitable(result):
        await result


class Service:
    """A service process's parts, started and stopped as one.

    Subclasses implement `_start()` (registering each part with
    `self.lifecycle` as it comes up), `address`, and optionally
    `other_addresses` and `_on_stopped()`.
    """

    def __init__(self, label: str, *, default_grace_s: float) -> None:
        self.lifecycle = Lifecycle(label)
        self.default_grace_s = default_grace_s  # stop()'s grace when none is given
        self._is_started = False
        self._is_stopped = False
        self._start_lock = asyncio.Lock()
        self._stop_lock = asyncio.Lock()

    @property
    def address(self) -> str:
        """host:port clients dial."""
        raise NotImplementedError

    @property
    def other_addresses(self) -> dict[str, str]:
        """Listeners besides `address`, by name, for the SERVING line
        (`lemix.infra.service_main`)."""
        return {}

    async def start(self) -> None:
        """Start every part; a second call returns at once. On failure, stop
        what was started (grace 0) and re-raise; a stopped service cannot be
        started again."""
        async with self._start_lock:
            if self._is_stopped:
                raise RuntimeError(f"the {self.lifecycle.label} service is stopped")
            if self._is_started:
                return
            self._is_started = True
            try:
                await self._start()
            except BaseException:
                # Each part's failure to stop is logged; the start failure is the news.
                with contextlib.suppress(Exception):
                    await self.stop(grace_s=0.0)
                raise

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop every part started (`Lifecycle.stop`), giving work and calls in
        flight up to `grace_s` (default `default_grace_s`). Runs once."""
        async with self._stop_lock:
            if self._is_stopped:
                return
            self._is_stopped = True
            try:
                await self.lifecycle.stop(self.default_grace_s if grace_s is None else grace_s)
            finally:
                self._on_stopped()

    async def _start(self) -> None:
        raise NotImplementedError

    def _on_stopped(self) -> None:
        """Called once every part is down (log the service's own line here)."""
