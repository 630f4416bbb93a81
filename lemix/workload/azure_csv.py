"""Azure LLM inference trace (CSV) reader and time-scaling for replay.

Format (Azure/AzurePublicDataset, AzureLLMInferenceTrace_*.csv): a header
`TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps like
"2023-11-16 18:15:46.6805900" (seven fractional digits, which
`datetime.fromisoformat` does not accept on every Python version, so the
fraction is parsed by hand). Plain numeric timestamps (seconds) are accepted
too.
"""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import numpy as np

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class AzureTrace(NamedTuple):
    """A trace as arrays, sorted by arrival (stable for equal timestamps)."""

    arrival_s: np.ndarray  # float64, seconds since the first request, shape (n,)
    prompt_tokens: np.ndarray  # int64 ContextTokens, shape (n,)
    output_tokens: np.ndarray  # int64 GeneratedTokens, shape (n,)

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        """Span from the first to the last request."""
        return float(self.arrival_s[-1]) if len(self.arrival_s) else 0.0

    @property
    def mean_rate_rps(self) -> float:
        """Requests over span (n / duration), the figure the trace README quotes."""
        return self.num_requests / self.duration_s if self.duration_s > 0 else 0.0


def segment(trace: AzureTrace, index: int, num_segments: int) -> AzureTrace:
    """The `index`-th (0-based) of `num_segments` disjoint slices of equal row
    counts (the first ones one row longer when n does not divide), its times
    rebased to its first arrival: different segments replay different
    requests, so runs over segments vary the arrivals, not only the noise."""
    if num_segments < 1:
        raise ValueError(f"--segments must be >= 1, got {num_segments}")
    if not 0 <= index < num_segments:
        raise ValueError(f"--segment must be in 0..{num_segments - 1}, got {index}")
    if trace.num_requests < 2 * num_segments:
        raise ValueError(
            f"a trace of {trace.num_requests} requests cannot make {num_segments} "
            f"segments of at least 2 requests"
        )
    bounds = np.linspace(0, trace.num_requests, num_segments + 1).round().astype(np.int64)
    rows = slice(int(bounds[index]), int(bounds[index + 1]))
    arrival_s = trace.arrival_s[rows]
    return AzureTrace(
        arrival_s - arrival_s[0], trace.prompt_tokens[rows], trace.output_tokens[rows]
    )


def parse_timestamp(text: str) -> tuple[float, float]:
    """Split a timestamp into (whole seconds since the epoch, fraction).

    Kept apart so relative times stay exact to 0.1 µs: a float of epoch
    seconds with seven fractional digits would exceed float64 precision.
    Naive datetimes are read as UTC; only differences are ever used.
    """
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        whole = float(np.floor(value))
        return whole, value - whole
    base, dot, frac = text.partition(".")
    if dot and not frac.isdigit():
        raise ValueError(f"bad fractional seconds in timestamp {text!r}")
    when = datetime.fromisoformat(base)  # ValueError on a malformed date
    epoch = datetime(1970, 1, 1, tzinfo=when.tzinfo)
    whole = (when - epoch).total_seconds()
    fraction = int(frac) / 10 ** len(frac) if dot else 0.0
    return whole, fraction


def read_azure_csv(path: str | Path) -> AzureTrace:
    """Read an Azure-format CSV into relative arrival seconds and token counts.

    Raises ValueError naming the line for a missing column, a bad timestamp or
    a non-integer / negative token count, and for an empty trace.
    """
    wholes: list[float] = []
    fracs: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; need {list(COLUMNS)}")
        for row in reader:
            try:
                whole, frac = parse_timestamp(row["TIMESTAMP"])
                prompt, output = (
                    _token_count(row["ContextTokens"]),
                    _token_count(row["GeneratedTokens"]),
                )
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{reader.line_num}: {e}") from e
            wholes.append(whole)
            fracs.append(frac)
            prompts.append(prompt)
            outputs.append(output)
    if not wholes:
        raise ValueError(f"{path}: no requests")
    return _to_trace(wholes, fracs, prompts, outputs)


def _token_count(text: str | None) -> int:
    if text is None:
        raise ValueError("row has too few fields")
    value = int(text.strip())
    if value < 0:
        raise ValueError(f"negative token count {value}")
    return value


def _to_trace(
    wholes: list[float], fracs: list[float], prompts: list[int], outputs: list[int]
) -> AzureTrace:
    whole = np.asarray(wholes, dtype=np.float64)
    frac = np.asarray(fracs, dtype=np.float64)
    # (whole - first whole) is exact; adding the fraction difference keeps 0.1 µs.
    rel = (whole - whole.min()) + frac
    order = np.argsort(rel, kind="stable")
    rel = rel[order]
    return AzureTrace(
        arrival_s=rel - rel[0],
        prompt_tokens=np.asarray(prompts, dtype=np.int64)[order],
        output_tokens=np.asarray(outputs, dtype=np.int64)[order],
    )


def time_scale(arrival_s: np.ndarray, request_rate: float) -> np.ndarray:
    """Scale relative arrivals so the mean inter-arrival gap is 1/request_rate.

    The trace's own rate is (n − 1) / span, one gap per consecutive pair; the
    scaled trace keeps the shape of the arrival process (bursts and lulls).
    """
    n = len(arrival_s)
    span = float(arrival_s[-1] - arrival_s[0]) if n else 0.0
    if n < 2 or span <= 0:
        raise ValueError("time-scaling needs at least two distinct arrival times")
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    trace_rate = (n - 1) / span
    return (arrival_s - arrival_s[0]) * (trace_rate / request_rate)


def describe(trace: AzureTrace) -> dict[str, float]:
    """Summary numbers of a trace (count, span, rate, length medians and means)."""
    return {
        "num_requests": float(trace.num_requests),
        "duration_s": trace.duration_s,
        "mean_rate_rps": trace.mean_rate_rps,
        "prompt_median": float(np.median(trace.prompt_tokens)),
        "prompt_mean": float(np.mean(trace.prompt_tokens)),
        "output_median": float(np.median(trace.output_tokens)),
        "output_mean": float(np.mean(trace.output_tokens)),
    }
