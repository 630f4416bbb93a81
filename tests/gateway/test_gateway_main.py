"""`python -m gateway`: help, bad flags, and a real process serving then stopping."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from gateway_fakes import FakeScheduler

from lemix.infra.rpc import GATEWAY_SERVICE
from lemix.infra.rpc.client import wait_for_serving
from lemix.infra.store.server import EmbeddedRedis

REPO_ROOT = Path(__file__).resolve().parents[2]
PREFIX = "SERVING gateway address="


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_help_exits_zero_and_names_the_env_vars() -> None:
    result = _run("--help")
    assert result.returncode == 0, result.stderr
    assert "--max-in-flight" in result.stdout and "LEMIX_REDIS_URL" in result.stdout


def test_bad_env_value_exits_two() -> None:
    result = _run(env={**os.environ, "LEMIX_MAX_IN_FLIGHT": "zero"})
    assert result.returncode == 2 and "LEMIX_MAX_IN_FLIGHT" in result.stderr


def test_unreachable_redis_exits_one() -> None:
    result = _run("--port", "0", "--redis-url", "redis://127.0.0.1:1/0")
    assert result.returncode == 1 and "cannot reach Redis" in result.stderr


async def test_serves_then_stops_cleanly_on_sigterm(
    redis_server: EmbeddedRedis, fake_scheduler: FakeScheduler, namespace: str
) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "--port",
            "0",
            "--http-port",
            "0",
            "--redis-url",
            redis_server.url,
            "--scheduler",
            fake_scheduler.address,
            "--namespace",
            namespace,
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LEMIX_LOG_FORMAT": "json"},
    )
    try:
        assert proc.stdout is not None
        # Off the event loop: the fake scheduler's intake reader runs on it.
        line = (await asyncio.to_thread(proc.stdout.readline)).strip()
        assert line.startswith(PREFIX), line
        # The line goes on with the other listeners: http=HOST:PORT, metrics=HOST:PORT.
        address, *others = line.removeprefix(PREFIX).split()
        assert others and others[0].startswith("http=127.0.0.1:"), line
        await wait_for_serving(address, GATEWAY_SERVICE, timeout_s=10.0)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
        assert proc.stderr is not None
        # gRPC core may print its own (non-JSON) lines to stderr too.
        logs = [
            json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")
        ]
        assert {"gateway.started", "gateway.stopped"} <= {entry["event"] for entry in logs}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()
