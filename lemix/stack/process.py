"""The children of `lemix up`: a service process, the embedded Redis, their ports.

Each is a `lemix.stack.supervisor.Restartable`: `restart` brings it back with the
same environment, hence on the same ports, so whoever dials it (the gateway
dials the scheduler; Prometheus scrapes every /metrics) finds it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import sys
from pathlib import Path

from lemix.infra.rpc.client import wait_for_serving
from lemix.infra.store.server import LOG_NAME, EmbeddedRedis

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
_REDIS_POLL_S = 0.05  # how often a Redis watcher looks at its (non-asyncio) process
# Signals a fault-injecting caller sends to end a child (SIGSTOP/SIGCONT do not).
_ENDING_SIGNALS = {
    signal.SIGKILL,
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGABRT,
    signal.SIGSEGV,
}
# Ports are picked below the kernel's ephemeral range when it is known: a
# port there is never handed to an outgoing connection, so it stays free
# between a child's crash and its restart on the same port.
_FIXED_PORT_BAND = 12000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def pick_free_ports(host: str, num_ports: int) -> list[int]:
    """`num_ports` distinct TCP ports free on `host` now (held open until all
    are found, so they differ), outside the ephemeral range where possible."""
    low = _ephemeral_low()
    band = range(max(1024, low - _FIXED_PORT_BAND), low) if low else range(0)
    rng = random.Random()  # not replayed: which free port is immaterial
    sockets: list[socket.socket] = []
    ports: list[int] = []
    num_tries = 0
    try:
        while len(ports) < num_ports:
            num_tries += 1
            wanted = rng.choice(band) if band and num_tries <= 50 * num_ports else 0
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            try:
                sock.bind((host, wanted))  # no SO_REUSEADDR: skip ports in TIME_WAIT too
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
            ports.append(int(sock.getsockname()[1]))
    finally:
        for sock in sockets:
            sock.close()
    return ports


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


class ServiceProcess:
    """One LeMix service as `python -m MODULE`, configured by its environment.

    Up when it prints `SERVING ... address=HOST:PORT` and answers gRPC health
    for `service`. Its stdout (after that line) and stderr go to `log_path`;
    a restart appends to the same log.
    """

    def __init__(
        self, name: str, module: str, service: str, env: dict[str, str], log_path: Path
    ) -> None:
        self.name = name
        self.module = module
        self.service = service
        self.env = env  # fixed ports included: the same on every restart
        self.log_path = log_path
        self.process: asyncio.subprocess.Process | None = None
        self.address = ""
        self.metrics_address = ""  # host:port of its /metrics; "" = none
        self.http_address = ""  # host:port of its HTTP API (the gateway's); "" = none
        self.is_serving = False
        self.num_restarts = 0
        self.num_unexpected_exits = 0  # exits not asked for by `send_signal` or `terminate`
        self._copier: asyncio.Task[None] | None = None
        self._is_exit_expected = False

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    async def start(self, log_note: str = "") -> None:
        """Spawn it and return once it serves; raises RuntimeError (with its
        log's tail) if it exits or stays silent, leaving no process behind.

        A first start truncates the log; with `log_note` (a restart) the log
        is appended to, after a line with the note.
        """
        with self.log_path.open("a" if log_note else "w") as log_file:
            if log_note:
                log_file.write(f"--- lemix up: {log_note} ---\n")
                log_file.flush()
            # The child holds its own descriptor of the log once spawned.
            self.process = process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                self.module,
                env=self.env,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
                start_new_session=True,
            )
        self._is_exit_expected = False
        try:
            try:
                address, metrics, http = await asyncio.wait_for(
                    _read_address(process), START_TIMEOUT_S
                )
            except (TimeoutError, EOFError) as exc:
                if isinstance(exc, EOFError):
                    # It is exiting: let it, rather than signal it. (Signalling
                    # makes Popen reap it behind asyncio's child watcher, which
                    # then reports 255 instead of its own exit status.)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
                raise RuntimeError(
                    f"{self.name} did not start ({exc}); its log "
                    f"({self.log_path}) ends:\n{_tail(self.log_path)}"
                ) from None
            self._copier = asyncio.create_task(_copy_rest(process, self.log_path))
            self.address, self.metrics_address, self.http_address = address, metrics, http
            await wait_for_serving(address, self.service, timeout_s=START_TIMEOUT_S)
        except BaseException as exc:  # also cancelled by a stopping stack
            await self._kill()
            if not isinstance(exc, asyncio.CancelledError):
                self.num_unexpected_exits += 1  # it did not come up: a failure of its own
            raise
        self.is_serving = True

    async def restart(self) -> None:
        if self._copier is not None:
            self._copier.cancel()
        await self.start(f"restart {self.num_restarts + 1} of {self.name}")
        self.num_restarts += 1

    async def wait_exit(self) -> int:
        assert self.process is not None, "not started"
        code = await self.process.wait()
        if self.is_serving and not self._is_exit_expected:
            self.num_unexpected_exits += 1
        self.is_serving = False
        return code

    def send_signal(self, sig: int) -> None:
        """Signal the process (fault injection): a signal that ends it is not
        counted as an unexpected exit; the supervisor restarts it all the same."""
        if self.process is None or self.process.returncode is not None:
            raise ProcessLookupError(f"{self.name} is not running")
        if sig in _ENDING_SIGNALS:
            self._is_exit_expected = True
        self.process.send_signal(sig)

    async def terminate(self) -> None:
        """SIGTERM (it drains), SIGKILL after STOP_TIMEOUT_S."""
        process = self.process
        self._is_exit_expected = True
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                await self._kill()
        self.is_serving = False
        if self._copier is not None:
            self._copier.cancel()

    async def _kill(self) -> None:
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


class RedisProcess:
    """The embedded Redis as a supervised child: restarted on its port and data dir."""

    name = "redis"

    def __init__(self, server: EmbeddedRedis) -> None:
        self.server = server
        self.num_restarts = 0
        self.num_unexpected_exits = 0
        self._is_exit_expected = False

    @property
    def log_path(self) -> Path:
        assert self.server.data_dir is not None, "not started"
        return self.server.data_dir / LOG_NAME

    @property
    def pid(self) -> int | None:
        return self.server.pid

    @property
    def is_serving(self) -> bool:
        return self.server.is_running

    async def wait_exit(self) -> int:
        while self.server.is_running:
            await asyncio.sleep(_REDIS_POLL_S)
        code = self.server.exit_code
        if not self._is_exit_expected:
            self.num_unexpected_exits += 1
        self._is_exit_expected = False
        return -1 if code is None else code

    async def restart(self) -> None:
        # start() blocks (it polls the server); in a thread, so the other
        # supervisors go on. The thread cannot be cancelled: a stopping stack
        # waits for it, then stops the server it started.
        future = asyncio.ensure_future(asyncio.to_thread(self.server.restart))
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await future
            raise
        self.num_restarts += 1

    def send_signal(self, sig: int) -> None:
        pid = self.server.pid
        if pid is None or not self.server.is_running:
            raise ProcessLookupError("redis is not running")
        if sig in _ENDING_SIGNALS:
            self._is_exit_expected = True
        os.kill(pid, sig)


async def _read_address(process: asyncio.subprocess.Process) -> tuple[str, str, str]:
    """(gRPC address, metrics address or "", HTTP API address or "") from the
    `SERVING` line."""
    assert process.stdout is not None
    while True:
        line = await process.stdout.readline()
        if not line:
            raise EOFError("exited before it served")
        text = line.decode(errors="replace").strip()
        if text.startswith("SERVING ") and "address=" in text:
            words = dict(w.split("=", 1) for w in text.split() if "=" in w)
            return words["address"], words.get("metrics", ""), words.get("http", "")


async def _copy_rest(process: asyncio.subprocess.Process, log_path: Path) -> None:
    assert process.stdout is not None
    with log_path.open("a") as log:
        while line := await process.stdout.readline():
            log.write(line.decode(errors="replace"))
            log.flush()


def _tail(path: Path, num_lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"
