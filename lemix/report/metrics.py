"""Run metrics (the DESIGN.md "Metrics JSON" object), confidence intervals, tables.

`summarize` turns the TaskRecords of one run into the stable metrics dict
written by `sim`, `replay` and `compare`. Definitions:
- TTFT = first_token_s − arrival_s; E2E = finish_s − arrival_s;
  TBT per request = (finish_s − first_token_s) / (num_output_tokens − 1) for
  requests with >= 2 output tokens. Distributions are over completed
  inference requests; percentiles interpolate linearly (numpy's default).
- A request meets the SLO when it completed with TTFT <= slo_ttft_s and TBT
  <= slo_tbt_s (a one-token request has no TBT and meets that half).
  slo_attainment divides by ALL inference requests: rejected, failed and
  lost ones count as misses.
- Throughputs divide by the wall-clock makespan_s (first arrival to last
  completion); `throughput_tasks_s_paper` is the prototype's tasks over summed
  node active spans, reported beside ours, never instead.
- goodput_rps divides the SLO-meeting requests by the arrival window
  (duration_s): the rate of good answers for the offered load. Dividing by the
  makespan would let a few long decodes in the drain tail swing it.
- Training delivered is judged inside the same window, [0, duration_s]:
  training_samples_s_window = samples of training tasks finished by its end /
  duration_s; training_backlog_end = samples offered in it not finished by
  then. A policy that holds training back and drains it afterwards shows a
  low window rate and a large backlog, where training_samples_s (over the
  makespan, drain included) would not tell.
- num_failed_kv_memory counts the inference requests that failed for want of
  KV memory (a RESOURCE_EXHAUSTED reason: wait-then-drop, the engine with
  offload off, fails a request whose KV did not fit within T_max), so a
  memory-bound run shows where memory, not compute, ended requests.
- Requests/s, output tokens/s and training samples/s are separate keys,
  never summed (throughput_tasks_s, the contract's sum, stays for it).
Every value is JSON-safe: no NaN or inf, None where undefined.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from lemix.reasons import ReasonCode, reason_code
from lemix.types import TaskKind, TaskRecord, TaskStatus

# The DESIGN.md contract, in order, then our extra keys.
METRIC_KEYS: tuple[str, ...] = (
    "policy",
    "seed",
    "request_rate",
    "train_rate",
    "duration_s",
    "num_inference",
    "num_training",
    "num_completed_inference",
    "num_completed_training",
    "num_rejected",
    "num_lost",
    "throughput_tasks_s",
    "throughput_tokens_s",
    "goodput_rps",
    "slo_attainment",
    "ttft_s",
    "tbt_s",
    "e2e_s",
    "utilization",
    "inference_loss",
    "decision_latency_us",
    "serving_staleness_updates",
    "throughput_tasks_s_paper",
)
EXTRA_KEYS: tuple[str, ...] = (
    "num_failed",
    "num_completed",
    "training_samples_s",
    "slo_ttft_s",
    "slo_tbt_s",
    "makespan_s",
    "throughput_requests_s",
    "training_samples_s_window",
    "training_backlog_end",
    "num_failed_kv_memory",
)

# Two-sided 95% critical values of Student's t (the standard t table, e.g.
# NIST/SEMATECH e-Handbook of Statistical Methods, table 1.3.6.7.2), df 1..30,
# then 40, 60, 120. Between tabulated df the next lower df is used (slightly
# conservative); beyond 120 the normal value 1.96.
_T95 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    16: 2.120,
    17: 2.110,
    18: 2.101,
    19: 2.093,
    20: 2.086,
    21: 2.080,
    22: 2.074,
    23: 2.069,
    24: 2.064,
    25: 2.060,
    26: 2.056,
    27: 2.052,
    28: 2.048,
    29: 2.045,
    30: 2.042,
    40: 2.021,
    60: 2.000,
    120: 1.980,
}
_Z95 = 1.96


# (dotted key, label) rows the `lemix sim` and `lemix replay` tables share.
OUTCOME_TABLE_ROWS: tuple[tuple[str, str], ...] = (
    ("num_inference", "inference requests"),
    ("num_training", "training tasks"),
    ("num_completed", "completed"),
    ("num_rejected", "rejected"),
    ("num_failed", "failed"),
    ("num_lost", "lost"),
    ("slo_attainment", "SLO attainment"),
    ("goodput_rps", "goodput (req/s)"),
    ("throughput_tasks_s", "throughput (tasks/s)"),
    ("throughput_tokens_s", "throughput (tokens/s)"),
    ("throughput_requests_s", "throughput (requests/s)"),
    ("training_samples_s_window", "training samples/s (in window)"),
    ("training_backlog_end", "training backlog at window end (samples)"),
)
LATENCY_TABLE_ROWS: tuple[tuple[str, str], ...] = (
    ("ttft_s.p50", "TTFT p50 (s)"),
    ("ttft_s.p99", "TTFT p99 (s)"),
    ("tbt_s.p50", "TBT p50 (s)"),
    ("e2e_s.p50", "E2E p50 (s)"),
)


def summarize(
    records: Sequence[TaskRecord],
    *,
    policy: str,
    seed: int,
    request_rate: float,
    train_rate: float,
    duration_s: float,
    makespan_s: float,
    slo_ttft_s: float,
    slo_tbt_s: float,
    utilization: float,
    decision_latency_us: Sequence[float],
    node_active_spans_s: Sequence[float],
) -> dict[str, Any]:
    """The metrics object of one run (keys METRIC_KEYS + EXTRA_KEYS, in order).

    Raises ValueError for SLO thresholds <= 0, a negative makespan, or a
    completed inference record without first_token_s / finish_s (a producer
    bug that must not pass as a fast request).
    """
    if slo_ttft_s <= 0 or slo_tbt_s <= 0:
        raise ValueError(f"SLO thresholds must be > 0, got {slo_ttft_s}, {slo_tbt_s}")
    if makespan_s < 0:
        raise ValueError(f"makespan_s must be >= 0, got {makespan_s}")
    inference = [r for r in records if r.kind is TaskKind.INFERENCE]
    training = [r for r in records if r.kind is TaskKind.TRAINING]
    done_inf = [r for r in inference if r.status is TaskStatus.COMPLETED]
    done_trn = [r for r in training if r.status is TaskStatus.COMPLETED]
    for r in done_inf:
        if r.first_token_s is None or r.finish_s is None:
            raise ValueError(f"completed inference {r.task_id} lacks first_token_s/finish_s")
    num_completed = len(done_inf) + len(done_trn)
    num_met = sum(1 for r in done_inf if _meets_slo(r, slo_ttft_s, slo_tbt_s))
    num_tokens = sum(r.num_output_tokens for r in done_inf)
    num_samples = sum(r.batch_size for r in done_trn)
    window_end_s = duration_s
    num_samples_window = sum(
        r.batch_size for r in done_trn if r.finish_s is not None and r.finish_s <= window_end_s
    )
    num_samples_backlog = sum(
        r.batch_size
        for r in training
        if r.arrival_s <= window_end_s
        and not (
            r.status is TaskStatus.COMPLETED
            and r.finish_s is not None
            and r.finish_s <= window_end_s
        )
    )
    ttft = [_ttft(r) for r in done_inf]
    tbt = [t for t in (_tbt(r) for r in done_inf) if t is not None]
    e2e = [_e2e(r) for r in done_inf]
    losses = [r.inference_loss for r in done_inf if r.inference_loss is not None]
    stale = [
        float(r.serving_staleness_updates)
        for r in done_inf
        if r.serving_staleness_updates is not None
    ]
    values: dict[str, Any] = {
        "policy": policy,
        "seed": seed,
        "request_rate": _safe(request_rate),
        "train_rate": _safe(train_rate),
        "duration_s": _safe(duration_s),
        "num_inference": len(inference),
        "num_training": len(training),
        "num_completed_inference": len(done_inf),
        "num_completed_training": len(done_trn),
        "num_rejected": _count(records, TaskStatus.REJECTED),
        "num_lost": _count(records, None),
        "throughput_tasks_s": _ratio(num_completed, makespan_s),
        "throughput_tokens_s": _ratio(num_tokens, makespan_s),
        "goodput_rps": _ratio(num_met, duration_s),
        "slo_attainment": _ratio(num_met, len(inference)),
        "ttft_s": distribution(ttft),
        "tbt_s": distribution(tbt),
        "e2e_s": distribution(e2e),
        "utilization": _safe(utilization),
        "inference_loss": _mean(losses),
        "decision_latency_us": _p50_p99(decision_latency_us),
        "serving_staleness_updates": _mean(stale),
        "throughput_tasks_s_paper": _ratio(num_completed, math.fsum(node_active_spans_s)),
        "num_failed": _count(records, TaskStatus.FAILED),
        "num_completed": num_completed,
        "training_samples_s": _ratio(num_samples, makespan_s),
        "slo_ttft_s": _safe(slo_ttft_s),
        "slo_tbt_s": _safe(slo_tbt_s),
        "makespan_s": _safe(makespan_s),
        "throughput_requests_s": _ratio(len(done_inf), makespan_s),
        "training_samples_s_window": _ratio(num_samples_window, duration_s),
        "training_backlog_end": num_samples_backlog,
        "num_failed_kv_memory": sum(1 for r in inference if _is_kv_memory_failure(r)),
    }
    return {key: values[key] for key in METRIC_KEYS + EXTRA_KEYS}


def _is_kv_memory_failure(r: TaskRecord) -> bool:
    """A request failed for want of KV memory: the engine's only failure of an
    admitted request with a RESOURCE_EXHAUSTED reason (wait-then-drop)."""
    return r.status is TaskStatus.FAILED and reason_code(r.reason) is ReasonCode.RESOURCE_EXHAUSTED


def _ttft(r: TaskRecord) -> float:
    assert r.first_token_s is not None  # checked in summarize
    return r.first_token_s - r.arrival_s


def _e2e(r: TaskRecord) -> float:
    assert r.finish_s is not None  # checked in summarize
    return r.finish_s - r.arrival_s


def _tbt(r: TaskRecord) -> float | None:
    """Mean time between tokens after the first; None with fewer than 2 tokens."""
    if r.num_output_tokens < 2 or r.first_token_s is None or r.finish_s is None:
        return None
    return (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)


def _meets_slo(r: TaskRecord, slo_ttft_s: float, slo_tbt_s: float) -> bool:
    tbt = _tbt(r)
    return _ttft(r) <= slo_ttft_s and (tbt is None or tbt <= slo_tbt_s)


def _count(records: Sequence[TaskRecord], status: TaskStatus | None) -> int:
    return sum(1 for r in records if r.status is status)


def _safe(x: float | None) -> float | None:
    """x as a float, or None for None / NaN / inf."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _ratio(num: float, den: float) -> float | None:
    return _safe(num / den) if den > 0 else None


