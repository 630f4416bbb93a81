"""`lemix up`: run the whole stack as local processes (no Docker needed).

Starts an embedded Redis (unless a URL is given), N executors, the profiler,
the scheduler and the gateway as `python -m ...` subprocesses, each configured through its
`LEMIX_*` environment variables (the services' own config modules map them).
A service is up when it prints its `SERVING ... address=HOST:PORT` line and
answers gRPC health checks; each serves Prometheus metrics on a free port
(`metrics=HOST:PORT` on that line; `Stack.metrics_addresses`); the gateway's
line also names its OpenAI-compatible HTTP API (`http=HOST:PORT`;
`Stack.http_address`). Stopping goes in reverse order of dependency: the
gateway drains first, then the scheduler, then the executors, then Redis.
Each service's output goes to `<log_dir>/<name>.log`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lemix.redis_server import EmbeddedRedis
from lemix.rpc import EXECUTOR_SERVICE, GATEWAY_SERVICE, PROFILER_SERVICE, SCHEDULER_SERVICE
from lemix.rpc.client import wait_for_serving

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class StackConfig:
    num_nodes: int = 2
    profile_path: Path | None = None  # None: the shipped A100 profile
    backend: str = "emulated"
    policy: str = "lemix"
    host: str = "127.0.0.1"
    gateway_port: int = 50051
    # The gateway's OpenAI-compatible HTTP API; 0 = a free port (`lemix up`'s
    # --http-port defaults to 8000), so programmatic stacks never collide on it.
    http_port: int = 0
    redis_url: str | None = None  # None: start an embedded Redis
    namespace: str = "lemix"
    time_scale: float = 1.0
    latency_noise_cv: float = 0.05
    max_batch_size: int = 64
    train_rate: float = 0.0  # SEPARATE's split
    log_dir: Path = Path("runs/stack-logs")
    extra_env: dict[str, str] = field(default_factory=dict)
    # torch backend: the model every executor builds and the tokenizer the
    # gateway and the executors share (trained once here before they start).
    model: str = "tiny-llama"
    tokenizer: str = "bpe:8192"
    torch_threads: int = 1  # per executor process; several share the cores

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError("--nodes must be >= 1")
        if self.backend not in ("emulated", "torch"):
            raise ValueError(f"backend must be 'emulated' or 'torch', got {self.backend!r}")
        if self.time_scale <= 0:
            raise ValueError("--time-scale must be > 0")
        if self.backend == "torch" and self.time_scale != 1.0:
            raise ValueError("--time-scale is for the emulated backend; torch runs in real time")


@dataclass
class _Child:
    name: str
    process: asyncio.subprocess.Process
    address: str
    copier: asyncio.Task[None]
    metrics_address: str = ""  # host:port of its /metrics; "" = none
    http_address: str = ""  # host:port of its HTTP API (the gateway's); "" = none


class Stack:
    """The running stack; `start()` then `stop()` (or `async with`)."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.children: list[_Child] = []
        self.gateway_address = ""
        self.http_address = ""  # the gateway's OpenAI-compatible API, once started

    async def __aenter__(self) -> Stack:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _env(self, redis_url: str) -> dict[str, str]:
        c = self.config
        env = dict(os.environ)
        env.update({
            "LEMIX_REDIS_URL": redis_url,
            "LEMIX_NAMESPACE": c.namespace,
            "LEMIX_POLICY": c.policy,
            "LEMIX_NUM_NODES": str(c.num_nodes),
            "LEMIX_TIME_SCALE": repr(c.time_scale),
            "LEMIX_LATENCY_NOISE_CV": repr(c.latency_noise_cv),
            "LEMIX_MAX_BATCH_SIZE": str(c.max_batch_size),
            "LEMIX_TRAIN_RATE": repr(c.train_rate),
            "LEMIX_LOG_FORMAT": "json",
            # Every service's /metrics on a free port, reported on its SERVING line.
            **{f"LEMIX_{svc}_METRICS_PORT": "0"
               for svc in ("GATEWAY", "SCHEDULER", "EXECUTOR", "PROFILER")},
            "PYTHONUNBUFFERED": "1",
        })
        if c.profile_path is not None:
            env["LEMIX_PROFILE"] = str(c.profile_path)
        if c.backend == "torch":
            env.update({"LEMIX_EXECUTOR_BACKEND": "torch", "LEMIX_MODEL": c.model,
                        "LEMIX_TOKENIZER": c.tokenizer,
                        "LEMIX_TORCH_THREADS": str(c.torch_threads)})
        env.update(c.extra_env)
        return env

    async def start(self) -> str:
        """Start everything; return the gateway's address once it serves."""
        c = self.config
        c.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            redis_url = c.redis_url
            if redis_url is None:
                self.redis = EmbeddedRedis().start()
                redis_url = self.redis.url
            env = self._env(redis_url)
            if c.backend == "torch":
                await asyncio.to_thread(_prepare_tokenizer, c.tokenizer)
            executors = [
                self._spawn(f"executor-{i}", "services.executor", EXECUTOR_SERVICE,
                            {**env, "LEMIX_NODE_ID": str(i), "LEMIX_EXECUTOR_PORT": "0",
                             "LEMIX_EXECUTOR_HOST": c.host})
                for i in range(c.num_nodes)
            ]
            await asyncio.gather(*executors)
            await self._spawn("profiler", "profiler", PROFILER_SERVICE,
                              {**env, "LEMIX_PROFILER_PORT": "0", "LEMIX_PROFILER_HOST": c.host})
            scheduler = await self._spawn("scheduler", "services.scheduler", SCHEDULER_SERVICE,
                                          {**env, "LEMIX_SCHEDULER_PORT": "0",
                                           "LEMIX_SCHEDULER_HOST": c.host})
            gateway = await self._spawn("gateway", "gateway", GATEWAY_SERVICE,
                                        {**env, "LEMIX_SCHEDULER_ADDRESS": scheduler.address,
                                         "LEMIX_GATEWAY_HOST": c.host,
                                         "LEMIX_GATEWAY_PORT": str(c.gateway_port),
                                         "LEMIX_GATEWAY_HTTP_PORT": str(c.http_port)})
        except BaseException:
            await self.stop()
            raise
        self.gateway_address = gateway.address
        self.http_address = gateway.http_address
        return gateway.address

    async def _spawn(self, name: str, module: str, service: str, env: dict[str, str]) -> _Child:
        log_path = self.config.log_dir / f"{name}.log"
        log_file = log_path.open("w")
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, env=env, stdout=asyncio.subprocess.PIPE,
            stderr=log_file, start_new_session=True)
        log_file.close()  # the child holds its own descriptor
        try:
            address, metrics, http = await asyncio.wait_for(_read_address(process),
                                                            START_TIMEOUT_S)
        except (TimeoutError, EOFError) as exc:
            process.kill()
            await process.wait()
            raise RuntimeError(f"{name} did not start ({exc}); its log ({log_path}) ends:\n"
                               f"{_tail(log_path)}") from None
        copier = asyncio.create_task(_copy_rest(process, log_path))
        child = _Child(name, process, address, copier, metrics, http)
        self.children.append(child)
        await wait_for_serving(address, service, timeout_s=START_TIMEOUT_S)
        return child

    async def stop(self) -> None:
        """Gateway first (it drains), then scheduler, executors, Redis."""
        order = {"gateway": 0, "scheduler": 1, "profiler": 2}
        for child in sorted(self.children, key=lambda ch: order.get(ch.name, 2)):
            await _terminate(child)
        self.children.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def metrics_addresses(self) -> dict[str, str]:
        """host:port of each running service's /metrics, by service name."""
        return {ch.name: ch.metrics_address for ch in self.children if ch.metrics_address}

    def failed_child(self) -> str | None:
        """The name of a service that exited on its own, if any."""
        for child in self.children:
            if child.process.returncode is not None:
                return child.name
        return None


def _prepare_tokenizer(spec: str) -> None:
    """Train (or find cached) the shared tokenizer once, before the services
    that load it start, so they do not each train it at the same time."""
    from lemix.model.tokenizer import load_tokenizer

    load_tokenizer(spec)


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


async def _terminate(child: _Child) -> None:
    process = child.process
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await process.wait()
    child.copier.cancel()


def _tail(path: Path, num_lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


async def run_until_signalled(config: StackConfig) -> int:
    """`lemix up`: start, print READY, run until SIGINT/SIGTERM or a child dies."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stack = Stack(config)
    address = await stack.start()
    print(f"READY gateway={address} http={stack.http_address}", flush=True)
    for name, metrics in stack.metrics_addresses().items():
        print(f"metrics {name}: http://{metrics}/metrics", flush=True)
    exit_code = 0
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                dead = stack.failed_child()
                if dead is not None:
                    print(f"error: {dead} exited; see {config.log_dir}/{dead}.log",
                          file=sys.stderr)
                    exit_code = 1
                    break
    finally:
        await stack.stop()
    return exit_code
