"""The engine v2 options (issue 9) that the executor and the scheduler share.

An executor runs its node engine with them (`lemix.engine.EngineConfig`); the
scheduler's planner must model the same engine (`PlannerConfig`'s engine
knobs), so both read the same `LEMIX_*` variables and flags, declared once
here, and resolve them with the same profile (`EngineKnobs.resolve`). The
defaults are engine v2 (since 2026-12-02; v1 before). Values are sentinels,
not None, because a flag parsed to None counts as not given
(`lemix.infra.settings`):

- ``num_micro_batches``: N >= 1, or 0 = auto (one per stage; default);
- ``prefill_token_budget``: TOKENS >= 1, 0 = off (whole prompts), -1 = auto
  (`lemix.engine_config.default_prefill_token_budget` of the profile; default);
- ``train_slice_s``: profile seconds > 0, 0 = off (whole training passes), or
  -1 = auto (default): a quarter of the TBT SLO (half before 2026-12-04). A
  live service knows no workload, so auto takes the SLO the scheduler derives
  from the profile when no ``LEMIX_SLO_*`` is set
  (`lemix.engine_config.default_train_slice_s`); with an SLO of your own,
  give the slice (and the pace) in seconds to both services;
- ``batch_cap``: what ``max_batch_size`` caps once there are micro-batches,
  ``node`` (the node's running requests) or ``micro-batch`` (each iteration;
  default). docs/results.md (engine v2, table (a), 2026-12-01) measured the cap
  per micro-batch better for SEPARATE serving on every node (18.5 vs 17.5
  req/s at >= 90% SLO attainment) and equal for MIX-RR (16.75, bound by KV
  memory first), and it is what vLLM's pipeline-parallel virtual engines do.

- ``gather_decodes``: ``on`` (default since 2026-12-03) or ``off``: while a
  node has training, its requests decode in one micro-batch and new ones join
  the others (`lemix.engine_groups`, "Gathered decodes").
- ``decode_pace_s``: profile seconds > 0, 0 = off, or -1 = auto (default
  since 2026-12-04): gathered decode rounds start at least this long apart
  (`lemix.engine_groups`, "Paced decodes"); auto is
  `lemix.engine_config.AUTO_DECODE_PACE_TBT_FRACTION` of the TBT SLO the
  profile gives, resolved as the slice is;
- ``training_order``: ``forward-first`` (default since 2026-12-04) or
  ``backward-first`` (1F1B's rule, v1): which training pass a stage runs
  first when both are ready (`lemix.engine_stages`);
- ``spare_training``: N >= 0 training tasks a node admits beyond one per stage
  while its memory is spare (default 1 since 2026-12-04; 0 = v1;
  `lemix.engine_config.EngineConfig.spare_training_in_flight`).

``--micro-batches 1 --prefill-token-budget off --train-slice-s off
--gather-decodes off --decode-pace-s off --training-order backward-first
--spare-training 0`` select v1 (``--batch-cap`` is then moot: with one micro-batch both caps are C;
so is ``--gather-decodes``, and with it the pace).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from lemix.engine_config import (
    AUTO_DECODE_PACE_TBT_FRACTION,
    SPARE_TRAINING_FREE_FRACTION,
    TRAINING_ORDERS,
    EngineConfig,
    default_decode_pace_s,
    default_prefill_token_budget,
    default_train_slice_s,
)
from lemix.infra.settings import Option
from lemix.profile import Profile

AUTO_MICRO_BATCHES = 0
OFF_PREFILL_TOKEN_BUDGET = 0
AUTO_PREFILL_TOKEN_BUDGET = -1
OFF_TRAIN_SLICE_S = 0.0
AUTO_TRAIN_SLICE_S = -1.0
OFF_DECODE_PACE_S = 0.0
AUTO_DECODE_PACE_S = -1.0
BATCH_CAPS = ("node", "micro-batch")
ON_OFF = ("on", "off")


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
    """Seconds, "off" (0: whole training passes) or "auto" (-1: a quarter of the TBT SLO)."""
    return _seconds(text, OFF_TRAIN_SLICE_S, AUTO_TRAIN_SLICE_S)


def pace_seconds(text: str) -> float:
    """Seconds, "off" (0: unpaced) or "auto" (-1: a fraction of the TBT SLO)."""
    return _seconds(text, OFF_DECODE_PACE_S, AUTO_DECODE_PACE_S)


def _seconds(text: str, off: float, auto: float) -> float:
    lowered = text.strip().lower()
    if lowered == "off":
        return off
    return auto if lowered == "auto" else float(text)


def spare_tasks(text: str) -> int:
    """N >= 0 (0: none)."""
    return int(text)


def training_order(text: str) -> str:
    """forward-first | backward-first."""
    return _choice(text, TRAINING_ORDERS)


def batch_cap(text: str) -> str:
    """node | micro-batch."""
    return _choice(text, BATCH_CAPS)


def on_off(text: str) -> str:
    """on | off."""
    return _choice(text, ON_OFF)


def _choice(text: str, choices: tuple[str, ...]) -> str:
    value = text.strip().lower()
    if value not in choices:
        raise ValueError(f"choose one of {', '.join(choices)}")
    return value


def knob_text(field: str, value: float | str) -> str:
    """One option's value as its flag spells it (auto, off, a number, a cap)."""
    if field == "num_micro_batches" and value == AUTO_MICRO_BATCHES:
        return "auto"
    if field in ("prefill_token_budget", "train_slice_s", "decode_pace_s") and value in (0, -1):
        return "off" if value == 0 else "auto"
    return str(value)


