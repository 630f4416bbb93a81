"""End to end: every service's Prometheus endpoint agrees with the load harness.

`lemix.stack.launcher.Stack` starts Redis, two emulated executors, the profiler, the
scheduler and the gateway as processes, each serving ``/metrics`` on a free
port; `lemix.harness.replay` fires a short mixed workload; then each endpoint is
scraped over HTTP and parsed with prometheus_client's own parser. Counters must
match what the client saw: completions, tokens, training, placements.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from lemix.harness.replay import ReplayConfig, run_replay
from lemix.stack.launcher import Stack, StackConfig
from lemix.workload import WorkloadConfig, build_workload

TIME_SCALE = 0.05  # 20x faster than the A100 profile, so the test stays short
SETTLE_S = 10.0  # executors count right after their Redis write; heartbeats set gauges

Samples = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value)


def _scrape(address: str) -> Samples:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def _sum(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        value
        for got, value in samples.get(name, [])
        if all(got.get(k) == v for k, v in labels.items())
    )


async def _scrape_all(addresses: dict[str, str]) -> dict[str, Samples]:
    return {name: await asyncio.to_thread(_scrape, address) for name, address in addresses.items()}


async def _settled(
    addresses: dict[str, str], is_settled: Callable[[dict[str, Samples]], bool]
) -> dict[str, Samples]:
    """Scrape until `is_settled` (or SETTLE_S passed); the last scrape either way."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        scraped = await _scrape_all(addresses)
        if is_settled(scraped) or time.monotonic() > deadline:
            return scraped
        await asyncio.sleep(0.2)


async def test_metrics_endpoints_agree_with_the_replay(tmp_path: Path) -> None:
    workload = build_workload(
        WorkloadConfig(
            request_rate=10.0, train_rate=0.2, duration_s=6.0, seed=5, max_total_tokens=2048
        )
    )
    tasks = list(workload.tasks)
    inference = [t for t in tasks if not t.is_training]
    training = [t for t in tasks if t.is_training]
    assert len(inference) >= 30 and len(training) >= 2
    config = StackConfig(
        num_nodes=2,
        gateway_port=0,
        time_scale=TIME_SCALE,
        log_dir=tmp_path / "logs",
        namespace="e2e-metrics",
    )
    async with Stack(config) as stack:
        addresses = stack.metrics_addresses()
        assert set(addresses) == {"gateway", "scheduler", "profiler", "executor-0", "executor-1"}
        metrics = await run_replay(
            ReplayConfig(target=stack.gateway_address, drain_timeout_s=60.0, show_progress=False),
            tasks,
            request_rate=10.0,
            train_rate=0.2,
            duration_s=workload.duration_s,
            seed=5,
        )
        num_tokens = sum(t.max_output_tokens for t in inference)  # ignore_eos: all of them
        scraped = await _settled(
            addresses,
            lambda s: _executor_tokens(s) >= num_tokens and _executor_training(s) >= len(training),
        )
        assert stack.failed_child() is None
    assert metrics["num_lost"] == 0
    assert metrics["num_completed_inference"] == len(inference)
    assert metrics["num_completed_training"] == len(training)

    gateway = scraped["gateway"]
    completed = _sum(gateway, "lemix_gateway_requests_total", kind="inference", outcome="completed")
    assert completed == metrics["num_completed_inference"]
    assert (
        _sum(gateway, "lemix_gateway_requests_total", kind="training", outcome="accepted")
        == metrics["num_training"]
    )
    assert _sum(gateway, "lemix_gateway_ttft_seconds_count") == completed
    assert _sum(gateway, "lemix_gateway_e2e_seconds_count") == completed
    assert _sum(gateway, "lemix_gateway_output_tokens_total") == num_tokens
    assert _sum(gateway, "lemix_gateway_slo_requests_total") == len(inference)
    assert _sum(gateway, "lemix_gateway_slo_ttft_seconds") > 0  # the scheduler's SLO arrived
    assert _sum(gateway, "lemix_gateway_requests_in_flight") == 0
    # vLLM-style series, labelled with the served model name.
    model = {"model_name": "lemix"}
    assert _sum(gateway, "lemix_gateway_output_tokens_total", **model) == num_tokens
    assert _sum(gateway, "lemix_gateway_prompt_tokens_total", **model) == sum(
        t.num_prompt_tokens for t in inference
    )
    # One ITL observation per token after each request's first.
    assert _sum(gateway, "lemix_gateway_itl_seconds_count", **model) == num_tokens - len(inference)
    assert _sum(
        gateway, "lemix_gateway_finish_reasons_total", finish_reason="length", **model
    ) == len(inference)
    # One registry per service: no phantom series of another service.
    for name, samples in scraped.items():
        service = name.split("-")[0]
        foreign = {
            n
            for n in samples
            if n.startswith("lemix_") and not n.startswith((f"lemix_{service}_", "lemix_redis_"))
        }
        assert not foreign, f"{name} exports {sorted(foreign)}"

    assert _executor_tokens(scraped) == num_tokens
    assert _executor_training(scraped) == metrics["num_completed_training"]
    assert sum(
        _sum(scraped[f"executor-{i}"], "lemix_executor_training_samples_total") for i in range(2)
    ) == sum(t.batch_size for t in training)
    for i in range(2):
        executor = scraped[f"executor-{i}"]
        assert _sum(executor, "lemix_executor_memory_capacity_bytes", node=str(i)) > 0
        assert "lemix_executor_busy_fraction" in executor

    scheduler = scraped["scheduler"]
    assert _sum(scheduler, "lemix_scheduler_tasks_placed_total") == len(tasks)
    assert _sum(scheduler, "lemix_scheduler_tasks_placed_total", kind="training") == len(training)
    assert _sum(scheduler, "lemix_scheduler_decision_seconds_count") > 0
    assert _sum(scheduler, "lemix_scheduler_node_healthy") == 2
    assert "lemix_scheduler_queue_depth" in scheduler
    for samples in scraped.values():
        assert _sum(samples, "lemix_redis_errors_total") == 0


def _executor_tokens(scraped: dict[str, Samples]) -> float:
    return sum(
        _sum(s, "lemix_executor_tokens_generated_total")
        for name, s in scraped.items()
        if name.startswith("executor-")
    )


def _executor_training(scraped: dict[str, Samples]) -> float:
    return sum(
        _sum(s, "lemix_executor_tasks_total", kind="training", outcome="completed")
        for name, s in scraped.items()
        if name.startswith("executor-")
    )
