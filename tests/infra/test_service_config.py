"""lemix.infra.config + lemix.infra.settings: the options every service shares,
declared and checked once, and deprecated aliases of renamed flags/variables."""

from __future__ import annotations

import dataclasses
import gc
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest

import gateway.config as gateway_config
import profiler.config as profiler_config
import services.executor.config as executor_config
import services.scheduler.config as scheduler_config
from lemix.infra import settings
from lemix.infra.config import (
    SHARED_OPTIONS,
    CommonServiceConfig,
    common_options,
    listener_options,
)
from lemix.infra.service_main import GC_GEN0_FACTOR, loop_factory, tune_gc
from lemix.infra.settings import Option

# module, config class, LEMIX_<SERVICE>_ prefix
SERVICES: tuple[tuple[ModuleType, type, str], ...] = (
    (gateway_config, gateway_config.GatewayConfig, "GATEWAY"),
    (scheduler_config, scheduler_config.SchedulerConfig, "SCHEDULER"),
    (executor_config, executor_config.ExecutorConfig, "EXECUTOR"),
    (profiler_config, profiler_config.ProfilerConfig, "PROFILER"),
)


def _parse(module: ModuleType, argv: list[str], env: dict[str, str]) -> Any:
    if module is executor_config:
        return executor_config.ExecutorConfig.from_env_and_args(argv, env)
    return module.from_env_and_args(argv, env)


@pytest.mark.parametrize(("module", "config_cls", "prefix"), SERVICES)
def test_every_service_reads_the_shared_options_under_one_name(
    module: ModuleType, config_cls: type, prefix: str
) -> None:
    assert issubclass(config_cls, CommonServiceConfig)
    by_field = {o.field: o for o in module._OPTIONS}
    for opt in common_options(prefix):
        assert (by_field[opt.field].flag, by_field[opt.field].env) == (opt.flag, opt.env)
    assert by_field["port"].env == f"LEMIX_{prefix}_PORT"
    env = {
        "LEMIX_REDIS_URL": "rediss://r:6380/2",
        "LEMIX_NAMESPACE": "ns",
        "LEMIX_SHUTDOWN_GRACE_S": "7.5",
        "LEMIX_LOG_LEVEL": "debug",
        "LEMIX_LOG_FORMAT": "json",
        "LEMIX_EVENT_LOOP": "uvloop",
        f"LEMIX_{prefix}_HOST": "0.0.0.0",
        f"LEMIX_{prefix}_METRICS_PORT": "off",
    }
    config = _parse(module, ["--port", "7001"], env)
    common = CommonServiceConfig(
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(CommonServiceConfig)}
    )
    assert common == CommonServiceConfig(
        host="0.0.0.0",
        port=7001,
        metrics_port=-1,
        redis_url="rediss://r:6380/2",
        namespace="ns",
        shutdown_grace_s=7.5,
        log_level="debug",
        log_format="json",
        event_loop="uvloop",
    )
    # `python -m <service>` serves metrics on a free port unless told otherwise.
    assert _parse(module, [], {}).metrics_port == 0 and config_cls().metrics_port == -1


