"""`lemix up`: run the whole stack as local processes (no Docker needed), supervised.

Starts an embedded Redis (unless a URL is given), N executors, the profiler,
the scheduler and the gateway as `python -m ...` subprocesses, each configured through its
`LEMIX_*` environment variables (the services' own config modules map them).
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
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from lemix.infra.config import (
    EXECUTOR,
    GATEWAY,
    PROFILER,
    SCHEDULER,
    SHARED_ENV,
    listener_options,
)
from lemix.infra.engine_options import ENGINE_OPTIONS, EngineKnobs
from lemix.infra.rpc import EXECUTOR_SERVICE, GATEWAY_SERVICE, PROFILER_SERVICE, SCHEDULER_SERVICE
from lemix.infra.rpc.auth import API_KEY_ENV, SERVICE_TOKEN_ENV, generate_token, parse_api_keys
from lemix.infra.store.server import (
    APPENDFSYNC_POLICIES,
    EmbeddedRedis,
    RedisServerError,
    check_password,
    generate_password,
)
from lemix.stack.process import STOP_TIMEOUT_S, RedisProcess, ServiceProcess, pick_free_ports
from lemix.stack.supervisor import RestartPolicy, supervise

__all__ = ["STOP_TIMEOUT_S", "RestartPolicy", "Stack", "StackConfig", "run_until_signalled"]

REDIS_URL_FILE = "lemix-redis-url"  # `lemix up` writes the URL (with password) here, mode 0600
_WAIT_POLL_S = 0.05
_NUM_PORT_ATTEMPTS = 3  # a picked port taken before the child binds it: pick again

# The service-specific variables `lemix up` sets, by the config field that
# reads them (the readers in the comments). The shared ones (Redis, namespace,
# logging, token, each service's host and ports) come from lemix.infra.config;
# these are spelled here because lemix.stack may not import the services.
# tests/test_launcher.py checks each against its service's option table.
SERVICE_ENV = {
    "policy": "LEMIX_POLICY",  # scheduler
    "num_nodes": "LEMIX_NUM_NODES",  # scheduler
    "train_rate": "LEMIX_TRAIN_RATE",  # scheduler
    "profile_path": "LEMIX_PROFILE",  # scheduler, executor (the profiler's base_profile_path)
    "max_batch_size": "LEMIX_MAX_BATCH_SIZE",  # scheduler, executor
    "node_id": "LEMIX_NODE_ID",  # executor
    "time_scale": "LEMIX_TIME_SCALE",  # executor
    "latency_noise_cv": "LEMIX_LATENCY_NOISE_CV",  # executor
    "backend": "LEMIX_EXECUTOR_BACKEND",  # executor
    "model": "LEMIX_MODEL",  # executor
    "torch_threads": "LEMIX_TORCH_THREADS",  # executor
    "tokenizer": "LEMIX_TOKENIZER",  # executor, gateway
    "scheduler_address": "LEMIX_SCHEDULER_ADDRESS",  # gateway
    "http_port": "LEMIX_GATEWAY_HTTP_PORT",  # gateway
    "served_model_name": "LEMIX_SERVED_MODEL_NAME",  # gateway
    "max_context_tokens": "LEMIX_MAX_CONTEXT_TOKENS",  # gateway (`lemix up --max-model-len`)
    "max_in_flight": "LEMIX_MAX_IN_FLIGHT",  # gateway
    # scheduler, executor: the engine v2 knobs (one table for both)
    **{opt.field: opt.env for opt in ENGINE_OPTIONS},
}


@dataclass(frozen=True)
class StackConfig:
    num_nodes: int = 2
    profile_path: Path | None = None  # None: the shipped A100 profile
    backend: str = "emulated"
    policy: str = "lemix"
    host: str = "127.0.0.1"
    gateway_port: int = 50051  # 0 = a free port, picked once at start
    # The gateway's OpenAI-compatible HTTP API; 0 = a free port (`lemix up`'s
    # --http-port defaults to 8000), so programmatic stacks never collide on it.
    http_port: int = 0
    redis_url: str | None = None  # None: start an embedded Redis
    # The embedded Redis's data dir (its AOF); None = a temporary one, kept
    # across Redis restarts and removed when the stack stops.
    redis_dir: Path | None = None
    redis_fsync: str = "always"  # the embedded Redis's appendfsync: always | everysec
    # The embedded Redis's password; None = a random one per start.
    redis_password: str | None = field(default=None, repr=False)
    restart_policy: RestartPolicy = RestartPolicy()
    namespace: str = "lemix"
    time_scale: float = 1.0
    latency_noise_cv: float = 0.05
    max_batch_size: int = 64
    # The executors' engine (and the scheduler's model of it); default v1.
    engine: EngineKnobs = EngineKnobs()
    train_rate: float = 0.0  # SEPARATE's split
    log_dir: Path = Path("runs/stack-logs")
    extra_env: dict[str, str] = field(default_factory=dict)
    # torch backend: the model every executor builds and the tokenizer the
    # gateway and the executors share (trained once here before they start).
    model: str = "tiny-llama"
    tokenizer: str = "bpe:8192"
    torch_threads: int = 1  # per executor process; several share the cores
    # The gateway's API keys (`--api-key`, comma-separated); "" = the
    # LEMIX_API_KEY the launcher was given, if any, else an open API. Given to
    # the gateway alone, in its environment (flags show in `ps`).
    api_key: str = field(default="", repr=False)
    # The gateway's served model name (the OpenAI `model`, the metrics'
    # model_name), context limit (0 = the model's) and in-flight streams.
    served_model_name: str = "lemix"
    max_model_len: int = 0
    max_in_flight: int = 1024
    # Gateways against the one scheduler and Redis: "gateway" on `gateway_port`
    # (and `http_port`), "gateway-1".. on free ports (`Stack.gateway_addresses`).
    num_gateways: int = 1

    def __post_init__(self) -> None:
        parse_api_keys(self.api_key)  # ValueError for a malformed key
        if not self.served_model_name or any(ch.isspace() for ch in self.served_model_name):
            raise ValueError(
                f"--served-model-name must be a non-empty name without spaces, "
                f"got {self.served_model_name!r}"
            )
        if self.max_model_len < 0:
            raise ValueError(
                f"--max-model-len must be >= 0 (0 = the model's), got {self.max_model_len}"
            )
        if self.max_in_flight < 1:
            raise ValueError(f"--max-in-flight must be >= 1, got {self.max_in_flight}")
        if self.num_nodes < 1:
            raise ValueError("--nodes must be >= 1")
        if self.num_gateways < 1:
            raise ValueError(f"num_gateways must be >= 1, got {self.num_gateways}")
        if self.backend not in ("emulated", "torch"):
            raise ValueError(f"backend must be 'emulated' or 'torch', got {self.backend!r}")
        if self.time_scale <= 0:
            raise ValueError("--time-scale must be > 0")
        if self.backend == "torch" and self.time_scale != 1.0:
            raise ValueError("--time-scale is for the emulated backend; torch runs in real time")
        if self.redis_fsync not in APPENDFSYNC_POLICIES:
            raise ValueError(
                f"--redis-fsync must be one of {', '.join(APPENDFSYNC_POLICIES)}, "
                f"got {self.redis_fsync!r}"
            )
        if self.redis_password is not None:
            check_password(self.redis_password)
        for name in ("gateway_port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {getattr(self, name)}")


def stack_env(
    config: StackConfig,
    *,
    redis_url: str,
    service_token: str,
    profile_path: str | None = None,
) -> dict[str, str]:
    """The LEMIX_* variables every service of `config`'s stack is given (each
    reads those it has an option for): Redis, namespace, the internal token,
    the policy and the backend. `profile_path` overrides the config's (a
    container sees the file elsewhere). No listener and no API key: those
    are per service."""
    c = config
    shared = {
        "redis_url": redis_url,
        "namespace": c.namespace,
        "log_format": "json",
        "service_token": service_token,
    }
    specific = {
        "policy": c.policy,
        "num_nodes": str(c.num_nodes),
        "time_scale": repr(c.time_scale),
        "latency_noise_cv": repr(c.latency_noise_cv),
        "max_batch_size": str(c.max_batch_size),
        "train_rate": repr(c.train_rate),
        "served_model_name": c.served_model_name,
        "max_context_tokens": str(c.max_model_len),
        "max_in_flight": str(c.max_in_flight),
        "num_micro_batches": str(c.engine.num_micro_batches),
        "prefill_token_budget": str(c.engine.prefill_token_budget),
        "train_slice_s": repr(c.engine.train_slice_s),
        "batch_cap": c.engine.batch_cap,
    }
    profile = profile_path or (str(c.profile_path) if c.profile_path is not None else None)
    if profile is not None:
        specific["profile_path"] = profile
    if c.backend == "torch":
        specific.update(
            backend="torch",
            model=c.model,
            tokenizer=c.tokenizer,
            torch_threads=str(c.torch_threads),
        )
    return {
        **{SHARED_ENV[name]: value for name, value in shared.items()},
        **{SERVICE_ENV[name]: value for name, value in specific.items()},
    }


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


def _print_report(message: str) -> None:
    print(f"lemix up: {message}", file=sys.stderr, flush=True)


class Stack:
    """The running stack; `start()` then `stop()` (or `async with`).

    Fault injection for tests: `pid(name)`, `kill(name, sig)`,
    `wait_restarted(name)`; names are "executor-0".., "profiler",
    "scheduler", "gateway" (then "gateway-1".. with `num_gateways`) and "redis".
    """

    def __init__(self, config: StackConfig, report: Callable[[str], None] = _print_report) -> None:
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
            _print_report("stopping: the gateway drains its streams first, then the rest")
        started_s = time.monotonic()
        await stack.stop()
        if url_file is not None:
            url_file.unlink(missing_ok=True)
        _print_report(f"stopped in {time.monotonic() - started_s:.1f} s")
    if stack.failure is not None:
        print(f"error: {stack.failure}", file=sys.stderr)
        return 1
    return 0
