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
  training pass on one stage; auto (default) = half the run's TBT SLO, so a
  decode step that arrives behind a slice still has half its SLO left to run
  in. The SLO depends on the workload (`lemix.slo.compute_slo`), so auto is
  resolved when each run's SLO is known (`SimRunConfig.train_slice_tbt_fraction`).
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

``--micro-batches 1 --prefill-budget off --train-slice-s off --gather-decodes
off`` is the v1 engine (the batch cap and gathering are then moot: with one
micro-batch both caps are C and there is one group to decode in).
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Literal

from lemix.engine_config import AUTO_TRAIN_SLICE_TBT_FRACTION

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
)


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
        help="longest piece of a training pass on a stage (auto, default: half the TBT SLO; "
        "off = v1)",
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


def engine_flags(args: argparse.Namespace) -> str:
    """The engine flags of `args` that differ from the defaults, as a command
    line spells them ("" for engine v2's defaults)."""
    given = (
        ("--micro-batches", args.micro_batches, AUTO),
        ("--prefill-budget", args.prefill_budget, AUTO),
        ("--train-slice-s", args.train_slice_s, AUTO),
        ("--batch-cap", args.batch_cap, BATCH_CAP_MICRO_BATCH),
        ("--gather-decodes", args.gather_decodes, ON),
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
