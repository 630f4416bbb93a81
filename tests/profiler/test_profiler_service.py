"""The Profiler gRPC service end to end: real gRPC on free ports, real Redis,
a real emulated executor to profile."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis
from known_profile import GRID, true_profile

from lemix._proto.lemix.v1 import profiler_pb2, profiler_pb2_grpc
from lemix.infra.rpc import PROFILER_SERVICE
from lemix.infra.rpc.client import channel, wait_for_serving
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.server import EmbeddedRedis
from lemix.infra.store.store import Store
from lemix.profile import Profile, save_profile
from profiler.config import ProfilerConfig, from_env_and_args
from profiler.runner import DEFAULT_BATCH_SIZES, DEFAULT_NUM_REPEATS, DEFAULT_NUM_TOKENS
from profiler.service import ProfilerService
from services.executor.service import ExecutorService

REPO = Path(__file__).resolve().parents[2]
RUN_DEADLINE_S = 60.0


@pytest.fixture
async def profiler(redis_server: EmbeddedRedis, namespace: str) -> AsyncIterator[ProfilerService]:
    config = ProfilerConfig(redis_url=redis_server.url, namespace=namespace, shutdown_grace_s=0.5)
    service = ProfilerService(config, base_profile=true_profile())
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


@pytest.fixture
async def stub(profiler: ProfilerService) -> AsyncIterator[profiler_pb2_grpc.ProfilerStub]:
    async with channel(profiler.address) as ch:
        yield profiler_pb2_grpc.ProfilerStub(ch)


@pytest.fixture
def store(redis_client: aioredis.Redis, namespace: str) -> Store:
    return Store(redis_client, RedisKeys(namespace))


def grid_request(address: str, name: str, **overrides: object) -> profiler_pb2.RunProfileRequest:
    fields: dict[str, object] = dict(
        executor_address=address,
        batch_sizes=GRID.batch_sizes,
        num_tokens=GRID.num_tokens,
        sum_context_tokens=GRID.sum_context_tokens,
        num_repeats=3,
        name=name,
    )
    fields.update(overrides)
    return profiler_pb2.RunProfileRequest(**fields)  # type: ignore[arg-type]


async def test_run_profile_stores_the_fitted_profile_and_returns_json(
    profiler: ProfilerService,
    stub: profiler_pb2_grpc.ProfilerStub,
    store: Store,
    executor: ExecutorService,
) -> None:
    await wait_for_serving(profiler.address, PROFILER_SERVICE, timeout_s=5)
    reply = await stub.RunProfile(
        grid_request(executor.address, "node0-measured"), timeout=RUN_DEADLINE_S
    )
    profile = Profile.from_json_dict(json.loads(reply.profile_json))
    assert profile.name == "node0-measured" and profile.num_stages == 2
    assert profile.memory == true_profile().memory
    for phase in ("forward", "backward", "decode"):
        assert all(q["r2"] > 0.99 for q in profile.fit_quality[phase]["ours"])
    # Stored in Redis under its name, exactly what was returned.
    assert await store.get_profile("node0-measured") == reply.profile_json
    report = json.loads(reply.fit_report_json)
    assert report["name"] == "node0-measured" and report["executor_address"] == executor.address
    assert report["num_repeats"] == 3 and report["base_profile"] == "truth"
    assert set(report["fit_quality"]["forward"]) == {"paper", "ours"}
    assert [s["is_consistent"] for s in report["memory_check"]] == [True, True]


async def test_unset_grid_and_repeats_mean_the_defaults(
    stub: profiler_pb2_grpc.ProfilerStub, executor: ExecutorService
) -> None:
    request = profiler_pb2.RunProfileRequest(executor_address=executor.address, name="dflt")
    reply = await stub.RunProfile(request, timeout=RUN_DEADLINE_S)
    report = json.loads(reply.fit_report_json)
    assert report["num_repeats"] == DEFAULT_NUM_REPEATS
    assert tuple(report["grid"]["batch_sizes"]) == DEFAULT_BATCH_SIZES
    assert tuple(report["grid"]["num_tokens"]) == DEFAULT_NUM_TOKENS


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"executor_address": "no-port"}, "host:port"),
        ({"name": ""}, "name"),
        ({"name": "two words"}, "whitespace"),
        ({"num_tokens": [128]}, "two lengths"),
        ({"num_repeats": 10_001}, "num_repeats"),
    ],
)
async def test_bad_requests_are_invalid_argument_and_store_nothing(
    stub: profiler_pb2_grpc.ProfilerStub,
    executor: ExecutorService,
    redis_client: aioredis.Redis,
    namespace: str,
    overrides: dict[str, object],
    message: str,
) -> None:
    request = grid_request(executor.address, "bad")
    for field, value in overrides.items():
        request.ClearField(field)  # type: ignore[arg-type]
        if isinstance(value, list):
            getattr(request, field).extend(value)
        else:
            setattr(request, field, value)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.RunProfile(request, timeout=RUN_DEADLINE_S)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in (info.value.details() or "")
    assert await redis_client.keys(f"{namespace}:profile:*") == []


async def test_an_unreachable_executor_is_unavailable(
    stub: profiler_pb2_grpc.ProfilerStub, store: Store
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.RunProfile(grid_request(f"127.0.0.1:{port}", "gone"), timeout=RUN_DEADLINE_S)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert f"127.0.0.1:{port}" in (info.value.details() or "")
    assert await store.get_profile("gone") is None


# ------------------------------------------------------------------ config


def test_config_reads_env_and_flags_with_flags_winning() -> None:
    env = {
        "LEMIX_PROFILER_HOST": "0.0.0.0",
        "LEMIX_PROFILER_PORT": "7100",
        "LEMIX_REDIS_URL": "redis://r:6380/1",
        "LEMIX_NAMESPACE": "ns1",
        "LEMIX_PROFILE": "/p.json",
        "LEMIX_PROFILER_SEED": "",
    }
    config = from_env_and_args(["--port", "7200", "--holdout-fraction", "0.3"], env)
    assert (config.host, config.port, config.redis_url, config.namespace) == (
        "0.0.0.0",
        7200,
        "redis://r:6380/1",
        "ns1",
    )
    assert config.resolved_base_profile_path == Path("/p.json")
    assert config.fit_config().holdout_fraction == 0.3 and config.seed == 0
    # The command line serves metrics on a free port; the dataclass default is off.
    assert from_env_and_args([], {}) == ProfilerConfig(metrics_port=0)
    assert from_env_and_args(["--metrics-port", "off"], {}).metrics_port == -1


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"LEMIX_PROFILER_PORT": "x"}, "LEMIX_PROFILER_PORT"),
        (["--port", "70000"], {}, "port"),
        (["--redis-url", "localhost:6379"], {}, "redis_url"),
        (["--namespace", "a b"], {}, "namespace"),
        (["--holdout-fraction", "1"], {}, "holdout_fraction"),
        (["--measure-deadline-s", "0"], {}, "measure_deadline_s"),
        (["--log-level", "loud"], {}, "log_level"),
    ],
)
def test_config_rejects_bad_values(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_env_and_args(argv, env)


# ------------------------------------------------------------------ the process


def _subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEMIX_")}
    env.update(extra)
    return env


def test_bad_setting_exits_two() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "profiler", "--holdout-fraction", "2"],
        cwd=REPO,
        env=_subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "holdout_fraction" in result.stderr


async def test_process_serves_until_sigterm_and_exits_zero(
    redis_server: EmbeddedRedis,
    namespace: str,
    store: Store,
    executor: ExecutorService,
    tmp_path: Path,
) -> None:
    base_path = tmp_path / "base.json"
    save_profile(true_profile(), base_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "profiler",
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_subprocess_env(
            LEMIX_REDIS_URL=redis_server.url,
            LEMIX_NAMESPACE=namespace,
            LEMIX_PROFILE=str(base_path),
            LEMIX_LOG_FORMAT="json",
        ),
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode()
        assert line.startswith("SERVING profiler address="), line
        address, *rest = line.split("address=", 1)[1].split()
        assert rest and rest[0].startswith("metrics=127.0.0.1:"), line  # --metrics-port 0
        async with channel(address) as ch:
            reply = await profiler_pb2_grpc.ProfilerStub(ch).RunProfile(
                grid_request(executor.address, "from-process", num_repeats=1),
                timeout=RUN_DEADLINE_S,
            )
        assert await store.get_profile("from-process") == reply.profile_json
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, stderr.decode()
    events = [json.loads(x)["event"] for x in stderr.decode().splitlines() if x.strip()]
    assert "profiler.stopped" in events
