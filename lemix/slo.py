"""The SLO a run is judged by: a multiple of the unloaded latency of the
workload's median request on the profile. The simulator, `lemix compare` and
the live scheduler compute it the same way."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from lemix.profile import Profile
from lemix.types import Task, TaskKind


@dataclass(frozen=True)
class SloConfig:
    """One SLO for every policy in a comparison, computed the same way."""

    multiplier: float = 5.0  # × the standalone (unloaded) latency

    def __post_init__(self) -> None:
        if self.multiplier <= 0:
            raise ValueError("SLO multiplier must be > 0")


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tbt_s: float


def compute_slo(profile: Profile, tasks: Sequence[Task], config: SloConfig) -> Slo:
    """TTFT SLO = k × unloaded prefill of the median prompt; TBT SLO = k × unloaded
    decode step at the median mid-decode context. Depends on the workload and the
    profile only, never on the policy."""
    inference = [t for t in tasks if t.kind is TaskKind.INFERENCE]
    if inference:
        prompt = int(statistics.median(t.num_prompt_tokens for t in inference))
        context = int(
            statistics.median(t.num_prompt_tokens + t.max_output_tokens // 2 for t in inference)
        )
    else:
        prompt, context = 512, 512
    return Slo(
        ttft_s=config.multiplier * profile.standalone_prefill_s(prompt),
        tbt_s=config.multiplier * profile.standalone_decode_step_s(context),
    )
