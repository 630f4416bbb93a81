"""The long-prompt bursty workload (issue 9): long prompts, short answers,
arrivals in bursts.

Summarisation/RAG-shaped traffic that stresses prefill rather than decode:
- prompts uniform in [1024, 8192] tokens, outputs uniform in [5, 30] tokens
  (independent draws, both ends inclusive);
- Gamma inter-arrival gaps of mean 1/rate and coefficient of variation CV
  (default 3, so bursts of near-simultaneous arrivals separated by long
  quiet gaps): shape k = 1/CV², scale θ = 1/(rate·k), so mean kθ = 1/rate and
  CV = 1/√k. CV 1 is a Poisson process.

Pure and seeded like every workload: the arrivals and lengths come from
their own RNG streams (`lemix.workload.base.stream_rng`), drawn in fixed
chunks, so a longer window only appends tasks. Select it with
`WorkloadConfig(source="long-prompt", ...)`; the context limit must fit the
longest prompt plus the longest output (`LONG_PROMPT_MAX_TOTAL_TOKENS`), or
`build_workload` clips prompts as for any source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LONG_PROMPT_MIN_TOKENS = 1024
LONG_PROMPT_MAX_TOKENS = 8192
LONG_OUTPUT_MIN_TOKENS = 5
LONG_OUTPUT_MAX_TOKENS = 30
DEFAULT_BURST_CV = 3.0
# Fits every prompt and output unclipped.
LONG_PROMPT_MAX_TOTAL_TOKENS = LONG_PROMPT_MAX_TOKENS + LONG_OUTPUT_MAX_TOKENS
GAMMA_CHUNK = 1024  # gaps drawn per RNG call; fixed, so prefixes never depend on n


@dataclass(frozen=True)
class UniformLengths:
    """Independent uniform prompt and output lengths (tokens, inclusive bounds)."""

    prompt_min: int = LONG_PROMPT_MIN_TOKENS
    prompt_max: int = LONG_PROMPT_MAX_TOKENS
    output_min: int = LONG_OUTPUT_MIN_TOKENS
    output_max: int = LONG_OUTPUT_MAX_TOKENS

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_min <= self.prompt_max:
            raise ValueError(f"need 1 <= prompt_min <= prompt_max, got {self}")
        if not 1 <= self.output_min <= self.output_max:
            raise ValueError(f"need 1 <= output_min <= output_max, got {self}")

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n pairs; one (prompt, output) row per task keeps prefixes stable."""
        u = rng.random((n, 2))
        prompt = self.prompt_min + np.floor(u[:, 0] * (self.prompt_max - self.prompt_min + 1))
        output = self.output_min + np.floor(u[:, 1] * (self.output_max - self.output_min + 1))
        return prompt.astype(np.int64), output.astype(np.int64)


def gamma_arrivals(
    rate: float, cv: float, duration_s: float, rng: np.random.Generator
) -> np.ndarray:
    """Arrival times in [0, duration_s) with Gamma gaps: mean 1/rate, CV `cv`.

    Shape k = 1/cv², scale 1/(rate·k). Rate 0 gives no arrivals.
    """
    if rate < 0 or duration_s < 0:
        raise ValueError(f"need rate >= 0 and duration_s >= 0, got {rate}, {duration_s}")
    if not (math.isfinite(cv) and cv > 0):
        raise ValueError(f"the inter-arrival CV must be > 0, got {cv}")
    if rate == 0 or duration_s == 0:
        return np.empty(0, dtype=np.float64)
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    chunks: list[np.ndarray] = []
    last = 0.0
    while last < duration_s:
        times = last + np.cumsum(rng.gamma(shape, scale, size=GAMMA_CHUNK))
        chunks.append(times)
        last = float(times[-1])
    arrivals = np.concatenate(chunks)
    return arrivals[arrivals < duration_s]
