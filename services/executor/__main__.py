"""`python -m services.executor [flags]`: run one executor until SIGINT/SIGTERM.

Prints exactly one line to stdout once it serves (logs go to stderr):

    SERVING executor node=N address=HOST:PORT

Exit status: 0 after a clean shutdown, 1 when it could not start (Redis
unreachable, port busy, bad profile), 2 for bad flags or settings.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

import structlog

from lemix.logs import configure_logging
from services.executor.config import ExecutorConfig
from services.executor.service import ExecutorService

log = structlog.get_logger("services.executor")


async def serve(config: ExecutorConfig) -> int:
    """Start, announce, wait for SIGINT/SIGTERM, stop. Returns the exit status."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    service = ExecutorService(config)
    try:
        await service.start()
    except Exception as exc:  # start() already undid what it began
        log.error("executor.start_failed", node=config.node_id,
                  error=f"{type(exc).__name__}: {exc}")
        return 1
    print(f"SERVING executor node={config.node_id} address={service.address}", flush=True)
    await stop.wait()
    log.info("executor.shutting_down", node=config.node_id, grace_s=config.shutdown_grace_s)
    await service.stop(config.shutdown_grace_s)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = ExecutorConfig.from_env_and_args(argv)
    except ValueError as exc:
        print(f"python -m services.executor: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
