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
from lemix.reasons import NEVER_FITS


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
    model = "slo-test"
    before = {r: _value(name, model_name=model, result=r) for r in ("met", "missed", "unknown")}
    slo = (1.0, 0.1)
    telemetry.observe_inference(0.5, 1.4, 10, slo, model_name=model)  # TBT 0.1: met
    telemetry.observe_inference(0.5, 2.5, 10, slo, model_name=model)  # TBT 0.22: missed
    telemetry.observe_inference(None, None, 0, slo, model_name=model)  # failed: missed
    telemetry.observe_inference(0.2, 0.2, 1, None, model_name=model)  # no SLO known
    # The client's fault: no SLO result at all.
    telemetry.observe_inference(None, None, 0, slo, model_name=model, is_client_fault=True)
    after = {r: _value(name, model_name=model, result=r) - before[r] for r in before}
    assert after == {"met": 1, "missed": 2, "unknown": 1}


@pytest.mark.parametrize(
    ("code", "details", "is_client"),
    [
        ("INVALID_ARGUMENT", "", True),
        ("UNAUTHENTICATED", "", True),
        ("ALREADY_EXISTS", "", True),
        ("NOT_FOUND", "no model gpt-9", True),
        ("RESOURCE_EXHAUSTED", "every in-flight slot is taken", False),
        ("RESOURCE_EXHAUSTED", "no KV memory within T_max", False),
        ("RESOURCE_EXHAUSTED", f"9 tokens of KV cache need 9 B ({NEVER_FITS}); shorten", True),
        ("UNAVAILABLE", "", False),
        ("INTERNAL", "", False),
        ("OK", "", False),
    ],
)
def test_only_the_clients_own_faults_are_client_faults(
    code: str, details: str, is_client: bool
) -> None:
    assert telemetry.is_client_fault(code, details) is is_client


def test_itl_is_one_observation_per_token_gap() -> None:
    model = "itl-test"
    count, total = "lemix_gateway_itl_seconds_count", "lemix_gateway_itl_seconds_sum"
    before = (_value(count, model_name=model), _value(total, model_name=model))
    telemetry.observe_token_gaps(model, 0.3, 3)  # 3 tokens in one message, 0.3 s after
    telemetry.observe_token_gaps(model, 0.05, 1)
    telemetry.observe_token_gaps(model, 1.0, 0)  # nothing new: nothing observed
    assert _value(count, model_name=model) - before[0] == 4
    assert _value(total, model_name=model) - before[1] == pytest.approx(0.35)
    # Each of the three counts its own 0.1 s gap, not a per-request mean.
    le_100ms = REGISTRY.get_sample_value(
        "lemix_gateway_itl_seconds_bucket", {"model_name": model, "le": "0.1"}
    )
    assert le_100ms is not None and le_100ms >= 4


async def _scrape(service: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    server = await MetricsServer.start("127.0.0.1", 0, service)
    try:
        url = f"http://{server.address}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    finally:
        await server.stop()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


async def test_each_service_serves_only_its_own_families() -> None:
    telemetry.observe_tokens(7, 3)
    telemetry.observe_inference(0.1, 0.2, 2, None, model_name="m")
    telemetry.observe_redis_error("get")
    executor = await _scrape("executor")
    assert executor[("lemix_executor_tokens_generated_total", (("node", "7"),))] >= 3
    names = {name for name, _ in executor}
    assert not {n for n in names if n.startswith(("lemix_gateway_", "lemix_scheduler_"))}
    assert "lemix_redis_errors_total" in names  # shared
    assert any(n.startswith("process_") or n.startswith("python_") for n in names)
    gateway = {name for name, _ in await _scrape("gateway")}
    assert "lemix_gateway_ttft_seconds_count" in gateway
    assert not {n for n in gateway if n.startswith(("lemix_executor_", "lemix_scheduler_"))}
    profiler = {name for name, _ in await _scrape("profiler")}
    assert not {n for n in profiler if n.startswith("lemix_") and "redis" not in n}
    assert await MetricsServer.start_optional("127.0.0.1", -1, "executor") is None


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
