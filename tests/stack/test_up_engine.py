"""`lemix up`'s engine: the LEMIX_* values the stack gives every service make
the executors run, and the scheduler's planner model, the same engine: engine
v2 by default, v1 with the v1 flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lemix.cli.main import build_parser
from lemix.cli.up import stack_config
from lemix.engine_config import default_prefill_token_budget, default_train_slice_s
from lemix.profile import load_profile
from lemix.stack.config import stack_env
from services.executor.config import ExecutorConfig
from services.scheduler.config import from_env_and_args as scheduler_config

V1_FLAGS = ("--micro-batches", "1", "--prefill-token-budget", "off", "--train-slice-s", "off")


def _engines(tmp_path: Path, *flags: str) -> tuple[Any, Any, Any]:
    """(executor EngineConfig, scheduler PlannerConfig, profile) of one `lemix up`."""
    args = build_parser().parse_args(["up", "--log-dir", str(tmp_path), *flags])
    config = stack_config(args)
    env = stack_env(config, redis_url="redis://127.0.0.1:1/0", service_token="x" * 32)
    assert config.profile_path is not None
    profile = load_profile(config.profile_path)
    executor = ExecutorConfig.from_env_and_args([], env).engine_config(profile)
    planner = scheduler_config([], env).planner_config(profile)
    return executor, planner, profile


def test_up_runs_engine_v2_by_default_and_the_planner_models_it(tmp_path: Path) -> None:
    executor, planner, profile = _engines(tmp_path)
    assert executor.num_micro_batches is None  # one per stage
    assert planner.num_micro_batches == profile.num_stages
    assert executor.prefill_token_budget == planner.prefill_token_budget
    assert planner.prefill_token_budget == default_prefill_token_budget(profile)
    assert executor.max_training_slice_s == planner.max_training_slice_s
    assert planner.max_training_slice_s == pytest.approx(default_train_slice_s(profile))
    assert executor.is_batch_cap_per_micro_batch and planner.is_batch_cap_per_micro_batch


def test_up_v1_flags_give_both_services_the_v1_engine(tmp_path: Path) -> None:
    executor, planner, _ = _engines(tmp_path, *V1_FLAGS)
    assert executor.num_micro_batches == planner.num_micro_batches == 1
    assert executor.prefill_token_budget is planner.prefill_token_budget is None
    assert executor.max_training_slice_s is planner.max_training_slice_s is None
    assert planner.max_running_per_node == planner.max_batch_size
