"""`lemix profile`, run in-process (lemix.cli.main.main) against an in-process
emulated executor. `main` runs its own event loop, so it runs in a worker
thread while the executor keeps serving on the test's loop."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from known_profile import GRID, TRUE_OURS, true_profile

from lemix.cli.main import main
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.server import EmbeddedRedis
from lemix.infra.store.store import Store
from lemix.profile import load_profile, save_profile
from services.executor.service import ExecutorService


def csv(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


def grid_flags() -> list[str]:
    return [
        "--batch-sizes",
        csv(GRID.batch_sizes),
        "--tokens",
        csv(GRID.num_tokens),
        "--contexts",
        csv(GRID.sum_context_tokens),
    ]


@pytest.fixture
def base_path(tmp_path: Path) -> Path:
    path = tmp_path / "base.json"
    save_profile(true_profile(), path)
    return path


async def test_profile_writes_a_loadable_profile_and_prints_the_fit_table(
    executor: ExecutorService,
    base_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "profiles" / "measured.json"
    argv = [
        "profile",
        "--target",
        executor.address,
        "--out",
        str(out),
        "--repeats",
        "5",
        "--base-profile",
        str(base_path),
        *grid_flags(),
    ]
    assert await asyncio.to_thread(main, argv) == 0
    profile = load_profile(out)
    assert profile.name == "measured"  # the file's stem
    for stage in range(2):
        for c, n in GRID.phase_points():
            assert profile.ours.forward_s(stage, c, n) == pytest.approx(
                TRUE_OURS.forward_s(stage, c, n), rel=0.04
            )
    stdout = capsys.readouterr().out
    assert "paper R²" in stdout and "ours R²" in stdout and "decode" in stdout
    assert f"wrote {out}" in stdout and "warning" not in stdout


async def test_profile_can_also_store_the_profile_in_redis(
    executor: ExecutorService,
    base_path: Path,
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    redis_client: aioredis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "p.json"
    argv = [
        "profile",
        "--target",
        executor.address,
        "--out",
        str(out),
        "--name",
        "node-7",
        "--repeats",
        "1",
        "--base-profile",
        str(base_path),
        "--redis-url",
        redis_server.url,
        "--namespace",
        "cli-test",
        *grid_flags(),
    ]
    assert await asyncio.to_thread(main, argv) == 0
    stored = await Store(redis_client, RedisKeys("cli-test")).get_profile("node-7")
    assert stored is not None and stored == out.read_text()
    assert "stored in Redis as cli-test:profile:node-7" in capsys.readouterr().out


async def test_a_base_profile_of_another_shape_is_flagged(
    executor: ExecutorService,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The shipped A100 profile has 2 stages too, but other memory figures.
    argv = [
        "profile",
        "--target",
        executor.address,
        "--out",
        str(tmp_path / "p.json"),
        "--repeats",
        "1",
        *grid_flags(),
    ]
    assert await asyncio.to_thread(main, argv) == 0
    assert "warning: stage 0: peak memory measured" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--target", "nohost"], "host:port"),
        (["--tokens", "128"], "two lengths"),
        (["--batch-sizes", "1,x"], "--batch-sizes needs comma-separated integers"),
        (["--repeats", "0"], "num_repeats"),
        (["--name", "two words"], "whitespace"),
        (["--base-profile", "/nonexistent.json"], "cannot read profile"),
    ],
)
def test_bad_flags_exit_two_with_an_error_line(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["profile", "--target", "127.0.0.1:1", "--out", str(tmp_path / "p.json"), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_an_unreachable_executor_exits_two(
    tmp_path: Path, base_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [
        "profile",
        "--target",
        f"127.0.0.1:{port}",
        "--out",
        str(tmp_path / "p.json"),
        "--base-profile",
        str(base_path),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: executor 127.0.0.1:{port}: GetNodeState") and "connect" in err
