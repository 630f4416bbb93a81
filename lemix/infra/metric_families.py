"""Every Prometheus metric family LeMix exports, defined once, on
prometheus_client's default registry (`lemix.infra.telemetry` records them and
serves each service its view).

Names follow Prometheus conventions: ``lemix_`` prefix, ``_total`` counters,
``_seconds`` histograms, ``_bytes`` gauges; labels are few and bounded (node,
stage, kind, outcome, code, policy, queue, op, result, model_name: the served
model name, finish_reason). docs/metrics.md describes each.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
    "docs/protocol.md, Fencing), by what (place|token|end)",
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
