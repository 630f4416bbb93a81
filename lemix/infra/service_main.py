"""The one `main()` every service's `python -m ...` entry point runs.

Parse the config (flags and `LEMIX_*` variables; exit 2 on bad settings), set
up logging, start the service (exit 1 if it cannot start: Redis unreachable,
port busy) and the process's Prometheus endpoint (`metrics_port`; metrics are
per process, so the endpoint is too), print one `SERVING <name>
address=HOST:PORT [NAME=HOST:PORT ...] [metrics=HOST:PORT]` line on stdout
(what `lemix up` waits for; logs go to stderr; NAME=... are the service's
`other_addresses`, e.g. the gateway's `http=`), run until SIGINT/SIGTERM, stop
cleanly (exit 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import structlog

from lemix.infra.lifecycle import Service
from lemix.infra.logs import configure_logging
from lemix.infra.metrics_http import MetricsServer

log = structlog.get_logger(__name__)

# Young-generation collections run this many times less often than Python's
# default (700 allocations): a request allocates hundreds of short-lived
# objects, so the default collects several times per request.
GC_GEN0_FACTOR = 10


class _ServiceConfig(Protocol):
    @property
    def host(self) -> str: ...

    @property
    def metrics_port(self) -> int: ...  # 0 = any free port, negative = no endpoint

    @property
    def log_level(self) -> str: ...

    @property
    def log_format(self) -> str: ...

    @property
    def event_loop(self) -> str: ...


C = TypeVar("C", bound=_ServiceConfig)


async def serve(
    service: Service, label: str, *, metrics_host: str = "127.0.0.1", metrics_port: int = -1
) -> int:
    """Start, announce, wait for SIGINT/SIGTERM, stop. Returns the exit status."""
    metrics: MetricsServer | None = None
    try:
        await service.start()  # undoes what it had begun when it fails
        # The label's first word names the service ("executor 3" -> executor).
        service_name = label.split()[0] if label.strip() else label
        metrics = await MetricsServer.start_optional(metrics_host, metrics_port, service_name)
    except Exception as exc:
        log.error("start_failed", service=label, error=f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(Exception):
            await service.stop()  # the metrics endpoint failed: the service is up
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    tune_gc()
    log.info("event_loop", service=label, loop=f"{type(loop).__module__}.{type(loop).__name__}")
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        # Other listeners a service names (the gateway's `http`), then metrics.
        others = service.other_addresses
        where = "".join(f" {name}={address}" for name, address in others.items())
        where += f" metrics={metrics.address}" if metrics is not None else ""
        print(f"SERVING {label} address={service.address}{where}", flush=True)
        await stop.wait()
        log.info("stopping", service=label)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await service.stop()
        if metrics is not None:
            await metrics.stop()
    return 0


def tune_gc() -> None:
    """Once started: the objects built so far (modules, servers, config) move
    to the collector's permanent generation, so its full passes stop walking
    them, and young collections run 1 in GC_GEN0_FACTOR as often."""
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0 * GC_GEN0_FACTOR, gen1, gen2)


def run_service(
    argv: Sequence[str] | None,
    parse: Callable[[Sequence[str] | None], C],
    make: Callable[[C], Service],
    label: Callable[[C], str],
) -> int:
    """`main()` of a service: config → logging → serve; returns the exit status."""
    try:
        config = parse(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    # A native crash (a segfault or heap corruption in a C extension) then
    # leaves every thread's Python stack in the service's log.
    faulthandler.enable(all_threads=True)
    try:
        with asyncio.Runner(loop_factory=loop_factory(config.event_loop)) as runner:
            return runner.run(
                serve(
                    make(config),
                    label(config),
                    metrics_host=config.host,
                    metrics_port=config.metrics_port,
                )
            )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def loop_factory(event_loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop factory for `event_loop` (`EVENT_LOOPS`); None: asyncio's.
    Raises ValueError when uvloop is asked for but not installed."""
    if event_loop != "uvloop":
        return None
    try:
        import uvloop  # a dependency, except where it does not build (Windows)
    except ImportError as exc:
        raise ValueError(
            "event_loop uvloop needs the uvloop package: pip install uvloop "
            "(or set LEMIX_EVENT_LOOP=asyncio)"
        ) from exc
    return uvloop.new_event_loop
