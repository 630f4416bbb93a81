"""The planner: one pure, synchronous state machine shared by sim and scheduler.

Inputs (each with `now_s`): `submit(task)`, `on_task_finished(...)`, and
`plan()` which returns decisions. Nothing here reads a clock, touches I/O or
draws random numbers, so recording the inputs of a live run and replaying them
yields the same decisions (the parity test relies on that).

Mechanism, not policy: the policy ranks nodes; the planner runs Algorithm 1
where the policy needs it (for a policy that bounds its score, only on the
nodes that can still be among the best few: `lemix.planner.candidates`),
applies queue-level deprioritization of training (with aging, so training
never starves and is never dropped), keeps the accounting, rejects what can
never fit, and emits SEPARATE's weight syncs and the replica averages of
`lemix.planner.replica_sync`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from lemix.memory import dynamic_bytes, threshold_bytes
from lemix.planner.base import (
    PlacementPolicy,
    PlannerConfig,
    PolicyContext,
    Ranked,
    ScoreBoundedPolicy,
)
from lemix.planner.candidates import best_candidates
from lemix.planner.costs import CostEstimator
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
from lemix.planner.trace import (
    NodeView,
    Prediction,
    TaskCosts,
    compute_idleness,
    response_lower_bound_s,
)
from lemix.profile import MemoryProfile
from lemix.reasons import NEVER_FITS, ReasonCode, format_reason
from lemix.types import Decision, Deferral, Placement, Rejection, Task, TaskKind, WeightSync

_TOKEN_EPSILON = 1e-9
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
        # Policies that can bound their score let `_candidates` skip nodes.
        self._bounded = policy if isinstance(policy, ScoreBoundedPolicy) else None
        self.estimator = estimator
        self.views = [NodeView(i, config.num_stages) for i in range(config.num_nodes)]
        self._intake: deque[Task] = deque()
        self._deferred: deque[_Deferred] = deque()
        self._task_node: dict[str, int] = {}
        self._recent_arrivals: deque[float] = deque()
        self._memory = memory
        self._kv_bytes_per_token = sum(memory.kv_bytes_per_token)
        self._act_bytes_per_token = sum(memory.activation_bytes_per_token)
        self._threshold_bytes = threshold_bytes(memory, kappa)
        self._dynamic_bytes = dynamic_bytes(memory, kappa, config.num_stages)
        if self._dynamic_bytes <= 0:
            raise ValueError("the model's static memory does not fit under the threshold")
        self._inference_len_mean = 0.0
        self._inference_out_mean = 0.0
        self._num_inference_seen = 0
        self._train_done_since_sync = 0
        self._replica_sync = ReplicaSyncClock(config.replica_sync_every_tasks)
        self._is_deferred_dirty = False
        self._down_nodes: set[int] = set()
        self._is_rank_empty_by_policy = False  # the last rank(): the policy offered no node
        self._deferred_eval_s = 0.0
        self._aged_tokens = float(config.num_nodes)  # token bucket for forced releases
        self._aged_tokens_at_s = 0.0
        self.num_deferrals = 0
        self.num_aged_releases = 0
        # (node, version, now_s, probe lengths) -> misses, for one `plan` call
        self._probe_memo: dict[tuple[int, int, float, int, int], bool] = {}

    # ------------------------------------------------------------ inputs

    def submit(self, task: Task, now_s: float) -> None:
        """Queue a task for the next `plan`."""
        self._intake.append(task)
        if task.kind is TaskKind.INFERENCE:
            self._recent_arrivals.append(now_s)
            self._num_inference_seen += 1
            n = self._num_inference_seen
            self._inference_len_mean += (task.num_prompt_tokens - self._inference_len_mean) / n
            self._inference_out_mean += (task.max_output_tokens - self._inference_out_mean) / n

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
        the periodic recheck or the head's aging deadline, whichever is first."""
        if not self._deferred:
            return None
        # An aged head also needs a release token; wake when one has accrued.
        rate = self.config.aged_release_rps_per_node * self.config.num_nodes
        token_ready_s = self._aged_tokens_at_s + max(1.0 - self._aged_tokens, 0.0) / rate
        aged_s = max(self._deferred[0].since_s + self.config.max_defer_s, token_ready_s)
        return min(aged_s, self._deferred_eval_s + self.config.defer_recheck_s)

    @property
    def num_deferred(self) -> int:
        return len(self._deferred)

    def node_of(self, task_id: str) -> int | None:
        return self._task_node.get(task_id)

    def request_rate_rps(self, now_s: float) -> float:
        window_s = self.config.request_rate_window_s
        while self._recent_arrivals and self._recent_arrivals[0] < now_s - window_s:
            self._recent_arrivals.popleft()
        return len(self._recent_arrivals) / window_s

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
            "recent_arrivals": list(self._recent_arrivals),
            "inference_len_mean": self._inference_len_mean,
            "inference_out_mean": self._inference_out_mean,
            "num_inference_seen": self._num_inference_seen,
            "train_done_since_sync": self._train_done_since_sync,
            "replica_sync": self._replica_sync.snapshot_state(),
            "is_deferred_dirty": self._is_deferred_dirty,
            "down_nodes": sorted(self._down_nodes),
            "deferred_eval_s": self._deferred_eval_s,
            "aged_tokens": self._aged_tokens,
            "aged_tokens_at_s": self._aged_tokens_at_s,
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
        self._recent_arrivals = deque(float(t) for t in snapshot["recent_arrivals"])
        self._inference_len_mean = float(snapshot["inference_len_mean"])
        self._inference_out_mean = float(snapshot["inference_out_mean"])
        self._num_inference_seen = int(snapshot["num_inference_seen"])
        self._train_done_since_sync = int(snapshot["train_done_since_sync"])
        self._replica_sync.restore_state(snapshot.get("replica_sync"))
        self._is_deferred_dirty = bool(snapshot["is_deferred_dirty"])
        self._down_nodes = {int(n) for n in snapshot["down_nodes"]}
        self._deferred_eval_s = float(snapshot["deferred_eval_s"])
        self._aged_tokens = float(snapshot["aged_tokens"])
        self._aged_tokens_at_s = float(snapshot["aged_tokens_at_s"])
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
            or self._is_aged(self._deferred[0], now_s)
            or now_s >= self._deferred_eval_s + self.config.defer_recheck_s
        )
        if not is_blocked:
            self._deferred_eval_s = now_s
        self._is_deferred_dirty = False
        self._probe_memo.clear()
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
        while self._deferred:
            item = self._deferred[0]
            decision = self._place_training(item, now_s, context)
            if isinstance(decision, Deferral):
                if item.since_s == now_s:
                    decisions.append(decision)
                break
            self._deferred.popleft()
            decisions.append(decision)
        return decisions

    def _is_aged(self, item: _Deferred, now_s: float) -> bool:
        # Same arithmetic as next_wakeup_s, so a wake-up at the deadline ages it.
        return now_s >= item.since_s + self.config.max_defer_s

    def _candidates(
        self,
        task: Task,
        now_s: float,
        views: list[NodeView],
        context: PolicyContext,
        num_needed: int,
    ) -> dict[int, Prediction]:
        """Predictions for the policy to rank: every node's, or (a policy that
        bounds its score, every node up) at least the `num_needed` best's
        (`lemix.planner.candidates`)."""
        if not self.policy.needs_prediction:
            return {}
        if self._bounded is not None and not self._down_nodes and len(views) > num_needed:
            predictions = best_candidates(
                self._bounded,
                task,
                views,
                context,
                num_needed,
                lambda view: self.estimator.costs(view, task, now_s),
                lambda view, costs: self._response_floor_s(view, task, now_s, costs),
                lambda view, costs: self._predict_with(view, task, now_s, costs),
            )
            if predictions is not None:
                return predictions
        return {view.node_id: self._predict(view, task, now_s) for view in views}

    def _response_floor_s(
        self, view: NodeView, task: Task, now_s: float, costs: TaskCosts
    ) -> float:
        """A floor under `_predict_with(...).response_s` (Algorithm 1's, or the
        sliced one when that is lower)."""
        floor_s = response_lower_bound_s(view, task, now_s, costs)
        if task.is_training or self.config.max_training_slice_s is None:
            return floor_s
        return min(floor_s, self._sliced_response_s(view, costs))

    def _predict(self, view: NodeView, task: Task, now_s: float) -> Prediction:
        """Algorithm 1 for `task` on `view`, with an inference response that
        knows training slices (see `_sliced_response_s`)."""
        return self._predict_with(view, task, now_s, self.estimator.costs(view, task, now_s))

    def _predict_with(
        self, view: NodeView, task: Task, now_s: float, costs: TaskCosts
    ) -> Prediction:
        """`_predict` with the estimator's costs of `task` on `view` given."""
        prediction = compute_idleness(
            view, task, now_s, costs, self.estimator.decode_load(view, now_s)
        )
        if task.is_training or self.config.max_training_slice_s is None:
            return prediction
        sliced_s = self._sliced_response_s(view, costs)
        if not sliced_s < prediction.response_s:
            return prediction  # the min would keep it: no copy
        return replace(prediction, response_s=sliced_s)

    def _sliced_response_s(self, view: NodeView, costs: TaskCosts) -> float:
        """An inference's response when training runs in slices: inference goes
        first at every slice boundary, so a request waits behind at most one
        slice per stage, not behind the training that Algorithm 1's FIFO trace
        queues ahead of it (the trace itself is kept: idleness still counts it)."""
        slice_s = self.config.max_training_slice_s or 0.0
        stall_s = view.num_stages * slice_s if view.training_tasks else 0.0
        return costs.start_delay_s + sum(costs.forward_s) + stall_s

    def _rank(
        self, task: Task, now_s: float, context: PolicyContext, num_needed: int = 1
    ) -> list[Ranked]:
        """Eligible live nodes for `task`, best first; the first `num_needed`
        are exact, the rest may be left out (nodes that cannot be among them)."""
        views: list[NodeView] = self.views
        # SEPARATE ranks its own training nodes (the config's are inert for it).
        if (
            task.is_training
            and self.config.num_training_nodes is not None
            and self.policy.training_nodes(self.config.num_nodes, context) is None
        ):
            homes = set(self.config.training_node_ids)
            views = [v for v in self.views if v.node_id in homes]
        predictions = self._candidates(task, now_s, views, context, num_needed)
        ranked = self.policy.rank(task, views, predictions, context)
        self._is_rank_empty_by_policy = not ranked
        if self._down_nodes:
            ranked = [r for r in ranked if r.node_id not in self._down_nodes]
        return ranked

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

    def _never_fits(self, task: Task) -> str | None:
        """A reason when `task` cannot fit on some stage GPU even on an empty node."""
        memory = self._memory
        if task.is_training:
            per_token = memory.activation_bytes_per_token
            num_tokens = task.batch_size * task.num_prompt_tokens
            what = f"{task.batch_size}x{task.num_prompt_tokens} training tokens of activations"
            fix = "use shorter samples or a smaller batch"
        else:
            per_token = memory.kv_bytes_per_token
            num_tokens = task.num_total_tokens
            what = f"{task.num_total_tokens} tokens of KV cache"
            fix = "shorten the prompt or max_tokens"
        for stage, bytes_per_token in enumerate(per_token):
            need = bytes_per_token * num_tokens
            room = self._threshold_bytes - memory.static_bytes(stage)
            if need > room:
                return format_reason(
                    ReasonCode.RESOURCE_EXHAUSTED,
                    f"{what} need {need} B on stage {stage} but it has {room} B for them "
                    f"({NEVER_FITS}); {fix}",
                )
        return None

    def _place(self, task: Task, now_s: float, context: PolicyContext) -> Decision:
        reason = self._never_fits(task)
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
            prediction = compute_idleness(
                view, task, now_s, costs, self.estimator.decode_load(view, now_s)
            )
        view.commit(task, prediction, now_s)
        self._task_node[task.task_id] = choice.node_id
        return Placement(task.task_id, choice.node_id, prediction.response_s, choice.score)

    def _place_training(self, item: _Deferred, now_s: float, context: PolicyContext) -> Decision:
        task = item.task
        reason = self._never_fits(task)
        if reason is not None:
            return Rejection(task.task_id, reason)
        is_checked = self.config.is_deprioritization_enabled and self.policy.needs_prediction
        ranked = self._rank(task, now_s, context, _MAX_DEFER_CANDIDATES if is_checked else 1)
        if not ranked:
            return Rejection(task.task_id, self._no_node_reason(task))
        if not is_checked:
            return self._commit(task, ranked[0], now_s)
        # The best few nodes only: the score already ranks nodes by the decode
        # slowdown this task would cause, so if those would miss, the rest would.
        for choice in ranked[:_MAX_DEFER_CANDIDATES]:
            if choice.prediction is not None and not self._hurts_inference(task, choice, now_s):
                return self._commit(task, choice, now_s)
        if self._is_aged(item, now_s) and self._take_aged_token(now_s):
            self.num_aged_releases += 1
            return self._commit(task, ranked[0], now_s)
        self.num_deferrals += 1
        return Deferral(task.task_id, "placing it now would make the next inference miss its SLO")

    def _take_aged_token(self, now_s: float) -> bool:
        """Rate-limit forced releases (token bucket, refilled by time passed in)."""
        rate = self.config.aged_release_rps_per_node * self.config.num_nodes
        elapsed_s = max(now_s - self._aged_tokens_at_s, 0.0)
        self._aged_tokens = min(float(self.config.num_nodes), self._aged_tokens + elapsed_s * rate)
        self._aged_tokens_at_s = now_s
        if self._aged_tokens < 1.0 - _TOKEN_EPSILON:  # float residue from the refill
            return False
        self._aged_tokens = max(self._aged_tokens - 1.0, 0.0)
        return True

    def _hurts_inference(self, task: Task, choice: Ranked, now_s: float) -> bool:
        """Would the next inference on this node miss its SLO with `task` placed?"""
        if choice.prediction is None:
            return False
        if self._num_inference_seen == 0 or self.request_rate_rps(now_s) == 0.0:
            return False  # no recent inference: no next request to protect
        view = self.views[choice.node_id].copy(share_requests=task.is_training)
        view.commit(task, choice.prediction, now_s)
        probe = Task(
            task_id="__probe__",
            kind=TaskKind.INFERENCE,
            arrival_s=now_s,
            num_prompt_tokens=max(1, round(self._inference_len_mean)),
            max_output_tokens=max(1, round(self._inference_out_mean)),
        )
        if not self._probe_misses(view, probe, now_s):
            return False
        if not self.config.is_admission_cluster_wide:
            return True
        # Cluster-wide: it hurts only if the next request would miss on every
        # other live node too (placing `task` changes none of them).
        return all(
            self._other_probe_misses(other, probe, now_s)
            for other in self.views
            if other.node_id != choice.node_id and other.node_id not in self._down_nodes
        )

    def _other_probe_misses(self, view: NodeView, probe: Task, now_s: float) -> bool:
        """`_probe_misses` on a live node, remembered for the `plan` call: the
        check repeats for every candidate and every deferred task while the
        other nodes stay as they are. A view changes its version on every
        change but the window prune at the start of `plan` (same `now_s`)."""
        key = (view.node_id, view.version, now_s, probe.num_prompt_tokens, probe.max_output_tokens)
        misses = self._probe_memo.get(key)
        if misses is None:
            misses = self._probe_misses(view, probe, now_s)
            self._probe_memo[key] = misses
        return misses

    def _probe_misses(self, view: NodeView, probe: Task, now_s: float) -> bool:
        """Would `probe` (the next inference) miss its SLO, with headroom, on `view`?"""
        prediction = self._predict(view, probe, now_s)
        headroom = self.config.slo_headroom
        return (
            prediction.response_s > headroom * self.config.slo_ttft_s
            or prediction.time_between_tokens_s > headroom * self.config.slo_tbt_s
        )

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
