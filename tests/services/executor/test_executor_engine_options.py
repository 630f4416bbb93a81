"""The executor's engine v2 options (issue 9): flags and LEMIX_* variables into
the node's EngineConfig; the torch backend takes every one of them."""

from __future__ import annotations

import pytest
from factories import make_profile

from lemix.engine_config import (
    EngineConfig,
    default_prefill_token_budget,
    default_train_slice_s,
)
from lemix.infra.engine_options import V1_ENGINE_KNOBS
from services.executor.config import ExecutorConfig
from services.scheduler import config as scheduler_config
from services.scheduler.config import SchedulerConfig


def _config(argv: list[str] | None = None, **env: str) -> ExecutorConfig:
    return ExecutorConfig.from_env_and_args(argv or [], env=env)


def test_defaults_are_engine_v2() -> None:
    profile = make_profile()
    engine = _config().engine_config(profile)
    assert engine.num_micro_batches is None  # one per stage
    assert engine.prefill_token_budget == default_prefill_token_budget(profile)
    assert engine.max_training_slice_s == default_train_slice_s(profile) > 0
    assert engine.is_batch_cap_per_micro_batch
    assert engine.emit_tokens


def test_default_engine_is_the_one_the_scheduler_plans_for() -> None:
    profile = make_profile()
    engine = _config().engine_config(profile)
    planner = SchedulerConfig().planner_config(profile)
    assert planner.num_micro_batches == profile.num_stages
    assert planner.prefill_token_budget == engine.prefill_token_budget
    assert planner.max_training_slice_s == engine.max_training_slice_s
    assert planner.is_batch_cap_per_micro_batch == engine.is_batch_cap_per_micro_batch


def test_v1_flags_select_the_v1_engine() -> None:
    argv = ["--micro-batches", "1", "--prefill-token-budget", "off", "--train-slice-s", "off"]
    engine = _config(argv).engine_config(make_profile())
    v1 = EngineConfig()
    assert engine.num_micro_batches == v1.num_micro_batches == 1
    assert engine.prefill_token_budget is v1.prefill_token_budget is None
    assert engine.max_training_slice_s is v1.max_training_slice_s is None
    plain = V1_ENGINE_KNOBS.resolve(make_profile())
    assert plain["max_training_slice_s"] is None and plain["num_micro_batches"] == 1
    assert plain["decode_pace_s"] is None and plain["training_order"] == "backward-first"
    assert EngineConfig(**plain) == EngineConfig()  # every knob of v1 is the plain engine's


def test_environment_variables() -> None:
    config = _config(
        LEMIX_NUM_MICRO_BATCHES="2", LEMIX_PREFILL_TOKEN_BUDGET="512", LEMIX_TRAIN_SLICE_S="0.02"
    )
    engine = config.engine_config(make_profile())
    assert (engine.num_micro_batches, engine.prefill_token_budget) == (2, 512)
    assert engine.max_training_slice_s == 0.02


def test_flags_beat_variables_and_auto_off_words() -> None:
    config = _config(
        ["--micro-batches", "auto", "--prefill-token-budget", "off", "--train-slice-s", "off"],
        LEMIX_NUM_MICRO_BATCHES="3",
        LEMIX_PREFILL_TOKEN_BUDGET="64",
        LEMIX_TRAIN_SLICE_S="0.5",
    )
    assert (config.num_micro_batches, config.prefill_token_budget) == (0, 0)
    assert config.train_slice_s == 0.0
    engine = config.engine_config(make_profile())
    assert engine.num_micro_batches is None  # one per stage
    assert engine.prefill_token_budget is None and engine.max_training_slice_s is None


def test_batch_cap_variable_and_flag() -> None:
    assert _config().engine_config(make_profile()).is_batch_cap_per_micro_batch
    config = _config(LEMIX_BATCH_CAP="node", LEMIX_NUM_MICRO_BATCHES="auto")
    assert not config.engine_config(make_profile()).is_batch_cap_per_micro_batch
    assert _config(["--batch-cap", "node"], LEMIX_BATCH_CAP="micro-batch").batch_cap == "node"
    with pytest.raises(ValueError, match="LEMIX_BATCH_CAP"):
        _config(LEMIX_BATCH_CAP="each")


def test_prefill_budget_auto_is_the_engines_profile_default() -> None:
    config = _config(LEMIX_PREFILL_TOKEN_BUDGET="auto")
    assert config.prefill_token_budget == -1  # resolved once the profile is known
    profile = make_profile()
    budget = config.engine_config(profile).prefill_token_budget
    assert budget == default_prefill_token_budget(profile)


