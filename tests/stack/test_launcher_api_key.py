"""`lemix up --api-key`: the key reaches the gateway's environment and no other
child's; LEMIX_API_KEY given to `lemix up` itself is handled the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from lemix.cli.main import build_parser
from lemix.cli.up import stack_config
from lemix.stack.launcher import Stack, StackConfig

KEY = "sk-stack-test-key"
REDIS_URL = "redis://:pw@127.0.0.1:1/0"


def test_only_the_gateway_gets_the_api_key(tmp_path: Path) -> None:
    stack = Stack(StackConfig(log_dir=tmp_path, api_key=KEY))
    env = stack._env(REDIS_URL)
    assert "LEMIX_API_KEY" not in env  # executors, profiler, scheduler
    assert stack._gateway_env(env, "127.0.0.1:2")["LEMIX_API_KEY"] == KEY
    assert stack.is_api_key_required
    assert KEY not in repr(stack.config)


def test_an_inherited_variable_goes_to_the_gateway_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LEMIX_API_KEY", KEY)
    stack = Stack(StackConfig(log_dir=tmp_path))
    env = stack._env(REDIS_URL)
    assert "LEMIX_API_KEY" not in env
    assert stack._gateway_env(env, "127.0.0.1:2")["LEMIX_API_KEY"] == KEY
    monkeypatch.delenv("LEMIX_API_KEY")
    open_stack = Stack(StackConfig(log_dir=tmp_path))
    assert "LEMIX_API_KEY" not in open_stack._gateway_env(open_stack._env(REDIS_URL), "h:2")
    assert not open_stack.is_api_key_required


def test_lemix_up_api_key_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LEMIX_API_KEY", raising=False)
    args = build_parser().parse_args(["up", "--api-key", KEY, "--log-dir", str(tmp_path / "l")])
    assert stack_config(args).api_key == KEY
    assert KEY not in build_parser().format_help()
    with pytest.raises(ValueError, match="printable ASCII"):
        StackConfig(api_key="two words")
