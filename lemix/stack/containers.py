"""`lemix up --runtime docker`: the `lemix up` topology as containers.

The same services, settings and wiring as the process stack
(`lemix.stack.launcher`; `lemix.stack.config.stack_env` gives both their variables), each
in its own container of one image, on a private bridge network, through the
Docker SDK: Redis (AOF on a volume, a password), one executor per node with
its node id fixed and its container name advertised, the profiler, the
scheduler and the gateway, the only one with published ports. Every container
has a gRPC health check, `init` (so SIGTERM reaches the service) and an
`unless-stopped` restart policy, so Docker, not this process, restarts what
crashes. Everything carries the label ``lemix.project=<project>``; `stop`
removes the containers, the network and the volumes.

For a user who wants `lemix up`'s one command with container isolation and
no compose file; `docker compose` (docker-compose.yml) remains the way to run
a long-lived deployment.
"""

from __future__ import annotations

import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types

from lemix.infra.config import EXECUTOR, GATEWAY, PROFILER, SCHEDULER, listener_options
from lemix.infra.rpc import EXECUTOR_SERVICE, GATEWAY_SERVICE, PROFILER_SERVICE, SCHEDULER_SERVICE
from lemix.infra.rpc.auth import API_KEY_ENV
from lemix.stack.config import SERVICE_ENV, StackConfig, stack_env

PROJECT_LABEL = "lemix.project"
# Ports inside the containers (the network is private; only the gateway's
# are published, on the StackConfig's host and ports).
_PORTS = {SCHEDULER: 50052, PROFILER: 50053, EXECUTOR: 50060, GATEWAY: 50051}
_HTTP_PORT = 8000
_METRICS_PORT = 9090
_PROFILE_IN_CONTAINER = "/etc/lemix/profile.json"
_WEIGHTS_DIR = "/var/lib/lemix/weights"  # the image's LEMIX_WEIGHT_SYNC_DIR owner is lemix
_NS = 1_000_000_000  # the Docker API counts health-check times in ns


@dataclass(frozen=True)
class ContainerConfig:
    """What the container runtime adds to a `StackConfig`."""

    image: str = "lemix:cpu"  # built from this repo's Dockerfile
    redis_image: str = "redis:7.4-alpine"  # any image whose redis-server takes flags
    project: str = "lemix"  # the prefix of every name, and the label's value
    gpus_per_node: int = 0  # >0: executor i reserves GPUs i*k .. i*k+k-1
    health_interval_s: float = 2.0
    start_timeout_s: float = 300.0  # the torch backend trains its tokenizer at start
    stop_timeout_s: int = 15  # SIGTERM, then SIGKILL (the services drain within it)

    def __post_init__(self) -> None:
        if len(self.project) < 2 or not self.project.replace("-", "").isalnum():
            raise ValueError(f"--project must be >= 2 letters, digits or '-', got {self.project!r}")
        if self.gpus_per_node < 0:
            raise ValueError("--gpus-per-node must be >= 0")


def _health(address: str, service: str, interval_s: float) -> dict[str, Any]:
    test = ["CMD", "python", "-m", "lemix.infra.healthcheck", address, service]
    return {
        "test": test,
        "interval": int(interval_s * _NS),
        "timeout": 5 * _NS,
        "retries": 3,
        "start_period": 300 * _NS,
    }


