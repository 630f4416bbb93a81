"""Every Prometheus metric LeMix exports, and the small functions that record them.

Metrics live on prometheus_client's default registry; each service serves its
own view of it, `registry_for(service)` (its ``lemix_<service>_`` families,
the shared ones and the process collectors), on its own `metrics_port`
(`lemix.infra.metrics_http`), so an executor exports no gateway series; the
gateway's HTTP server serves the gateway's view at ``/metrics`` too. Code calls the
`observe_*`/`set_*` functions below where an event already happens (servicers,
the scheduler core, the executor's sink layer), never from the pure planner or
engine. Names follow Prometheus conventions: ``lemix_`` prefix, ``_total``
counters, ``_seconds`` histograms, ``_bytes`` gauges; labels are few and
bounded (node, stage, kind, outcome, code, policy, queue, op, result,
model_name: the served model name, finish_reason).

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

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from lemix.reasons import NEVER_FITS

# Latency buckets for LLM serving, 2.5 ms .. 60 s: TBT lives at the low end,
# TTFT in the middle, E2E of long decodes at the top.
LATENCY_BUCKETS_S = (
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    7.5,
    10.0,
    15.0,
    30.0,
    60.0,
)
# One planner call takes microseconds to milliseconds.
DECISION_BUCKETS_S = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    1.0,
)

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

# ------------------------------------------------------------------ gateway

GATEWAY_REQUESTS = Counter(
    "lemix_gateway_requests_total",
    "Requests the gateway ended, by kind (inference|training), outcome "
    "(completed|failed|rejected|cancelled; training: accepted) and gRPC status code",
    ["model_name", "kind", "outcome", "code"],
)
GATEWAY_IN_FLIGHT = Gauge("lemix_gateway_requests_in_flight", "Generate streams holding a slot now")
GATEWAY_TTFT = Histogram(
    "lemix_gateway_ttft_seconds",
    "Time to first token, from receipt at the gateway",
    ["model_name"],
    buckets=LATENCY_BUCKETS_S,
)
GATEWAY_TBT = Histogram(
    "lemix_gateway_tbt_seconds",
    "Mean time between tokens of one completed request, (E2E - TTFT) / (tokens - 1)",
    ["model_name"],
    buckets=LATENCY_BUCKETS_S,
)
GATEWAY_ITL = Histogram(
    "lemix_gateway_itl_seconds",
    "Inter-token latency: one observation per output token after a sequence's first, "
    "the gap since the previous one at the gateway (tokens that arrive in one message "
    "share its gap evenly)",
    ["model_name"],
    buckets=LATENCY_BUCKETS_S,
)
GATEWAY_E2E = Histogram(
    "lemix_gateway_e2e_seconds",
    "Receipt to last token of completed inference requests",
    ["model_name"],
    buckets=LATENCY_BUCKETS_S,
)
GATEWAY_OUTPUT_TOKENS = Counter(
    "lemix_gateway_output_tokens_total",
    "Generation tokens streamed to clients (vLLM's generation_tokens)",
    ["model_name"],
)
GATEWAY_PROMPT_TOKENS = Counter(
    "lemix_gateway_prompt_tokens_total",
    "Prompt tokens of admitted inference tasks (each of n choices is a task)",
    ["model_name"],
)
GATEWAY_FINISH_REASONS = Counter(
    "lemix_gateway_finish_reasons_total",
    "Ended output sequences (one per choice) by finish reason "
    "(length|stop, as the final message says or a stop string ended it; abort: an "
    "error or the client's leaving ended it)",
    ["model_name", "finish_reason"],
)
GATEWAY_SLO_REQUESTS = Counter(
    "lemix_gateway_slo_requests_total",
    "Ended inference requests by SLO result (met|missed|unknown); client faults are not counted",
    ["model_name", "result"],
)
GATEWAY_SLO_TTFT = Gauge(
    "lemix_gateway_slo_ttft_seconds", "TTFT SLO the gateway judges against (0 = unknown)"
)
GATEWAY_SLO_TBT = Gauge(
    "lemix_gateway_slo_tbt_seconds", "TBT SLO the gateway judges against (0 = unknown)"
)

# ---------------------------------------------------------------- scheduler

SCHEDULER_QUEUE_DEPTH = Gauge(
    "lemix_scheduler_queue_depth",
    "Tasks waiting, by queue (intake_pending: read, not yet acked; deferred_training; "
    "held: placed or deferred, not finished)",
    ["queue"],
)
SCHEDULER_PLACED = Counter(
    "lemix_scheduler_tasks_placed_total", "Tasks dispatched to an executor", ["policy", "kind"]
)
SCHEDULER_REJECTED = Counter(
    "lemix_scheduler_tasks_rejected_total", "Tasks the planner rejected", ["policy", "kind"]
)
SCHEDULER_DISPATCH_FAILURES = Counter(
    "lemix_scheduler_dispatch_failures_total", "Dispatch calls an executor failed", ["node"]
)
SCHEDULER_DECISION = Histogram(
    "lemix_scheduler_decision_seconds",
    "Wall time of one planner call (plan + inputs)",
    buckets=DECISION_BUCKETS_S,
)
SCHEDULER_QUEUE = Histogram(
    "lemix_scheduler_queue_seconds",
    "Time from the intake to a successful dispatch (deferral included), by task kind",
    ["kind"],
    buckets=LATENCY_BUCKETS_S,
)
SCHEDULER_NODE_HEALTHY = Gauge(
    "lemix_scheduler_node_healthy", "1 if the planner may place on the node", ["node"]
)

# ----------------------------------------------------------------- executor

EXECUTOR_BUSY = Gauge(
    "lemix_executor_busy_fraction", "Recent busy share of the node's stages (0..1)", ["node"]
)
EXECUTOR_MEMORY_USED = Gauge(
    "lemix_executor_memory_used_bytes", "GPU memory accounted on a stage", ["node", "stage"]
)
EXECUTOR_MEMORY_MEASURED = Gauge(
    "lemix_executor_memory_measured_bytes",
    "Memory a stage really holds (torch backend: CUDA allocator, or tensors on a CPU)",
    ["node", "stage"],
)
EXECUTOR_MEMORY_CAPACITY = Gauge(
    "lemix_executor_memory_capacity_bytes",
    "Usable GPU memory of a stage (kappa x total)",
    ["node", "stage"],
)
EXECUTOR_KV_OFFLOADS = Counter(
    "lemix_executor_kv_offloads_total", "Requests whose KV cache moved to host memory", ["node"]
)
EXECUTOR_REQUESTS = Gauge(
    "lemix_executor_requests",
    "Inference requests on the node, by state (running|waiting)",
    ["node", "state"],
)
EXECUTOR_TASKS = Counter(
    "lemix_executor_tasks_total",
    "Tasks the node ended, by kind and outcome (completed|failed|requeued)",
    ["node", "kind", "outcome"],
)
EXECUTOR_FENCED_WRITES = Counter(
    "lemix_executor_fenced_writes_total",
    "Writes dropped because their task was placed again since (a stale attempt; "
    "docs/protocol.md, Fencing), by what (token|end)",
    ["node", "what"],
)
EXECUTOR_TRAINING_SAMPLES = Counter(
    "lemix_executor_training_samples_total",
    "Training samples completed (rate() = samples/s)",
    ["node"],
)
EXECUTOR_TOKENS = Counter(
    "lemix_executor_tokens_generated_total", "Output tokens the node generated", ["node"]
)
EXECUTOR_TRAINING_LOSS = Gauge(
    "lemix_executor_training_loss", "Loss of the node's latest training step", ["node"]
)
EXECUTOR_INFERENCE_LOSS = Gauge(
    "lemix_executor_inference_loss",
    "Reference-token cross-entropy of the node's latest scored request",
    ["node"],
)

# ------------------------------------------------------------------- shared

REDIS_ERRORS = Counter(
    "lemix_redis_errors_total", "Redis calls that raised, by Store operation", ["op"]
)
REDIS_POOL_CONNECTIONS = Gauge(
    "lemix_redis_pool_connections",
    "This service's Redis connection pool: its bound (max) and the connections in use",
    ["state"],
)


# ================================================================ recording


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
    in one process (tests) or one module defines them all (this one)."""

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


def metric_names() -> set[str]:
    """Every family name defined here, as it appears in the exposition
    (counters with `_total`, histograms with `_bucket/_sum/_count`)."""
    names: set[str] = set()
    for value in globals().values():
        if not isinstance(value, Counter | Gauge | Histogram):
            continue
        name = next(iter(value.describe())).name
        if isinstance(value, Counter):
            names.add(f"{name}_total")
        elif isinstance(value, Histogram):
            names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)
    return names
