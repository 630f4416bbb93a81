"""The one mapping from a run's settings to the planner's `PlannerConfig`.

The simulator (`lemix.sim.run.build_simulator`) and the live scheduler
(`services.scheduler.config.SchedulerConfig.planner_config`) both call it, so
a policy plans alike in both: a field added to the mapping reaches both.
"""

from __future__ import annotations

from lemix.planner.base import PlannerConfig
from lemix.profile import Profile
from lemix.slo import Slo


def build_planner_config(
    *,
    num_nodes: int,
    profile: Profile,
    slo: Slo,
    max_batch_size: int,
    max_defer_s: float,
    defer_recheck_s: float,
    train_rate: float,
    sync_every_tasks: int,
    slo_headroom: float = PlannerConfig.slo_headroom,
    training_nodes: str = "all",
    is_admission_cluster_wide: bool = False,
    num_micro_batches: int | None = 1,
    is_batch_cap_per_micro_batch: bool = False,
    is_decode_gathered: bool = False,
    prefill_token_budget: int | None = None,
    max_training_slice_s: float | None = None,
    decode_pace_s: float | None = None,
    replica_sync_every_tasks: int | None = None,
    max_training_runs_per_plan: int = PlannerConfig.max_training_runs_per_plan,
) -> PlannerConfig:
    """The planner's config for `num_nodes` nodes running `profile`'s stages
    under `slo`; the other knobs keep `PlannerConfig`'s defaults. The engine
    knobs are the executors' (`lemix.engine.EngineConfig`'s, same meaning;
    `num_micro_batches` None = one per stage). `training_nodes`: see
    `resolve_training_nodes`."""
    return PlannerConfig(
        num_nodes=num_nodes,
        num_stages=profile.num_stages,
        slo_ttft_s=slo.ttft_s,
        slo_tbt_s=slo.tbt_s,
        max_batch_size=max_batch_size,
        max_defer_s=max_defer_s,
        defer_recheck_s=defer_recheck_s,
        train_rate=train_rate,
        sync_every_tasks=sync_every_tasks,
        slo_headroom=slo_headroom,
        num_training_nodes=resolve_training_nodes(training_nodes, num_nodes, train_rate),
        is_admission_cluster_wide=is_admission_cluster_wide,
        num_micro_batches=num_micro_batches or profile.num_stages,
        is_batch_cap_per_micro_batch=is_batch_cap_per_micro_batch,
        is_decode_gathered=is_decode_gathered,
        prefill_token_budget=prefill_token_budget,
        max_training_slice_s=max_training_slice_s,
        decode_pace_s=decode_pace_s,
        max_training_runs_per_plan=max_training_runs_per_plan,
        replica_sync_every_tasks=replica_sync_every_tasks or None,
    )


TRAINING_NODES_HELP = (
    "co-located policies: nodes that train and hold training state: all (default), auto "
    "(SEPARATE's split: max(1, round(N x train rate))) or a count; the rest only serve"
)


def resolve_training_nodes(spec: str, num_nodes: int, train_rate: float) -> int | None:
    """`PlannerConfig.num_training_nodes` from a user's setting: "all" (None:
    every node), "auto" (SEPARATE's static split, the same node count SEPARATE
    trains on at this train rate) or a count in [1, num_nodes]."""
    if spec == "all":
        return None
    if spec == "auto":
        return min(max(1, round(num_nodes * train_rate)), num_nodes)
    try:
        num = int(spec)
    except ValueError:
        raise ValueError(f"training nodes must be all, auto or a count, got {spec!r}") from None
    if not 1 <= num <= num_nodes:
        raise ValueError(f"training nodes must be in [1, {num_nodes}], got {num}")
    return num
