"""lemix.infra.telemetry's recording rules and lemix.infra.metrics_http's endpoint."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from lemix.infra import telemetry
from lemix.infra.metrics_http import MetricsServer
from lemix.infra.store.client import RedisClientConfig, connect, export_pool_metrics
from lemix.infra.store.server import EmbeddedRedis


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize(
    ("code", "has_token", "outcome"),
    [
        ("OK", True, "completed"),
        ("CANCELLED", True, "cancelled"),
        ("UNAVAILABLE", False, "rejected"),
        ("UNAVAILABLE", True, "failed"),
        ("RESOURCE_EXHAUSTED", False, "rejected"),
        ("INTERNAL", False, "failed"),
    ],
)
def test_outcomes_follow_the_replay_rule(code: str, has_token: bool, outcome: str) -> None:
    assert telemetry.request_outcome(code, has_token) == outcome


def test_slo_is_met_only_by_fast_completed_requests() -> None:
    name = "lemix_gateway_slo_requests_total"
    before = {r: _value(name, result=r) for r in ("met", "missed", "unknown")}
    slo = (1.0, 0.1)
    telemetry.observe_inference(0.5, 1.4, 10, slo)  # TBT 0.1: met
    telemetry.observe_inference(0.5, 2.5, 10, slo)  # TBT 0.22: missed
    telemetry.observe_inference(None, None, 0, slo)  # failed: missed
    telemetry.observe_inference(0.2, 0.2, 1, None)  # no SLO known
    after = {r: _value(name, result=r) - before[r] for r in before}
    assert after == {"met": 1, "missed": 2, "unknown": 1}


async def test_the_endpoint_serves_the_default_registry() -> None:
    telemetry.observe_tokens(7, 3)
    server = await MetricsServer.start("127.0.0.1", 0)
    try:
        url = f"http://{server.address}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    finally:
        await server.stop()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }
    assert samples[("lemix_executor_tokens_generated_total", (("node", "7"),))] >= 3
    assert await MetricsServer.start_optional("127.0.0.1", -1) is None


async def test_the_redis_pool_gauge_shows_its_bound_and_connections_in_use(
    redis_server: EmbeddedRedis,
) -> None:
    client = connect(RedisClientConfig(redis_server.url, max_connections=3, socket_timeout_s=5.0))
    try:
        export_pool_metrics(client)
        gauge = "lemix_redis_pool_connections"
        assert REGISTRY.get_sample_value(gauge, {"state": "max"}) == 3
        # Two blocking reads hold two connections while they wait.
        readers = [asyncio.create_task(client.blpop([f"k{i}"], timeout=0.5)) for i in range(2)]
        await asyncio.sleep(0.2)
        assert REGISTRY.get_sample_value(gauge, {"state": "in_use"}) == 2
        await asyncio.gather(*readers)
        assert REGISTRY.get_sample_value(gauge, {"state": "in_use"}) == 0
    finally:
        await client.aclose()
