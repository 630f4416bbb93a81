"""The engine v2 options (issue 9) that the executor and the scheduler share.

An executor runs its node engine with them (`lemix.engine.EngineConfig`); the
scheduler's planner must model the same engine (`PlannerConfig`'s engine
knobs), so both read the same `LEMIX_*` variables and flags, declared once
here. The defaults are the v1 engine. Values are sentinels, not None, because
a flag parsed to None counts as not given (`lemix.infra.settings`):

- ``num_micro_batches``: N >= 1, or 0 = auto (one per stage);
- ``prefill_token_budget``: TOKENS >= 1, 0 = off (whole prompts), -1 = auto
  (`lemix.engine_config.default_prefill_token_budget` of the profile);
- ``train_slice_s``: profile seconds > 0, or 0 = off (whole training passes);
- ``batch_cap``: what ``max_batch_size`` caps once there are micro-batches,
  ``node`` (the node's running requests) or ``micro-batch`` (each iteration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lemix.engine_config import default_prefill_token_budget
from lemix.infra.settings import Option
from lemix.profile import Profile

AUTO_MICRO_BATCHES = 0
OFF_PREFILL_TOKEN_BUDGET = 0
AUTO_PREFILL_TOKEN_BUDGET = -1
BATCH_CAPS = ("node", "micro-batch")


def micro_batches(text: str) -> int:
    """N, or "auto" (0: one per stage)."""
    return AUTO_MICRO_BATCHES if text.strip().lower() == "auto" else int(text)


def token_budget(text: str) -> int:
    """TOKENS, "off" (0: whole prompts) or "auto" (-1: the profile's default)."""
    lowered = text.strip().lower()
    if lowered == "off":
        return OFF_PREFILL_TOKEN_BUDGET
    return AUTO_PREFILL_TOKEN_BUDGET if lowered == "auto" else int(text)


def slice_seconds(text: str) -> float:
    """Seconds, or "off" (0: whole training passes)."""
    return 0.0 if text.strip().lower() == "off" else float(text)


def batch_cap(text: str) -> str:
    """node | micro-batch."""
    value = text.strip().lower()
    if value not in BATCH_CAPS:
        raise ValueError(f"choose one of {', '.join(BATCH_CAPS)}")
    return value


ENGINE_OPTIONS: tuple[Option, ...] = (
    Option(
        "num_micro_batches",
        "--micro-batches",
        "LEMIX_NUM_MICRO_BATCHES",
        micro_batches,
        "inference micro-batches in flight per node (auto or 0 = one per stage)",
        "N|auto",
    ),
    Option(
        "prefill_token_budget",
        "--prefill-token-budget",
        "LEMIX_PREFILL_TOKEN_BUDGET",
        token_budget,
        "chunked prefill: tokens per iteration (off or 0 = whole prompts; auto or -1 = "
        "the profile's default)",
        "TOKENS|auto|off",
    ),
    Option(
        "train_slice_s",
        "--train-slice-s",
        "LEMIX_TRAIN_SLICE_S",
        slice_seconds,
        "longest piece of a training pass on a stage, profile s (off or 0 = whole passes; "
        "on torch a slice clips its layer group's gradient norm)",
        "S|off",
    ),
    Option(
        "batch_cap",
        "--batch-cap",
        "LEMIX_BATCH_CAP",
        batch_cap,
        "what --max-batch-size caps with micro-batches: node (the node's running "
        "requests) or micro-batch (each iteration; up to M x C per node)",
        "node|micro-batch",
    ),
)


@dataclass(frozen=True)
class EngineKnobs:
    """The four options' values, checked; `resolve` maps them onto the
    keyword arguments `EngineConfig` and `build_planner_config` take."""

    num_micro_batches: int = 1
    prefill_token_budget: int = OFF_PREFILL_TOKEN_BUDGET
    train_slice_s: float = 0.0
    batch_cap: str = "node"

    def __post_init__(self) -> None:
        if self.num_micro_batches < 0:
            raise ValueError(
                f"num_micro_batches must be >= 1, or 0 (auto: one per stage), "
                f"got {self.num_micro_batches}"
            )
        if self.prefill_token_budget < AUTO_PREFILL_TOKEN_BUDGET:
            raise ValueError(
                f"prefill_token_budget must be >= 1 tokens, 0 (off) or -1 (auto), "
                f"got {self.prefill_token_budget}"
            )
        if not (math.isfinite(self.train_slice_s) and self.train_slice_s >= 0):
            raise ValueError(f"train_slice_s must be >= 0 s (0 = off), got {self.train_slice_s}")
        if self.batch_cap not in BATCH_CAPS:
            raise ValueError(f"batch_cap must be one of {BATCH_CAPS}, got {self.batch_cap!r}")

    def resolve(self, profile: Profile | None) -> dict[str, Any]:
        """`EngineConfig` keyword arguments; `profile` resolves an auto budget
        (None: no profile yet, an auto budget stays unresolved as None)."""
        budget: int | None = self.prefill_token_budget or None
        if self.prefill_token_budget == AUTO_PREFILL_TOKEN_BUDGET:
            budget = default_prefill_token_budget(profile) if profile is not None else None
        return {
            "num_micro_batches": self.num_micro_batches or None,
            "prefill_token_budget": budget,
            "max_training_slice_s": self.train_slice_s or None,
            "is_batch_cap_per_micro_batch": self.batch_cap == "micro-batch",
        }
