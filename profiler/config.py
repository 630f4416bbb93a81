"""The profiler's typed config, and the ONE place env vars and flags map onto it.

Precedence: command-line flag, then ``LEMIX_*`` environment variable, then the
default (lemix.infra.settings is the mechanism). Nothing is read at import time:
`from_env_and_args` reads `argv` and the environment when called (tests pass
both in). The fields every service shares (host, ports, Redis, logging, the
service token, the drain grace) come from `lemix.infra.config`;
`scripts/config_table.py` prints the docs/configuration.md table from `_OPTIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lemix.infra import settings
from lemix.infra.config import COMMON_CLI_DEFAULTS, PROFILER, CommonServiceConfig, common_options
from lemix.infra.settings import Option, check_finite
from lemix.profile import default_profile_path
from profiler.fit import FitConfig
from profiler.runner import DEFAULT_MEASURE_DEADLINE_S


@dataclass(frozen=True)
class ProfilerConfig(CommonServiceConfig):
    """Everything the profiler process needs; validated on construction (ValueError).

    `service_token` (from CommonServiceConfig) is required on RunProfile and
    sent to executors; `shutdown_grace_s` is what in-flight RunProfile calls get.
    """

    # Memory, transfer and optimizer figures of every fitted profile come from
    # here (RunProfileRequest has no field for them): the profile the executors
    # run. "" = lemix.profile.default_profile_path(), the executors' default too.
    base_profile_path: str = ""
    measure_deadline_s: float = DEFAULT_MEASURE_DEADLINE_S  # one executor Measure call
    holdout_fraction: float = FitConfig().holdout_fraction
    seed: int = FitConfig().seed  # seeds the held-out split

    def __post_init__(self) -> None:
        super().__post_init__()
        check_finite("measure_deadline_s", self.measure_deadline_s, allow_zero=False)
        self.fit_config()  # checks holdout_fraction

    def fit_config(self) -> FitConfig:
        return FitConfig(holdout_fraction=self.holdout_fraction, seed=self.seed)

    @property
    def resolved_base_profile_path(self) -> Path:
        return Path(self.base_profile_path) if self.base_profile_path else default_profile_path()


# ------------------------------------------------------------------ mapping


_OPTIONS: tuple[Option, ...] = (
    *common_options(PROFILER),
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
)

# `python -m profiler` serves metrics unless told not to.
_CLI_DEFAULTS: dict[str, Any] = dict(COMMON_CLI_DEFAULTS)


SPEC = settings.ConfigSpec(
    ProfilerConfig,
    _OPTIONS,
    prog="python -m profiler",
    description="LeMix profiler: measures executors over a (C, l) grid and fits the "
    "latency models.",
    cli_defaults=_CLI_DEFAULTS,
)
build_parser = SPEC.build_parser
from_env_and_args = SPEC.parse
