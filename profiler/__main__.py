"""``python -m profiler [flags]``: run the profiler until SIGINT/SIGTERM.

Prints one line ``SERVING profiler address=HOST:PORT`` on stdout once it serves
(logs go to stderr). Exit status: 0 after a clean stop, 2 for a bad flag or
env value, 1 when it cannot start (Redis unreachable, port busy, bad profile).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

import structlog

from lemix.logs import configure_logging
from profiler.config import ProfilerConfig, from_env_and_args
from profiler.service import ProfilerService

log = structlog.get_logger("profiler")


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
    configure_logging(config.log_level, config.log_format)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
