"""A real `docker compose` project of the shipped compose files, for tests.

The image is built with the Docker SDK (the classic builder: this engine has no
buildx), then `docker compose -f docker-compose.yml -f docker-compose.cpu.yml`
runs it under a project name of its own, with the gateway's ports published
on free host ports. A small override file (written per project, next to
nothing in it) only makes faults show in seconds, as tests/faults does:
heartbeats, leases and health-check intervals; the stack's wiring is the
shipped files'. Containers are found by their compose labels.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import docker
import docker.errors
import docker.models.containers
import yaml

from lemix.harness.faults import FAST_ENV

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILES = (REPO / "docker-compose.yml", REPO / "docker-compose.cpu.yml")
IMAGE_REPO = "lemix-ci"  # LEMIX_IMAGE: the compose files tag `${LEMIX_IMAGE}:cpu`
# Where Docker Hub is out of reach, scripts/docker_engine.sh builds these.
LOCAL_BASE_IMAGE = "local/python:3.11"
LOCAL_REDIS_IMAGE = "local/redis:7"
LEMIX_SERVICES = ("scheduler", "profiler", "gateway", "executor")
_CLAIMED = re.compile(r"node_identity: claimed node id (\d+)")

Container = docker.models.containers.Container


def engine_or_reason() -> tuple[docker.DockerClient | None, str]:
    """A client of a running engine, or why there is none."""
    if shutil.which("docker") is None:
        return None, "no docker CLI on PATH (scripts/docker_engine.sh up installs one)"
    try:
        client = docker.from_env(timeout=600)
        client.ping()
    except docker.errors.DockerException as exc:
        return None, f"no Docker engine answers ({exc}); run scripts/docker_engine.sh up"
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        return None, "no `docker compose` plugin (scripts/docker_engine.sh up installs it)"
    return client, ""


def has_image(client: docker.DockerClient, name: str) -> bool:
    try:
        client.images.get(name)
    except docker.errors.ImageNotFound:
        return False
    return True


def build_image(client: docker.DockerClient) -> tuple[str, float]:
    """Build `lemix-ci:cpu` from the repo; (tag, seconds it took).

    The classic builder leaves the `build` stage as an untagged image; it is
    built and tagged first (`lemix-ci:build`, all cached the second time), so
    that the previous run's images of both tags can be removed, not left to
    pile up (~3.6 GB per source change)."""
    base = LOCAL_BASE_IMAGE if has_image(client, LOCAL_BASE_IMAGE) else None
    args = {"VARIANT": "cpu", **({"BASE_IMAGE": base} if base else {})}
    tags = {"build": f"{IMAGE_REPO}:build", "runtime": f"{IMAGE_REPO}:cpu"}
    previous = {t: client.images.get(t).id for t in tags.values() if has_image(client, t)}
    start_s = time.monotonic()
    built = {}
    for target, tag in tags.items():
        try:
            image, _ = client.images.build(
                path=str(REPO), tag=tag, target=target, buildargs=args, rm=True, forcerm=True
            )
        except docker.errors.BuildError as exc:
            tail = "".join(str(line.get("stream", line)) for line in list(exc.build_log)[-30:])
            raise AssertionError(f"docker build failed: {exc}\n{tail}") from exc
        built[tag] = image.id
    took_s = time.monotonic() - start_s
    for tag, old_id in previous.items():
        if old_id != built[tag]:
            with contextlib.suppress(docker.errors.APIError):
                client.images.remove(old_id, noprune=False)
    return tags["runtime"], took_s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _override(health_interval_s: int) -> dict[str, object]:
    """Seconds-scale fault detection (as tests/faults) and quicker health checks."""
    health = {"interval": f"{health_interval_s}s", "start_period": "120s"}
    return {
        "services": {
            name: {"environment": dict(FAST_ENV), "healthcheck": health} for name in LEMIX_SERVICES
        }
    }


@dataclass
class ComposeProject:
    """One compose project: its name, environment and Docker handles."""

    client: docker.DockerClient
    name: str
    workdir: Path
    env_overrides: dict[str, str] = field(default_factory=dict)
    grpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        self.override = self.workdir / "compose.test.yml"
        self.override.write_text(yaml.safe_dump(_override(health_interval_s=2)))
        redis_image = LOCAL_REDIS_IMAGE if has_image(self.client, LOCAL_REDIS_IMAGE) else None
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root"),
            "LEMIX_IMAGE": IMAGE_REPO,
            "LEMIX_SERVICE_TOKEN": os.urandom(16).hex(),
            "LEMIX_REDIS_PASSWORD": os.urandom(12).hex(),
            "LEMIX_PUBLISH_GRPC_PORT": str(self.grpc_port),
            "LEMIX_PUBLISH_HTTP_PORT": str(self.http_port),
            **({"LEMIX_REDIS_IMAGE": redis_image} if redis_image else {}),
            **self.env_overrides,
        }

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def compose(self, *args: str, timeout_s: float = 300.0) -> str:
        files = [arg for path in (*COMPOSE_FILES, self.override) for arg in ("-f", str(path))]
        command = ["docker", "compose", "-p", self.name, *files, *args]
        done = subprocess.run(
            command, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout_s
        )
        if done.returncode != 0:
            logs = self.logs_tail()
            raise AssertionError(
                f"{' '.join(command[:3])} {' '.join(args)} exited {done.returncode}:\n"
                f"{done.stderr[-3000:]}\n--- container logs ---\n{logs}"
            )
        return done.stdout

    def up(self, num_executors: int, *extra: str) -> float:
        """`up -d --wait` with `num_executors` executor replicas; seconds taken."""
        start_s = time.monotonic()
        scale = f"executor={num_executors}"
        self.compose("up", "-d", "--wait", "--no-build", "--scale", scale, *extra)
        return time.monotonic() - start_s

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "15")

    def containers(self, service: str | None = None) -> list[Container]:
        labels = [f"com.docker.compose.project={self.name}"]
        if service is not None:
            labels.append(f"com.docker.compose.service={service}")
        return list(self.client.containers.list(all=True, filters={"label": labels}))

    def container(self, service: str) -> Container:
        (only,) = self.containers(service)
        return only

    def node_ids(self) -> dict[int, Container]:
        """Executor containers by the node id each one last claimed (its logs)."""
        claimed: dict[int, Container] = {}
        for container in self.containers("executor"):
            ids = _CLAIMED.findall(container.logs().decode(errors="replace"))
            if ids:
                claimed[int(ids[-1])] = container
        return claimed

    def wait_for_claim(self, node_id: int, timeout_s: float = 90.0) -> Container:
        give_up_s = time.monotonic() + timeout_s
        while True:
            found = self.node_ids().get(node_id)
            if found is not None or time.monotonic() > give_up_s:
                assert found is not None, f"no executor claimed node id {node_id}"
                return found
            time.sleep(0.5)

    def partition(self, container: Container, seconds: float) -> None:
        """Disconnect `container` from the project's network for `seconds`,
        then connect it again under the same aliases and, where the engine
        allows it, the same address."""
        container.reload()
        ((network_name, endpoint),) = container.attrs["NetworkSettings"]["Networks"].items()
        network = self.client.networks.get(network_name)
        aliases = [a for a in endpoint.get("Aliases") or [] if a != container.id[:12]]
        network.disconnect(container)
        time.sleep(seconds)
        try:
            network.connect(container, aliases=aliases, ipv4_address=endpoint["IPAddress"])
        except docker.errors.APIError:  # only networks with a user-set subnet take an address
            network.connect(container, aliases=aliases)

    def leftovers(self) -> dict[str, list[str]]:
        """What the project still has in the engine (after `down -v`: nothing)."""
        label = {"label": f"com.docker.compose.project={self.name}"}
        return {
            "containers": [c.name for c in self.client.containers.list(all=True, filters=label)],
            "volumes": [v.name for v in self.client.volumes.list(filters=label)],
            "networks": [n.name for n in self.client.networks.list(filters=label)],
        }

    def logs_tail(self, lines: int = 15) -> str:
        out = []
        for container in self.containers():
            text = container.logs(tail=lines).decode(errors="replace")
            out.append(f"== {container.name} ({container.status})\n{text}")
        return "\n".join(out)


@contextlib.contextmanager
def running_project(
    client: docker.DockerClient,
    name: str,
    workdir: Path,
    env_overrides: dict[str, str],
    num_executors: int,
    results: dict[str, object],
) -> Iterator[ComposeProject]:
    """A project up (`results[name + "_up_seconds"]`: how long it took),
    taken down with its volumes afterwards, whatever happened."""
    project = ComposeProject(client, name=name, workdir=workdir, env_overrides=env_overrides)
    try:
        results[f"{name.rstrip('0123456789')}_up_seconds"] = round(project.up(num_executors), 1)
        yield project
    finally:
        if project.containers():
            project.down()
