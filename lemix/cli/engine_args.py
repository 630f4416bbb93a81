"""The engine v2 flags of `lemix sim` and `lemix compare` (issue 9), mapped onto
`SimRunConfig`'s knobs. Every default is the v1 engine: one micro-batch in
flight per node, whole prompts, whole training passes.

- ``--micro-batches N|auto``: inference micro-batches in flight per node;
  auto = one per stage, so every stage of the pipeline can work at once.
- ``--prefill-budget TOKENS|auto|off``: tokens one iteration may carry (each
  decode step counts one; prefills are chunked into the rest); auto = the
  profile-derived default of `lemix.engine_config.default_prefill_token_budget`.
- ``--train-slice-s SECONDS|auto|off``: the longest uninterrupted piece of a
  training pass on one stage; auto = half the run's TBT SLO, so a decode step
  that arrives behind a slice still has half its SLO left to run in. The SLO
  depends on the workload (`lemix.slo.compute_slo`), so auto is resolved when
  each run's SLO is known (`SimRunConfig.train_slice_tbt_fraction`).
- ``--batch-cap node|micro-batch``: what ``--max-batch-size`` C caps once there
  are micro-batches: the node's running requests, split evenly (default), or
  each micro-batch's iteration (the node holds up to M × C when KV memory
  allows), as vLLM's pipeline-parallel virtual engines do.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from lemix.engine_config import default_prefill_token_budget
from lemix.profile import Profile

AUTO, OFF = "auto", "off"
BATCH_CAP_NODE, BATCH_CAP_MICRO_BATCH = "node", "micro-batch"
AUTO_TRAIN_SLICE_TBT_FRACTION = 0.5  # --train-slice-s auto: half the TBT SLO


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--micro-batches",
        default="1",
        metavar="N|auto",
        help="inference micro-batches in flight per node (auto: one per stage; default 1)",
    )
    p.add_argument(
        "--prefill-budget",
        default=OFF,
        metavar="TOKENS|auto|off",
        help="chunked prefill: tokens per iteration (auto: profile default; default off)",
    )
    p.add_argument(
        "--train-slice-s",
        default=OFF,
        metavar="SECONDS|auto|off",
        help="longest piece of a training pass on a stage (auto: half the TBT SLO; default off)",
    )
    p.add_argument(
        "--batch-cap",
        default=BATCH_CAP_NODE,
        choices=(BATCH_CAP_NODE, BATCH_CAP_MICRO_BATCH),
        help="what --max-batch-size caps with micro-batches: the node's running requests "
        "(default) or each micro-batch's iteration",
    )


def engine_knobs(args: argparse.Namespace, profile: Profile) -> dict[str, Any]:
    """`SimRunConfig` keyword arguments for the engine flags (ValueError on bad values)."""
    return {
        "num_micro_batches": parse_micro_batches(args.micro_batches),
        "prefill_token_budget": parse_prefill_budget(args.prefill_budget, profile),
        **parse_train_slice(args.train_slice_s),
        "is_batch_cap_per_micro_batch": args.batch_cap == BATCH_CAP_MICRO_BATCH,
    }


def parse_micro_batches(text: str) -> int | None:
    """N >= 1, or auto (None: one per stage)."""
    if text.strip().lower() == AUTO:
        return None
    value = _int("--micro-batches", text, "N|auto")
    if value < 1:
        raise ValueError(f"--micro-batches must be >= 1 or auto, got {value}")
    return value


def parse_prefill_budget(text: str, profile: Profile) -> int | None:
    """TOKENS >= 1, off (None: whole prompts) or auto (the profile's default)."""
    lowered = text.strip().lower()
    if lowered == OFF:
        return None
    if lowered == AUTO:
        return default_prefill_token_budget(profile)
    value = _int("--prefill-budget", text, "TOKENS|auto|off")
    if value < 1:
        raise ValueError(f"--prefill-budget must be >= 1 tokens, auto or off, got {value}")
    return value


def parse_train_slice(text: str) -> dict[str, float | None]:
    """SECONDS > 0, off, or auto (a fraction of the TBT SLO, resolved per run)."""
    lowered = text.strip().lower()
    if lowered == OFF:
        return {"train_slice_s": None, "train_slice_tbt_fraction": None}
    if lowered == AUTO:
        return {"train_slice_s": None, "train_slice_tbt_fraction": AUTO_TRAIN_SLICE_TBT_FRACTION}
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--train-slice-s needs SECONDS|auto|off, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"--train-slice-s must be > 0 s, auto or off, got {text!r}")
    return {"train_slice_s": value, "train_slice_tbt_fraction": None}


def _int(flag: str, text: str, expected: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{flag} needs {expected}, got {text!r}") from None
