"""Build and run one simulation from typed configs; return its metrics object."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from lemix.batching import BatchingConfig
from lemix.engine import EngineConfig, NodeEngine
from lemix.engine_config import (
    AUTO_DECODE_PACE_TBT_FRACTION,
    AUTO_TRAIN_SLICE_TBT_FRACTION,
    default_prefill_token_budget,
)
from lemix.memory import MemoryConfig
from lemix.noise import NoisyLatency
from lemix.planner.base import PlannerConfig
from lemix.planner.configure import build_planner_config, resolve_training_nodes
from lemix.planner.registry import build_planner, get_spec
from lemix.profile import Profile
from lemix.sim.simulator import SimResult, Simulator
from lemix.slo import Slo, SloConfig, compute_slo
from lemix.types import Task

AUTO: Literal["auto"] = "auto"


@dataclass(frozen=True)
class SimRunConfig:
    """One simulation's settings. The engine knobs default to engine v2 (one
    micro-batch per stage, the profile's prefill budget, training slices of a
    quarter of the run's TBT SLO, gathered and paced decodes, forward-first
    training with a spare task, C per micro-batch: `lemix.cli.engine_args` says why);
    `V1_ENGINE` holds the knobs that select v1."""

    policy: str = "lemix"
    num_nodes: int = 4
    seed: int = 0
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    stage_order: str = "inference-first"
    max_training_in_flight: int | None = None  # per node; None = one per stage
    latency_noise_cv: float = 0.05
    train_rate: float = 0.0
    sync_every_tasks: int = 100
    # `PlannerConfig.replica_sync_every_tasks`: average the trainers' replicas
    # every M training tasks; None = off.
    replica_sync_every_tasks: int | None = None
    max_defer_s: float = 30.0
    defer_recheck_s: float = 1.0
    # `PlannerConfig.slo_headroom`: the admission threshold of the policies
    # that defer training (lemix*, mix-*-capped); their Pareto knob.
    slo_headroom: float = PlannerConfig.slo_headroom
    # `lemix.planner.configure.resolve_training_nodes`: all, auto or a count.
    training_nodes: str = "all"
    is_admission_cluster_wide: bool = PlannerConfig.is_admission_cluster_wide
    drain_limit_s: float = 600.0
    measure_decision_latency: bool = True
    keep_decisions: bool = False
    # Engine v2 knobs (`lemix.engine.EngineConfig`); the defaults are engine v2.
    # Inference micro-batches in flight per node; None = one per stage.
    num_micro_batches: int | None = None
    # Tokens per iteration, prefill chunked to fit; None = whole prompts;
    # "auto" = the profile's `default_prefill_token_budget`.
    prefill_token_budget: int | Literal["auto"] | None = AUTO
    # Longest piece of a stage's training pass (s). When set it wins over
    # `train_slice_tbt_fraction`; both None = whole passes.
    train_slice_s: float | None = None
    # Slice = this fraction of the run's TBT SLO, which is only known once the
    # workload is (`compute_slo`): `--train-slice-s auto`, the default.
    train_slice_tbt_fraction: float | None = AUTO_TRAIN_SLICE_TBT_FRACTION
    # `EngineConfig.is_batch_cap_per_micro_batch`: C caps each micro-batch.
    is_batch_cap_per_micro_batch: bool = True
    # `EngineConfig.is_decode_gathered`: with training on a node, decode in one group.
    is_decode_gathered: bool = True
    # `EngineConfig.decode_pace_s` (s). When set it wins over
    # `decode_pace_tbt_fraction`; both None = unpaced.
    decode_pace_s: float | None = None
    # Pace = this fraction of the run's TBT SLO (known once the workload is,
    # as the slices'): `--decode-pace-s auto`, the default.
    decode_pace_tbt_fraction: float | None = AUTO_DECODE_PACE_TBT_FRACTION
    # `EngineConfig.training_order`.
    training_order: str = "forward-first"
    # `EngineConfig.spare_training_in_flight`: tasks beyond the cap while memory is spare.
    spare_training_in_flight: int = 1
    # The control plane as fixed delays (`Simulator`): submit to planner, and
    # engine to client for an inference task's tokens. 0: not modelled.
    intake_delay_s: float = 0.0
    output_delay_s: float = 0.0

    def __post_init__(self) -> None:
        get_spec(self.policy)  # unknown names fail here, with the list of choices
        if self.num_nodes < 1:
            raise ValueError("num_nodes must be >= 1")
        if self.latency_noise_cv < 0:
            raise ValueError("latency_noise_cv must be >= 0")
        if not 0.0 < self.slo_headroom <= 1.0:
            raise ValueError(f"slo_headroom must be in (0, 1], got {self.slo_headroom}")
        resolve_training_nodes(self.training_nodes, self.num_nodes, self.train_rate)
        fraction = self.train_slice_tbt_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"train_slice_tbt_fraction must be in (0, 1], got {fraction}")
        pace = self.decode_pace_tbt_fraction
        if pace is not None and not 0 < pace <= 1:
            raise ValueError(f"decode_pace_tbt_fraction must be in (0, 1], got {pace}")
        budget = self.prefill_token_budget
        if isinstance(budget, str) and budget != AUTO:
            raise ValueError(f"prefill_token_budget must be tokens, None or 'auto', got {budget!r}")
        self._engine_config(Slo(ttft_s=1.0, tbt_s=1.0), None)  # the knobs' own range checks

    def engine_config(self, slo: Slo, profile: Profile) -> EngineConfig:
        """The engine config of every node of this run (`slo`: the run's SLO;
        `profile` resolves an auto prefill budget)."""
        return self._engine_config(slo, profile)

    def _engine_config(self, slo: Slo, profile: Profile | None) -> EngineConfig:
        slice_s = _seconds(self.train_slice_s, self.train_slice_tbt_fraction, slo)
        pace_s = _seconds(self.decode_pace_s, self.decode_pace_tbt_fraction, slo)
        budget: int | None
        if isinstance(self.prefill_token_budget, str):  # AUTO (__post_init__ checked it);
            # left unresolved (None) without a profile, for the range checks only
            budget = default_prefill_token_budget(profile) if profile is not None else None
        else:
            budget = self.prefill_token_budget
        return EngineConfig(
            batching=self.batching,
            memory=self.memory,
            stage_order=self.stage_order,
            max_training_in_flight=self.max_training_in_flight,
            num_micro_batches=self.num_micro_batches,
            prefill_token_budget=budget,
            max_training_slice_s=slice_s,
            is_batch_cap_per_micro_batch=self.is_batch_cap_per_micro_batch,
            is_decode_gathered=self.is_decode_gathered,
            decode_pace_s=pace_s,
            training_order=self.training_order,
            spare_training_in_flight=self.spare_training_in_flight,
        )


def _seconds(seconds: float | None, tbt_fraction: float | None, slo: Slo) -> float | None:
    """A knob given in seconds, or else as a fraction of the run's TBT SLO;
    None: off. A zero TBT SLO (a zero-latency profile) leaves nothing to slice
    or pace: None too."""
    if seconds is not None or tbt_fraction is None:
        return seconds
    return tbt_fraction * slo.tbt_s or None


# `SimRunConfig(**V1_ENGINE)`: the v1 engine (one iteration in flight per node,
# whole prompts, whole training passes, C per node), the default before
# 2026-12-02 and the prototype's.
V1_ENGINE: Mapping[str, Any] = MappingProxyType(
    {
        "num_micro_batches": 1,
        "prefill_token_budget": None,
        "train_slice_s": None,
        "train_slice_tbt_fraction": None,
        "is_batch_cap_per_micro_batch": False,
        "is_decode_gathered": False,
        "decode_pace_s": None,
        "decode_pace_tbt_fraction": None,
        "training_order": "backward-first",
        "spare_training_in_flight": 0,
    }
)


ENGINE_KNOB_FIELDS = tuple(V1_ENGINE)


def engine_name(config: SimRunConfig) -> str:
    """What a page should call `config`'s engine: "engine v2" (the defaults),
    "engine v1" (`V1_ENGINE`) or "a custom engine" (any other knobs)."""
    knobs = {name: getattr(config, name) for name in ENGINE_KNOB_FIELDS}
    if knobs["num_micro_batches"] == 1:  # one micro-batch: either cap is C per node,
        knobs["is_batch_cap_per_micro_batch"] = False  # and it is the one decode group
        knobs["is_decode_gathered"] = False  # (so nothing is paced)
        knobs["decode_pace_s"] = knobs["decode_pace_tbt_fraction"] = None
    if knobs == {name: getattr(SimRunConfig(), name) for name in ENGINE_KNOB_FIELDS}:
        return "engine v2"
    return "engine v1" if knobs == dict(V1_ENGINE) else "a custom engine"


def serving_only_profile(profile: Profile) -> Profile:
    """`profile` for a node that only serves: no gradients or optimizer state
    charged, so that memory holds KV instead (SEPARATE's serving nodes)."""
    memory = replace(
        profile.memory, training_state_bytes=(0,) * len(profile.memory.training_state_bytes)
    )
    return replace(profile, memory=memory)


def build_simulator(
    config: SimRunConfig, profile: Profile, tasks: Sequence[Task], slo: Slo
) -> Simulator:
    spec = get_spec(config.policy)
    engine_config = config.engine_config(slo, profile)
    planner_config = build_planner_config(
        num_nodes=config.num_nodes,
        profile=profile,
        slo=slo,
        max_batch_size=config.batching.max_batch_size,
        max_defer_s=config.max_defer_s,
        defer_recheck_s=config.defer_recheck_s,
        slo_headroom=config.slo_headroom,
        training_nodes=config.training_nodes,
        is_admission_cluster_wide=config.is_admission_cluster_wide,
        train_rate=config.train_rate,
        sync_every_tasks=config.sync_every_tasks,
        replica_sync_every_tasks=config.replica_sync_every_tasks,
        num_micro_batches=engine_config.num_micro_batches,
        is_batch_cap_per_micro_batch=engine_config.is_batch_cap_per_micro_batch,
        is_decode_gathered=engine_config.is_decode_gathered,
        prefill_token_budget=engine_config.prefill_token_budget,
        max_training_slice_s=engine_config.max_training_slice_s,
        decode_pace_s=engine_config.decode_pace_s,
    )
    memory = config.memory
    if not spec.is_memory_aware:
        memory = MemoryConfig(
            kappa=memory.kappa, max_wait_s=memory.max_wait_s, is_offload_enabled=False
        )
    planner = build_planner(config.policy, planner_config, profile, memory)
    engine_config = replace(engine_config, memory=memory)
    # Nodes that never train keep no training state, so their memory holds KV:
    # SEPARATE's serving nodes, and a co-located policy's nodes outside
    # `--training-nodes` (both static roles for the whole run).
    serving_only: tuple[int, ...] = ()
    is_homed = spec.is_colocated and planner_config.num_training_nodes is not None
    if not spec.is_training_state_on_serving_nodes or is_homed:
        trainers = planner.training_nodes(planner.context(0.0))
        serving_only = tuple(i for i in range(config.num_nodes) if i not in trainers)
    # Noise streams derive from the run seed, so every policy sees the same draws
    # per node for the same sequence of work.
    engines = [
        NodeEngine(
            i,
            serving_only_profile(profile) if i in serving_only else profile,
            NoisyLatency(
                profile.ours, config.latency_noise_cv, random.Random(config.seed * 1_000_003 + i)
            ),
            engine_config,
        )
        for i in range(config.num_nodes)
    ]
    return Simulator(
        planner,
        engines,
        tasks,
        profile,
        drain_limit_s=config.drain_limit_s,
        measure_decision_latency=config.measure_decision_latency,
        keep_decisions=config.keep_decisions,
        intake_delay_s=config.intake_delay_s,
        output_delay_s=config.output_delay_s,
    )


def run_simulation(
    config: SimRunConfig,
    profile: Profile,
    tasks: Sequence[Task],
    *,
    request_rate: float,
    duration_s: float,
    slo: Slo | None = None,
) -> tuple[dict[str, Any], SimResult]:
    """Run one simulation; return (metrics JSON object, raw result)."""
    from lemix.report.metrics import summarize

    slo = slo or compute_slo(profile, tasks, config.slo)
    sim = build_simulator(config, profile, tasks, slo)
    result = sim.run()
    metrics = summarize(
        result.records,
        policy=config.policy,
        seed=config.seed,
        request_rate=request_rate,
        train_rate=config.train_rate,
        duration_s=duration_s,
        makespan_s=result.makespan_s,
        slo_ttft_s=slo.ttft_s,
        slo_tbt_s=slo.tbt_s,
        utilization=result.utilization,
        decision_latency_us=result.decision_latency_us,
        node_active_spans_s=result.node_active_spans_s,
    )
    metrics["num_deferrals"] = result.num_deferrals
    metrics["num_weight_syncs"] = result.num_weight_syncs
    metrics["num_kv_offloads"] = result.num_offloads
    metrics["sync_every_tasks"] = config.sync_every_tasks
    metrics["replica_sync_every_tasks"] = config.replica_sync_every_tasks
    metrics["num_replica_averages"] = result.num_replica_averages
    metrics["slo_headroom"] = config.slo_headroom
    metrics["training_nodes"] = config.training_nodes
    metrics["admission"] = "cluster" if config.is_admission_cluster_wide else "node"
    return metrics, result
