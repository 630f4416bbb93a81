"""`benchmarks.host_load`: what a benchmark records of the host it ran on."""

from __future__ import annotations

import pytest

from benchmarks import host_load


def test_a_host_whose_load_passes_half_its_cpus_is_called_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host_load.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(host_load.os, "getloadavg", lambda: (0.4, 0.9, 1.5))
    quiet = host_load.host_load(speed_us=123.0)
    assert quiet == {
        "num_cpus": 2,
        "load_avg_1m": 0.4,
        "load_avg_5m": 0.9,
        "load_avg_15m": 1.5,
        "is_busy": False,
        "python_speed_us": 123.0,
        "python_speed_stmt": "sum(range(10_000))",
    }
    assert "BUSY" not in host_load.describe(quiet)
    assert "takes 123.0 µs on one core" in host_load.describe(quiet)
    monkeypatch.setattr(host_load.os, "getloadavg", lambda: (1.2, 0.9, 1.5))
    busy = host_load.host_load(speed_us=123.0)
    assert busy["is_busy"]
    assert "BUSY" in host_load.describe(busy) and "on 2 CPUs" in host_load.describe(busy)
