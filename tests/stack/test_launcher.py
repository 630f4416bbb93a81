"""lemix.stack.launcher under faults: real service processes, a real embedded Redis
(AOF, password), real gRPC. A SIGKILLed child comes back on the same address
and the stack keeps serving; a crash loop fails the stack with a clear message."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from redis_pool import TEST_POOL_SIZE

from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc
from lemix.infra.rpc.client import channel
from lemix.infra.settings import Option
from lemix.infra.store.client import RedisClientConfig, connect
from lemix.stack import launcher
from lemix.stack.config import SERVICE_ENV
from lemix.stack.launcher import Stack, StackConfig
from lemix.stack.process import pick_free_ports
from lemix.stack.supervisor import RestartPolicy

TIME_SCALE = 0.05
GENERATE_DEADLINE_S = 60.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _generate(stub: gateway_pb2_grpc.GatewayStub) -> None:
    """One Generate through the gateway, retried on UNAVAILABLE until a deadline
    (a just-restarted executor is live again at its next heartbeat)."""
    deadline = time.monotonic() + GENERATE_DEADLINE_S
    while True:
        try:
            messages = [
                m
                async for m in stub.Generate(
                    gateway_pb2.GenerateRequest(prompt_token_ids=[1] * 20, max_tokens=4), timeout=30
                )
            ]
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
            continue
        assert messages[-1].is_finished and messages[-1].num_output_tokens == 4
        return


def _addresses(stack: Stack) -> dict[str, tuple[str, str, str]]:
    return {ch.name: (ch.address, ch.metrics_address, ch.http_address) for ch in stack.children}


@pytest.mark.slow
async def test_killed_children_come_back_on_their_addresses_and_the_stack_serves(
    tmp_path: Path,
) -> None:
    reports: list[str] = []
    config = StackConfig(
        num_nodes=1,
        gateway_port=0,
        time_scale=TIME_SCALE,
        log_dir=tmp_path / "logs",
        namespace="sup",
        redis_dir=tmp_path / "redis",
    )
    async with (
        Stack(config, report=reports.append) as stack,
        channel(stack.gateway_address) as chan,
    ):
        stub = gateway_pb2_grpc.GatewayStub(chan)
        await _generate(stub)
        before = _addresses(stack)
        assert all(
            address for address, metrics, _ in before.values() for address in (address, metrics)
        )
        for name in ("executor-0", "scheduler", "gateway"):
            pid = stack.pid(name)
            stack.kill(name)
            await stack.wait_restarted(name, timeout_s=60)
            assert stack.pid(name) != pid and not _alive(pid)
            assert _addresses(stack) == before, name  # same gRPC, metrics and HTTP ports
            await _generate(stub)  # the gateway (re)finds the scheduler; it finds the node

        assert stack.redis is not None
        # The client's one retry of a connection error rides over the restart.
        client = connect(
            RedisClientConfig(stack.redis.url, max_connections=1, socket_timeout_s=5.0)
        )
        try:
            await client.set("acknowledged", "yes")
            redis_pid, redis_port = stack.redis_pid, stack.redis.port
            stack.kill("redis")
            await stack.wait_restarted("redis", timeout_s=30)
            assert stack.redis_pid != redis_pid and stack.redis.port == redis_port
            assert await client.get("acknowledged") == "yes"  # from the AOF
        finally:
            await client.aclose()
        await _generate(stub)
        assert stack.failed_child() is None  # every exit was one we caused
        pids = [stack.pid(ch.name) for ch in stack.children] + [stack.redis_pid]
        num_reports = len(reports)
    assert not any(pid is not None and _alive(pid) for pid in pids)
    assert len(reports) == num_reports  # stopping restarted nothing
    assert reports[0] == (
        "executor-0 exited (killed by SIGKILL); restarting in 0.5 s; "
        f"log: {tmp_path / 'logs' / 'executor-0.log'}"
    )
    assert "redis restarted" in reports
    assert (tmp_path / "redis" / "appendonly.aof").exists() or (
        tmp_path / "redis" / "appendonlydir"
    ).is_dir()


@pytest.mark.slow
async def test_embedded_redis_requires_the_password_the_services_get(tmp_path: Path) -> None:
    config = StackConfig(
        num_nodes=1,
        gateway_port=0,
        time_scale=TIME_SCALE,
        log_dir=tmp_path / "logs",
        namespace="auth",
        redis_fsync="always",
        redis_password="given-password-123",
    )
    async with Stack(config) as stack:
        assert stack.redis is not None
        assert stack.redis.url.startswith("redis://:given-password-123@127.0.0.1:")
        anonymous = aioredis.Redis(
            host="127.0.0.1", port=stack.redis.port, max_connections=TEST_POOL_SIZE
        )
        with pytest.raises(Exception, match="(?i)auth"):
            await anonymous.ping()
        await anonymous.aclose()
        client = aioredis.from_url(
            stack.redis.url, decode_responses=True, max_connections=TEST_POOL_SIZE
        )
        assert await client.config_get("appendfsync") == {"appendfsync": "always"}
        assert await client.config_get("appendonly") == {"appendonly": "yes"}
        await client.aclose()
        for child in stack.children:
            log = child.log_path.read_text()
            assert "given-password-123" not in log, child.name
    assert "given-password-123" not in repr(config)


@pytest.mark.slow
async def test_a_crash_loop_fails_the_stack_with_a_clear_message(tmp_path: Path) -> None:
    policy = RestartPolicy(
        initial_backoff_s=0.05, max_backoff_s=0.2, max_crashes=3, crash_window_s=60.0
    )
    reports: list[str] = []
    config = StackConfig(
        num_nodes=1,
        gateway_port=0,
        time_scale=TIME_SCALE,
        log_dir=tmp_path / "logs",
        namespace="loop",
        restart_policy=policy,
    )
    async with Stack(config, report=reports.append) as stack:
        executor = stack.child("executor-0")
        assert hasattr(executor, "env")
        executor.env["LEMIX_EXECUTOR_BACKEND"] = "no-such-backend"  # every restart exits at once
        stack.kill("executor-0")
        message = await asyncio.wait_for(stack.wait_failed(), 120)
        log_path = tmp_path / "logs" / "executor-0.log"
        assert message.startswith("executor-0 crashed 3 times within 60 s (last: exit code 2)")
        assert str(log_path) in message and stack.failure == message
        assert "no-such-backend" in log_path.read_text()  # the log says why
        assert stack.failed_child() == "executor-0"
        assert executor.num_restarts == 0
        assert stack.child("scheduler").is_serving  # the others were left alone
        with pytest.raises(RuntimeError, match="gave up"):
            await stack.wait_restarted("executor-0", timeout_s=5)
    assert sum("did not restart" in r for r in reports) == 2


def test_picked_ports_are_distinct_and_free() -> None:
    ports = pick_free_ports("127.0.0.1", 20)
    assert len(set(ports)) == 20
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_config_rejects_bad_redis_settings() -> None:
    with pytest.raises(ValueError, match="--redis-fsync"):
        StackConfig(redis_fsync="no")
    with pytest.raises(ValueError, match="password"):
        StackConfig(redis_password="has space")
    with pytest.raises(ValueError, match="gateway_port"):
        StackConfig(gateway_port=70000)
    with pytest.raises(ValueError, match="num_gateways"):
        StackConfig(num_gateways=0)


# ------------------------------------------------------------------ the children's environment


def _service_options() -> list[Option]:
    import gateway.config
    import profiler.config
    import services.executor.config
    import services.scheduler.config

    modules = (gateway.config, services.scheduler.config, services.executor.config, profiler.config)
    return [opt for module in modules for opt in module._OPTIONS]


def test_service_variables_the_launcher_spells_are_the_services_own() -> None:
    options = _service_options()
    for field, env in SERVICE_ENV.items():
        assert any(o.field == field and o.env == env for o in options), (field, env)


def test_the_children_get_only_variables_some_service_reads(tmp_path: Path) -> None:
    config = StackConfig(backend="torch", profile_path=tmp_path / "p.json", log_dir=tmp_path)
    stack = Stack(config)
    env = stack._env("redis://:pw@127.0.0.1:1/0")
    set_here = {k for k, v in env.items() if k.startswith("LEMIX_") and os.environ.get(k) != v}
    read = {o.env for o in _service_options()}
    assert set_here <= read, set_here - read
    assert env["LEMIX_REDIS_URL"] == "redis://:pw@127.0.0.1:1/0"
    assert env["LEMIX_EXECUTOR_BACKEND"] == "torch" and env["LEMIX_PROFILE"].endswith("p.json")
    gateway, _ = stack._child("gateway", "gateway", "svc", env, "GATEWAY", {"port": 7001})
    assert (gateway.env["LEMIX_GATEWAY_HOST"], gateway.env["LEMIX_GATEWAY_PORT"]) == (
        "127.0.0.1",
        "7001",
    )


def test_a_second_stack_cannot_take_a_running_stacks_directory(tmp_path: Path) -> None:
    first = launcher.claim_dir(tmp_path / "logs")
    with pytest.raises(RuntimeError, match=rf"another `lemix up` \(pid {os.getpid()}\)"):
        launcher.claim_dir(tmp_path / "logs")
    first.close()  # the first stack stopped: the directory is free again
    launcher.claim_dir(tmp_path / "logs").close()
