"""Metrics on hand-built TaskRecords, CI helper and table formatting."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from metric_keys import DESIGN_KEYS

from lemix.report.metrics import (
    EXTRA_KEYS,
    METRIC_KEYS,
    format_table,
    mean_ci95,
    summarize,
    t_critical_95,
)
from lemix.types import TaskKind, TaskRecord, TaskStatus

INF, TRN = TaskKind.INFERENCE, TaskKind.TRAINING
DONE = TaskStatus.COMPLETED


def inf(
    task_id: str,
    arrival: float,
    first: float | None,
    finish: float | None,
    n: int,
    status: TaskStatus | None = DONE,
    **kw: Any,
) -> TaskRecord:
    return TaskRecord(
        task_id,
        INF,
        arrival,
        num_prompt_tokens=10,
        max_output_tokens=max(n, 1),
        status=status,
        first_token_s=first,
        finish_s=finish,
        num_output_tokens=n,
        **kw,
    )


def records() -> list[TaskRecord]:
    return [
        # TTFT 0.5, TBT 2.0/4 = 0.5, E2E 2.5: meets both SLOs.
        inf("a", 0.0, 0.5, 2.5, 5, inference_loss=2.0, serving_staleness_updates=1),
        # TTFT 2.0 > 1.0: misses. TBT 1.0/2 = 0.5, E2E 3.0.
        inf("b", 1.0, 3.0, 4.0, 3, inference_loss=3.0),
        # One token: no TBT; TTFT 0.2, E2E 0.2: meets.
        inf("c", 2.0, 2.2, 2.2, 1, serving_staleness_updates=3),
        inf(
            "d",
            3.0,
            None,
            None,
            0,
            status=TaskStatus.REJECTED,
            reason="too long",
            inference_loss=9.0,
        ),
        inf("e", 4.0, None, None, 0, status=None),  # lost: never got an outcome
        TaskRecord("t1", TRN, 0.0, 100, batch_size=4, status=DONE, finish_s=5.0),
        TaskRecord("t2", TRN, 1.0, 100, batch_size=4, status=TaskStatus.FAILED, reason="oom"),
    ]


def run(recs: list[TaskRecord], **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        policy="lemix",
        seed=1,
        request_rate=2.0,
        train_rate=0.3,
        duration_s=5.0,
        makespan_s=10.0,
        slo_ttft_s=1.0,
        slo_tbt_s=0.6,
        utilization=0.75,
        decision_latency_us=[10.0, 20.0, 30.0, 40.0, 50.0],
        node_active_spans_s=[2.0, 3.0],
    )
    kwargs.update(overrides)
    return summarize(recs, **kwargs)


def test_keys_are_the_design_contract_then_extras() -> None:
    m = run(records())
    assert tuple(DESIGN_KEYS) == METRIC_KEYS
    assert list(m) == [*METRIC_KEYS, *EXTRA_KEYS]
    json.dumps(m, allow_nan=False)


def test_counts_including_rejected_failed_and_lost() -> None:
    m = run(records())
    assert (m["num_inference"], m["num_training"]) == (5, 2)
    assert (m["num_completed_inference"], m["num_completed_training"]) == (3, 1)
    assert (m["num_rejected"], m["num_failed"], m["num_lost"], m["num_completed"]) == (1, 1, 1, 4)


def test_rates_slo_and_goodput_hand_values() -> None:
    m = run(records())
    assert m["throughput_tasks_s"] == pytest.approx(4 / 10)
    assert m["throughput_tokens_s"] == pytest.approx(9 / 10)
    assert m["goodput_rps"] == pytest.approx(2 / 5)  # a and c, over the 5 s arrival window
    assert m["slo_attainment"] == pytest.approx(2 / 5)  # rejected and lost count as misses
    assert m["training_samples_s"] == pytest.approx(4 / 10)
    assert m["throughput_tasks_s_paper"] == pytest.approx(4 / 5)
    assert (m["slo_ttft_s"], m["slo_tbt_s"], m["makespan_s"]) == (1.0, 0.6, 10.0)
    assert m["utilization"] == 0.75


def test_latency_distributions_hand_values() -> None:
    m = run(records())
    # TTFT sorted [0.2, 0.5, 2.0]; linear p90 at index 1.8, p99 at 1.98.
    assert m["ttft_s"] == pytest.approx({"mean": 0.9, "p50": 0.5, "p90": 1.7, "p99": 1.97})
    assert m["tbt_s"] == pytest.approx({"mean": 0.5, "p50": 0.5, "p90": 0.5, "p99": 0.5})
    # E2E sorted [0.2, 2.5, 3.0].
    assert m["e2e_s"] == pytest.approx({"mean": 1.9, "p50": 2.5, "p90": 2.9, "p99": 2.99})
    assert m["decision_latency_us"] == pytest.approx({"p50": 30.0, "p99": 49.6})


def test_means_over_completed_inference_only() -> None:
    m = run(records())
    assert m["inference_loss"] == pytest.approx(2.5)  # the rejected one's 9.0 is ignored
    assert m["serving_staleness_updates"] == pytest.approx(2.0)


def test_tbt_slo_miss() -> None:
    m = run(records(), slo_tbt_s=0.4)  # a's TBT 0.5 now misses; c has no TBT
    assert m["slo_attainment"] == pytest.approx(1 / 5)


def test_empty_run_is_json_safe_nulls() -> None:
    m = run(
        [], makespan_s=0.0, decision_latency_us=[], node_active_spans_s=[], utilization=float("nan")
    )
    assert m["slo_attainment"] is None and m["throughput_tasks_s"] is None
    assert m["ttft_s"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert m["decision_latency_us"] == {"p50": None, "p99": None}
    assert m["inference_loss"] is None and m["serving_staleness_updates"] is None
    assert m["utilization"] is None and m["num_lost"] == 0
    json.dumps(m, allow_nan=False)


def test_inconsistent_completed_record_raises() -> None:
    with pytest.raises(ValueError, match="lacks first_token_s"):
        run([inf("x", 0.0, None, 1.0, 2)])
    with pytest.raises(ValueError):
        run([], slo_ttft_s=0.0)


def test_mean_ci95_hand_values() -> None:
    mean, half = mean_ci95([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert half == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert mean_ci95([5.0]) == (5.0, None)
    with pytest.raises(ValueError):
        mean_ci95([])
    with pytest.raises(ValueError):
        mean_ci95([1.0, float("nan")])


def test_t_table() -> None:
    assert t_critical_95(1) == 12.706
    assert t_critical_95(30) == 2.042
    assert t_critical_95(35) == 2.042  # next lower tabulated df: conservative
    assert t_critical_95(60) == 2.000
    assert t_critical_95(1000) == 1.96
    with pytest.raises(ValueError):
        t_critical_95(0)


def test_format_table() -> None:
    rows = [
        {"policy": "lemix", "ttft_s": {"p99": 0.123456}, "n": 12, "ci": (1.5, 0.25)},
        {"policy": "separate", "ttft_s": {"p99": None}, "n": 3},
    ]
    out = format_table(
        rows, [("policy", "policy"), ("ttft_s.p99", "ttft p99"), ("n", "n"), ("ci", "thr")]
    )
    lines = out.splitlines()
    assert lines[0].split() == ["policy", "ttft", "p99", "n", "thr"]
    assert lines[2].split() == ["lemix", "0.1235", "12", "1.5", "±", "0.25"]
    assert lines[3].split() == ["separate", "-", "3", "-"]
    assert len({len(line) for line in lines[:3]}) == 1  # fixed width
    assert lines[3].startswith("separate")
    assert lines[2].index(" 12 ") + 3 == lines[3].index(" 3 ") + 2  # numbers right-aligned


def test_training_is_judged_inside_the_arrival_window() -> None:
    """Held-back training drained after the window shows as a low window rate
    and a backlog, which the makespan rate hides (issue 10)."""

    def trn(task_id: str, arrival: float, finish: float | None, samples: int) -> TaskRecord:
        status = DONE if finish is not None else TaskStatus.FAILED
        return TaskRecord(
            task_id, TRN, arrival, 10, batch_size=samples, status=status, finish_s=finish
        )

    recs = [
        inf("a", 0.0, 0.5, 2.5, 5),
        trn("t1", 0.5, 3.0, 2),  # finished inside the 5 s window
        trn("t2", 1.0, 9.0, 3),  # drained after it
        trn("t3", 4.0, None, 4),  # never finished
        trn("t4", 6.0, 8.0, 5),  # offered after the window: neither
    ]
    m = run(recs)
    assert m["training_samples_s_window"] == pytest.approx(2 / 5)
    assert m["training_backlog_end"] == 3 + 4
    assert m["training_samples_s"] == pytest.approx((2 + 3 + 5) / 10)
    assert m["throughput_requests_s"] == pytest.approx(1 / 10)


def test_kv_memory_failures_are_counted_apart_from_other_failures() -> None:
    kv = "RESOURCE_EXHAUSTED: no KV memory within T_max"
    recs = [
        inf("kv1", 0.0, None, None, 0, status=TaskStatus.FAILED, reason=kv),
        inf("kv2", 0.1, None, None, 0, status=TaskStatus.FAILED, reason=kv),
        # Failed for another reason, or refused before running: not counted.
        inf("gone", 0.2, None, None, 0, status=TaskStatus.FAILED, reason="CANCELLED: client"),
        inf("big", 0.3, None, None, 0, status=TaskStatus.REJECTED, reason=kv),
        # Training re-queued for memory never fails this way; a training
        # failure with that code is not a request's.
        TaskRecord("t", TRN, 0.0, 100, status=TaskStatus.FAILED, reason=kv),
    ]
    m = run(recs)
    assert m["num_failed_kv_memory"] == 2
    assert m["num_failed"] == 4
    assert run(records())["num_failed_kv_memory"] == 0
