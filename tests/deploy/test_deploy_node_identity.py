"""lemix.infra.store.node_identity: distinct node ids for identical executor replicas."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis_pool import TEST_POOL_SIZE

from lemix.infra.store import node_identity
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.node_identity import NodeClaim, ordinal_from_hostname
from lemix.infra.store.server import EmbeddedRedis

KEYS = RedisKeys("test")
PRINT_ID = [sys.executable, "-c", "import os; print(os.environ['LEMIX_NODE_ID'], flush=True)"]


def make_claim(
    client: aioredis.Redis, owner: str, num_nodes: int = 2, ttl_s: float = 5.0
) -> NodeClaim:
    return NodeClaim(client, KEYS, num_nodes, owner, ttl_s=ttl_s)


@pytest.mark.parametrize(
    "hostname,ordinal",
    [("executor-0", 0), ("executor-12", 12), ("lemix-executor-3.executor.default.svc", 3)],
)
def test_ordinal_from_hostname(hostname: str, ordinal: int) -> None:
    assert ordinal_from_hostname(hostname) == ordinal


@pytest.mark.parametrize("hostname", ["3f4e5a6b7c8d", "executor", "executor-", "-3"])
def test_hostname_without_ordinal(hostname: str) -> None:
    with pytest.raises(ValueError, match="ordinal"):
        ordinal_from_hostname(hostname)


async def test_claims_are_distinct_lowest_first(redis_client: aioredis.Redis) -> None:
    a, b, c = (make_claim(redis_client, owner) for owner in ("a", "b", "c"))
    assert [await a.claim(), await b.claim(), await c.claim()] == [0, 1, None]
    await a.release(0)
    assert await c.claim() == 0  # a spare takes the freed id
    assert await redis_client.get(KEYS.node_claim(0)) == "c"


async def test_a_restarted_owner_gets_its_own_id_back(redis_client: aioredis.Redis) -> None:
    a, b = make_claim(redis_client, "a"), make_claim(redis_client, "b")
    assert (await a.claim(), await b.claim()) == (0, 1)
    await a.release(0)
    assert await b.claim() == 1  # not the lower, free 0: its own claim first


async def test_renew_and_lost_claims(redis_client: aioredis.Redis) -> None:
    a, b = make_claim(redis_client, "a", ttl_s=0.2), make_claim(redis_client, "b")
    assert await a.claim() == 0
    assert await a.renew(0)
    await asyncio.sleep(0.3)  # a missed its renewals: the claim expired
    assert await b.claim() == 0
    assert not await a.renew(0)
    await a.release(0)  # releasing someone else's claim does nothing
    assert await redis_client.get(KEYS.node_claim(0)) == "b"


async def test_run_with_claim_sets_the_id_and_releases(
    redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    out = tmp_path / "id"
    command = [
        sys.executable,
        "-c",
        f"import os, pathlib; pathlib.Path({str(out)!r}).write_text("
        "os.environ['LEMIX_NODE_ID']); raise SystemExit(3)",
    ]
    await make_claim(redis_client, "other").claim()  # id 0 is taken
    status = await node_identity.run_with_claim(
        command, dict(os.environ), make_claim(redis_client, "me"), ttl_s=5.0
    )
    assert status == 3 and out.read_text() == "1"
    assert await redis_client.get(KEYS.node_claim(1)) is None


def _run_module(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lemix.infra.store.node_identity", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_module_claims_from_redis(redis_server: EmbeddedRedis) -> None:
    env = {
        "LEMIX_REDIS_URL": redis_server.url,
        "LEMIX_NAMESPACE": "cli",
        "LEMIX_NUM_NODES": "3",
        "LEMIX_NODE_ID": "auto",
    }
    done = _run_module(["--from", "redis", "--", *PRINT_ID], env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0" and "claimed node id 0" in done.stderr


def test_module_keeps_an_explicit_id_and_checks_usage() -> None:
    done = _run_module(["--", *PRINT_ID], {"LEMIX_NODE_ID": "7"})
    assert (done.returncode, done.stdout.strip()) == (0, "7")
    assert _run_module([], {}).returncode == 2  # no command


class _Exec(Exception):
    pass


def _fake_exec(file: str, args: list[str], env: dict[str, str]) -> None:
    raise _Exec(args, env)


def test_from_hostname_execs_with_the_ordinal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(node_identity.socket, "gethostname", lambda: "executor-5")
    monkeypatch.setattr(node_identity.socket, "gethostbyname", lambda name: "10.1.2.3")
    monkeypatch.setattr(node_identity.os, "execvpe", _fake_exec)
    env = {"LEMIX_NODE_ID": "auto", "LEMIX_NUM_NODES": "8", "LEMIX_ADVERTISE_HOST": "auto"}
    with pytest.raises(_Exec) as exec_call:
        node_identity.main(["--from", "hostname", "--", "python", "-m", "x"], env)
    args, child_env = exec_call.value.args
    assert args == ["python", "-m", "x"]
    assert (child_env["LEMIX_NODE_ID"], child_env["LEMIX_ADVERTISE_HOST"]) == ("5", "10.1.2.3")
    # An ordinal the scheduler would ignore is an error, not a silent idle node.
    assert (
        node_identity.main(["--from", "hostname", "--", "true"], {**env, "LEMIX_NUM_NODES": "4"})
        == 2
    )
    assert "LEMIX_NUM_NODES" in capsys.readouterr().err


def test_module_passes_sigterm_on_and_releases(redis_server: EmbeddedRedis) -> None:
    """`docker compose stop` signals the wrapper (PID 1); the executor must drain."""
    env = {
        **os.environ,
        "LEMIX_REDIS_URL": redis_server.url,
        "LEMIX_NAMESPACE": "sig",
        "LEMIX_NUM_NODES": "1",
    }
    child = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
        "print('up', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lemix.infra.store.node_identity",
            "--",
            sys.executable,
            "-c",
            child,
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    client = redis.Redis.from_url(
        redis_server.url, decode_responses=True, max_connections=TEST_POOL_SIZE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        assert client.get(RedisKeys("sig").node_claim(0))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert client.get(RedisKeys("sig").node_claim(0)) is None
    finally:
        proc.kill()
        proc.wait()
        client.close()
