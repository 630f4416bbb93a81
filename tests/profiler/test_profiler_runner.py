"""profiler.runner against a real emulated executor (real gRPC, real Redis):
profiling recovers the profile the executor was given."""

from __future__ import annotations

import socket

import pytest
from known_profile import GRID, NOISE_CV, TRUE_OURS, StartExecutor, true_profile

from lemix.infra.rpc.errors import InvalidArgument, Unavailable
from lemix.profile import Profile
from profiler.runner import ProfileGrid, profile_executor, run_profile
from services.executor.service import ExecutorService

NUM_REPEATS = 5


def relative_errors(fitted: Profile) -> dict[str, list[float]]:
    """|fitted / true - 1| of `ours` at every grid point, per phase."""
    errors: dict[str, list[float]] = {"forward": [], "backward": [], "decode": []}
    ours = fitted.ours
    for stage in range(2):
        for c, n in GRID.phase_points():
            errors["forward"].append(
                abs(ours.forward_s(stage, c, n) / TRUE_OURS.forward_s(stage, c, n) - 1)
            )
            errors["backward"].append(
                abs(ours.backward_s(stage, c, n) / TRUE_OURS.backward_s(stage, c, n) - 1)
            )
        for c, s in GRID.decode_points():
            errors["decode"].append(
                abs(ours.decode_step_s(stage, c, s) / TRUE_OURS.decode_step_s(stage, c, s) - 1)
            )
    return errors


async def test_profiling_a_noisy_executor_recovers_its_profile(executor: ExecutorService) -> None:
    base = true_profile()
    run = await run_profile(executor.address, GRID, NUM_REPEATS, base, "recovered")
    fitted = run.profile
    # Noise of CV 2% per run, median of 5: every grid point within 4%, mean within 1.5%.
    for phase, errors in relative_errors(fitted).items():
        assert max(errors) < 0.04, (phase, max(errors))
        assert sum(errors) / len(errors) < 0.015, phase
    quality = fitted.fit_quality
    for phase in ("forward", "backward", "decode"):
        for stage in range(2):
            ours, paper = quality[phase]["ours"][stage], quality[phase]["paper"][stage]
            assert ours["r2"] > 0.99 and ours["mape"] < 0.03, (phase, stage, ours)
            # The paper's model is fitted and scored on the same points, and loses.
            assert paper["r2"] < ours["r2"] and paper["mape"] > 5 * ours["mape"]
    # Memory, transfer and optimizer come from the base; the peaks agree with it.
    assert (fitted.memory, fitted.transfer, fitted.optimizer_step_s) == (
        base.memory,
        base.transfer,
        base.optimizer_step_s,
    )
    assert [s["is_consistent"] for s in run.report["memory_check"]] == [True, True]
    assert run.report["num_measure_calls"] == 2 * (2 * 20 + 20)
    assert run.report["num_repeats"] == NUM_REPEATS
    assert run.report["executor_address"] == executor.address
    assert executor.address in fitted.provenance and NOISE_CV > 0


async def test_a_noise_free_executor_is_recovered_exactly(start_executor: StartExecutor) -> None:
    executor = await start_executor(noise_cv=0.0)
    fitted = await profile_executor(executor.address, GRID, 1, true_profile(), "exact")
    for phase, errors in relative_errors(fitted).items():
        assert max(errors) < 1e-6, phase
    assert fitted.ours.forward[1].c == pytest.approx(TRUE_OURS.forward[1].c, rel=1e-6)
    assert fitted.ours.decode[0].d1 == pytest.approx(TRUE_OURS.decode[0].d1, rel=1e-6)


async def test_bad_grids_and_settings_are_invalid_arguments(executor: ExecutorService) -> None:
    base = true_profile()
    with pytest.raises(ValueError, match="two lengths"):
        ProfileGrid(num_tokens=(128,))
    with pytest.raises(ValueError, match="decode grid"):
        ProfileGrid(batch_sizes=(1, 2), sum_context_tokens=(1,))
    with pytest.raises(ValueError, match="repeated"):
        ProfileGrid(batch_sizes=(1, 1, 2))
    with pytest.raises(ValueError, match=">= 1"):
        ProfileGrid(batch_sizes=(0, 1, 2))
    with pytest.raises(InvalidArgument, match="num_repeats"):
        await run_profile(executor.address, GRID, 0, base, "x")
    with pytest.raises(InvalidArgument, match="name"):
        await run_profile(executor.address, GRID, 1, base, "")
    three_stages = true_profile()
    three_stages = type(three_stages).from_json_dict(_with_stages(three_stages.to_json_dict(), 3))
    with pytest.raises(InvalidArgument, match="2 stage.*has 3"):
        await run_profile(executor.address, GRID, 1, three_stages, "x")


async def test_an_unreachable_executor_is_unavailable() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(Unavailable, match=f"127.0.0.1:{port}.*GetNodeState"):
        await run_profile(f"127.0.0.1:{port}", GRID, 1, true_profile(), "x", deadline_s=2.0)


def _with_stages(data: dict, num_stages: int) -> dict:
    """A profile JSON with every per-stage list cycled out to `num_stages` entries."""

    def grow(values: list) -> list:
        return [values[i % len(values)] for i in range(num_stages)]

    data["num_stages"] = num_stages
    for model in ("paper", "ours"):
        for key, values in data["latency"][model].items():
            data["latency"][model][key] = grow(values)
    data["optimizer_step_s"] = grow(data["optimizer_step_s"])
    for key, value in data["memory"].items():
        if isinstance(value, list):
            data["memory"][key] = grow(value)
    return data
