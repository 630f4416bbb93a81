"""The planner: one pure, synchronous state machine shared by sim and scheduler.

Inputs (each with `now_s`): `submit(task)`, `on_task_finished(...)`, and
`plan()` which returns decisions. Nothing here reads a clock, touches I/O or
draws random numbers, so recording the inputs of a live run and replaying them
yields the same decisions (the parity test relies on that).

Mechanism, not policy: the policy ranks nodes; the planner runs Algorithm 1
where the policy needs it (`lemix.planner.predict`; for a policy that bounds
its score, only on the nodes that can still be among the best few:
`lemix.planner.candidates`), applies queue-level deprioritization of training
(`lemix.planner.admission`; with aging, so training never starves and is
never dropped), keeps the accounting, rejects what can never fit, and emits
SEPARATE's weight syncs and the replica averages of
`lemix.planner.replica_sync`. Its state round-trips through
`lemix.planner.snapshot`.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from lemix.memory import dynamic_bytes, threshold_bytes
from lemix.planner.admission import (
    AgedReleaseBucket,
    InferenceTraffic,
    TrainingAdmission,
    never_fits_reason,
)
from lemix.planner.base import PlacementPolicy, PlannerConfig, PolicyContext, Ranked
from lemix.planner.costs import CostEstimator
from lemix.planner.predict import Predictor
from lemix.planner.replica_sync import ReplicaSyncClock
from lemix.planner.snapshot import (
    SNAPSHOT_VERSION,
    check_snapshot,
    config_fingerprint,
    task_from_state,
    task_to_state,
    view_from_state,
    view_to_state,
)
from lemix.planner.trace import NodeView
from lemix.profile import MemoryProfile
from lemix.reasons import ReasonCode, format_reason
from lemix.types import Decision, Deferral, Placement, Rejection, Task, TaskKind, WeightSync

_MAX_DEFER_CANDIDATES = 3  # nodes a training task is checked against before deferral
NO_NODE_REASON = format_reason(ReasonCode.UNAVAILABLE, "no live executor can take this task")
NO_TRAINING_NODE_REASON = format_reason(
    ReasonCode.INVALID_ARGUMENT,
    "the placement policy keeps no node for training (separate at train rate 0 serves on "
    "every node); set a train rate > 0 to train",
)


@dataclass(slots=True)
class _Deferred:
    task: Task
    since_s: float


class Planner:
    """Places tasks on nodes. See the module docstring for the contract."""

    def __init__(
        self,
        config: PlannerConfig,
        policy: PlacementPolicy,
        estimator: CostEstimator,
        memory: MemoryProfile,
        kappa: float = 0.9,
    ) -> None:
        self.config = config
        self.policy = policy
        self.estimator = estimator
        self.predictor = Predictor(config, policy, estimator)
        self.views = [NodeView(i, config.num_stages) for i in range(config.num_nodes)]
        self._intake: deque[Task] = deque()
        self._deferred: deque[_Deferred] = deque()
        self._task_node: dict[str, int] = {}
        self._traffic = InferenceTraffic()
        self.admission = TrainingAdmission(config, self.predictor, self._traffic)
        self._memory = memory
        self._kv_bytes_per_token = sum(memory.kv_bytes_per_token)
        self._act_bytes_per_token = sum(memory.activation_bytes_per_token)
        self._threshold_bytes = threshold_bytes(memory, kappa)
        self._dynamic_bytes = dynamic_bytes(memory, kappa, config.num_stages)
        if self._dynamic_bytes <= 0:
            raise ValueError("the model's static memory does not fit under the threshold")
        self._train_done_since_sync = 0
        self._replica_sync = ReplicaSyncClock(config.replica_sync_every_tasks)
        self._is_deferred_dirty = False
        self._is_release_pending = False  # the last plan() stopped at its training cap
        self._down_nodes: set[int] = set()
        self._is_rank_empty_by_policy = False  # the last rank(): the policy offered no node
        self._deferred_eval_s = 0.0
        self._aged_release = AgedReleaseBucket(
            rate_per_s=config.aged_release_rps_per_node * config.num_nodes,
            capacity=float(config.num_nodes),
            tokens=float(config.num_nodes),
        )
        self.num_deferrals = 0
        self.num_aged_releases = 0

    # ------------------------------------------------------------ inputs

    def submit(self, task: Task, now_s: float) -> None:
        """Queue a task for the next `plan`."""
        self._intake.append(task)
        if task.kind is TaskKind.INFERENCE:
            self._traffic.on_submit(task, now_s)

    def on_task_finished(
        self, task_id: str, now_s: float, is_success: bool = True
    ) -> list[Decision]:
        """A node reports a task done (completed or failed). May emit weight syncs."""
        node_id = self._task_node.pop(task_id, None)
        if node_id is None:
            return []
        self._is_deferred_dirty = True
        view = self.views[node_id]
        is_training = task_id in view.training_tasks
        view.finish(task_id)
        if not (is_training and is_success):
            return []
        view.num_training_updates += 1
        return self._maybe_sync(now_s)

    def on_node_health(self, node_id: int, is_healthy: bool, now_s: float) -> None:
        """Executors' liveness: a node that is down gets no new tasks."""
        if not 0 <= node_id < self.config.num_nodes:
            raise ValueError(f"node {node_id} is not in this cluster of {self.config.num_nodes}")
        if is_healthy:
            self._down_nodes.discard(node_id)
        else:
            self._down_nodes.add(node_id)
        self._is_deferred_dirty = True

    # ------------------------------------------------------------ queries

    def next_wakeup_s(self) -> float | None:
        """When deferred training must be looked at again (callers set a timer):
        the periodic recheck or the head's aging deadline, whichever is first;
        the last `plan` call's time when it stopped at its training cap (due
        now: `is_release_pending`)."""
        if not self._deferred:
            return None
        if self._is_release_pending:
            return self._deferred_eval_s
        # An aged head also needs a release token; wake when one has accrued.
        token_ready_s = self._aged_release.ready_s()
        aged_s = max(self._deferred[0].since_s + self.config.max_defer_s, token_ready_s)
        return min(aged_s, self._deferred_eval_s + self.config.defer_recheck_s)

    @property
    def num_deferred(self) -> int:
        return len(self._deferred)

    @property
    def is_release_pending(self) -> bool:
        """The last `plan` spent the training work one call may
        (`PlannerConfig.max_training_runs_per_plan`) and more training may be
        placeable now: call `plan` again, at once (after letting other work
        run), with the same or a later time."""
        return self._is_release_pending and bool(self._deferred)

    def node_of(self, task_id: str) -> int | None:
        return self._task_node.get(task_id)

    def request_rate_rps(self, now_s: float) -> float:
        return self._traffic.rate_rps(now_s, self.config.request_rate_window_s)

    def context(self, now_s: float) -> PolicyContext:
        return PolicyContext(
            now_s=now_s,
            config=self.config,
            request_rate_rps=self.request_rate_rps(now_s),
            memory_used_fraction={v.node_id: self._memory_fraction(v) for v in self.views},
        )

    # ------------------------------------------------------------ snapshot

    def snapshot(self) -> dict[str, Any]:
        """Every piece of state that affects future decisions, as JSON-able data.

        `restore` on a fresh planner of the same config and policy continues
        exactly where this one is (lemix.planner.snapshot lists what is kept).
        """
        return {
            "version": SNAPSHOT_VERSION,
            "fingerprint": config_fingerprint(self.config, self.policy.name),
            "policy": self.policy.name,
            "config": asdict(self.config),
            "views": [view_to_state(view) for view in self.views],
            "intake": [task_to_state(task) for task in self._intake],
            "deferred": [[task_to_state(item.task), item.since_s] for item in self._deferred],
            "task_node": dict(self._task_node),
            "recent_arrivals": list(self._traffic.recent_arrivals),
            "inference_len_mean": self._traffic.len_mean,
            "inference_out_mean": self._traffic.out_mean,
            "num_inference_seen": self._traffic.num_seen,
            "train_done_since_sync": self._train_done_since_sync,
            "replica_sync": self._replica_sync.snapshot_state(),
            "is_deferred_dirty": self._is_deferred_dirty,
            "is_release_pending": self._is_release_pending,
            "down_nodes": sorted(self._down_nodes),
            "deferred_eval_s": self._deferred_eval_s,
            "aged_tokens": self._aged_release.tokens,
            "aged_tokens_at_s": self._aged_release.at_s,
            "num_deferrals": self.num_deferrals,
            "num_aged_releases": self.num_aged_releases,
            "policy_state": self.policy.snapshot_state(),
        }

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Take over the state of `snapshot` (from `snapshot()`), replacing this
        planner's. Raises `SnapshotMismatch` (a ValueError) when it was taken
        from a planner with another config or policy."""
        check_snapshot(snapshot, self.config, self.policy.name)
        views = [view_from_state(v) for v in snapshot["views"]]
        if [(v.node_id, v.num_stages) for v in views] != [
            (v.node_id, v.num_stages) for v in self.views
        ]:
            raise ValueError("the snapshot's nodes do not match this planner's")
        self.views = views
        self._intake = deque(task_from_state(t) for t in snapshot["intake"])
        self._deferred = deque(
            _Deferred(task_from_state(t), float(since_s)) for t, since_s in snapshot["deferred"]
        )
        self._task_node = {str(t): int(n) for t, n in snapshot["task_node"].items()}
        self._traffic.recent_arrivals = deque(float(t) for t in snapshot["recent_arrivals"])
        self._traffic.len_mean = float(snapshot["inference_len_mean"])
        self._traffic.out_mean = float(snapshot["inference_out_mean"])
        self._traffic.num_seen = int(snapshot["num_inference_seen"])
        self._train_done_since_sync = int(snapshot["train_done_since_sync"])
        self._replica_sync.restore_state(snapshot.get("replica_sync"))
        self._is_deferred_dirty = bool(snapshot["is_deferred_dirty"])
        self._is_release_pending = bool(snapshot["is_release_pending"])
        self._down_nodes = {int(n) for n in snapshot["down_nodes"]}
        self._deferred_eval_s = float(snapshot["deferred_eval_s"])
        self._aged_release.tokens = float(snapshot["aged_tokens"])
        self._aged_release.at_s = float(snapshot["aged_tokens_at_s"])
        self.num_deferrals = int(snapshot["num_deferrals"])
        self.num_aged_releases = int(snapshot["num_aged_releases"])
        self.policy.restore_state(snapshot["policy_state"])

    # ------------------------------------------------------------ planning

    def plan(self, now_s: float) -> list[Decision]:
        """Place what can be placed now: inference first, then training in order."""
        for view in self.views:
            if view.windows:  # most nodes have none: skip the call
                view.prune(now_s)
        decisions: list[Decision] = []
        context = self.context(now_s)
        # Re-evaluating deferred training is the planner's costliest step. New
        # arrivals only add load, so they do not trigger it; a finished task
        # (capacity freed), an aging deadline or the periodic recheck (predicted
        # work slides into the past) do.
        is_blocked = bool(self._deferred) and not (
            self._is_deferred_dirty
            or self._is_release_pending
            or self._is_aged(self._deferred[0], now_s)
            or now_s >= self._deferred_eval_s + self.config.defer_recheck_s
        )
        if not is_blocked:
            self._deferred_eval_s = now_s
        self._is_deferred_dirty = False
        self._is_release_pending = False
        self.admission.on_plan_start(now_s)
        while self._intake:
            task = self._intake.popleft()
            if task.is_training:
                # Every training task goes through the deferred queue, in FIFO order.
                self._deferred.append(_Deferred(task, now_s))
            else:
                decisions.append(self._place(task, now_s, context))
        if is_blocked:
            return decisions
        # Place from the head; the first task that must wait blocks the rest
        # (the head is the oldest, so it also ages first).
        num_placed = 0
        first_run = self.predictor.num_runs
        while self._deferred:
            if (
                num_placed
                and self.predictor.num_runs - first_run >= self.config.max_training_runs_per_plan
            ):
                self._is_release_pending = True  # the next call goes on from here
                break
            item = self._deferred[0]
            decision = self._place_training(item, now_s, context)
            if isinstance(decision, Deferral):
                if item.since_s == now_s:
                    decisions.append(decision)
                break
            self._deferred.popleft()
            decisions.append(decision)
            num_placed += isinstance(decision, Placement)
        return decisions

    def _is_aged(self, item: _Deferred, now_s: float) -> bool:
        # Same arithmetic as next_wakeup_s, so a wake-up at the deadline ages it.
        return now_s >= item.since_s + self.config.max_defer_s

    def _rank(
        self, task: Task, now_s: float, context: PolicyContext, num_needed: int = 1
    ) -> list[Ranked]:
        """Eligible live nodes for `task`, best first; the first `num_needed`
        are exact, the rest may be left out (nodes that cannot be among them)."""
        views = self._eligible_views(task, context)
        predictions = self.predictor.candidates(
            task, now_s, views, context, num_needed, bool(self._down_nodes)
        )
        ranked = self.policy.rank(task, views, predictions, context)
        self._is_rank_empty_by_policy = not ranked
        if self._down_nodes:
            ranked = [r for r in ranked if r.node_id not in self._down_nodes]
        return ranked

    def _rank_lazily(
        self, task: Task, now_s: float, context: PolicyContext, num_needed: int
    ) -> Iterator[Ranked]:
        """`_rank`'s nodes one at a time, best first: where the predictor can
        (`Predictor.ranked_lazily`: every node up, a bounded policy, many
        nodes), each is computed only when asked for, so a caller that stops
        early skips the Algorithm 1 runs the later ones would need. Else
        `_rank(..., num_needed)`'s list, of which the first `num_needed` are
        exact."""
        views = self._eligible_views(task, context)
        lazy = None
        if not self._down_nodes:
            lazy = self.predictor.ranked_lazily(task, now_s, views, context)
        if lazy is None:
            return iter(self._rank(task, now_s, context, num_needed))
        self._is_rank_empty_by_policy = not views
        return (Ranked(node_id, score, prediction) for node_id, score, prediction in lazy)

    def _eligible_views(self, task: Task, context: PolicyContext) -> list[NodeView]:
        # SEPARATE ranks its own training nodes (the config's are inert for it).
        if (
            task.is_training
            and self.config.num_training_nodes is not None
            and self.policy.training_nodes(self.config.num_nodes, context) is None
        ):
            homes = set(self.config.training_node_ids)
            return [v for v in self.views if v.node_id in homes]
        return self.views

    def training_nodes(self, context: PolicyContext) -> tuple[int, ...]:
        """Nodes that train: the policy's own split (SEPARATE), else the
        config's training nodes (`PlannerConfig.num_training_nodes`)."""
        own = self.policy.training_nodes(self.config.num_nodes, context)
        return self.config.training_node_ids if own is None else own

    def _no_node_reason(self, task: Task) -> str:
        """Why `task` got no node: the policy keeps none for its kind (SEPARATE
        at train rate 0 trains nowhere), or every eligible node is down."""
        if task.is_training and self._is_rank_empty_by_policy:
            return NO_TRAINING_NODE_REASON
        return NO_NODE_REASON

    def _place(self, task: Task, now_s: float, context: PolicyContext) -> Decision:
        reason = never_fits_reason(task, self._memory, self._threshold_bytes)
        if reason is not None:
            return Rejection(task.task_id, reason)
        ranked = self._rank(task, now_s, context)
        if not ranked:
            return Rejection(task.task_id, self._no_node_reason(task))
        return self._commit(task, ranked[0], now_s)

    def _commit(self, task: Task, choice: Ranked, now_s: float) -> Placement:
        view = self.views[choice.node_id]
        prediction = choice.prediction
        if prediction is None:  # policies without Algorithm 1 still keep the trace
            costs = self.estimator.costs(view, task, now_s)
            prediction = self.predictor.idleness(view, task, now_s, costs)
        view.commit(task, prediction, now_s)
        self._task_node[task.task_id] = choice.node_id
        return Placement(task.task_id, choice.node_id, prediction.response_s, choice.score)

    def _place_training(self, item: _Deferred, now_s: float, context: PolicyContext) -> Decision:
        task = item.task
        reason = never_fits_reason(task, self._memory, self._threshold_bytes)
        if reason is not None:
            return Rejection(task.task_id, reason)
        is_checked = self.config.is_deprioritization_enabled and self.policy.needs_prediction
        num_needed = _MAX_DEFER_CANDIDATES if is_checked else 1
        # Lazily: the best node usually admits the task, and then the next
        # ones' Algorithm 1 runs are not needed.
        ranked = self._rank_lazily(task, now_s, context, num_needed)
        best = next(ranked, None)
        if best is None:
            return Rejection(task.task_id, self._no_node_reason(task))
        if not is_checked:
            return self._commit(task, best, now_s)
        # The best few nodes only: the score already ranks nodes by the decode
        # slowdown this task would cause, so if those would miss, the rest would.
        for choice in itertools.chain((best,), itertools.islice(ranked, num_needed - 1)):
            if choice.prediction is not None and not self.admission.hurts_inference(
                task, choice, now_s, self.views, self._down_nodes
            ):
                return self._commit(task, choice, now_s)
        if self._is_aged(item, now_s) and self._aged_release.take(now_s):
            self.num_aged_releases += 1
            return self._commit(task, best, now_s)
        self.num_deferrals += 1
        return Deferral(task.task_id, "placing it now would make the next inference miss its SLO")

    # ------------------------------------------------------------ accounting

    def _memory_fraction(self, view: NodeView) -> float:
        kv = view.sum_request_prompt_tokens + view.sum_request_output_tokens
        act = view.sum_training_tokens
        used = kv * self._kv_bytes_per_token + act * self._act_bytes_per_token
        return used / self._dynamic_bytes

    def _maybe_sync(self, now_s: float) -> list[Decision]:
        """Every K completed training tasks, copy the freshest replica to the
        nodes that serve but do not train (SEPARATE's serving nodes, or a
        co-located policy's serving-only nodes). With replica sync on, also
        every M average the replicas of the live training nodes."""
        context = self.context(now_s)
        trainer_ids = set(self.training_nodes(context))
        live_trainers = [n for n in sorted(trainer_ids) if n not in self._down_nodes]
        average = self._replica_sync.on_training_done(live_trainers)
        averages: list[Decision] = [average] if average is not None else []
        serving = self.policy.serving_nodes(self.config.num_nodes, context)
        targets = tuple(n for n in serving if n not in trainer_ids)
        if not targets or not trainer_ids:
            return averages  # every serving node trains: its own updates are its weights
        self._train_done_since_sync += 1
        if self._train_done_since_sync < self.config.sync_every_tasks:
            return averages
        self._train_done_since_sync = 0
        trainers = [v for v in self.views if v.node_id in trainer_ids]
        source = max(trainers, key=lambda v: (v.num_training_updates, -v.node_id))
        return [*averages, WeightSync(source.node_id, targets, source.num_training_updates)]