@pytest.mark.parametrize(("module", "config_cls", "prefix"), SERVICES)
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"host": ""}, "host must be a non-empty"),
        ({"host": "a b"}, "host must be a non-empty"),
        ({"port": 70000}, r"port must be in \[0, 65535\]"),
        ({"metrics_port": -2}, "metrics_port must be in"),
        ({"redis_url": "localhost:6379"}, "redis_url must start with"),
        ({"namespace": "a b"}, "namespace"),
        ({"shutdown_grace_s": -1.0}, "shutdown_grace_s must be a finite number >= 0"),
        ({"shutdown_grace_s": float("nan")}, "shutdown_grace_s must be"),
        ({"log_level": "loud"}, "log_level must be one of debug, info"),
        ({"log_format": "xml"}, "log_format must be one of console, json"),
        ({"event_loop": "trio"}, "event_loop must be one of asyncio, uvloop"),
        ({"service_token": "short"}, "at least 16"),
    ],
)
def test_every_service_checks_the_shared_fields_alike(
    module: ModuleType, config_cls: type, prefix: str, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        config_cls(**kwargs)


def test_listener_options_name_the_service() -> None:
    assert [o.env for o in listener_options("PROFILER")] == [
        "LEMIX_PROFILER_HOST",
        "LEMIX_PROFILER_PORT",
        "LEMIX_PROFILER_METRICS_PORT",
    ]
    with pytest.raises(ValueError, match="service must be one of"):
        listener_options("NOPE")
    assert len({o.field for o in SHARED_OPTIONS}) == len(SHARED_OPTIONS)


# ------------------------------------------------------------------ deprecated aliases


def test_scheduler_reads_the_old_stop_grace_names_with_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parse = scheduler_config.from_env_and_args
    assert parse([], {"LEMIX_STOP_GRACE_S": "3"}).shutdown_grace_s == 3.0
    assert (
        "warning: LEMIX_STOP_GRACE_S is deprecated, use LEMIX_SHUTDOWN_GRACE_S"
        in capsys.readouterr().err
    )
    assert parse(["--stop-grace-s", "2"], {}).shutdown_grace_s == 2.0
    assert "--stop-grace-s is deprecated, use --shutdown-grace-s" in capsys.readouterr().err
    # The new names win over the old; the old one is still reported.
    both = {"LEMIX_SHUTDOWN_GRACE_S": "10", "LEMIX_STOP_GRACE_S": "4"}
    assert parse([], both).shutdown_grace_s == 10.0
    assert "(ignored: LEMIX_SHUTDOWN_GRACE_S is set)" in capsys.readouterr().err
    assert parse(["--shutdown-grace-s", "1", "--stop-grace-s", "9"], {}).shutdown_grace_s == 1.0
    assert parse([], {"LEMIX_SHUTDOWN_GRACE_S": "6"}).shutdown_grace_s == 6.0
    assert capsys.readouterr().err.count("deprecated") == 1  # only the --stop-grace-s call
    help_text = " ".join(scheduler_config.build_parser().format_help().split())
    assert "deprecated aliases: --stop-grace-s, LEMIX_STOP_GRACE_S" in help_text


def test_other_services_do_not_read_the_scheduler_old_name() -> None:
    env = {"LEMIX_STOP_GRACE_S": "3"}
    assert gateway_config.from_env_and_args([], env).shutdown_grace_s == 5.0
    assert profiler_config.from_env_and_args([], env).shutdown_grace_s == 5.0


@dataclass(frozen=True)
class _Toy:
    is_on: bool = False
    size: int = 1


_TOY_OPTIONS = (
    Option(
        "is_on",
        "--on",
        "TOY_ON",
        settings.boolean,
        "on",
        deprecated_flags=("--enabled",),
        deprecated_envs=("TOY_ENABLED",),
    ),
    settings.option("size", "TOY_SIZE", int, "size"),
)


def _toy(argv: list[str], env: dict[str, str], warnings: list[str]) -> _Toy:
    parser = settings.build_parser(_Toy, _TOY_OPTIONS, prog="toy", description="Toy.")
    return settings.parse_settings(_Toy, parser, _TOY_OPTIONS, argv, env, warn=warnings.append)


def test_deprecated_aliases_of_any_option_kind() -> None:
    warnings: list[str] = []
    assert _toy(["--no-enabled"], {"TOY_ON": "1"}, warnings) == _Toy(is_on=False)
    assert warnings == ["--enabled is deprecated, use --on"]
    warnings.clear()
    assert _toy(["--size", "3"], {"TOY_ENABLED": "yes"}, warnings) == _Toy(True, 3)
    assert warnings == ["TOY_ENABLED is deprecated, use TOY_ON"]
    with pytest.raises(ValueError, match="TOY_ENABLED='maybe' is not a valid boolean"):
        _toy([], {"TOY_ENABLED": "maybe"}, [])
    assert _toy([], {}, warnings := []) == _Toy() and warnings == []


def test_the_event_loop_factory_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    assert loop_factory("asyncio") is None  # asyncio's own
    fake = ModuleType("uvloop")
    fake.new_event_loop = lambda: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "uvloop", fake)
    assert loop_factory("uvloop") is fake.new_event_loop  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed: import fails
    with pytest.raises(ValueError, match="pip install uvloop"):
        loop_factory("uvloop")


def test_a_started_service_freezes_its_start_up_objects_and_collects_less_often() -> None:
    threshold = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (threshold[0] * GC_GEN0_FACTOR, *threshold[1:])
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
