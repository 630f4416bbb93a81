"""Policies by name, with the planner/runtime settings each one implies.

Ablations are LeMix with one mechanism switched off; the switches live in the
mechanism (planner or executor runtime), so no policy re-implements them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from lemix.latency import PaperLatencyModel
from lemix.memory import MemoryConfig, dynamic_bytes
from lemix.planner.base import PlacementPolicy, PlannerConfig
from lemix.planner.costs import CostEstimator, DecodeAwareCostEstimator, PaperCostEstimator
from lemix.planner.planner import Planner
from lemix.planner.policies.baselines import (
    Capped,
    MixLeastUtilizedPolicy,
    MixRoundRobinPolicy,
    SeparatePolicy,
)
from lemix.planner.policies.lemix import LemixPolicy
from lemix.profile import Profile

# The prototype's fallback coefficients when no profile exists (s per seq·token²).
NOPROFILE_ETA_FORWARD_S = 2e-6
NOPROFILE_ETA_BACKWARD_S = 1e-6


@dataclass(frozen=True)
class PolicySpec:
    name: str
    description: str
    make_policy: Callable[[PlannerConfig], PlacementPolicy]
    estimator: str = "decode-aware"  # or "paper" / "noprofile"
    is_deprioritization_enabled: bool = True
    is_memory_aware: bool = True  # planner predicts KV waits; executor offloads
    is_colocated: bool = True
    # False: the policy's serving nodes never train and keep no gradients or
    # optimizer state, so their memory goes to KV (static roles only: a role
    # that can change over a run keeps the training state everywhere).
    is_training_state_on_serving_nodes: bool = True


def _lemix(**kw: Any) -> Callable[[PlannerConfig], PlacementPolicy]:
    return lambda config: LemixPolicy(**kw)


# lemix-paper is the prototype's placement (its score and prefill-only η
# estimator), not its engine: like every policy it runs on the engine the
# nodes run, engine v2 by default since 2026-12-02, so a comparison varies
# the placement alone. Its estimator ignores micro-batches, chunks and slices,
# as the prototype's did; nothing of the paper's mechanism needs v1 to run.
# The prototype's own configuration is the v1 engine (one running batch per
# node, whole prompts, whole training passes): `--micro-batches 1
# --prefill-budget off --train-slice-s off` (`lemix.sim.run.V1_ENGINE`).
def _paper_form(config: PlannerConfig) -> PlacementPolicy:
    return LemixPolicy(
        name="lemix-paper",
        form="paper",
        lambda_response=config.lambda_response,
        lambda_length=config.lambda_length,
    )


POLICIES: dict[str, PolicySpec] = {
    spec.name: spec
    for spec in [
        PolicySpec("lemix", "ours: decode-aware Algorithm 1, normalized score", _lemix()),
        PolicySpec(
            "lemix-paper",
            "the prototype's exact score and prefill-only model",
            _paper_form,
            estimator="paper",
        ),
        PolicySpec(
            "lemix-noprofile",
            "ours without the profile (prototype default η)",
            _lemix(name="lemix-noprofile"),
            estimator="noprofile",
        ),
        PolicySpec(
            "lemix-nodeprio",
            "ours without deprioritization of training",
            _lemix(name="lemix-nodeprio"),
            is_deprioritization_enabled=False,
        ),
        PolicySpec(
            "lemix-nomem",
            "ours without memory awareness (wait-then-drop)",
            _lemix(name="lemix-nomem"),
            is_memory_aware=False,
        ),
        PolicySpec(
            "lemix-nolc",
            "ours without length consistency",
            _lemix(name="lemix-nolc", is_length_consistency_enabled=False),
        ),
        PolicySpec(
            "separate",
            "dedicated training/serving nodes, sync every K",
            lambda c: SeparatePolicy(),
            is_colocated=False,
            is_training_state_on_serving_nodes=False,
        ),
        PolicySpec(
            "separate-dynamic",
            "SEPARATE with serving share growing with load",
            lambda c: SeparatePolicy(name="separate-dynamic", is_dynamic=True),
            is_colocated=False,
        ),
        PolicySpec("mix-rr", "co-located, round-robin", lambda c: MixRoundRobinPolicy()),
        PolicySpec(
            "mix-luf",
            "co-located, least-utilized (memory) first",
            lambda c: MixLeastUtilizedPolicy(),
        ),
        PolicySpec(
            "mix-rr-capped",
            "MIX-RR's placement with LeMix's training admission control",
            lambda c: Capped(MixRoundRobinPolicy()),
        ),
        PolicySpec(
            "mix-luf-capped",
            "MIX-LUF's placement with LeMix's training admission control",
            lambda c: Capped(MixLeastUtilizedPolicy()),
        ),
    ]
}


def get_spec(name: str) -> PolicySpec:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None


def make_estimator(
    spec: PolicySpec, profile: Profile, config: PlannerConfig, memory: MemoryConfig
) -> CostEstimator:
    if spec.estimator == "paper":
        return PaperCostEstimator(profile.paper, profile.optimizer_step_s)
    latency = profile.ours
    if spec.estimator == "noprofile":
        stages = profile.num_stages
        return PaperCostEstimator(
            PaperLatencyModel(
                (NOPROFILE_ETA_FORWARD_S,) * stages,
                (NOPROFILE_ETA_BACKWARD_S,) * stages,
                name="noprofile",
            ),
            (0.0,) * stages,
        )
    kv_per_token = sum(profile.memory.kv_bytes_per_token)
    kv_bytes = dynamic_bytes(profile.memory, memory.kappa, profile.num_stages)
    kv_tokens = kv_bytes // max(kv_per_token, 1)
    return DecodeAwareCostEstimator(
        latency,
        profile.optimizer_step_s,
        config.max_running_per_node,
        kv_tokens,
        is_memory_aware=spec.is_memory_aware,
        max_kv_wait_s=memory.max_wait_s,
        num_micro_batches=config.num_micro_batches,
        is_decode_gathered=config.is_decode_gathered,
        prefill_token_budget=config.prefill_token_budget,
        max_training_slice_s=config.max_training_slice_s,
        decode_pace_s=config.decode_pace_s,
    )


def build_planner(
    name: str, config: PlannerConfig, profile: Profile, memory: MemoryConfig
) -> Planner:
    """The one way sim and scheduler construct a planner from a policy name."""
    spec = get_spec(name)
    if not spec.is_deprioritization_enabled:
        config = replace(config, is_deprioritization_enabled=False)
    policy = spec.make_policy(config)
    estimator = make_estimator(spec, profile, config, memory)
    return Planner(config, policy, estimator, profile.memory, kappa=memory.kappa)
