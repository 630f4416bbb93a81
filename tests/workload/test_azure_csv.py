"""Azure CSV parsing, time-scaling and trace-replay workloads (synthetic files)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lemix.types import TaskKind
from lemix.workload import WorkloadConfig, build_workload, read_azure_csv, time_scale
from lemix.workload.azure_csv import describe, parse_timestamp, segment

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write_csv(tmp_path: Path, rows: list[str], name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(HEADER + "".join(r + "\n" for r in rows))
    return path


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    # Relative arrivals 0, 1, 3, 4 s: mean gap 4/3 s, trace rate 0.75 rps.
    return write_csv(
        tmp_path,
        [
            "2023-11-16 18:15:46.6805900,374,44",
            "2023-11-16 18:15:47.6805900,396,109",
            "2023-11-16 18:15:49.6805900,879,55",
            "2023-11-16 18:15:50.6805900,91,16",
        ],
    )


def test_reads_seven_digit_fractions_as_relative_seconds(small_trace: Path) -> None:
    trace = read_azure_csv(small_trace)
    np.testing.assert_allclose(trace.arrival_s, [0.0, 1.0, 3.0, 4.0], atol=1e-9)
    assert trace.prompt_tokens.tolist() == [374, 396, 879, 91]
    assert trace.output_tokens.tolist() == [44, 109, 55, 16]
    assert trace.num_requests == 4
    assert trace.duration_s == pytest.approx(4.0)
    assert trace.mean_rate_rps == pytest.approx(1.0)  # n / span, as the README quotes


def test_fraction_precision_and_day_boundary(tmp_path: Path) -> None:
    path = write_csv(
        tmp_path,
        [
            "2023-11-16 23:59:59.9999999,10,10",
            "2023-11-17 00:00:00.0000001,10,10",
            "2023-11-17 00:00:01.5,10,10",
            "2023-11-17 00:00:02,10,10",
        ],
    )
    trace = read_azure_csv(path)
    np.testing.assert_allclose(trace.arrival_s, [0.0, 2e-7, 1.5000001, 2.0000001], atol=1e-9)


def test_unsorted_rows_are_sorted_with_their_lengths(tmp_path: Path) -> None:
    path = write_csv(tmp_path, ["5.0,50,5", "1.0,10,1", "3.0,30,3"])
    trace = read_azure_csv(path)
    assert trace.arrival_s.tolist() == [0.0, 2.0, 4.0]
    assert trace.prompt_tokens.tolist() == [10, 30, 50]
    assert trace.output_tokens.tolist() == [1, 3, 5]


def test_parse_timestamp_splits_whole_and_fraction() -> None:
    whole, frac = parse_timestamp("1970-01-01 00:01:00.2500000")
    assert (whole, frac) == (60.0, 0.25)


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (["2023-11-16 18:15:46.1,10,x"], ":2:"),
        (["2023-11-16 18:15:46.1,10,5", "not-a-date,10,5"], ":3:"),
        (["2023-11-16 18:15:46.1,-1,5"], ":2:"),
        (["2023-11-16 18:15:46.1x,1,5"], ":2:"),
        ([], "no requests"),
    ],
)
def test_bad_rows_raise_with_line_number(tmp_path: Path, rows: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        read_azure_csv(write_csv(tmp_path, rows))


def test_missing_column_raises(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens\n1.0,5\n")
    with pytest.raises(ValueError, match="GeneratedTokens"):
        read_azure_csv(path)


def test_time_scale_hits_target_mean_gap(small_trace: Path) -> None:
    scaled = time_scale(read_azure_csv(small_trace).arrival_s, 1.5)
    # Trace rate (n-1)/span = 0.75; to 1.5 rps every gap halves.
    np.testing.assert_allclose(scaled, [0.0, 0.5, 1.5, 2.0], atol=1e-9)


def test_time_scale_needs_two_distinct_times() -> None:
    with pytest.raises(ValueError):
        time_scale(np.array([3.0]), 1.0)
    with pytest.raises(ValueError):
        time_scale(np.array([2.0, 2.0]), 1.0)


def test_trace_workload_replays_scaled_window(small_trace: Path) -> None:
    cfg = WorkloadConfig(
        source="trace", trace_path=str(small_trace), request_rate=1.5, duration_s=2.0
    )
    wl = build_workload(cfg)
    assert [t.arrival_s for t in wl.tasks] == pytest.approx([0.0, 0.5, 1.5])
    assert [t.task_id for t in wl.tasks] == ["inf-000000", "inf-000001", "inf-000002"]
    assert [(t.num_prompt_tokens, t.max_output_tokens) for t in wl.tasks] == [
        (374, 44),
        (396, 109),
        (879, 55),
    ]
    assert wl.duration_s == 2.0


def test_trace_workload_whole_trace_when_no_duration(small_trace: Path) -> None:
    for duration in (None, 0.0, 100.0):
        cfg = WorkloadConfig(
            source="trace", trace_path=str(small_trace), request_rate=1.5, duration_s=duration
        )
        wl = build_workload(cfg)
        assert [t.arrival_s for t in wl.tasks] == pytest.approx([0.0, 0.5, 1.5, 2.0])
        assert wl.duration_s == pytest.approx(4 / 1.5)  # n mean gaps


def test_trace_workload_clips_to_context(tmp_path: Path) -> None:
    path = write_csv(tmp_path, ["0.0,5000,100", "1.0,10,5000", "2.0,100,100"])
    wl = build_workload(
        WorkloadConfig(source="trace", trace_path=str(path), request_rate=1.0, duration_s=None)
    )
    lengths = [(t.num_prompt_tokens, t.max_output_tokens) for t in wl.tasks]
    assert lengths == [(3996, 100), (1, 4095), (100, 100)]
    assert wl.num_clipped == 2


def test_trace_workload_with_training_and_parametric_lengths(small_trace: Path) -> None:
    cfg = WorkloadConfig(
        source="trace",
        trace_path=str(small_trace),
        request_rate=1.5,
        duration_s=None,
        length_source="parametric",
        train_rate=0.5,
        seed=3,
    )
    wl = build_workload(cfg)
    inference = [t for t in wl.tasks if t.kind is TaskKind.INFERENCE]
    assert [t.arrival_s for t in inference] == pytest.approx([0.0, 0.5, 1.5, 2.0])
    assert all(0 <= t.arrival_s < wl.duration_s for t in wl.tasks)


def test_describe_reports_medians(small_trace: Path) -> None:
    stats = describe(read_azure_csv(small_trace))
    assert stats["num_requests"] == 4
    assert stats["prompt_median"] == pytest.approx((374 + 396) / 2)
    assert stats["output_median"] == pytest.approx((44 + 55) / 2)


def test_segments_are_disjoint_equal_slices_rebased_to_zero(small_trace: Path) -> None:
    trace = read_azure_csv(small_trace)
    first, second = segment(trace, 0, 2), segment(trace, 1, 2)
    assert list(first.prompt_tokens) == [374, 396] and list(second.prompt_tokens) == [879, 91]
    assert list(first.arrival_s) == pytest.approx([0.0, 1.0])
    assert list(second.arrival_s) == pytest.approx([0.0, 1.0])  # 3 s and 4 s, rebased
    assert list(segment(trace, 0, 1).prompt_tokens) == [374, 396, 879, 91]


@pytest.mark.parametrize(
    ("index", "num", "match"),
    [(2, 2, "--segment must be in 0..1"), (0, 0, "--segments must be >= 1"), (0, 3, "cannot make")],
)
def test_bad_segments_are_refused(small_trace: Path, index: int, num: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        segment(read_azure_csv(small_trace), index, num)


def test_trace_workload_replays_the_chosen_segment(small_trace: Path) -> None:
    def lengths(k: int) -> list[int]:
        cfg = WorkloadConfig(
            source="trace",
            trace_path=str(small_trace),
            request_rate=1.0,
            duration_s=None,
            num_segments=2,
            segment=k,
        )
        return [t.num_prompt_tokens for t in build_workload(cfg).tasks]

    assert lengths(0) == [374, 396] and lengths(1) == [879, 91]
    with pytest.raises(ValueError, match="segments slice a trace replay"):
        WorkloadConfig(source="poisson", num_segments=2)
