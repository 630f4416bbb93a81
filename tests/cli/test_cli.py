"""The `lemix` command line: sim, compare and the not-yet-implemented commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from metric_keys import DESIGN_KEYS

from lemix.cli.main import build_parser, configs_from_args, main
from lemix.planner.registry import POLICIES
from lemix.report.compare import run_sweep

SIM = ["sim", "--policy", "lemix", "--poisson", "2", "--duration", "20", "--train-rate", "0.3"]
COMPARE = [
    "compare",
    "--policies",
    "mix-rr,lemix",
    "--seeds",
    "2",
    "--rates",
    "2",
    "--train-rates",
    "0.3",
    "--duration",
    "20",
    "--deterministic",
]


def run_sim(tmp_path: Path, name: str, *extra: str) -> Path:
    out = tmp_path / name
    assert main([*SIM, "--json", str(out), *extra]) == 0
    return out


def test_sim_writes_every_design_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = json.loads(run_sim(tmp_path, "m.json").read_text())
    assert isinstance(runs, list) and len(runs) == 1
    run = runs[0]
    assert [k for k in DESIGN_KEYS if k not in run] == []
    assert run["policy"] == "lemix" and run["num_lost"] == 0
    assert run["num_inference"] > 0 and run["num_training"] > 0
    for key in ("ttft_s", "tbt_s", "e2e_s"):
        assert set(run[key]) == {"mean", "p50", "p90", "p99"}
    assert set(run["decision_latency_us"]) == {"p50", "p99"}
    assert run["decision_latency_us"]["p50"] is not None  # measured without --deterministic
    assert "SLO attainment" in capsys.readouterr().out


def test_deterministic_sim_is_byte_identical_per_seed(tmp_path: Path) -> None:
    first = run_sim(tmp_path, "a.json", "--deterministic", "--seed", "3").read_bytes()
    again = run_sim(tmp_path, "b.json", "--deterministic", "--seed", "3").read_bytes()
    other = run_sim(tmp_path, "c.json", "--deterministic", "--seed", "4").read_bytes()
    assert first == again
    assert first != other


def test_unknown_policy_exits_2_listing_policies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--policy", "nope", "--poisson", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert all(name in err for name in POLICIES)


@pytest.mark.parametrize(
    "argv",
    [
        ["sim", "--policy", "lemix"],  # no arrivals
        ["sim", "--policy", "lemix", "--poisson", "-1"],
        ["sim", "--policy", "lemix", "--poisson", "2", "--trace", "/nonexistent.csv"],
        ["compare", "--rates", "4,x", "--out", "unused"],
        ["compare", "--policies", "lemix,bogus", "--out", "unused"],
        ["sim", "--policy", "lemix", "--poisson", "2", "--training-nodes", "9"],
        ["sim", "--policy", "lemix", "--poisson", "2", "--training-nodes", "half"],
    ],
)
def test_bad_input_exits_2_without_traceback(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_profile_command_rejects_a_malformed_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Profiling a live executor is tested in tests/profiler/test_profiler_cli.py.
    assert main(["profile", "--target", "x", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "host:port" in err and "Traceback" not in err


def test_console_entry_point_runs_as_a_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lemix.cli", "up", "--nodes", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--nodes must be >= 1" in done.stderr


def test_replay_rejects_a_malformed_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--target", "nohost", "--poisson", "1", "--duration", "1"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err


def _by_seed(runs: list[dict[str, Any]], key: str) -> dict[int, set[Any]]:
    values: dict[int, set[Any]] = {}
    for run in runs:
        values.setdefault(run["seed"], set()).add(json.dumps(run[key]))
    return values


def test_compare_on_identical_workloads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    assert main([*COMPARE, "--workers", "2", "--out", str(out)]) == 0
    runs = json.loads((out / "runs.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert len(runs) == 2 * 2  # policies × seeds
    assert all(k in run for run in runs for k in DESIGN_KEYS)
    for key in ("num_inference", "num_training", "workload_sha256", "slo_ttft_s", "slo_tbt_s"):
        per_seed = _by_seed(runs, key)
        assert all(len(v) == 1 for v in per_seed.values()), key  # every policy, same workload
    hashes = _by_seed(runs, "workload_sha256")
    assert hashes[0] != hashes[1]  # repetitions use different seeds
    rows = summary["aggregates"]
    assert [r["policy"] for r in rows] == ["mix-rr", "lemix"]
    assert all(r["num_seeds"] == 2 and r["slo_attainment"]["n"] == 2 for r in rows)
    for png in ("vs_request_rate.png", "vs_train_rate.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert "runs.json" in capsys.readouterr().out
    # The pool's scheduling does not change the results: the inline run matches.
    setup = configs_from_args(build_parser().parse_args([*COMPARE, "--out", str(out)]))
    assert setup.sweep is not None
    inline = run_sweep(setup.sweep, setup.workload, setup.run, setup.profile, num_workers=1)
    assert inline == runs


def test_up_maps_the_redis_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lemix.cli.up import stack_config

    monkeypatch.delenv("LEMIX_REDIS_URL", raising=False)
    monkeypatch.delenv("LEMIX_REDIS_PASSWORD", raising=False)
    logs = tmp_path / "run" / "logs"
    config = stack_config(build_parser().parse_args(["up", "--log-dir", str(logs)]))
    assert config.redis_dir == tmp_path / "run" / "redis"  # beside the logs, kept across runs
    assert config.redis_fsync == "always" and config.redis_password is None  # random
    monkeypatch.setenv("LEMIX_REDIS_PASSWORD", "from-the-env")
    config = stack_config(
        build_parser().parse_args(
            ["up", "--redis-dir", str(tmp_path / "r"), "--redis-fsync", "always"]
        )
    )
    assert (config.redis_dir, config.redis_fsync) == (tmp_path / "r", "always")
    assert config.redis_password == "from-the-env"
    assert "from-the-env" not in repr(config)


def test_up_logs_each_start_in_its_own_directory(tmp_path: Path) -> None:
    from lemix.cli.up import LOG_ROOT, point_latest, run_log_dir, stack_config

    config = stack_config(build_parser().parse_args(["up"]))
    assert config.log_dir.parent == LOG_ROOT and config.log_dir.name.endswith(f"-{os.getpid()}")
    assert config.redis_dir == LOG_ROOT.parent / "redis"  # one Redis dir across runs
    first, second = tmp_path / "a-1", tmp_path / "b-2"
    point_latest(first)
    point_latest(second)
    assert (tmp_path / "latest").resolve() == second.resolve()
    assert run_log_dir(tmp_path).parent == tmp_path


def test_up_rejects_a_bad_redis_password_or_fsync(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--redis-password", "with space"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "password" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as info:
        main(["up", "--redis-fsync", "no"])
    assert info.value.code == 2
    assert "everysec" in capsys.readouterr().err