class ContainerStack:
    """The running stack as containers; `start()` then `stop()`."""

    def __init__(
        self,
        config: StackConfig,
        containers: ContainerConfig,
        report: Callable[[str], None] = lambda line: None,
        client: docker.DockerClient | None = None,
    ) -> None:
        self.config = config
        self.spec = containers
        self.report = report
        self.client = client or docker.from_env(timeout=120)
        self.labels = {PROJECT_LABEL: containers.project}
        self.gateway_address = f"{config.host}:{config.gateway_port}"
        self.http_address = f"{config.host}:{config.http_port}"
        self._redis_password = config.redis_password or secrets.token_hex(16)
        self._token = secrets.token_hex(32)

    def _name(self, role: str) -> str:
        return f"{self.spec.project}-{role}"

    def _check_clean(self) -> None:
        if not self.client.images.list(name=self.spec.image):
            raise RuntimeError(
                f"no image {self.spec.image!r}; build it first: "
                f"docker build --build-arg VARIANT=cpu -t {self.spec.image} ."
            )
        left = self.client.containers.list(all=True, filters={"label": self._label_filter()})
        if left:
            names = ", ".join(sorted(c.name for c in left))
            raise RuntimeError(
                f"project {self.spec.project!r} already has containers ({names}): another "
                f"`lemix up --runtime docker` runs, or one was killed; pass another --project "
                f"or remove them: docker rm -f $(docker ps -aq -f label={PROJECT_LABEL}="
                f"{self.spec.project})"
            )

    def _label_filter(self) -> str:
        return f"{PROJECT_LABEL}={self.spec.project}"

    def start(self) -> str:
        """Create everything, wait until every container is healthy; the
        gateway's published address. On any failure what was made is removed."""
        self._check_clean()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self.gateway_address

    def _start(self) -> None:
        c, spec = self.config, self.spec
        network = self.client.networks.create(
            self._name("net"), driver="bridge", labels=self.labels
        )
        for role in ("redis-data", "weights"):
            self.client.volumes.create(self._name(role), labels=self.labels)
        self._run(
            "redis",
            spec.redis_image,
            [
                "redis-server", "--appendonly", "yes", "--appendfsync", c.redis_fsync,
                "--requirepass", self._redis_password,
            ],
            env={"REDISCLI_AUTH": self._redis_password},
            volumes={self._name("redis-data"): {"bind": "/data", "mode": "rw"}},
            healthcheck={
                "test": ["CMD", "redis-cli", "ping"],
                "interval": int(spec.health_interval_s * _NS),
                "timeout": 3 * _NS,
                "retries": 5,
            },
            network=network.name,
        )  # fmt: skip
        self._wait_healthy([self._name("redis")])
        redis_url = f"redis://:{self._redis_password}@{self._name('redis')}:6379/0"
        profile = None if c.profile_path is None else _PROFILE_IN_CONTAINER
        env = stack_env(c, redis_url=redis_url, service_token=self._token, profile_path=profile)
        env.update(c.extra_env)
        env["LEMIX_WEIGHT_SYNC_DIR"] = _WEIGHTS_DIR
        mounts: dict[str, dict[str, str]] = {self._name("weights"): {"bind": _WEIGHTS_DIR}}
        if c.profile_path is not None:
            mounts[str(Path(c.profile_path).resolve())] = {
                "bind": _PROFILE_IN_CONTAINER,
                "mode": "ro",
            }
        names = []
        for node_id in range(c.num_nodes):
            role = f"executor-{node_id}"
            node_env = {
                **env,
                SERVICE_ENV["node_id"]: str(node_id),
                "LEMIX_ADVERTISE_HOST": self._name(role),
            }
            names.append(self._service(role, "services.executor", EXECUTOR, node_env, mounts))
        names.append(self._service("profiler", "profiler", PROFILER, env, mounts))
        names.append(self._service("scheduler", "services.scheduler", SCHEDULER, env, mounts))
        gateway_env = {
            **env,
            SERVICE_ENV["scheduler_address"]: f"{self._name('scheduler')}:{_PORTS[SCHEDULER]}",
            SERVICE_ENV["http_port"]: str(_HTTP_PORT),
        }
        if c.api_key:
            gateway_env[API_KEY_ENV] = c.api_key
        ports = {
            f"{_PORTS[GATEWAY]}/tcp": (c.host, c.gateway_port),
            f"{_HTTP_PORT}/tcp": (c.host, c.http_port),
        }
        names.append(self._service("gateway", "gateway", GATEWAY, gateway_env, mounts, ports))
        self._wait_healthy(names)
        # Port 0 asked Docker for a free one: read back which.
        published = self.client.containers.get(self._name("gateway")).ports
        grpc_port = published[f"{_PORTS[GATEWAY]}/tcp"][0]["HostPort"]
        http_port = published[f"{_HTTP_PORT}/tcp"][0]["HostPort"]
        self.gateway_address = f"{c.host}:{grpc_port}"
        self.http_address = f"{c.host}:{http_port}"

    def _service(
        self,
        role: str,
        module: str,
        prefix: str,
        env: dict[str, str],
        mounts: dict[str, dict[str, str]],
        ports: dict[str, tuple[str, int]] | None = None,
    ) -> str:
        listener = {opt.field: opt.env for opt in listener_options(prefix)}
        port = _PORTS[prefix]
        service_env = {
            **env,
            listener["host"]: "0.0.0.0",
            listener["port"]: str(port),
            listener["metrics_port"]: str(_METRICS_PORT),
        }
        grpc_service = {
            EXECUTOR: EXECUTOR_SERVICE,
            PROFILER: PROFILER_SERVICE,
            SCHEDULER: SCHEDULER_SERVICE,
            GATEWAY: GATEWAY_SERVICE,
        }[prefix]
        devices = None
        if prefix == EXECUTOR and self.spec.gpus_per_node:
            k, node_id = self.spec.gpus_per_node, int(role.split("-")[1])
            ids = [str(i) for i in range(node_id * k, node_id * k + k)]
            devices = [docker.types.DeviceRequest(device_ids=ids, capabilities=[["gpu"]])]
        self._run(
            role,
            self.spec.image,
            ["python", "-m", module],
            env=service_env,
            volumes=mounts,
            healthcheck=_health(f"127.0.0.1:{port}", grpc_service, self.spec.health_interval_s),
            network=self._name("net"),
            ports=ports,
            device_requests=devices,
        )
        return self._name(role)

    def _run(self, role: str, image: str, command: list[str], **options: Any) -> None:
        name = self._name(role)
        self.report(f"starting {name} ({image})")
        self.client.containers.run(
            image,
            command,
            name=name,
            hostname=name,
            detach=True,
            init=True,
            labels=self.labels,
            restart_policy={"Name": "unless-stopped"},
            environment=options.pop("env"),
            **{key: value for key, value in options.items() if value is not None},
        )

    def _wait_healthy(self, names: list[str]) -> None:
        give_up_s = time.monotonic() + self.spec.start_timeout_s
        pending = list(names)
        while pending:
            for name in list(pending):
                container = self.client.containers.get(name)
                state = container.attrs["State"]
                health = state.get("Health", {}).get("Status")
                if health == "healthy":
                    pending.remove(name)
                elif state["Status"] in ("exited", "dead") or state.get("RestartCount", 0) > 0:
                    raise RuntimeError(f"{name} exited at start:\n{_tail(container)}")
            if pending and time.monotonic() > give_up_s:
                logs = "\n".join(_tail(self.client.containers.get(n)) for n in pending)
                raise RuntimeError(
                    f"not healthy within {self.spec.start_timeout_s:g} s: {pending}\n{logs}"
                )
            if pending:
                time.sleep(0.5)

    def containers(self) -> list[Any]:
        return list(self.client.containers.list(all=True, filters={"label": self._label_filter()}))

    def stop(self) -> None:
        """Stop (SIGTERM, then SIGKILL after `stop_timeout_s`) and remove
        every container, then the network and the volumes."""
        label = {"label": self._label_filter()}
        for container in self.containers():
            self.report(f"stopping {container.name}")
            try:
                container.stop(timeout=self.spec.stop_timeout_s)
                container.remove(v=True, force=True)
            except docker.errors.NotFound:
                pass
        for network in self.client.networks.list(filters=label):
            network.remove()
        for volume in self.client.volumes.list(filters=label):
            volume.remove(force=True)


def _tail(container: Any, lines: int = 20) -> str:
    text = container.logs(tail=lines).decode(errors="replace")
    return f"--- {container.name} ---\n{text}"


def run_containers_until_signalled(config: StackConfig, containers: ContainerConfig) -> int:
    """`lemix up --runtime docker`: start, print READY, wait for SIGINT or
    SIGTERM, then remove everything. Exit 1 with one line when it cannot start."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stack = ContainerStack(config, containers, report=_print_report)
    except docker.errors.DockerException as exc:
        print(f"error: no Docker engine ({exc}); see scripts/docker_engine.sh", file=sys.stderr)
        return 1
    try:
        address = stack.start()
    except (RuntimeError, docker.errors.DockerException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"READY gateway={address} http={stack.http_address}", flush=True)
    print(
        f"containers: {', '.join(sorted(c.name for c in stack.containers()))} "
        f"(label {PROJECT_LABEL}={containers.project}; `docker logs NAME` for logs)",
        flush=True,
    )
    try:
        while not stop.wait(1.0):
            pass
    finally:
        stack.stop()
    return 0


def _print_report(message: str) -> None:
    print(f"lemix up: {message}", file=sys.stderr, flush=True)
