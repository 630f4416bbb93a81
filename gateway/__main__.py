"""``python -m gateway [flags]``: run the gateway until SIGINT/SIGTERM.

Prints one line ``SERVING gateway address=HOST:PORT`` on stdout once it serves
(logs go to stderr). Exit status: 0 after a clean stop, 2 for a bad flag or
env value, 1 when it cannot start (Redis unreachable, port busy).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

from gateway.config import GatewayConfig, from_env_and_args
from gateway.service import GatewayService
from lemix.logs import configure_logging


async def serve(config: GatewayConfig) -> int:
    """Start, announce, wait for SIGINT/SIGTERM, stop cleanly."""
    service = GatewayService(config)
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        print(f"SERVING gateway address={service.address}", flush=True)
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
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    try:
        return asyncio.run(serve(config))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
