"""`python -m services.scheduler [flags]`: run the scheduler until SIGINT/SIGTERM.

Prints ``SERVING scheduler address=HOST:PORT`` on stdout once it accepts
calls (scripts and tests wait for that line); logs go to stderr. Exit status:
0 after a clean stop, 2 for a bad configuration, 1 if it could not start.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

import structlog

from lemix.logs import configure_logging
from services.scheduler.config import SchedulerConfig, from_env_and_args
from services.scheduler.service import SchedulerService

log = structlog.get_logger("services.scheduler")


async def serve(config: SchedulerConfig) -> int:
    service = SchedulerService(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
    except Exception as exc:
        log.error("start_failed", error=f"{type(exc).__name__}: {exc}")
        await service.stop(grace_s=0.0)
        return 1
    print(f"SERVING scheduler address={service.address}", flush=True)
    await stop.wait()
    log.info("stopping", grace_s=config.stop_grace_s)
    await service.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = from_env_and_args(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
