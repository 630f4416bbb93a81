"""The small functions that record LeMix's Prometheus metrics, and each service's
view of them.

The metric families are defined in `lemix.infra.metric_families`, on
prometheus_client's default registry; each service serves its
own view of it, `registry_for(service)` (its ``lemix_<service>_`` families,
the shared ones and the process collectors), on its own `metrics_port`
(`lemix.infra.metrics_http`), so an executor exports no gateway series; the
gateway's HTTP server serves the gateway's view at ``/metrics`` too. Code calls the
`observe_*`/`set_*` functions below where an event already happens (servicers,
the scheduler core, the executor's sink layer), never from the pure planner or
engine.

SLO attainment: the gateway counts every inference request it ends in
`lemix_gateway_slo_requests_total{result}`: ``met`` (completed with TTFT <=
the TTFT SLO and mean TBT <= the TBT SLO, as `lemix.report.metrics` defines it),
``missed`` (slower, or rejected/failed/cancelled) or ``unknown`` (no SLO
published yet). A request refused for the client's own fault
(`is_client_fault`: a bad argument, a missing key, an unknown model, a reused
request id, a request too large for any node) is no SLO result at all. The SLO is the
scheduler's (given, or derived by
`lemix.sim.run.compute_slo`), published to Redis and exported as
`lemix_gateway_slo_{ttft,tbt}_seconds`. Attainment = met / all results.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import Metric

from lemix.infra.metric_families import (
    EXECUTOR_BUSY,
    EXECUTOR_FENCED_WRITES,
    EXECUTOR_INFERENCE_LOSS,
    EXECUTOR_KV_OFFLOADS,
    EXECUTOR_MEMORY_CAPACITY,
    EXECUTOR_MEMORY_MEASURED,
    EXECUTOR_MEMORY_USED,
    EXECUTOR_REQUESTS,
    EXECUTOR_TASKS,
    EXECUTOR_TOKENS,
    EXECUTOR_TRAINING_LOSS,
    EXECUTOR_TRAINING_SAMPLES,
    GATEWAY_E2E,
    GATEWAY_FINISH_REASONS,
    GATEWAY_IN_FLIGHT,
    GATEWAY_ITL,
    GATEWAY_OUTPUT_TOKENS,
    GATEWAY_PROMPT_TOKENS,
    GATEWAY_REQUESTS,
    GATEWAY_SLO_REQUESTS,
    GATEWAY_SLO_TBT,
    GATEWAY_SLO_TTFT,
    GATEWAY_TBT,
    GATEWAY_TTFT,
    REDIS_ERRORS,
    REDIS_POOL_CONNECTIONS,
    SCHEDULER_DECISION,
    SCHEDULER_DISPATCH_FAILURES,
    SCHEDULER_NODE_HEALTHY,
    SCHEDULER_PLACED,
    SCHEDULER_QUEUE,
    SCHEDULER_QUEUE_DEPTH,
    SCHEDULER_REJECTED,
)
from lemix.reasons import NEVER_FITS

# Outcomes of a gateway request, as `lemix replay` classifies them.
COMPLETED, FAILED, REJECTED, CANCELLED, ACCEPTED = (
    "completed",
    "failed",
    "rejected",
    "cancelled",
    "accepted",
)
# Refusals decided before any work ran (no token yet) are rejections.
REJECT_CODES = frozenset({"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE"})
# Statuses that are always the client's fault (no SLO result). RESOURCE_EXHAUSTED
# is only when the request can never fit (`NEVER_FITS` in its details); a full
# gateway or a busy cluster is ours.
CLIENT_FAULT_CODES = frozenset(
    {
        "INVALID_ARGUMENT",
        "UNAUTHENTICATED",
        "PERMISSION_DENIED",
        "NOT_FOUND",  # an unknown model
        "ALREADY_EXISTS",
        "OUT_OF_RANGE",
    }
)


def request_outcome(code: str, has_first_token: bool) -> str:
    """How a Generate that ended with status `code` counts (`lemix replay`'s rule)."""
    if code == "OK":
        return COMPLETED
    if code == "CANCELLED":
        return CANCELLED
    return REJECTED if code in REJECT_CODES and not has_first_token else FAILED


def is_client_fault(code: str, details: str = "") -> bool:
    """Whether a request that ended with status `code` (and `details`) failed by
    the client's own fault, so that it is no SLO result."""
    if code in CLIENT_FAULT_CODES:
        return True
    return code == "RESOURCE_EXHAUSTED" and NEVER_FITS in details


def observe_request(
    kind: str, outcome: str, code: str, count: int = 1, model_name: str = ""
) -> None:
    GATEWAY_REQUESTS.labels(model_name=model_name, kind=kind, outcome=outcome, code=code).inc(count)


def observe_prompt_tokens(model_name: str, count: int) -> None:
    if count > 0:
        GATEWAY_PROMPT_TOKENS.labels(model_name=model_name).inc(count)


def observe_token_gaps(model_name: str, gap_s: float, num_tokens: int) -> None:
    """`num_tokens` tokens arrived together `gap_s` after the sequence's
    previous token: each is one ITL observation of `gap_s / num_tokens`."""
    if num_tokens <= 0:
        return
    child = GATEWAY_ITL.labels(model_name=model_name)
    each_s = max(gap_s, 0.0) / num_tokens
    for _ in range(num_tokens):
        child.observe(each_s)


def observe_finish(model_name: str, finish_reason: str) -> None:
    GATEWAY_FINISH_REASONS.labels(model_name=model_name, finish_reason=finish_reason).inc()


def observe_inference(
    ttft_s: float | None,
    e2e_s: float | None,
    num_tokens: int,
    slo: tuple[float, float] | None,
    *,
    model_name: str = "",
    is_client_fault: bool = False,
    num_output_tokens: int | None = None,
) -> None:
    """One inference request ended; `ttft_s`/`e2e_s` are None unless it completed.

    `num_tokens` is its (longest) sequence's length, for the mean TBT;
    `num_output_tokens` all its sequences' tokens (default `num_tokens`).
    `slo` is (ttft_s, tbt_s), or None while unknown. A request refused for
    the client's fault (`is_client_fault`) gets no SLO result.
    """
    num_output = num_tokens if num_output_tokens is None else num_output_tokens
    if num_output > 0:
        GATEWAY_OUTPUT_TOKENS.labels(model_name=model_name).inc(num_output)
    tbt_s = None
    if ttft_s is not None and e2e_s is not None:
        GATEWAY_TTFT.labels(model_name=model_name).observe(ttft_s)
        GATEWAY_E2E.labels(model_name=model_name).observe(e2e_s)
        if num_tokens >= 2:
            tbt_s = (e2e_s - ttft_s) / (num_tokens - 1)
            GATEWAY_TBT.labels(model_name=model_name).observe(tbt_s)
    if is_client_fault:
        return
    if slo is None:
        result = "unknown"
    else:
        is_met = (
            ttft_s is not None
            and e2e_s is not None
            and ttft_s <= slo[0]
            and (tbt_s is None or tbt_s <= slo[1])
        )
        result = "met" if is_met else "missed"
    GATEWAY_SLO_REQUESTS.labels(model_name=model_name, result=result).inc()


def set_slo(slo: tuple[float, float] | None) -> None:
    GATEWAY_SLO_TTFT.set(slo[0] if slo else 0.0)
    GATEWAY_SLO_TBT.set(slo[1] if slo else 0.0)


def set_in_flight_source(read: Callable[[], float]) -> None:
    """The in-flight gauge reads `read()` at every scrape."""
    GATEWAY_IN_FLIGHT.set_function(read)


def set_redis_pool_source(max_connections: int, read_in_use: Callable[[], float]) -> None:
    """The pool gauge: its bound now, and `read_in_use()` at every scrape."""
    REDIS_POOL_CONNECTIONS.labels(state="max").set(max_connections)
    REDIS_POOL_CONNECTIONS.labels(state="in_use").set_function(read_in_use)


def set_queue_depth(queue: str, depth: int) -> None:
    SCHEDULER_QUEUE_DEPTH.labels(queue=queue).set(depth)


def observe_placed(policy: str, kind: str, queued_s: float | None = None) -> None:
    """A dispatched placement; `queued_s`: how long the task waited since the intake."""
    SCHEDULER_PLACED.labels(policy=policy, kind=kind).inc()
    if queued_s is not None:
        SCHEDULER_QUEUE.labels(kind=kind).observe(max(queued_s, 0.0))


def observe_rejected(policy: str, kind: str) -> None:
    SCHEDULER_REJECTED.labels(policy=policy, kind=kind).inc()


def observe_dispatch_failure(node: int) -> None:
    SCHEDULER_DISPATCH_FAILURES.labels(node=str(node)).inc()


def observe_decision(seconds: float) -> None:
    SCHEDULER_DECISION.observe(seconds)


def set_node_health(node: int, is_healthy: bool) -> None:
    SCHEDULER_NODE_HEALTHY.labels(node=str(node)).set(1.0 if is_healthy else 0.0)


def set_node_state(
    node: int,
    *,
    busy_fraction: float,
    num_running: int,
    num_waiting: int,
    used_bytes: Sequence[int],
    capacity_bytes: Sequence[int],
) -> None:
    """One executor heartbeat's gauges (memory per stage)."""
    label = str(node)
    EXECUTOR_BUSY.labels(node=label).set(busy_fraction)
    EXECUTOR_REQUESTS.labels(node=label, state="running").set(num_running)
    EXECUTOR_REQUESTS.labels(node=label, state="waiting").set(num_waiting)
    for stage, (used, capacity) in enumerate(zip(used_bytes, capacity_bytes, strict=True)):
        EXECUTOR_MEMORY_USED.labels(node=label, stage=str(stage)).set(used)
        EXECUTOR_MEMORY_CAPACITY.labels(node=label, stage=str(stage)).set(capacity)


def set_measured_memory(node: int, used_bytes: Sequence[int]) -> None:
    """Memory the stages really hold (beside the ledger's accounted figure)."""
    for stage, used in enumerate(used_bytes):
        EXECUTOR_MEMORY_MEASURED.labels(node=str(node), stage=str(stage)).set(used)


def observe_kv_offloads(node: int, count: int) -> None:
    if count > 0:
        EXECUTOR_KV_OFFLOADS.labels(node=str(node)).inc(count)


def observe_task_ended(node: int, kind: str, outcome: str, num_samples: int = 0) -> None:
    """An executor ended a task; completed training adds its `num_samples`."""
    EXECUTOR_TASKS.labels(node=str(node), kind=kind, outcome=outcome).inc()
    if kind == "training" and outcome == COMPLETED and num_samples > 0:
        EXECUTOR_TRAINING_SAMPLES.labels(node=str(node)).inc(num_samples)


def observe_fenced_writes(node: int, what: str, count: int = 1) -> None:
    """An executor's writes for a task placed again since were dropped."""
    if count > 0:
        EXECUTOR_FENCED_WRITES.labels(node=str(node), what=what).inc(count)


def observe_tokens(node: int, count: int) -> None:
    if count > 0:
        EXECUTOR_TOKENS.labels(node=str(node)).inc(count)


def observe_training_loss(node: int, loss: float) -> None:
    """For the torch backend: the loss of a finished training step."""
    EXECUTOR_TRAINING_LOSS.labels(node=str(node)).set(loss)


def observe_inference_loss(node: int, loss: float) -> None:
    """For the torch backend: a request's reference-token cross-entropy."""
    EXECUTOR_INFERENCE_LOSS.labels(node=str(node)).set(loss)


def observe_redis_error(op: str) -> None:
    REDIS_ERRORS.labels(op=op).inc()


# Families every service exports: `lemix_redis_*` and prometheus_client's
# process/platform/gc collectors (no `lemix_` prefix).
SHARED_PREFIXES = ("lemix_redis_",)


def is_service_family(name: str, service: str) -> bool:
    """Whether family `name` belongs in `service`'s exposition."""
    if not name.startswith("lemix_"):
        return True
    return name.startswith((f"lemix_{service}_", *SHARED_PREFIXES))


class ServiceRegistry(CollectorRegistry):
    """One service's view of the default registry (`generate_latest` takes it):
    its own ``lemix_<service>_`` families, the shared ones and the process
    collectors; another service's families never appear, even when both run
    in one process (tests) or one module defines them all
    (`lemix.infra.metric_families`)."""

    def __init__(self, service: str) -> None:
        super().__init__(auto_describe=False)
        self.service = service

    def collect(self) -> Iterator[Metric]:
        for family in REGISTRY.collect():
            if is_service_family(family.name, self.service):
                yield family


def registry_for(service: str) -> ServiceRegistry:
    """What `service` (gateway|scheduler|executor|profiler) serves at /metrics."""
    return ServiceRegistry(service)
