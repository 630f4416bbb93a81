"""deploy/grafana/lemix-dashboard.json only queries metrics lemix.infra.metric_families defines."""

from __future__ import annotations

import json
import re
from pathlib import Path

from lemix.infra import metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "lemix-dashboard.json"
_METRIC = re.compile(r"\blemix_[a-z0-9_]+")


def _expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_metric_the_dashboard_queries_exists() -> None:
    known = metric_families.metric_names()
    used = {name for expr in _expressions() for name in _METRIC.findall(expr)}
    assert used, "the dashboard queries no lemix_ metric"
    assert used <= known, f"unknown metrics: {sorted(used - known)}"


def test_the_dashboard_covers_each_service() -> None:
    text = " ".join(_expressions())
    for prefix in ("lemix_gateway_", "lemix_scheduler_", "lemix_executor_", "lemix_redis_"):
        assert prefix in text
    assert "histogram_quantile(0.99" in text