def _mean(values: Sequence[float]) -> float | None:
    return _safe(math.fsum(values) / len(values)) if values else None


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """{mean, p50, p90, p99} of values (linear percentiles); None values if empty."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": _mean(values), "p50": _safe(p50), "p90": _safe(p90), "p99": _safe(p99)}


def _p50_p99(values: Sequence[float]) -> dict[str, float | None]:
    if len(values) == 0:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 99])
    return {"p50": _safe(p50), "p99": _safe(p99)}


# ------------------------------------------------------ confidence intervals


def t_critical_95(df: int) -> float:
    """Two-sided 95% Student-t critical value for df >= 1 (table lookup)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df > 120:
        return _Z95
    return _T95[max(k for k in _T95 if k <= df)]


def mean_ci95(values: Sequence[float]) -> tuple[float, float | None]:
    """(mean, half width of the 95% CI) with Student t and the sample std.

    Half width = t(n−1) · s / √n; None for a single value (undefined).
    Raises ValueError for no values or a non-finite one.
    """
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        raise ValueError("mean_ci95 needs at least one value")
    if not np.all(np.isfinite(arr)):
        raise ValueError("mean_ci95 got a NaN or infinite value")
    mean = float(arr.mean())
    if arr.size == 1:
        return mean, None
    std = float(arr.std(ddof=1))
    return mean, t_critical_95(arr.size - 1) * std / math.sqrt(arr.size)


