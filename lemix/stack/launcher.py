"""`lemix up`: run the whole stack as local processes (no Docker needed), supervised.

Starts an embedded Redis (unless a URL is given), N executors, the profiler,
the scheduler and the gateway as `python -m ...` subprocesses, each configured through its
`LEMIX_*` environment variables (`lemix.stack.config.stack_env`; the services' own
config modules map them).
A service is up when it prints its `SERVING ... address=HOST:PORT` line and
answers gRPC health checks; each serves Prometheus metrics
(`metrics=HOST:PORT` on that line; `Stack.metrics_addresses`); the gateway's
line also names its OpenAI-compatible HTTP API (`http=HOST:PORT`;
`Stack.http_address`). Stopping goes in reverse order of dependency: the
gateway drains first, then the scheduler, then the executors, then Redis.
Each service's output goes to `<log_dir>/<name>.log`.

Durability and supervision:

* The embedded Redis runs with AOF (`appendfsync` everysec or always; see
  `lemix.infra.store.server` for what an acknowledged write survives) in
  `redis_dir`, and requires a password (random per start unless given),
  which the services get inside `LEMIX_REDIS_URL` and which is never printed.
* Every port (gRPC, metrics, the gateway's HTTP) is fixed once, at start:
  free ports picked then, or the configured ones.
* A child that exits on its own (Redis included) is restarted by
  `lemix.stack.supervisor.supervise` with the same environment, hence on the same
  address: the gateway finds the scheduler again, the scheduler finds an
  executor by its heartbeat, Redis comes back with its data. The delay
  doubles per crash in a row; after `RestartPolicy.max_crashes` crashes
  within `crash_window_s` the stack fails (`Stack.failure`; `lemix up` exits
  1 with that message). A stopping stack cancels its supervisors first, so
  nothing it stops is restarted.

`lemix up` itself (start, print the addresses, run until a signal) is
`lemix.stack.up`.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from lemix.infra.config import EXECUTOR, GATEWAY, PROFILER, SCHEDULER, listener_options
from lemix.infra.rpc import EXECUTOR_SERVICE, GATEWAY_SERVICE, PROFILER_SERVICE, SCHEDULER_SERVICE
from lemix.infra.rpc.auth import API_KEY_ENV, SERVICE_TOKEN_ENV, generate_token
from lemix.infra.store.redis_binary import RedisServerError
from lemix.infra.store.redis_password import generate_password
from lemix.infra.store.server import EmbeddedRedis
from lemix.stack.config import SERVICE_ENV, StackConfig, stack_env
from lemix.stack.process import STOP_TIMEOUT_S, RedisProcess, ServiceProcess, pick_free_ports
from lemix.stack.supervisor import RestartPolicy, supervise

# `Stack` and what its config is made of, for the code that starts a stack.
__all__ = ["STOP_TIMEOUT_S", "RestartPolicy", "Stack", "StackConfig"]

_WAIT_POLL_S = 0.05
_NUM_PORT_ATTEMPTS = 3  # a picked port taken before the child binds it: pick again

LOCK_FILE = ".lemix-up.lock"


def claim_dir(directory: Path) -> IO[str]:
    """An exclusive lock on `directory` for one running stack (held until the
    returned file is closed), so a second `lemix up` cannot overwrite the
    first one's logs or open its Redis AOF files beside it."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = (directory / LOCK_FILE).open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise RuntimeError(
            f"another `lemix up` (pid {holder}) is using {directory}: its logs and Redis "
            f"files would be overwritten; stop it, or give this one its own --log-dir "
            f"and --redis-dir"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def print_report(message: str) -> None:
    """One line of `lemix up`'s own on stderr (crashes, restarts, stopping)."""
    print(f"lemix up: {message}", file=sys.stderr, flush=True)


