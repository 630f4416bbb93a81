"""`lemix up`'s gateway flags (--served-model-name, --max-model-len,
--max-in-flight), --version, defaults in --help, and a one-line start-up
failure; the last two run real `lemix up` processes (embedded Redis, services)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from gateway.config import from_env_and_args as gateway_config
from lemix import __version__
from lemix.cli.main import build_parser, main
from lemix.cli.up import stack_config
from lemix.stack.launcher import Stack, StackConfig

REDIS_URL = "redis://:pw@127.0.0.1:1/0"
UP_TIMEOUT_S = 120.0


def test_the_flags_reach_the_gateways_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "up",
            "--log-dir",
            str(tmp_path),
            "--served-model-name",
            "acme/tiny-1",
            "--max-model-len",
            "512",
            "--max-in-flight",
            "7",
        ]
    )
    config = stack_config(args)
    assert (config.served_model_name, config.max_model_len, config.max_in_flight) == (
        "acme/tiny-1",
        512,
        7,
    )
    stack = Stack(config)
    env = stack._gateway_env(stack._env(REDIS_URL), "127.0.0.1:2")
    gateway = gateway_config([], env)
    assert gateway.served_model_name == "acme/tiny-1"
    assert gateway.max_context_tokens == 512
    assert gateway.max_in_flight == 7


def test_the_defaults_are_set_explicitly_and_match_the_gateways(tmp_path: Path) -> None:
    stack = Stack(StackConfig(log_dir=tmp_path))
    env = stack._gateway_env(stack._env(REDIS_URL), "127.0.0.1:2")
    assert env["LEMIX_SERVED_MODEL_NAME"] == "lemix"
    assert env["LEMIX_MAX_CONTEXT_TOKENS"] == "0"
    assert env["LEMIX_MAX_IN_FLIGHT"] == "1024"
    defaults = gateway_config([], {})
    assert (defaults.served_model_name, defaults.max_context_tokens, defaults.max_in_flight) == (
        "lemix",
        0,
        1024,
    )


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--served-model-name", "two words", "served-model-name"),
        ("--max-model-len", "-1", "max-model-len"),
        ("--max-in-flight", "0", "max-in-flight"),
    ],
)
def test_bad_values_exit_2_with_one_line(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["up", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_help_shows_defaults_and_version_prints(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["up", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in ("(default: 50051)", "(default: lemix)", "(default: 1024)", "(default: 0)"):
        assert shown in text, shown
    assert "(default: None)" not in text
    for argv in (["--version"], ["up", "--version"]):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args(argv)
        assert exited.value.code == 0
        assert capsys.readouterr().out.strip() == f"lemix {__version__}"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEMIX_")}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def test_a_start_up_failure_is_one_line_with_the_log_path(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "lemix.cli", "up", "--nodes", "1", "--gateway-port"]
            + [str(port), "--http-port", "0", "--log-dir", str(logs)],
            capture_output=True,
            text=True,
            timeout=UP_TIMEOUT_S,
            env=_env(),
            cwd=tmp_path,
        )
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: lemix up did not start: gateway")
    assert str(logs / "gateway.log") in lines[0] and "Traceback" not in result.stderr


async def test_a_stack_serves_its_served_model_name(tmp_path: Path) -> None:
    config = StackConfig(
        num_nodes=1,
        gateway_port=0,
        time_scale=0.05,
        log_dir=tmp_path / "logs",
        namespace="up-flags",
        served_model_name="acme-tiny",
        max_model_len=300,
    )
    async with Stack(config) as stack:
        url = f"http://{stack.http_address}/v1/models"
        with urllib.request.urlopen(url, timeout=10) as response:
            models = json.loads(response.read())
    [model] = models["data"]
    assert model["id"] == "acme-tiny"
    assert model["max_model_len"] == 300


def test_ctrl_c_says_what_it_does_and_a_second_stack_on_the_same_dirs_refuses(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "logs"
    command = [sys.executable, "-m", "lemix.cli", "up", "--nodes", "1", "--gateway-port", "0"]
    command += ["--http-port", "0", "--log-dir", str(logs)]
    errors = tmp_path / "up.err"
    with errors.open("w") as stderr:
        up = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=_env(), cwd=tmp_path
        )
    try:
        assert up.stdout is not None
        ready = up.stdout.readline()
        assert ready.startswith("READY "), ready + errors.read_text()
        second = subprocess.run(
            command, capture_output=True, text=True, timeout=UP_TIMEOUT_S, env=_env(), cwd=tmp_path
        )
        assert second.returncode == 1, second.stderr
        (line,) = second.stderr.strip().splitlines()
        assert f"another `lemix up` (pid {up.pid}) is using {logs}" in line
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=UP_TIMEOUT_S) == 0, errors.read_text()
    said = errors.read_text()
    assert "lemix up: stopping: the gateway drains" in said and "lemix up: stopped in" in said