ENGINE_OPTIONS: tuple[Option, ...] = (
    Option(
        "num_micro_batches",
        "--micro-batches",
        "LEMIX_NUM_MICRO_BATCHES",
        micro_batches,
        "inference micro-batches in flight per node (auto or 0 = one per stage; 1 = v1)",
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
        "longest piece of a training pass or optimizer step on a stage, profile s (off or "
        "0 = whole passes; auto or -1 = a quarter of the TBT SLO the profile gives)",
        "S|auto|off",
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
    Option(
        "gather_decodes",
        "--gather-decodes",
        "LEMIX_GATHER_DECODES",
        on_off,
        "while a node trains, decode its requests in one micro-batch and let new ones join "
        "the others (on or off)",
        "on|off",
    ),
    Option(
        "decode_pace_s",
        "--decode-pace-s",
        "LEMIX_DECODE_PACE_S",
        pace_seconds,
        "while decodes are gathered, start their rounds at least this long apart, profile s "
        f"(off or 0 = unpaced; auto or -1 = {AUTO_DECODE_PACE_TBT_FRACTION:g} x the TBT SLO "
        "the profile gives)",
        "S|auto|off",
    ),
    Option(
        "training_order",
        "--training-order",
        "LEMIX_TRAINING_ORDER",
        training_order,
        "which training pass a stage runs first when both are ready: forward-first or "
        "backward-first (1F1B's rule; v1)",
        "forward-first|backward-first",
    ),
    Option(
        "spare_training",
        "--spare-training",
        "LEMIX_SPARE_TRAINING",
        spare_tasks,
        "training tasks a node admits beyond one per stage while no request waits and "
        f"{SPARE_TRAINING_FREE_FRACTION:g} of its KV and activation memory is free (0 = none, v1)",
        "N",
    ),
)


@dataclass(frozen=True)
class EngineKnobs:
    """The eight options' values, checked; `resolve` maps them onto the
    keyword arguments `EngineConfig` and `build_planner_config` take. The
    defaults are engine v2 (module docstring); `V1_ENGINE_KNOBS` is v1."""

    num_micro_batches: int = AUTO_MICRO_BATCHES
    prefill_token_budget: int = AUTO_PREFILL_TOKEN_BUDGET
    train_slice_s: float = AUTO_TRAIN_SLICE_S
    batch_cap: str = "micro-batch"
    gather_decodes: str = "on"
    decode_pace_s: float = AUTO_DECODE_PACE_S
    training_order: str = "forward-first"
    spare_training: int = 1

    @classmethod
    def of(cls, source: object) -> EngineKnobs:
        """The knobs of a config or parsed arguments with a field of each name."""
        return cls(**{f.name: getattr(source, f.name) for f in fields(cls)})

    @classmethod
    def of_engine(cls, engine: EngineConfig) -> EngineKnobs:
        """Knobs that resolve to `engine`'s shape, whatever the profile (the
        auto ones given as their resolved values)."""
        return cls(
            num_micro_batches=engine.num_micro_batches or AUTO_MICRO_BATCHES,
            prefill_token_budget=engine.prefill_token_budget or OFF_PREFILL_TOKEN_BUDGET,
            train_slice_s=engine.max_training_slice_s or OFF_TRAIN_SLICE_S,
            batch_cap="micro-batch" if engine.is_batch_cap_per_micro_batch else "node",
            gather_decodes="on" if engine.is_decode_gathered else "off",
            decode_pace_s=engine.decode_pace_s or OFF_DECODE_PACE_S,
            training_order=engine.training_order,
            spare_training=engine.spare_training_in_flight,
        )

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
        slice_s = self.train_slice_s
        if not (math.isfinite(slice_s) and (slice_s >= 0 or slice_s == AUTO_TRAIN_SLICE_S)):
            raise ValueError(
                f"train_slice_s must be >= 0 s (0 = off) or -1 (auto), got {self.train_slice_s}"
            )
        if self.batch_cap not in BATCH_CAPS:
            raise ValueError(f"batch_cap must be one of {BATCH_CAPS}, got {self.batch_cap!r}")
        if self.gather_decodes not in ON_OFF:
            raise ValueError(f"gather_decodes must be on or off, got {self.gather_decodes!r}")
        pace_s = self.decode_pace_s
        if not (math.isfinite(pace_s) and (pace_s >= 0 or pace_s == AUTO_DECODE_PACE_S)):
            raise ValueError(
                f"decode_pace_s must be >= 0 s (0 = off) or -1 (auto), got {self.decode_pace_s}"
            )
        if self.training_order not in TRAINING_ORDERS:
            raise ValueError(
                f"training_order must be one of {TRAINING_ORDERS}, got {self.training_order!r}"
            )
        if self.spare_training < 0:
            raise ValueError(f"spare_training must be >= 0, got {self.spare_training}")

    def resolve(self, profile: Profile | None) -> dict[str, Any]:
        """`EngineConfig` keyword arguments; `profile` resolves an auto budget,
        slice and pace (None: no profile yet, for range checks only: they
        stay unresolved as None)."""
        budget: int | None = self.prefill_token_budget or None
        if self.prefill_token_budget == AUTO_PREFILL_TOKEN_BUDGET:
            budget = default_prefill_token_budget(profile) if profile is not None else None
        slice_s: float | None = self.train_slice_s or None
        if self.train_slice_s == AUTO_TRAIN_SLICE_S:
            # A profile whose SLO is 0 (zero latency: nothing takes time) has nothing to slice.
            slice_s = (default_train_slice_s(profile) or None) if profile is not None else None
        pace_s: float | None = self.decode_pace_s or None
        if self.decode_pace_s == AUTO_DECODE_PACE_S:
            pace_s = (default_decode_pace_s(profile) or None) if profile is not None else None
        return {
            "num_micro_batches": self.num_micro_batches or None,
            "prefill_token_budget": budget,
            "max_training_slice_s": slice_s,
            "is_batch_cap_per_micro_batch": self.batch_cap == "micro-batch",
            "is_decode_gathered": self.gather_decodes == "on",
            "decode_pace_s": pace_s,
            "training_order": self.training_order,
            "spare_training_in_flight": self.spare_training,
        }


# The v1 engine (one iteration in flight per node, whole prompts, whole
# training passes), for a run that must reproduce it.
V1_ENGINE_KNOBS = EngineKnobs(
    num_micro_batches=1,
    prefill_token_budget=OFF_PREFILL_TOKEN_BUDGET,
    train_slice_s=OFF_TRAIN_SLICE_S,
    batch_cap="node",
    gather_decodes="off",
    decode_pace_s=OFF_DECODE_PACE_S,
    training_order="backward-first",
    spare_training=0,
)
