"""`python -m lemix.infra.healthcheck`: the probe the compose healthchecks run."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lemix.infra import healthcheck
from lemix.infra.rpc import SCHEDULER_SERVICE
from lemix.infra.store.server import find_free_port


@pytest.fixture
def server() -> Iterator[tuple[str, health.HealthServicer]]:
    """A real gRPC server with the standard health service; the scheduler SERVING."""
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(SCHEDULER_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        srv.stop(None)


def test_serving(server: tuple[str, health.HealthServicer]) -> None:
    address, _ = server
    assert healthcheck.check(address) == (True, "SERVING")
    assert healthcheck.check(address, SCHEDULER_SERVICE) == (True, "SERVING")


def test_not_serving_while_draining(server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = server
    servicer.set(SCHEDULER_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.check(address, SCHEDULER_SERVICE) == (False, "NOT_SERVING")


def test_unknown_service(server: tuple[str, health.HealthServicer]) -> None:
    address, _ = server
    is_serving, seen = healthcheck.check(address, "lemix.v1.Nothing")
    assert not is_serving and seen.startswith("NOT_FOUND")


def test_nothing_listening_fails_within_the_deadline() -> None:
    is_serving, seen = healthcheck.check(f"127.0.0.1:{find_free_port()}", deadline_s=2.0)
    assert not is_serving and seen.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))


def test_main_exit_codes_and_messages(
    server: tuple[str, health.HealthServicer], capsys: pytest.CaptureFixture[str]
) -> None:
    address, servicer = server
    assert healthcheck.main([address, SCHEDULER_SERVICE]) == 0
    assert f"healthy: {address} {SCHEDULER_SERVICE} is SERVING" in capsys.readouterr().out
    servicer.set(SCHEDULER_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main([address, SCHEDULER_SERVICE, "--deadline-s", "2"]) == 1
    assert "unhealthy" in capsys.readouterr().err
    # Docker reserves exit status 2, so bad usage is 1 like any failure.
    assert healthcheck.main(["no-port"]) == 1
    assert healthcheck.main(["127.0.0.1:1", "--deadline-s", "0"]) == 1


def test_module_entry_point(server: tuple[str, health.HealthServicer]) -> None:
    address, _ = server
    done = subprocess.run(
        [sys.executable, "-m", "lemix.infra.healthcheck", address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "SERVING" in done.stdout
