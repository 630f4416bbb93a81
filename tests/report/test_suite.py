"""`lemix report` end to end on a tiny configuration, and its CLI wiring."""

from __future__ import annotations

from pathlib import Path

import pytest

from lemix.cli.engine_args import V1_ENGINE_FLAGS
from lemix.cli.main import build_parser
from lemix.cli.report import report_config, resolve_trace
from lemix.profile import default_profile_path, load_profile
from lemix.report.suite import (
    PARETO_POLICIES,
    ReportConfig,
    full_config,
    long_prompt_workload,
    quick_config,
    run_report,
)
from lemix.report.suite_write import pareto_commands
from lemix.sim.run import engine_name


def tiny_config() -> ReportConfig:
    return ReportConfig(
        workloads=(long_prompt_workload(10.0, (2.0,)),),
        seeds=(0, 1),
        train_rates=(0.3,),
        headroom_values=(0.5,),
        headroom_train_rates=(0.3,),
        ablation_train_rates=(0.3,),
        num_workers=1,
    )


def test_tiny_report_writes_index_and_plots(tmp_path: Path) -> None:
    lines: list[str] = []
    result = run_report(
        tiny_config(),
        load_profile(default_profile_path()),
        tmp_path,
        command="lemix report --tiny",
        date="2026-01-01 00:00 UTC",
        notes=["trace section skipped: test"],
        progress=lines.append,
    )
    text = result.index_path.read_text()
    assert result.index_path == tmp_path / "index.md"
    assert "2026-01-01 00:00 UTC" in text and "lemix report --tiny" in text
    assert "trace section skipped: test" in text
    for section in ("## Verdicts", "## Pareto frontiers", "## Throughput", "## Ablations"):
        assert section in text
    # One verdict per other policy, each one of the three outcomes.
    (cell,) = result.cells
    assert [v.policy for v in cell.verdicts] == [p for p in PARETO_POLICIES if p != "lemix"]
    assert all(v.outcome in ("wins", "ties", "loses") for v in cell.verdicts)
    # The admission policies have a point per threshold, the others one.
    headrooms = {(p.policy, p.slo_headroom) for p in cell.points}
    assert ("lemix", 0.5) in headrooms and ("mix-rr", 0.5) not in headrooms
    assert "python -m lemix.cli compare" in text and "--slo-headroom 0.5" in text
    pngs = [p for p in result.png_paths if p.suffix == ".png"]
    assert (tmp_path / "long-prompt" / "pareto_2rps.png") in pngs
    assert all(p.stat().st_size > 0 for p in pngs)
    assert lines and lines[-1].startswith("ablations")
    # Re-rendered from the runs it wrote: the same verdicts, nothing simulated.
    again = run_report(
        tiny_config(),
        load_profile(default_profile_path()),
        tmp_path,
        command="lemix report --from-runs",
        date="2026-01-02 00:00 UTC",
        runs_from=tmp_path,
    )
    assert [v.outcome for v in again.cells[0].verdicts] == [v.outcome for v in cell.verdicts]
    assert "lemix report --from-runs" in again.index_path.read_text()


def test_presets_cover_every_section() -> None:
    trace = "t.csv"
    for preset in (full_config, quick_config):
        config = preset(trace)
        assert [w.slug for w in config.workloads] == ["conversation", "long-prompt", "trace"]
        assert all(len(w.rates) == 3 for w in config.workloads)
        assert len(config.seeds) >= 2 and config.headroom_values
    assert [w.slug for w in quick_config(None).workloads] == ["conversation", "long-prompt"]
    with pytest.raises(ValueError, match="2 seeds"):
        ReportConfig(**{**tiny_config().__dict__, "seeds": (0,)})


def test_trace_is_skipped_with_a_note(tmp_path: Path) -> None:
    args = build_parser().parse_args(["report", "--no-trace"])
    assert resolve_trace(args) == (None, "trace section skipped: --no-trace")
    args = build_parser().parse_args(["report", "--trace", str(tmp_path / "missing.csv")])
    with pytest.raises(ValueError, match="no such file"):
        resolve_trace(args)


def test_slo_headroom_flag_reaches_the_run_config() -> None:
    from lemix.cli.main import configs_from_args

    sim = ["sim", "--policy", "lemix", "--poisson", "2", "--slo-headroom", "0.5"]
    assert configs_from_args(build_parser().parse_args(sim)).run.slo_headroom == 0.5
    default = configs_from_args(build_parser().parse_args(sim[:-2])).run.slo_headroom
    assert default == 0.8  # PlannerConfig's
    with pytest.raises(ValueError, match="slo_headroom"):
        configs_from_args(build_parser().parse_args([*sim[:-1], "1.5"]))


def test_report_runs_engine_v2_unless_the_engine_flags_say_otherwise() -> None:
    args = build_parser().parse_args(["report", "--quick", "--no-trace"])
    config = report_config(args, None)
    assert engine_name(config.template) == "engine v2" and config.engine_flags == ""
    assert not config.template.measure_decision_latency  # the preset's template kept
    args = build_parser().parse_args(["report", "--quick", "--no-trace", *V1_ENGINE_FLAGS])
    config = report_config(args, None)
    assert engine_name(config.template) == "engine v1"
    flags = " ".join(V1_ENGINE_FLAGS)
    assert flags.startswith("--micro-batches 1 --prefill-budget off --train-slice-s off")
    assert config.engine_flags == flags
    # The page's reproduce commands run the same engine.
    commands = pareto_commands(config.workloads[0], config)
    assert commands and all(flags in command for command in commands)
