"""``python -m profiler [flags]``: run the profiler until SIGINT/SIGTERM.

Prints one line ``SERVING profiler address=HOST:PORT`` on stdout once it serves
(logs go to stderr). Exit status: 0 after a clean stop, 2 for a bad flag or
env value, 1 when it cannot start (Redis unreachable, port busy, bad profile).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import structlog

from profiler.config import ProfilerConfig, from_env_and_args
from profiler.service import ProfilerService

log = structlog.get_logger("profiler")


def configure_logging(log_format: str, log_level: str = "info") -> None:
    """structlog to stderr: one JSON object per line, or a console rendering.

    The executor's and the gateway's entry points configure logging the same
    way; this belongs in one shared lemix module once there is one.
    """
    renderer: structlog.types.Processor
    tracebacks: list[structlog.types.Processor] = []
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
        tracebacks = [structlog.processors.dict_tracebacks]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *tracebacks,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[log_level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


async def serve(config: ProfilerConfig) -> int:
    """Start, announce, wait for SIGINT/SIGTERM, stop cleanly."""
    service = ProfilerService(config)
    try:
        await service.start()
    except Exception as exc:  # start() already undid what it began
        log.error("profiler.start_failed", error=f"{type(exc).__name__}: {exc}")
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        print(f"SERVING profiler address={service.address}", flush=True)
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await service.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = from_env_and_args(argv)
    except ValueError as exc:
        print(f"python -m profiler: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_format, config.log_level)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