class Stack:
    """The running stack; `start()` then `stop()` (or `async with`).

    Fault injection for tests: `pid(name)`, `kill(name, sig)`,
    `wait_restarted(name)`; names are "executor-0".., "profiler",
    "scheduler", "gateway" (then "gateway-1".. with `num_gateways`) and "redis".
    """

    def __init__(self, config: StackConfig, report: Callable[[str], None] = print_report) -> None:
        self.config = config
        self.report = report  # one line per crash, restart and give-up
        self.redis: EmbeddedRedis | None = None
        self.children: list[ServiceProcess] = []
        self.gateway_address = ""
        self.gateway_addresses: list[str] = []  # every gateway's, the first one's first
        self.http_address = ""  # the gateway's OpenAI-compatible API, once started
        self.failure: str | None = None  # why supervision gave up, if it did
        self._redis_child: RedisProcess | None = None
        self._supervisors: list[asyncio.Task[None]] = []
        self._failed = asyncio.Event()
        self._service_token = generate_token()
        self._api_key = ""  # set by `_env`: the config's, else the inherited one
        self._locks: list[IO[str]] = []  # held on the log and Redis dirs while running

    async def __aenter__(self) -> Stack:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _env(self, redis_url: str) -> dict[str, str]:
        c = self.config
        env = dict(os.environ)
        # Internal RPCs require this token; one per stack (kept across
        # restarts of a child: `_env` runs once per start).
        token = os.environ.get(SERVICE_TOKEN_ENV) or self._service_token
        env.update(stack_env(c, redis_url=redis_url, service_token=token))
        env["PYTHONUNBUFFERED"] = "1"
        env.update(c.extra_env)
        # Only the gateway checks API keys: the others never see them.
        inherited_key = env.pop(API_KEY_ENV, "")
        self._api_key = c.api_key or inherited_key
        return env

    def _gateway_env(self, env: dict[str, str], scheduler_address: str) -> dict[str, str]:
        """`_env`'s variables, plus the gateway's own: its scheduler and its API keys."""
        gateway_env = {**env, SERVICE_ENV["scheduler_address"]: scheduler_address}
        if self._api_key:
            gateway_env[API_KEY_ENV] = self._api_key
        return gateway_env

    @property
    def is_api_key_required(self) -> bool:
        """Whether the gateway was given API keys (known once started)."""
        return bool(self._api_key)

    def _child(
        self,
        name: str,
        module: str,
        service: str,
        env: dict[str, str],
        prefix: str,
        ports: dict[str, int],
    ) -> tuple[ServiceProcess, list[str]]:
        """A service on fixed ports, and the variables of those picked here.

        `prefix` is the service's LEMIX_<prefix>_* (lemix.infra.config);
        `ports` maps its port fields to a port, 0 meaning a free one, picked
        now and kept for every restart.
        """
        variables = {opt.field: opt.env for opt in listener_options(prefix)}
        variables.update(SERVICE_ENV)
        picked = [variables[port_field] for port_field, port in ports.items() if port == 0]
        fixed = {variables[port_field]: str(port) for port_field, port in ports.items() if port}
        fixed.update(
            zip(picked, map(str, pick_free_ports(self.config.host, len(picked))), strict=True)
        )
        child = ServiceProcess(
            name,
            module,
            service,
            {**env, variables["host"]: self.config.host, **fixed},
            self.config.log_dir / f"{name}.log",
        )
        return child, picked

    async def start(self) -> str:
        """Start everything; return the gateway's address once it serves."""
        c = self.config
        c.log_dir.mkdir(parents=True, exist_ok=True)
        dirs = [c.log_dir] + ([c.redis_dir] if c.redis_dir is not None else [])
        self._locks = [claim_dir(d) for d in dict.fromkeys(dirs)]
        try:
            redis_url = c.redis_url
            if redis_url is None:
                server = await asyncio.to_thread(self._start_redis)
                self.redis, self._redis_child = server, RedisProcess(server)
                redis_url = server.url
            env = self._env(redis_url)
            if c.backend == "torch":
                await asyncio.to_thread(_prepare_tokenizer, c.tokenizer)
            executors = [
                self._child(
                    f"executor-{i}",
                    "services.executor",
                    EXECUTOR_SERVICE,
                    {**env, SERVICE_ENV["node_id"]: str(i)},
                    EXECUTOR,
                    {"port": 0, "metrics_port": 0},
                )
                for i in range(c.num_nodes)
            ]
            await asyncio.gather(*(self._start_child(child) for child in executors))
            await self._start_child(
                self._child(
                    "profiler",
                    "profiler",
                    PROFILER_SERVICE,
                    env,
                    PROFILER,
                    {"port": 0, "metrics_port": 0},
                )
            )
            scheduler = await self._start_child(
                self._child(
                    "scheduler",
                    "services.scheduler",
                    SCHEDULER_SERVICE,
                    env,
                    SCHEDULER,
                    {"port": 0, "metrics_port": 0},
                )
            )
            gateways = [
                await self._start_child(
                    self._child(
                        f"gateway-{i}" if i else "gateway",
                        "gateway",
                        GATEWAY_SERVICE,
                        self._gateway_env(env, scheduler.address),
                        GATEWAY,
                        {
                            "port": 0 if i else c.gateway_port,
                            "http_port": 0 if i else c.http_port,
                            "metrics_port": 0,
                        },
                    )
                )
                for i in range(c.num_gateways)
            ]
        except BaseException:
            await self.stop()
            raise
        gateway = gateways[0]
        self.gateway_address = gateway.address
        self.gateway_addresses = [g.address for g in gateways]
        self.http_address = gateway.http_address
        supervised: list[ServiceProcess | RedisProcess] = [*self.children]
        if self._redis_child is not None:
            supervised.append(self._redis_child)
        self._supervisors = [
            asyncio.create_task(self._supervise(child), name=f"supervise-{child.name}")
            for child in supervised
        ]
        return gateway.address

    def _start_redis(self) -> EmbeddedRedis:
        """The embedded Redis, on a port fixed now (a restart reuses it)."""
        c = self.config
        password = c.redis_password or generate_password()
        for attempt in range(_NUM_PORT_ATTEMPTS):
            (port,) = pick_free_ports("127.0.0.1", 1)
            server = EmbeddedRedis(
                port, dir=c.redis_dir, appendonly=True, appendfsync=c.redis_fsync, password=password
            )
            try:
                return server.start()
            except RedisServerError as exc:  # the picked port was taken meanwhile
                if "already in use" not in str(exc) or attempt == _NUM_PORT_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    async def _start_child(self, planned: tuple[ServiceProcess, list[str]]) -> ServiceProcess:
        child, picked = planned
        self.children.append(child)  # stop() terminates it even if start fails
        for attempt in range(_NUM_PORT_ATTEMPTS):
            try:
                await child.start("start again on other ports" if attempt else "")
                return child
            except RuntimeError as exc:
                # Another process took a picked port between the pick and the
                # bind: pick again (nobody knows these ports yet).
                text = str(exc).lower()
                is_port_taken = "in use" in text or "cannot bind" in text
                if not (picked and is_port_taken) or attempt == _NUM_PORT_ATTEMPTS - 1:
                    raise
                child.env.update(
                    zip(
                        picked,
                        map(str, pick_free_ports(self.config.host, len(picked))),
                        strict=True,
                    )
                )
        raise AssertionError("unreachable")

    async def _supervise(self, child: ServiceProcess | RedisProcess) -> None:
        message = await supervise(child, self.config.restart_policy, self.report)
        if self.failure is None:
            self.failure = message
        self._failed.set()

    async def stop(self) -> None:
        """Supervisors first (nothing stopped is restarted), then the gateway
        (it drains), the scheduler, the profiler and executors, Redis."""
        for task in self._supervisors:
            task.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        self._supervisors.clear()
        order = {"gateway": 0, "scheduler": 1, "profiler": 2}
        for child in sorted(self.children, key=lambda ch: order.get(ch.name.partition("-")[0], 2)):
            await child.terminate()
        self.children.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
            self._redis_child = None
        for lock in self._locks:
            lock.close()  # closing the file releases its flock
        self._locks = []

    # ------------------------------------------------------------ inspection
    def metrics_addresses(self) -> dict[str, str]:
        """host:port of each running service's /metrics, by service name."""
        return {ch.name: ch.metrics_address for ch in self.children if ch.metrics_address}

    def failed_child(self) -> str | None:
        """The name of a child (Redis included) that exited on its own since
        start, restarted or not; exits caused by `kill` do not count."""
        for child in self._all():
            if child.num_unexpected_exits > 0:
                return child.name
        return None

    def child(self, name: str) -> ServiceProcess | RedisProcess:
        """The child called `name` ("executor-0", ..., "gateway", "redis")."""
        for child in self._all():
            if child.name == name:
                return child
        raise KeyError(f"no child {name!r}; the stack has {', '.join(c.name for c in self._all())}")

    def pid(self, name: str) -> int:
        pid = self.child(name).pid
        if pid is None:
            raise ProcessLookupError(f"{name} has no process")
        return pid

    @property
    def redis_pid(self) -> int | None:
        return None if self.redis is None else self.redis.pid

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to a child (fault injection); the supervisor restarts it."""
        self.child(name).send_signal(sig)

    async def wait_restarted(
        self, name: str, num_restarts: int = 1, timeout_s: float = 60.0
    ) -> None:
        """Return once `name` has been restarted `num_restarts` times in all
        and serves again; RuntimeError if the stack gave up, TimeoutError
        after `timeout_s`."""
        child = self.child(name)
        deadline = time.monotonic() + timeout_s
        while not (child.num_restarts >= num_restarts and child.is_serving):
            if self.failure is not None:
                raise RuntimeError(f"the stack gave up: {self.failure}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{name} was not restarted {num_restarts} time(s) within "
                    f"{timeout_s:g} s (restarts so far: {child.num_restarts})"
                )
            await asyncio.sleep(_WAIT_POLL_S)

    async def wait_failed(self) -> str:
        """Return the give-up message once supervision gives up on a child."""
        await self._failed.wait()
        assert self.failure is not None
        return self.failure

    def _all(self) -> list[ServiceProcess | RedisProcess]:
        redis = [] if self._redis_child is None else [self._redis_child]
        return [*self.children, *redis]


def _prepare_tokenizer(spec: str) -> None:
    """Train (or find cached) the shared tokenizer once, before the services
    that load it start, so they do not each train it at the same time."""
    from lemix.model.tokenizer import load_tokenizer

    load_tokenizer(spec)
