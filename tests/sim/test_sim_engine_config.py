"""The engine v2 knobs (issue 9) from `SimRunConfig` and the `lemix sim` /
`lemix compare` flags down to every node's `EngineConfig`."""

from __future__ import annotations

from dataclasses import fields

import pytest
from factories import make_profile

from lemix.cli.engine_args import V1_ENGINE_FLAGS
from lemix.cli.main import build_parser, configs_from_args
from lemix.engine_config import (
    AUTO_DECODE_PACE_TBT_FRACTION,
    AUTO_TRAIN_SLICE_TBT_FRACTION,
    EngineConfig,
    default_prefill_token_budget,
)
from lemix.profile import default_profile_path, load_profile
from lemix.sim.run import V1_ENGINE, SimRunConfig, build_simulator
from lemix.slo import Slo
from lemix.workload import LONG_PROMPT_MAX_TOTAL_TOKENS, WorkloadConfig, build_workload

SLO = Slo(ttft_s=2.0, tbt_s=0.06)
KNOBS = (
    "num_micro_batches",
    "prefill_token_budget",
    "max_training_slice_s",
    "is_batch_cap_per_micro_batch",
    "is_decode_gathered",
    "decode_pace_s",
    "training_order",
    "spare_training_in_flight",
)


def _engine_configs(config: SimRunConfig) -> list[EngineConfig]:
    tasks = build_workload(WorkloadConfig(request_rate=2.0, duration_s=5.0, seed=1)).tasks
    sim = build_simulator(config, make_profile(), tasks, SLO)
    return [engine.config for engine in sim.engines]


def _setup(*argv: str) -> SimRunConfig:
    args = build_parser().parse_args(list(argv))
    return configs_from_args(args).run


SIM = ("sim", "--policy", "mix-rr", "--poisson", "2")


def test_default_run_config_is_engine_v2() -> None:
    expected = {
        "num_micro_batches": None,  # one per stage
        "prefill_token_budget": default_prefill_token_budget(make_profile()),
        "max_training_slice_s": pytest.approx(0.25 * SLO.tbt_s),
        "is_batch_cap_per_micro_batch": True,
        "is_decode_gathered": True,
        "decode_pace_s": pytest.approx(0.7 * SLO.tbt_s),
        "training_order": "forward-first",
        "spare_training_in_flight": 1,
    }
    configs = _engine_configs(SimRunConfig(num_nodes=2))
    assert len(configs) == 2
    for config in configs:
        assert {k: getattr(config, k) for k in KNOBS} == expected


def test_v1_engine_knobs_are_the_plain_engine() -> None:
    v1 = EngineConfig()
    for config in _engine_configs(SimRunConfig(num_nodes=2, **V1_ENGINE)):
        assert {k: getattr(config, k) for k in KNOBS} == {k: getattr(v1, k) for k in KNOBS}
        assert config.batching == v1.batching and config.stage_order == v1.stage_order


def test_knobs_reach_every_node() -> None:
    run = SimRunConfig(
        num_nodes=3, num_micro_batches=None, prefill_token_budget=512, train_slice_s=0.02
    )
    configs = _engine_configs(run)
    assert len(configs) == 3
    for config in configs:
        assert config.num_micro_batches is None  # one per stage
        assert config.prefill_token_budget == 512
        assert config.max_training_slice_s == 0.02


def test_the_other_fields_still_pass_through() -> None:
    run = SimRunConfig(policy="lemix-nomem", stage_order="fifo", max_training_in_flight=3)
    config = _engine_configs(run)[0]
    assert config.stage_order == "fifo" and config.max_training_in_flight == 3
    assert not config.memory.is_offload_enabled  # not memory-aware: wait-then-drop


def test_train_slice_from_the_runs_tbt_slo() -> None:
    run = SimRunConfig(train_slice_tbt_fraction=0.25)
    assert run.engine_config(SLO, make_profile()).max_training_slice_s == pytest.approx(0.015)
    assert _engine_configs(run)[0].max_training_slice_s == pytest.approx(0.015)


def test_train_slice_seconds_win_over_the_default_fraction() -> None:
    run = SimRunConfig(train_slice_s=0.01)
    assert run.train_slice_tbt_fraction == AUTO_TRAIN_SLICE_TBT_FRACTION  # the default, not used
    assert run.engine_config(SLO, make_profile()).max_training_slice_s == 0.01


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_micro_batches": 0},
        {"prefill_token_budget": 0},
        {"train_slice_s": 0.0},
        {"train_slice_s": -1.0},
        {"train_slice_tbt_fraction": 0.0},
        {"train_slice_tbt_fraction": 1.5},
        {"decode_pace_tbt_fraction": 0.0},
        {"decode_pace_tbt_fraction": 1.5},
        {"training_order": "sideways"},
        {"spare_training_in_flight": -1},
        {"prefill_token_budget": "lots"},
    ],
)
def test_bad_knobs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SimRunConfig(**kwargs)  # type: ignore[arg-type]


def test_cli_defaults_are_engine_v2() -> None:
    run = _setup(*SIM)
    assert (run.num_micro_batches, run.prefill_token_budget) == (None, "auto")
    assert (run.train_slice_s, run.train_slice_tbt_fraction) == (
        None,
        AUTO_TRAIN_SLICE_TBT_FRACTION,
    )
    assert (run.decode_pace_s, run.decode_pace_tbt_fraction) == (
        None,
        AUTO_DECODE_PACE_TBT_FRACTION,
    )
    assert run.is_batch_cap_per_micro_batch and run.is_decode_gathered
    assert run.training_order == "forward-first" and run.spare_training_in_flight == 1


