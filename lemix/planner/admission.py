"""Admission checks the planner runs before it places a task.

- `never_fits_reason`: a task that cannot fit on some stage GPU even on an
  empty node is rejected at once, not queued forever.
- `TrainingAdmission.hurts_inference`: queue-level deprioritization of
  training. A training task is held back when, placed, it would make the next
  inference request (a probe of the recent mean lengths, `InferenceTraffic`)
  miss its SLO on its node, or with cluster-wide admission on every live node.
- `AgedReleaseBucket`: training held back too long is released anyway (so it
  never starves), at a bounded rate so a backlog does not flood the nodes.

The planner (`lemix.planner.planner`) decides when to run them and keeps the
deferred queue. Pure and synchronous: every time is an argument.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Set
from dataclasses import dataclass, field

from lemix.planner.base import PlannerConfig, Ranked
from lemix.planner.predict import Predictor
from lemix.planner.trace import NodeView
from lemix.profile import MemoryProfile
from lemix.reasons import NEVER_FITS, ReasonCode, format_reason
from lemix.types import Task, TaskKind

_TOKEN_EPSILON = 1e-9


def never_fits_reason(task: Task, memory: MemoryProfile, threshold_bytes: int) -> str | None:
    """A reason when `task` cannot fit on some stage GPU even on an empty node
    (`threshold_bytes`: a GPU's usable memory, static weights included)."""
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
        room = threshold_bytes - memory.static_bytes(stage)
        if need > room:
            return format_reason(
                ReasonCode.RESOURCE_EXHAUSTED,
                f"{what} need {need} B on stage {stage} but it has {room} B for them "
                f"({NEVER_FITS}); {fix}",
            )
    return None


@dataclass(slots=True)
class InferenceTraffic:
    """Recent inference as the planner saw it submitted: arrival times (for the
    request rate) and running means of the lengths (for the probe)."""

    recent_arrivals: deque[float] = field(default_factory=deque)
    len_mean: float = 0.0  # prompt tokens
    out_mean: float = 0.0  # max output tokens
    num_seen: int = 0

    def on_submit(self, task: Task, now_s: float) -> None:
        """Count an inference task submitted at `now_s`."""
        self.recent_arrivals.append(now_s)
        self.num_seen += 1
        n = self.num_seen
        self.len_mean += (task.num_prompt_tokens - self.len_mean) / n
        self.out_mean += (task.max_output_tokens - self.out_mean) / n

    def rate_rps(self, now_s: float, window_s: float) -> float:
        """Arrivals per second over the last `window_s` (older ones are dropped)."""
        while self.recent_arrivals and self.recent_arrivals[0] < now_s - window_s:
            self.recent_arrivals.popleft()
        return len(self.recent_arrivals) / window_s

    def probe(self, now_s: float) -> Task:
        """A stand-in for the next inference request: the mean lengths so far."""
        return Task(
            task_id="__probe__",
            kind=TaskKind.INFERENCE,
            arrival_s=now_s,
            num_prompt_tokens=max(1, round(self.len_mean)),
            max_output_tokens=max(1, round(self.out_mean)),
        )


@dataclass(slots=True)
class AgedReleaseBucket:
    """Rate-limit forced releases of aged training (a token bucket, refilled by
    the time passed in, up to `capacity` tokens)."""

    rate_per_s: float
    capacity: float
    tokens: float
    at_s: float = 0.0

    def ready_s(self) -> float:
        """When a whole token will have accrued (the past when one has)."""
        return self.at_s + max(1.0 - self.tokens, 0.0) / self.rate_per_s

    def take(self, now_s: float) -> bool:
        """Refill to `now_s`, then take one token if there is one."""
        elapsed_s = max(now_s - self.at_s, 0.0)
        self.tokens = min(self.capacity, self.tokens + elapsed_s * self.rate_per_s)
        self.at_s = now_s
        if self.tokens < 1.0 - _TOKEN_EPSILON:  # float residue from the refill
            return False
        self.tokens = max(self.tokens - 1.0, 0.0)
        return True


class TrainingAdmission:
    """Would placing a training task make the next inference miss its SLO?"""

    def __init__(
        self, config: PlannerConfig, predictor: Predictor, traffic: InferenceTraffic
    ) -> None:
        self.config = config
        self.predictor = predictor
        self.traffic = traffic
        # (node, version, now_s, probe lengths) -> misses, for the `plan`
        # calls at one time (a call that stops at its training cap is
        # followed by another at the same time: the memo still holds then).
        self._probe_memo: dict[tuple[int, int, float, int, int], bool] = {}
        self._memo_now_s: float | None = None

    def on_plan_start(self, now_s: float) -> None:
        """Forget the probes of earlier times (views have changed since; at
        the same time a view that changed has a new version, its own key)."""
        if now_s != self._memo_now_s:
            self._probe_memo.clear()
            self._memo_now_s = now_s

    def hurts_inference(
        self,
        task: Task,
        choice: Ranked,
        now_s: float,
        views: list[NodeView],
        down_nodes: Set[int],
    ) -> bool:
        """Would the next inference on `choice`'s node miss its SLO with `task`
        placed there (cluster-wide admission: on every live node)?"""
        if choice.prediction is None:
            return False
        traffic = self.traffic
        if traffic.num_seen == 0 or traffic.rate_rps(now_s, self.config.request_rate_window_s) == 0:
            return False  # no recent inference: no next request to protect
        view = views[choice.node_id].copy(share_requests=task.is_training)
        view.commit(task, choice.prediction, now_s)
        probe = traffic.probe(now_s)
        if not self._probe_misses(view, probe, now_s):
            return False
        if not self.config.is_admission_cluster_wide:
            return True
        # Cluster-wide: it hurts only if the next request would miss on every
        # other live node too (placing `task` changes none of them).
        return all(
            self._other_probe_misses(other, probe, now_s)
            for other in views
            if other.node_id != choice.node_id and other.node_id not in down_nodes
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
        prediction = self.predictor.predict(view, probe, now_s)
        headroom = self.config.slo_headroom
        return (
            prediction.response_s > headroom * self.config.slo_ttft_s
            or prediction.time_between_tokens_s > headroom * self.config.slo_tbt_s
        )
