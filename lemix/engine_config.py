"""A node engine's shape (`EngineConfig`) and the profile-derived defaults of
engine v2's knobs; `lemix.engine.NodeEngine` runs with them.

`EngineConfig`'s own defaults are the plain mechanism, the v1 engine: one
iteration in flight per node, whole-prompt prefill, each stage's training pass
in one piece; its unit tests build on them. Every entry point (the simulator's
`SimRunConfig`, `lemix sim`/`compare`/`report`/`demo`, the executors and the
scheduler through `lemix.infra.engine_options`, `lemix up`) defaults to engine
v2 instead, resolved with the functions below: one micro-batch per stage,
`default_prefill_token_budget`, training slices of
`AUTO_TRAIN_SLICE_TBT_FRACTION` × the TBT SLO (`default_train_slice_s` where
the workload, hence the SLO, is not known), gathered decodes paced at
`AUTO_DECODE_PACE_TBT_FRACTION` × the TBT SLO (`default_decode_pace_s`),
forward-first training and one spare training task in flight. Engine v2's knobs are described in
`lemix.engine_groups`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lemix.batching import BatchingConfig
from lemix.memory import MemoryConfig
from lemix.profile import Profile
from lemix.slo import SloConfig, compute_slo

# `default_prefill_token_budget`: a prefill chunk may cost this many batch-32
# decode steps at a 512-token context on the same stage.
CHUNK_DECODE_STEP_MULTIPLE = 3.0
# Auto training slices: this fraction of the TBT SLO, so a decode step queued
# behind a slice on each stage still has most of its SLO to run in (half of it
# before 2026-12-04: 0.25 with paced decodes and forward-first training gave
# more training in the window and higher attainment; 0.2 and 0.35 within a
# point of it; docs/results.md, part (c), 2026-12-04).
AUTO_TRAIN_SLICE_TBT_FRACTION = 0.25
# Auto paced decodes: gathered decode rounds start this fraction of the TBT
# SLO apart, leaving the rest for a round's waits behind training slices
# (0.6 and 0.8 measured within a point of its training, with 0.4 points more
# and 1.9 less SLO attainment: docs/results.md, part (c), 2026-12-04).
AUTO_DECODE_PACE_TBT_FRACTION = 0.7
TRAINING_ORDERS = ("backward-first", "forward-first")
# Spare training (`EngineConfig.spare_training_in_flight`): a task beyond the
# cap is admitted only while this fraction of every stage's dynamic memory (the
# KV cache's and the activations' share, `NodeMemory.dynamic_capacity_bytes`)
# is free, so the KV cache keeps room for the requests that arrive meanwhile.
SPARE_TRAINING_FREE_FRACTION = 0.3


@dataclass(frozen=True)
class EngineConfig:
    """One node engine's shape: batching, memory, stage order and engine v2's knobs."""

    batching: BatchingConfig = field(default_factory=BatchingConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    stage_order: str = "inference-first"  # or "fifo"
    # Training tasks admitted at once per node (None: one per stage, enough to
    # keep every stage's pipeline busy, as 1F1B does). A backlog waits unadmitted
    # and holds no memory, so it can never crowd serving out of its KV cache.
    max_training_in_flight: int | None = None
    emit_tokens: bool = False  # streaming executors need every token; the simulator does not
    # Engine v2 (issue 9). These defaults are the v1 engine; the entry points
    # pass v2's (see the module docstring).
    # Inference micro-batches in flight per node (None: one per stage, so all
    # stages work at once); 1 = one iteration in flight per node (v1).
    num_micro_batches: int | None = 1
    # Tokens one iteration may carry (decode steps count one each; prefill is
    # chunked to fit the rest); None = whole prompts, no chunking (v1).
    prefill_token_budget: int | None = None
    # Longest uninterrupted piece of a training forward/backward on one stage:
    # longer ones run in slices, and inference iterations may run between
    # slices; None = a stage's whole training pass at once (v1).
    max_training_slice_s: float | None = None
    # What `batching.max_batch_size` (C) caps with micro-batches: False = the
    # node's running requests, split evenly (each group holds ceil(C / M));
    # True = each micro-batch's own iteration, as vLLM's pipeline-parallel
    # virtual engines do (one scheduler per stage, each with its own
    # max_num_seqs), so the node may hold M × C when KV memory allows. Equal
    # with M = 1.
    is_batch_cap_per_micro_batch: bool = False
    # Gathered decodes (`lemix.engine_groups`): while the node has training and
    # M > 1, requests decode in group 0 only and new ones join the others.
    # The entry points default to on (since 2026-12-03).
    is_decode_gathered: bool = False
    # Paced decodes (`lemix.engine_groups`): while decodes are gathered, the
    # decode group's iterations start at least this long apart (s); None = as
    # soon as the group is back.
    decode_pace_s: float | None = None
    # Which training pass goes first on a stage when both are ready:
    # "backward-first" (1F1B's rule, v1) or "forward-first".
    training_order: str = "backward-first"
    # Training tasks admitted beyond `max_training_in_flight` while memory is
    # spare: no request waits for admission or for its KV to come back, and
    # `SPARE_TRAINING_FREE_FRACTION` of every stage's dynamic memory is free.
    # S tasks in flight leave pipeline bubbles once inference takes the stages
    # at random times; one more fills some (`lemix.engine`).
    spare_training_in_flight: int = 0

    def __post_init__(self) -> None:
        if self.stage_order not in ("inference-first", "fifo"):
            raise ValueError("stage_order must be 'inference-first' or 'fifo'")
        if self.training_order not in TRAINING_ORDERS:
            raise ValueError(
                f"training_order must be one of {', '.join(TRAINING_ORDERS)}, "
                f"got {self.training_order!r}"
            )
        if self.spare_training_in_flight < 0:
            raise ValueError(
                f"spare_training_in_flight must be >= 0, got {self.spare_training_in_flight}"
            )
        if self.decode_pace_s is not None and not self.decode_pace_s > 0:
            raise ValueError(f"decode_pace_s must be > 0 s or None, got {self.decode_pace_s}")
        if self.max_training_in_flight is not None and self.max_training_in_flight < 1:
            raise ValueError("max_training_in_flight must be >= 1 or None")
        if self.num_micro_batches is not None and self.num_micro_batches < 1:
            raise ValueError(
                f"num_micro_batches must be >= 1 or None, got {self.num_micro_batches}"
            )
        if self.prefill_token_budget is not None and self.prefill_token_budget < 1:
            raise ValueError(
                f"prefill_token_budget must be >= 1 tokens or None, got {self.prefill_token_budget}"
            )
        if self.max_training_slice_s is not None and not self.max_training_slice_s > 0:
            raise ValueError(
                f"max_training_slice_s must be > 0 s or None, got {self.max_training_slice_s}"
            )


def default_prefill_token_budget(profile: Profile) -> int:
    """A per-iteration token budget derived from the profile alone.

    The largest power of two n (32 ≤ n ≤ 16384) such that, on every stage, the
    forward of one n-token chunk takes at most `CHUNK_DECODE_STEP_MULTIPLE`
    (3) × a decode step of a batch of 32 at a 512-token context. An iteration
    that carries such a chunk along with a full decode batch then costs at most
    4 decode steps, so a chunk stretches the running requests' time between
    tokens by a bounded factor instead of by a whole prompt's prefill. On the
    shipped A100 Llama-2-7B profiles this gives 512 tokens, Sarathi-Serve's
    budget for strict TBT SLOs on that hardware (its relaxed setting and vLLM's
    chunked-prefill defaults are 2048 and up); H100 gives 1024, the CPU
    tiny-llama profile 256. Falls back to 32 when even that is too long.
    """
    model = profile.ours
    budget = 32
    for exponent in range(5, 15):
        num_tokens = 2**exponent
        if all(
            model.forward_s(s, 1, num_tokens)
            <= CHUNK_DECODE_STEP_MULTIPLE * model.decode_step_s(s, 32, 32 * 512)
            for s in range(profile.num_stages)
        ):
            budget = num_tokens
        else:
            break
    return budget


def default_decode_pace_s(profile: Profile) -> float:
    """Auto paced decodes where the workload is not known: as
    `default_train_slice_s`, with `AUTO_DECODE_PACE_TBT_FRACTION`."""
    return AUTO_DECODE_PACE_TBT_FRACTION * compute_slo(profile, (), SloConfig()).tbt_s


def default_train_slice_s(profile: Profile) -> float:
    """Auto training slices where the workload is not known (a live executor
    and the scheduler's model of it): `AUTO_TRAIN_SLICE_TBT_FRACTION` × the TBT
    SLO `compute_slo` derives from the profile alone (its 512-token reference
    request, the default multiplier). That is the SLO the scheduler judges by
    when no ``LEMIX_SLO_*`` is set, and both services compute it from the same
    profile, so the executors slice as the planner predicts. The simulator
    knows its workload and takes the fraction of the run's own SLO instead."""
    return AUTO_TRAIN_SLICE_TBT_FRACTION * compute_slo(profile, (), SloConfig()).tbt_s