def test_cli_v1_flags_select_the_v1_engine() -> None:
    run = _setup(*SIM, *V1_ENGINE_FLAGS)
    assert (run.num_micro_batches, run.prefill_token_budget) == (1, None)
    assert (run.train_slice_s, run.train_slice_tbt_fraction) == (None, None)
    assert (run.decode_pace_s, run.decode_pace_tbt_fraction) == (None, None)
    assert run.training_order == "backward-first" and not run.is_decode_gathered
    assert run.spare_training_in_flight == 0
    # The cap stays per micro-batch, which with one micro-batch is the node's C.
    sim = build_simulator(run, make_profile(), [], SLO)
    assert sim.planner.config.max_running_per_node == run.batching.max_batch_size


def test_cli_flags() -> None:
    run = _setup(
        *SIM, "--micro-batches", "auto", "--prefill-budget", "256", "--train-slice-s", "0.01"
    )
    assert (run.num_micro_batches, run.prefill_token_budget, run.train_slice_s) == (None, 256, 0.01)
    assert run.train_slice_tbt_fraction is None  # seconds given: no fraction
    run = _setup(*SIM, "--micro-batches", "3", "--prefill-budget", "off", "--train-slice-s", "auto")
    assert (run.num_micro_batches, run.prefill_token_budget) == (3, None)
    assert run.train_slice_s is None
    assert run.train_slice_tbt_fraction == AUTO_TRAIN_SLICE_TBT_FRACTION
    run = _setup(*SIM, "--micro-batches", "auto", "--batch-cap", "node")
    assert not run.is_batch_cap_per_micro_batch
    run = _setup(*SIM, "--decode-pace-s", "0.03", "--training-order", "backward-first")
    assert (run.decode_pace_s, run.decode_pace_tbt_fraction) == (0.03, None)
    assert run.engine_config(SLO, make_profile()).decode_pace_s == 0.03
    assert run.training_order == "backward-first"
    assert _setup(*SIM, "--spare-training", "2").spare_training_in_flight == 2
    with pytest.raises(SystemExit):
        _setup(*SIM, "--spare-training", "-1")
    run = _setup(*SIM, "--decode-pace-s", "off")
    assert run.engine_config(SLO, make_profile()).decode_pace_s is None
    for bad in (("--decode-pace-s", "0"), ("--decode-pace-s", "soon")):
        with pytest.raises(ValueError, match="--decode-pace-s"):
            _setup(*SIM, *bad)


def test_the_planner_models_the_engine_the_nodes_run() -> None:
    run = SimRunConfig(
        num_nodes=2,
        num_micro_batches=None,
        prefill_token_budget=256,
        train_slice_s=0.02,
        is_batch_cap_per_micro_batch=True,
    )
    tasks = build_workload(WorkloadConfig(request_rate=2.0, duration_s=5.0, seed=1)).tasks
    sim = build_simulator(run, make_profile(), tasks, SLO)
    planner = sim.planner.config
    engine = sim.engines[0].config
    assert planner.num_micro_batches == make_profile().num_stages  # auto, resolved
    assert planner.prefill_token_budget == engine.prefill_token_budget == 256
    assert planner.max_training_slice_s == engine.max_training_slice_s == 0.02
    assert planner.decode_pace_s == engine.decode_pace_s == pytest.approx(0.7 * SLO.tbt_s)
    assert planner.max_running_per_node == 2 * engine.batching.max_batch_size


def test_compare_template_carries_the_knobs() -> None:
    argv = ("compare", "--rates", "2", "--out", "unused", "--micro-batches", "2")
    run = _setup(*argv, "--prefill-budget", "128", "--train-slice-s", "auto")
    assert (run.num_micro_batches, run.prefill_token_budget) == (2, 128)
    assert run.train_slice_tbt_fraction == AUTO_TRAIN_SLICE_TBT_FRACTION


def test_prefill_budget_auto_is_the_engines_profile_default() -> None:
    profile = load_profile(default_profile_path())
    run = _setup(*SIM, "--prefill-budget", "auto")
    assert run.prefill_token_budget == "auto"  # resolved with the run's profile
    resolved = run.engine_config(SLO, profile).prefill_token_budget
    assert resolved == default_prefill_token_budget(profile) == 512
    four = _setup(*SIM, "--stages", "4", "--prefill-budget", "auto")
    four_stage = load_profile(default_profile_path().with_name("a100-llama2-7b-4stage.json"))
    resolved = four.engine_config(SLO, four_stage).prefill_token_budget
    assert resolved == default_prefill_token_budget(four_stage)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--micro-batches", "0"),
        ("--micro-batches", "two"),
        ("--prefill-budget", "0"),
        ("--prefill-budget", "lots"),
        ("--train-slice-s", "0"),
        ("--train-slice-s", "nan"),
        ("--train-slice-s", "soon"),
    ],
)
def test_bad_flag_values_name_the_flag(flag: str, value: str) -> None:
    with pytest.raises(ValueError, match=flag):
        _setup(*SIM, flag, value)


def test_workload_flag_long_prompt() -> None:
    args = build_parser().parse_args([*SIM, "--workload", "long-prompt", "--duration", "30"])
    workload = configs_from_args(args).workload
    assert workload.source == "long-prompt" and workload.request_rate == 2.0
    assert workload.duration_s == 30.0
    assert workload.max_total_tokens == LONG_PROMPT_MAX_TOTAL_TOKENS  # nothing clipped
    args = build_parser().parse_args([*SIM, "--workload", "long-prompt", "--trace", "x.csv"])
    with pytest.raises(ValueError, match="long-prompt"):
        configs_from_args(args)


def test_run_config_has_the_three_knobs() -> None:
    names = {f.name for f in fields(SimRunConfig)}
    assert {"num_micro_batches", "prefill_token_budget", "train_slice_s"} <= names
