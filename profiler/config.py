"""The profiler's typed config, and the ONE place env vars and flags map onto it.

Precedence: command-line flag, then ``LEMIX_*`` environment variable, then the
default. Nothing is read at import time: `from_env_and_args` reads `argv` and
the environment when called (tests pass both in).

=====================  =========================  ===================================
field                  flag                       environment variable
=====================  =========================  ===================================
host                   ``--host``                 ``LEMIX_PROFILER_HOST``
port                   ``--port``                 ``LEMIX_PROFILER_PORT``
metrics_port           ``--metrics-port``         ``LEMIX_PROFILER_METRICS_PORT``
redis_url              ``--redis-url``            ``LEMIX_REDIS_URL``
namespace              ``--namespace``            ``LEMIX_NAMESPACE``
base_profile_path      ``--base-profile``         ``LEMIX_PROFILE``
measure_deadline_s     ``--measure-deadline-s``   ``LEMIX_PROFILER_MEASURE_DEADLINE_S``
holdout_fraction       ``--holdout-fraction``     ``LEMIX_PROFILER_HOLDOUT_FRACTION``
seed                   ``--seed``                 ``LEMIX_PROFILER_SEED``
shutdown_grace_s       ``--shutdown-grace-s``     ``LEMIX_SHUTDOWN_GRACE_S``
log_level              ``--log-level``            ``LEMIX_LOG_LEVEL``
log_format             ``--log-format``           ``LEMIX_LOG_FORMAT``
service_token          ``--service-token``        ``LEMIX_SERVICE_TOKEN``
=====================  =========================  ===================================
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lemix.infra import settings
from lemix.infra.rpc.auth import SERVICE_TOKEN_OPTION, check_service_token
from lemix.infra.settings import Option, port_or_off
from lemix.infra.store.keys import DEFAULT_NAMESPACE, RedisKeys
from lemix.profile import default_profile_path
from profiler.fit import FitConfig
from profiler.runner import DEFAULT_MEASURE_DEADLINE_S

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("console", "json")
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True)
class ProfilerConfig:
    """Everything the profiler process needs; validated on construction (ValueError)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port (the bound one is printed at start)
    metrics_port: int = -1  # Prometheus /metrics: 0 = any free port, -1 = off
    redis_url: str = DEFAULT_REDIS_URL
    namespace: str = DEFAULT_NAMESPACE  # Redis key prefix shared with the other services
    # Memory, transfer and optimizer figures of every fitted profile come from
    # here (RunProfileRequest has no field for them): the profile the executors
    # run. "" = lemix.profile.default_profile_path(), the executors' default too.
    base_profile_path: str = ""
    measure_deadline_s: float = DEFAULT_MEASURE_DEADLINE_S  # one executor Measure call
    holdout_fraction: float = FitConfig().holdout_fraction
    seed: int = FitConfig().seed  # seeds the held-out split
    shutdown_grace_s: float = 5.0  # in-flight RunProfile calls get this long on stop
    log_level: str = "info"
    log_format: str = "console"
    # Required on RunProfile, sent to executors (lemix.infra.rpc.auth); "" = none.
    service_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not self.host or any(ch.isspace() for ch in self.host):
            raise ValueError(f"host must be a non-empty host name or address, got {self.host!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (0 = any free port), got {self.port}")
        settings.check_port_or_off("metrics_port", self.metrics_port)
        if not self.redis_url.startswith(_REDIS_SCHEMES):
            raise ValueError(
                f"redis_url must start with one of {', '.join(_REDIS_SCHEMES)}, "
                f"got {self.redis_url!r}"
            )
        RedisKeys(self.namespace)  # raises ValueError naming the problem
        if not (math.isfinite(self.measure_deadline_s) and self.measure_deadline_s > 0):
            raise ValueError(
                f"measure_deadline_s must be a finite number > 0, got {self.measure_deadline_s}"
            )
        if not (math.isfinite(self.shutdown_grace_s) and self.shutdown_grace_s >= 0):
            raise ValueError(
                f"shutdown_grace_s must be a finite number >= 0, got {self.shutdown_grace_s}"
            )
        self.fit_config()  # checks holdout_fraction
        check_service_token(self.service_token)
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.log_format not in LOG_FORMATS:
            raise ValueError(
                f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}"
            )

    def fit_config(self) -> FitConfig:
        return FitConfig(holdout_fraction=self.holdout_fraction, seed=self.seed)

    @property
    def resolved_base_profile_path(self) -> Path:
        return Path(self.base_profile_path) if self.base_profile_path else default_profile_path()


# ------------------------------------------------------------------ mapping


_OPTIONS: tuple[Option, ...] = (
    Option("host", "--host", "LEMIX_PROFILER_HOST", str, "address to bind"),
    Option("port", "--port", "LEMIX_PROFILER_PORT", int, "port to bind (0 = any free port)"),
    Option(
        "metrics_port",
        "--metrics-port",
        "LEMIX_PROFILER_METRICS_PORT",
        port_or_off,
        "Prometheus /metrics port (0 = any free port, -1 = off)",
    ),
    Option("redis_url", "--redis-url", "LEMIX_REDIS_URL", str, "Redis where profiles are stored"),
    Option(
        "namespace",
        "--namespace",
        "LEMIX_NAMESPACE",
        str,
        "Redis key prefix shared by the stack's services",
    ),
    Option(
        "base_profile_path",
        "--base-profile",
        "LEMIX_PROFILE",
        str,
        "profile JSON whose memory/transfer/optimizer figures fitted profiles keep "
        "(default: the shipped A100 one)",
    ),
    Option(
        "measure_deadline_s",
        "--measure-deadline-s",
        "LEMIX_PROFILER_MEASURE_DEADLINE_S",
        float,
        "deadline of one executor Measure call, seconds",
    ),
    Option(
        "holdout_fraction",
        "--holdout-fraction",
        "LEMIX_PROFILER_HOLDOUT_FRACTION",
        float,
        "share of grid points held out to score the fits",
    ),
    Option("seed", "--seed", "LEMIX_PROFILER_SEED", int, "seed of the held-out split"),
    Option(
        "shutdown_grace_s",
        "--shutdown-grace-s",
        "LEMIX_SHUTDOWN_GRACE_S",
        float,
        "on stop, in-flight RunProfile calls get this long, seconds",
    ),
    Option("log_level", "--log-level", "LEMIX_LOG_LEVEL", str, "/".join(LOG_LEVELS)),
    Option("log_format", "--log-format", "LEMIX_LOG_FORMAT", str, "/".join(LOG_FORMATS)),
    SERVICE_TOKEN_OPTION,
)

# `python -m profiler` serves metrics unless told not to.
_CLI_DEFAULTS: dict[str, Any] = {"metrics_port": 0}


def build_parser(prog: str = "python -m profiler") -> argparse.ArgumentParser:
    """The profiler's flags; every default is None so env and defaults can apply."""
    return settings.build_parser(
        ProfilerConfig,
        _OPTIONS,
        prog=prog,
        cli_defaults=_CLI_DEFAULTS,
        description="LeMix profiler: measures executors over a (C, l) grid and fits the "
        "latency models.",
    )


def from_env_and_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> ProfilerConfig:
    """Build the config from `argv` and `env` (see lemix.infra.settings)."""
    return settings.parse_settings(
        ProfilerConfig, build_parser(), _OPTIONS, argv, env, _CLI_DEFAULTS
    )
