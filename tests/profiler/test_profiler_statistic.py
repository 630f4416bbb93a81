"""How the profiler turns one point's repeats into its latency (profiler.runner)."""

from __future__ import annotations

import pytest

from lemix.infra.rpc.errors import InvalidArgument
from lemix.profile import default_profile_path, load_profile
from profiler.runner import STATISTICS, ProfileGrid, run_profile


def test_median_and_min_of_repeats() -> None:
    samples = [0.030, 0.010, 0.050, 0.012, 0.090]  # a loaded machine: most runs slowed
    assert STATISTICS["median"](samples) == 0.030
    assert STATISTICS["min"](samples) == 0.010


async def test_an_unknown_statistic_is_refused_before_any_call() -> None:
    base = load_profile(default_profile_path())
    with pytest.raises(InvalidArgument, match="statistic"):
        # Nothing listens on port 1: the refusal must come first.
        await run_profile("127.0.0.1:1", ProfileGrid(), 1, base, "x", statistic="mean")
