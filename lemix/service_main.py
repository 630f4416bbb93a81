"""The one `main()` every service's `python -m ...` entry point runs.

Parse the config (flags and `LEMIX_*` variables; exit 2 on bad settings), set
up logging, start the service (exit 1 if it cannot start: Redis unreachable,
port busy), print one `SERVING <name> address=HOST:PORT` line on stdout (what
`lemix up` waits for; logs go to stderr), run until SIGINT/SIGTERM, stop
cleanly (exit 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import structlog

from lemix.logs import configure_logging

log = structlog.get_logger(__name__)


class Service(Protocol):
    @property
    def address(self) -> str: ...

    async def start(self) -> Any: ...

    async def stop(self) -> Any: ...


class _LoggedConfig(Protocol):
    @property
    def log_level(self) -> str: ...

    @property
    def log_format(self) -> str: ...


C = TypeVar("C", bound=_LoggedConfig)


async def serve(service: Service, label: str) -> int:
    """Start, announce, wait for SIGINT/SIGTERM, stop. Returns the exit status."""
    try:
        await service.start()
    except Exception as exc:
        log.error("start_failed", service=label, error=f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(Exception):
            await service.stop()  # undo whatever start() had begun
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        print(f"SERVING {label} address={service.address}", flush=True)
        await stop.wait()
        log.info("stopping", service=label)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await service.stop()
    return 0


def run_service(argv: Sequence[str] | None, parse: Callable[[Sequence[str] | None], C],
                make: Callable[[C], Service], label: Callable[[C], str]) -> int:
    """`main()` of a service: config → logging → serve; returns the exit status."""
    try:
        config = parse(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    try:
        return asyncio.run(serve(make(config), label(config)))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
