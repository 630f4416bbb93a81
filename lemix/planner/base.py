"""The placement-policy interface and the planner's configuration.

A policy ranks candidate nodes for one task; the `Planner` (mechanism) owns
queues, deferral, aging, accounting and weight syncs. Policies are small and
chosen by name from `lemix.planner.registry`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from lemix.planner.trace import NodeView, Prediction
from lemix.types import Task


@dataclass(frozen=True)
class PlannerConfig:
    """Everything the planner needs, explicit. Validated on construction."""

    num_nodes: int
    num_stages: int
    slo_ttft_s: float  # τ_R: response-time SLO of inference (one value for every policy)
    slo_tbt_s: float  # time-between-tokens SLO of inference
    lambda_response: float = 0.15  # λ1
    lambda_length: float = 0.05  # λ2
    tau_idle_s: float = 0.2  # τ
    max_batch_size: int = 64  # C, the executors' running-batch cap
    is_deprioritization_enabled: bool = True
    max_defer_s: float = 30.0  # aging: a deferred training task waits at most this long
    defer_recheck_s: float = 1.0  # re-evaluate deferred training at least this often
    # Aged training is forced out at most this fast (per node): under sustained
    # overload training keeps a guaranteed trickle instead of flooding serving.
    aged_release_rps_per_node: float = 1.0
    # Algorithm 1 runs one `plan` call spends on placing training, after
    # which it places no more (it places one at least); the rest is due at
    # once, in the next call (`Planner.is_release_pending`). A call runs
    # synchronously in the scheduler's event loop and returns its decisions
    # together: a burst of released training (dozens of tasks when a finish
    # frees a loaded cluster) would hold the inference placed in the same
    # call, and every other coroutine, for the whole burst (16 ms at 64
    # nodes). Counted in runs, not tasks, so small clusters, where a
    # placement costs a few runs, still place several per call.
    max_training_runs_per_plan: int = 32
    request_rate_window_s: float = 10.0  # the arrival-rate estimate looks this far back
    # Deprioritization defers training once predictions pass this share of an
    # SLO: predictions are means, and half the requests sit above the mean.
    slo_headroom: float = 0.8
    train_rate: float = 0.0  # r: the SEPARATE split uses it
    sync_every_tasks: int = 100  # K: SEPARATE weight sync period in training tasks
    # M: average the training nodes' replicas every M completed training tasks
    # (`lemix.planner.replica_sync`); None = never, replicas drift apart.
    replica_sync_every_tasks: int | None = None
    dynamic_full_rate_rps: float = 32.0  # SEPARATE-dynamic: rate at which serving gets N-1 nodes
    # The executors' engine shape (`lemix.engine.EngineConfig`, resolved), so
    # the decode-aware costs model the engine the nodes run. These defaults
    # are the v1 engine (one iteration in flight, C caps the node, whole
    # prompts, whole training passes); the simulator and the scheduler pass
    # engine v2's, resolved (`lemix.planner.configure.build_planner_config`).
    # Co-located policies: how many nodes train (the last ones; None = all).
    # The others only serve, keep no training state and get the trainers'
    # weights every K training tasks, as SEPARATE's serving nodes do, but
    # training nodes serve too when the policy ranks them first.
    num_training_nodes: int | None = None
    # Admission of training (deprioritization): False = defer a training task
    # when the next request would miss its SLO *on the chosen node*; True =
    # only when it would miss on every node (the next request can go
    # elsewhere). Cluster-wide suits homed training: it protects the serving
    # nodes and lets the training nodes train.
    is_admission_cluster_wide: bool = False
    num_micro_batches: int = 1
    is_batch_cap_per_micro_batch: bool = False
    is_decode_gathered: bool = False
    prefill_token_budget: int | None = None
    max_training_slice_s: float | None = None
    decode_pace_s: float | None = None

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.num_stages < 1:
            raise ValueError("num_nodes and num_stages must be >= 1")
        if self.slo_ttft_s <= 0 or self.slo_tbt_s <= 0:
            raise ValueError("SLOs must be > 0 seconds")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.max_defer_s < 0:
            raise ValueError("max_defer_s must be >= 0")
        if not 0.0 < self.slo_headroom <= 1.0:
            raise ValueError("slo_headroom must be in (0, 1]")
        if self.request_rate_window_s <= 0:
            raise ValueError("request_rate_window_s must be > 0")
        if self.aged_release_rps_per_node <= 0:
            raise ValueError("aged_release_rps_per_node must be > 0")
        if self.defer_recheck_s <= 0:
            raise ValueError("defer_recheck_s must be > 0")
        if self.max_training_runs_per_plan < 1:
            raise ValueError("max_training_runs_per_plan must be >= 1")
        if not 0.0 <= self.train_rate < 1.0:
            raise ValueError("train_rate must be in [0, 1)")
        if self.sync_every_tasks < 1:
            raise ValueError("sync_every_tasks must be >= 1")
        num_training = self.num_training_nodes
        if num_training is not None and not 1 <= num_training <= self.num_nodes:
            raise ValueError(
                f"num_training_nodes must be in [1, {self.num_nodes}] or None, got {num_training}"
            )
        if self.replica_sync_every_tasks is not None and self.replica_sync_every_tasks < 1:
            raise ValueError("replica_sync_every_tasks must be >= 1 or None (off)")
        if self.num_micro_batches < 1:
            raise ValueError("num_micro_batches must be >= 1 (resolved: auto is num_stages)")
        if self.prefill_token_budget is not None and self.prefill_token_budget < 1:
            raise ValueError("prefill_token_budget must be >= 1 or None")
        if self.max_training_slice_s is not None and not self.max_training_slice_s > 0:
            raise ValueError("max_training_slice_s must be > 0 or None")
        if self.decode_pace_s is not None and not self.decode_pace_s > 0:
            raise ValueError("decode_pace_s must be > 0 or None")

    @property
    def training_node_ids(self) -> tuple[int, ...]:
        """The nodes co-located policies may train on: the last
        `num_training_nodes` (every node when None)."""
        num = self.num_nodes if self.num_training_nodes is None else self.num_training_nodes
        return tuple(range(self.num_nodes - num, self.num_nodes))

    @property
    def max_running_per_node(self) -> int:
        """Requests a node runs at once: C, or M × C when C caps each micro-batch."""
        if self.is_batch_cap_per_micro_batch:
            return self.max_batch_size * self.num_micro_batches
        return self.max_batch_size


# Not frozen, as `lemix.planner.trace.TaskCosts` is not (built per node per task).
@dataclass(slots=True)
class Ranked:
    """One candidate node with its score (higher is better)."""

    node_id: int
    score: float
    prediction: Prediction | None = None


@dataclass(frozen=True)
class PolicyContext:
    """Read-only facts a policy may use besides the node views."""

    now_s: float
    config: PlannerConfig
    request_rate_rps: float  # the planner's running estimate of the inference arrival rate
    memory_used_fraction: Mapping[int, float]  # per node, from the planner's accounting


class PlacementPolicy(Protocol):
    """Ranks nodes for a task. Pure: no clocks, no I/O, no randomness."""

    @property
    def name(self) -> str: ...

    @property
    def needs_prediction(self) -> bool:
        """True: the planner runs Algorithm 1 for every candidate node."""
        ...

    def rank(
        self,
        task: Task,
        views: Sequence[NodeView],
        predictions: Mapping[int, Prediction],
        context: PolicyContext,
    ) -> list[Ranked]:
        """Eligible nodes for `task`, best first. Empty means no eligible node."""
        ...

    def serving_nodes(self, num_nodes: int, context: PolicyContext) -> tuple[int, ...]:
        """Nodes that serve inference (all of them for co-located policies)."""
        ...

    def training_nodes(self, num_nodes: int, context: PolicyContext) -> tuple[int, ...] | None:
        """The policy's own training nodes (SEPARATE's split), or None: the
        planner's `PlannerConfig.training_node_ids` decide (co-located)."""
        ...

    def snapshot_state(self) -> dict[str, Any]:
        """The policy's own mutable state (counters), JSON-able; {} when none."""
        ...

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Take over what `snapshot_state` returned (planner restarts)."""
        ...


@runtime_checkable
class ScoreBoundedPolicy(Protocol):
    """A policy whose `rank` orders nodes by a per-node score it can also bound
    from cheap facts. The planner then runs Algorithm 1 only on the nodes whose
    bound can still reach the best few (an exact early exit, never a
    heuristic: the nodes it skips cannot be among those it returns first)."""

    def score(
        self, task: Task, view: NodeView, prediction: Prediction, context: PolicyContext
    ) -> float:
        """The score `rank` gives `task` on `view` (higher is better); `rank`
        orders by (-score, node id) and depends on no other node."""
        ...

    def score_upper_bound(
        self,
        task: Task,
        view: NodeView,
        response_lower_s: float,
        time_between_tokens_s: float,
        context: PolicyContext,
    ) -> float | None:
        """A float no smaller than `score` for any prediction of `task` on
        `view` whose response is >= `response_lower_s` and whose TBT is
        `time_between_tokens_s`, in floating point, not only in exact
        arithmetic; None: no such bound (the planner predicts every node)."""
        ...
