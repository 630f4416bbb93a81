"""The engine v2 flags of `lemix sim` and `lemix compare` (issue 9), mapped onto
`SimRunConfig`'s knobs. Every default is engine v2 (since 2026-12-02; the
tables of docs/results.md measured before then ran v1):

- ``--micro-batches N|auto``: inference micro-batches in flight per node;
  auto (default) = one per stage, so every stage of the pipeline can work at
  once.
- ``--prefill-budget TOKENS|auto|off``: tokens one iteration may carry (each
  decode step counts one; prefills are chunked into the rest); auto (default)
  = the profile-derived `lemix.engine_config.default_prefill_token_budget`,
  resolved with the run's profile.
- ``--train-slice-s SECONDS|auto|off``: the longest uninterrupted piece of a
  training pass on one stage; auto (default) = a quarter of the run's TBT SLO
  (half before 2026-12-04), so a decode step that waits behind a slice on each
  stage still has most of its SLO left to run in. The SLO depends on the
  workload (`lemix.slo.compute_slo`), so auto is resolved when each run's SLO
  is known (`SimRunConfig.train_slice_tbt_fraction`).
- ``--batch-cap node|micro-batch``: what ``--max-batch-size`` C caps once there
  are micro-batches: the node's running requests, split evenly, or each
  micro-batch's iteration (default; the node holds up to M × C when KV memory
  allows), as vLLM's pipeline-parallel virtual engines do. The default is the
  one docs/results.md measured better (engine v2, table (a), 2026-12-01):
  SEPARATE serving on every node sustains 18.5 req/s at >= 90% SLO attainment
  with the cap per micro-batch against 17.5 with the cap per node, and MIX-RR
  16.75 with either (KV memory binds before the cap).

- ``--gather-decodes on|off``: while a node has training, decode all its
  requests in one micro-batch and let new requests join the others
  (`lemix.engine_groups`, "Gathered decodes"); on by default since
  2026-12-03 (docs/results.md: more training in the window at the same or
  better SLO attainment for every co-located policy measured).

- ``--decode-pace-s SECONDS|auto|off``: while decodes are gathered, start
  their rounds at least this long apart (`lemix.engine_groups`, "Paced
  decodes"); auto (default since 2026-12-04) = 0.7 × the run's TBT SLO,
  resolved as the slice is.
- ``--training-order forward-first|backward-first``: which training pass a
  stage runs first when both are ready; forward-first is the default since
  2026-12-04, backward-first is 1F1B's rule and v1's.
- ``--spare-training N``: training tasks a node admits beyond one per stage
  while its memory is spare (`EngineConfig.spare_training_in_flight`); 1 by
  default since 2026-12-04, 0 = v1.

docs/results.md (part (c), 2026-12-04) measured the last four changes (and
the slice's new fraction). ``--micro-batches 1 --prefill-budget off
--train-slice-s off --gather-decodes off --decode-pace-s off --training-order
backward-first --spare-training 0`` is the v1 engine (the
batch cap and gathering are then moot: with one micro-batch both caps are C
and there is one group to decode in, which is never paced).
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Literal

from lemix.engine_config import (
    AUTO_DECODE_PACE_TBT_FRACTION,
    AUTO_TRAIN_SLICE_TBT_FRACTION,
    TRAINING_ORDERS,
)

AUTO, OFF, ON = "auto", "off", "on"
BATCH_CAP_NODE, BATCH_CAP_MICRO_BATCH = "node", "micro-batch"
# The flags' values that select the v1 engine (tests and benchmarks pin it so).
V1_ENGINE_FLAGS = (
    "--micro-batches",
    "1",
    "--prefill-budget",
    OFF,
    "--train-slice-s",
    OFF,
    "--gather-decodes",
    OFF,
    "--decode-pace-s",
    OFF,
    "--training-order",
    "backward-first",
    "--spare-training",
    "0",
)
FORWARD_FIRST = "forward-first"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--micro-batches",
        default=AUTO,
        metavar="N|auto",
        help="inference micro-batches in flight per node (auto, default: one per stage; 1 = v1)",
    )
    p.add_argument(
        "--prefill-budget",
        default=AUTO,
        metavar="TOKENS|auto|off",
        help="chunked prefill: tokens per iteration (auto, default: the profile's; off = v1)",
    )
    p.add_argument(
        "--train-slice-s",
        default=AUTO,
        metavar="SECONDS|auto|off",
        help="longest piece of a training pass on a stage (auto, default: a quarter of the "
        "TBT SLO; off = v1)",
    )
    p.add_argument(
        "--batch-cap",
        default=BATCH_CAP_MICRO_BATCH,
        choices=(BATCH_CAP_NODE, BATCH_CAP_MICRO_BATCH),
        help="what --max-batch-size caps with micro-batches: the node's running requests "
        "or each micro-batch's iteration (default)",
    )
    p.add_argument(
        "--gather-decodes",
        default=ON,
        choices=(ON, OFF),
        help="while a node trains, decode in one micro-batch, new requests join the others "
        "(default: on; off = v1 and engine v2 before 2026-12-03)",
    )
    p.add_argument(
        "--decode-pace-s",
        default=AUTO,
        metavar="SECONDS|auto|off",
        help="while decodes are gathered, start their rounds at least this long apart (auto, "
        f"default: {AUTO_DECODE_PACE_TBT_FRACTION:g} x the TBT SLO; off = v1 and engine v2 "
        "before 2026-12-04)",
    )
    p.add_argument(
        "--training-order",
        default=FORWARD_FIRST,
        choices=TRAINING_ORDERS,
        help="which training pass a stage runs first when both are ready (default: "
        "forward-first; backward-first = v1 and engine v2 before 2026-12-04)",
    )
    p.add_argument(
        "--spare-training",
        default=1,
        type=_spare_training,
        metavar="N",
        help="training tasks a node admits beyond one per stage while its memory is spare "
        "(default: 1; 0 = v1 and engine v2 before 2026-12-04)",
    )


def engine_flags(args: argparse.Namespace) -> str:
    """The engine flags of `args` that differ from the defaults, as a command
    line spells them ("" for engine v2's defaults)."""
    given = (
        ("--micro-batches", args.micro_batches, AUTO),
        ("--prefill-budget", args.prefill_budget, AUTO),
        ("--train-slice-s", args.train_slice_s, AUTO),
        ("--batch-cap", args.batch_cap, BATCH_CAP_MICRO_BATCH),
        ("--gather-decodes", args.gather_decodes, ON),
        ("--decode-pace-s", args.decode_pace_s, AUTO),
        ("--training-order", args.training_order, FORWARD_FIRST),
        ("--spare-training", args.spare_training, 1),
    )
    return " ".join(f"{flag} {value}" for flag, value, default in given if value != default)


def engine_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """`SimRunConfig` keyword arguments for the engine flags (ValueError on bad
    values); auto ones stay auto, resolved by the run with its profile and SLO."""
    return {
        "num_micro_batches": parse_micro_batches(args.micro_batches),
        "prefill_token_budget": parse_prefill_budget(args.prefill_budget),
        **parse_train_slice(args.train_slice_s),
        "is_batch_cap_per_micro_batch": args.batch_cap == BATCH_CAP_MICRO_BATCH,
        "is_decode_gathered": args.gather_decodes == ON,
        **parse_decode_pace(args.decode_pace_s),
        "training_order": args.training_order,
        "spare_training_in_flight": args.spare_training,
    }


def parse_micro_batches(text: str) -> int | None:
    """N >= 1, or auto (None: one per stage)."""
    if text.strip().lower() == AUTO:
        return None
    value = _int("--micro-batches", text, "N|auto")
    if value < 1:
        raise ValueError(f"--micro-batches must be >= 1 or auto, got {value}")
    return value


def parse_prefill_budget(text: str) -> int | Literal["auto"] | None:
    """TOKENS >= 1, off (None: whole prompts) or auto (the profile's default,
    `SimRunConfig` resolves it)."""
    lowered = text.strip().lower()
    if lowered == OFF:
        return None
    if lowered == AUTO:
        return "auto"
    value = _int("--prefill-budget", text, "TOKENS|auto|off")
    if value < 1:
        raise ValueError(f"--prefill-budget must be >= 1 tokens, auto or off, got {value}")
    return value


def parse_train_slice(text: str) -> dict[str, float | None]:
    """SECONDS > 0, off, or auto (a fraction of the TBT SLO, resolved per run)."""
    return _seconds_or_slo_fraction(
        "--train-slice-s", text, "train_slice_s", AUTO_TRAIN_SLICE_TBT_FRACTION
    )


def parse_decode_pace(text: str) -> dict[str, float | None]:
    """SECONDS > 0, off, or auto (a fraction of the TBT SLO, resolved per run)."""
    return _seconds_or_slo_fraction(
        "--decode-pace-s", text, "decode_pace_s", AUTO_DECODE_PACE_TBT_FRACTION
    )


def _seconds_or_slo_fraction(
    flag: str, text: str, field: str, auto_fraction: float
) -> dict[str, float | None]:
    """`SimRunConfig`'s `field` (seconds) and `field`'s TBT-fraction twin
    (`train_slice_s` → `train_slice_tbt_fraction`) for a SECONDS|auto|off flag."""
    fraction_field = field.removesuffix("_s") + "_tbt_fraction"
    lowered = text.strip().lower()
    if lowered == OFF:
        return {field: None, fraction_field: None}
    if lowered == AUTO:
        return {field: None, fraction_field: auto_fraction}
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag} needs SECONDS|auto|off, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} must be > 0 s, auto or off, got {text!r}")
    return {field: value, fraction_field: None}


def _spare_training(text: str) -> int:
    value = _int("--spare-training", text, "N >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"--spare-training must be >= 0, got {value}")
    return value


def _int(flag: str, text: str, expected: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{flag} needs {expected}, got {text!r}") from None
