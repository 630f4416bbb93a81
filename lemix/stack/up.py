"""`lemix up` in the foreground: start a `Stack`, print where it serves, run until
SIGINT/SIGTERM or until supervision gives up on a child, then stop it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from lemix.infra.store.server import EmbeddedRedis
from lemix.stack.config import StackConfig
from lemix.stack.launcher import Stack, print_report

REDIS_URL_FILE = "lemix-redis-url"  # `lemix up` writes the URL (with password) here, mode 0600


def _write_redis_url(redis: EmbeddedRedis) -> Path | None:
    """The URL with its password, readable by this user only, for tools such
    as `lemix audit` that talk to this stack's Redis."""
    if redis.data_dir is None:
        return None
    path = redis.data_dir / REDIS_URL_FILE
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(redis.url + "\n")
    return path


async def run_until_signalled(config: StackConfig) -> int:
    """`lemix up`: start, print READY, run until SIGINT/SIGTERM, or until
    supervision gives up on a child (then exit 1)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stack = Stack(config)
    address = await stack.start()
    url_file: Path | None = None
    print(f"READY gateway={address} http={stack.http_address}", flush=True)
    print(f"logs: {config.log_dir}", flush=True)
    for name, metrics in stack.metrics_addresses().items():
        print(f"metrics {name}: http://{metrics}/metrics", flush=True)
    if stack.is_api_key_required:
        print("api key: required (Authorization: Bearer <key>; health and metrics open)")
    if stack.redis is not None:
        url_file = _write_redis_url(stack.redis)
        print(
            f"redis {stack.redis.address}: AOF appendfsync={config.redis_fsync} in "
            f"{stack.redis.data_dir}; password required (URL in {url_file})",
            flush=True,
        )
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(stack.wait_failed())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        if stop.is_set():
            print_report("stopping: the gateway drains its streams first, then the rest")
        started_s = time.monotonic()
        await stack.stop()
        if url_file is not None:
            url_file.unlink(missing_ok=True)
        print_report(f"stopped in {time.monotonic() - started_s:.1f} s")
    if stack.failure is not None:
        print(f"error: {stack.failure}", file=sys.stderr)
        return 1
    return 0