# -------------------------------------------------------------------- tables


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A fixed-width text table; columns are (key, header) pairs.

    A key may be dotted ("ttft_s.p99") to reach into nested dicts. Floats
    print with 4 significant digits, a (mean, half_width) tuple as "m ± hw",
    None or a missing key as "-". Numbers are right-aligned, text left.
    """
    cells = [[_cell(_lookup(row, key)) for key, _ in columns] for row in rows]
    is_text = [
        not all(_is_numeric(_lookup(row, key)) for row in rows) if rows else True
        for key, _ in columns
    ]
    widths = [
        max([len(header)] + [len(line[i]) for line in cells])
        for i, (_, header) in enumerate(columns)
    ]

    def render(values: list[str]) -> str:
        parts = [
            v.ljust(w) if text else v.rjust(w)
            for v, w, text in zip(values, widths, is_text, strict=True)
        ]
        return "  ".join(parts).rstrip()

    lines = [render([header for _, header in columns])]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(render(line) for line in cells)
    return "\n".join(lines)


def _lookup(row: dict[str, Any], key: str) -> Any:
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _is_numeric(value: Any) -> bool:
    return value is None or isinstance(value, int | float | tuple)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, tuple) and len(value) == 2:
        mean, half = value
        return f"{_cell(mean)} ± {_cell(half)}"
    return str(value)