@pytest.mark.parametrize(
    ("env", "value", "match"),
    [
        ("LEMIX_NUM_MICRO_BATCHES", "-1", "num_micro_batches"),
        ("LEMIX_NUM_MICRO_BATCHES", "many", "LEMIX_NUM_MICRO_BATCHES"),
        ("LEMIX_PREFILL_TOKEN_BUDGET", "-2", "prefill_token_budget"),
        ("LEMIX_PREFILL_TOKEN_BUDGET", "big", "LEMIX_PREFILL_TOKEN_BUDGET"),
        ("LEMIX_TRAIN_SLICE_S", "-0.1", "train_slice_s"),
        ("LEMIX_TRAIN_SLICE_S", "-2", "train_slice_s"),
        ("LEMIX_TRAIN_SLICE_S", "inf", "train_slice_s"),
        ("LEMIX_TRAIN_SLICE_S", "soon", "LEMIX_TRAIN_SLICE_S"),
    ],
)
def test_bad_values_name_the_option(env: str, value: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(**{env: value})


@pytest.mark.parametrize(
    ("micro_batches", "budget", "want"),
    [("1", "off", (1, None)), ("2", "256", (2, 256)), ("auto", "auto", (None, "auto"))],
)
def test_torch_backend_runs_micro_batches_and_chunked_prefill(
    micro_batches: str, budget: str, want: tuple[int | None, int | str | None]
) -> None:
    config = _config(
        LEMIX_EXECUTOR_BACKEND="torch",
        LEMIX_NUM_MICRO_BATCHES=micro_batches,
        LEMIX_PREFILL_TOKEN_BUDGET=budget,
        LEMIX_TRAIN_SLICE_S="off",
    )
    profile = make_profile()
    engine = config.engine_config(profile)
    want_budget = default_prefill_token_budget(profile) if want[1] == "auto" else want[1]
    assert config.backend == "torch"
    assert (engine.num_micro_batches, engine.prefill_token_budget) == (want[0], want_budget)


@pytest.mark.parametrize(
    ("env", "value", "match"),
    [
        ("LEMIX_NUM_MICRO_BATCHES", "-1", "num_micro_batches"),
        ("LEMIX_PREFILL_TOKEN_BUDGET", "-2", "prefill_token_budget"),
        ("LEMIX_PREFILL_TOKEN_BUDGET", "big", "LEMIX_PREFILL_TOKEN_BUDGET"),
    ],
)
def test_torch_backend_still_refuses_bad_values(env: str, value: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ExecutorConfig.from_env_and_args([], env={"LEMIX_EXECUTOR_BACKEND": "torch", env: value})


def test_train_slice_and_pace_auto_are_fractions_of_the_profiles_default_tbt_slo() -> None:
    profile = make_profile()
    config = _config(LEMIX_TRAIN_SLICE_S="off")
    assert config.engine_config(profile).max_training_slice_s is None
    config = _config(["--train-slice-s", "auto"], LEMIX_TRAIN_SLICE_S="off")
    assert config.train_slice_s == -1.0  # resolved once the profile is known
    tbt_s = SchedulerConfig().slo(profile).tbt_s  # no LEMIX_SLO_*: derived from the profile
    assert config.engine_config(profile).max_training_slice_s == pytest.approx(0.25 * tbt_s)
    assert config.engine_config(profile).decode_pace_s == pytest.approx(0.7 * tbt_s)
    config = _config(["--decode-pace-s", "off"], LEMIX_DECODE_PACE_S="0.02")
    assert config.engine_config(profile).decode_pace_s is None
    assert _config().engine_config(profile).spare_training_in_flight == 1
    config = _config(
        LEMIX_DECODE_PACE_S="0.02", LEMIX_TRAINING_ORDER="backward-first", LEMIX_SPARE_TRAINING="0"
    )
    engine = config.engine_config(profile)
    assert (engine.decode_pace_s, engine.training_order) == (0.02, "backward-first")
    assert engine.spare_training_in_flight == 0
    # The scheduler's planner models the same pace (and has no use for the order).
    scheduler = scheduler_config.from_env_and_args([], env={"LEMIX_DECODE_PACE_S": "0.02"})
    assert scheduler.planner_config(profile).decode_pace_s == 0.02


def test_torch_backend_runs_training_in_slices() -> None:
    config = _config(LEMIX_EXECUTOR_BACKEND="torch", LEMIX_TRAIN_SLICE_S="0.01")
    assert config.engine_config(make_profile()).max_training_slice_s == 0.01


def test_a_zero_latency_profile_has_nothing_to_slice() -> None:
    # Its derived TBT SLO is 0 s: auto slices are off, not a 0 s slice.
    profile = make_profile(forward_s_per_token=0.0, backward_s_per_token=0.0, decode_d0_s=0.0)
    assert default_train_slice_s(profile) == 0.0
    assert _config().engine_config(profile).max_training_slice_s is None
    scheduler = SchedulerConfig(slo_ttft_s=1.0, slo_tbt_s=1.0)  # a derived SLO would be 0
    assert scheduler.planner_config(profile).max_training_slice_s is None
