"""Per-node predicted execution traces and Algorithm 1 ("ComputeIdleness").

`NodeView` is the planner's picture of one node: when the last placed forward
ends on every stage (`forward_end_s`, the paper's pfe), the pending training
backward windows (for far dependencies), the node's length statistics and the
inference requests it still holds (for decode occupancy). `compute_idleness`
simulates a new task stage by stage against that picture without mutating it;
`NodeView.commit` records the task once it is placed.

Pure and synchronous: time is an argument, never read from a clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from lemix.types import Task


@dataclass(frozen=True, slots=True)
class TrainWindow:
    """A placed training task's predicted backward interval on every stage."""

    task_id: str
    backward_begin_s: tuple[float, ...]  # bb per stage
    backward_end_s: tuple[float, ...]  # be per stage
    backward_s: tuple[float, ...]  # busy time per stage (the offset rule)


# Not frozen (treat as read-only): one is built per node per task, and a frozen
# dataclass's __init__ (object.__setattr__ per field) costs ~5x a plain one's.
@dataclass(slots=True)
class TaskCosts:
    """Predicted per-stage costs of one task on one node.

    `forward_s[s]` is the forward (for inference: the iteration it joins,
    prefill plus the running batch's decode step); `backward_s` is empty for
    inference. `start_delay_s` is time the task must wait before stage 0 can
    take it (a free batch slot, the next iteration boundary).
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...] = ()
    start_delay_s: float = 0.0
    time_between_tokens_s: float = 0.0  # inference: predicted TBT on this node (0 = unknown)


# Not frozen, as TaskCosts is not (built per node per task).
@dataclass(slots=True)
class DecodeLoad:
    """Occupancy of the node's running decode batch, as the planner predicts it.

    Until `until_s` each stage s is busy `busy_fraction[s]` of the time with
    decode iterations; that busy time is not idleness.
    """

    busy_fraction: tuple[float, ...]
    until_s: float


# Not frozen, as TaskCosts is not (built per node per task).
@dataclass(slots=True)
class Prediction:
    """Algorithm 1's output for one (task, node) pair."""

    node_id: int
    idleness_increase_s: float  # II = Σ_s max(fb_s − pfe_s − offset_s, 0)
    response_s: float  # R = fe_{S−1} − arrival
    arrival_gap_s: float  # Δa: gap since the node's last arrival (0 when empty)
    forward_begin_s: tuple[float, ...]
    forward_end_s: tuple[float, ...]
    window: TrainWindow | None  # the task's own backward chain (training only)
    num_passed_windows: int  # windows whose backward ends before this task's stage-0 forward
    time_between_tokens_s: float = 0.0  # from the costs (decode-aware estimators only)


@dataclass(slots=True)
class OutstandingRequest:
    """An inference request placed on the node and not yet reported finished."""

    num_prompt_tokens: int
    max_output_tokens: int


@dataclass
class NodeView:
    """The planner's mutable picture of one node (its trace queue)."""

    node_id: int
    num_stages: int
    forward_end_s: list[float] = field(default_factory=list)
    windows: list[TrainWindow] = field(default_factory=list)
    last_arrival_s: float | None = None
    # Welford running statistics of task lengths (training and inference).
    num_lengths: int = 0
    length_mean: float = 0.0
    length_m2: float = 0.0
    requests: dict[str, OutstandingRequest] = field(default_factory=dict)
    training_tasks: dict[str, int] = field(default_factory=dict)  # id -> activation tokens
    sum_training_tokens: int = 0  # over `training_tasks`, kept incrementally (memory use)
    # id -> predicted busiest-stage work (forward + backward) of each held training task
    training_work_s: dict[str, float] = field(default_factory=dict)
    sum_training_work_s: float = 0.0
    # (placed_s, busiest-stage work) of training placed in the last window:
    # the node's training *rate*, which is what slows its decoding.
    recent_training: deque[tuple[float, float]] = field(default_factory=deque)
    recent_training_work_s: float = 0.0  # running sum over `recent_training`
    version: int = 0  # bumped on every change; estimators cache per version
    # The estimator's derived facts, each entry carrying what it was computed
    # from (a version, sums): a copy keeps them, valid until it changes.
    cached: dict[str, object] = field(default_factory=dict)
    num_placed: int = 0
    num_training_updates: int = 0
    # Aggregates over `requests`, kept incrementally: Algorithm 1 runs on every
    # node for every task, so it must not walk the requests each time.
    sum_request_prompt_tokens: int = 0
    sum_request_output_tokens: int = 0
    max_request_output_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.forward_end_s:
            self.forward_end_s = [-math.inf] * self.num_stages

    def training_load(self, now_s: float, window_s: float) -> tuple[float, float]:
        """(busy fraction of the busiest stage, mean item length) from training
        placed in the last `window_s` seconds."""
        recent = self.recent_training
        while recent and recent[0][0] < now_s - window_s:
            self.recent_training_work_s -= recent.popleft()[1]
        if not recent:
            self.recent_training_work_s = 0.0  # no float residue once empty
            return 0.0, 0.0
        work_s = self.recent_training_work_s
        return work_s / window_s, work_s / (2 * len(recent))  # a forward + a backward each

    @property
    def is_empty(self) -> bool:
        return self.last_arrival_s is None

    @property
    def length_std(self) -> float:
        if self.num_lengths < 2:
            return 0.0
        return math.sqrt(self.length_m2 / (self.num_lengths - 1))

    @property
    def num_outstanding(self) -> int:
        return len(self.requests) + len(self.training_tasks)

    def commit(self, task: Task, prediction: Prediction, now_s: float | None = None) -> None:
        """Record a placed task: its forward ends, backward window and length."""
        self.version += 1
        self.forward_end_s = list(prediction.forward_end_s)
        if prediction.num_passed_windows:
            del self.windows[: prediction.num_passed_windows]
        if prediction.window is not None:
            self.windows.append(prediction.window)
        self.last_arrival_s = task.arrival_s
        self.num_lengths += 1
        delta = task.num_prompt_tokens - self.length_mean
        self.length_mean += delta / self.num_lengths
        self.length_m2 += delta * (task.num_prompt_tokens - self.length_mean)
        self.num_placed += 1
        if task.is_training:
            num_tokens = task.batch_size * task.num_prompt_tokens
            self.sum_training_tokens += num_tokens - self.training_tasks.get(task.task_id, 0)
            self.training_tasks[task.task_id] = num_tokens
            work_s = _busiest_stage_work_s(prediction)
            self.training_work_s[task.task_id] = work_s
            self.sum_training_work_s += work_s
            self.recent_training.append((task.arrival_s if now_s is None else now_s, work_s))
            self.recent_training_work_s += work_s
        else:
            self.requests[task.task_id] = OutstandingRequest(
                task.num_prompt_tokens, task.max_output_tokens
            )
            self.sum_request_prompt_tokens += task.num_prompt_tokens
            self.sum_request_output_tokens += task.max_output_tokens
            self.max_request_output_tokens = max(
                self.max_request_output_tokens, task.max_output_tokens
            )

    def finish(self, task_id: str) -> None:
        """Forget a task the node reported finished (completed, failed or dropped)."""
        self.version += 1
        request = self.requests.pop(task_id, None)
        if request is not None:
            self.sum_request_prompt_tokens -= request.num_prompt_tokens
            self.sum_request_output_tokens -= request.max_output_tokens
            if request.max_output_tokens >= self.max_request_output_tokens:
                self.max_request_output_tokens = max(
                    (r.max_output_tokens for r in self.requests.values()), default=0
                )
        num_tokens = self.training_tasks.pop(task_id, None)
        if num_tokens is not None:
            self.sum_training_tokens -= num_tokens
            self.sum_training_work_s -= self.training_work_s.pop(task_id, 0.0)
            if not self.training_tasks:
                self.sum_training_work_s = 0.0  # no float residue once empty
            self.windows = [w for w in self.windows if w.task_id != task_id]

    def prune(self, now_s: float) -> None:
        """Drop backward windows predicted to have ended before `now_s`."""
        if self.windows and self.windows[0].backward_end_s[0] < now_s:
            self.windows = [w for w in self.windows if w.backward_end_s[0] >= now_s]

    def copy(self, share_requests: bool = False) -> NodeView:
        """An independent copy (lists copied, never aliased: a prototype bug).

        `share_requests=True` reuses the request table itself: only for a
        throw-away copy that will commit training, which never touches it.
        """
        return NodeView(
            node_id=self.node_id,
            num_stages=self.num_stages,
            forward_end_s=list(self.forward_end_s),
            windows=list(self.windows),
            last_arrival_s=self.last_arrival_s,
            num_lengths=self.num_lengths,
            length_mean=self.length_mean,
            length_m2=self.length_m2,
            requests=self.requests if share_requests else dict(self.requests),
            training_tasks=dict(self.training_tasks),
            sum_training_tokens=self.sum_training_tokens,
            training_work_s=dict(self.training_work_s),
            sum_training_work_s=self.sum_training_work_s,
            recent_training=deque(self.recent_training),
            recent_training_work_s=self.recent_training_work_s,
            version=self.version,
            num_placed=self.num_placed,
            num_training_updates=self.num_training_updates,
            sum_request_prompt_tokens=self.sum_request_prompt_tokens,
            sum_request_output_tokens=self.sum_request_output_tokens,
            max_request_output_tokens=self.max_request_output_tokens,
            cached=dict(self.cached),  # entries are immutable: shared, not copied
        )


def _busiest_stage_work_s(prediction: Prediction) -> float:
    """Forward + backward time of a training task on its busiest stage."""
    backward = prediction.window.backward_s if prediction.window else ()
    return max(
        (end - begin) + (backward[s] if backward else 0.0)
        for s, (begin, end) in enumerate(
            zip(prediction.forward_begin_s, prediction.forward_end_s, strict=True)
        )
    )


def _busy_overlap_s(
    decode: DecodeLoad | None, stage: int, begin_s: float, end_s: float, now_s: float
) -> float:
    """Decode-busy time on `stage` inside [begin_s, end_s] (not idleness)."""
    if decode is None or end_s <= begin_s:
        return 0.0
    lo = max(begin_s, now_s)
    hi = min(end_s, decode.until_s)
    return max(hi - lo, 0.0) * decode.busy_fraction[stage]


def _backward_overlap_s(
    windows: list[TrainWindow], stage: int, begin_s: float, end_s: float
) -> float:
    """Backward time of pending training tasks on `stage` inside [begin_s, end_s]."""
    busy_s = 0.0
    for window in windows:
        lo = max(window.backward_begin_s[stage], begin_s)
        hi = min(window.backward_end_s[stage], end_s)
        if hi > lo:
            busy_s += hi - lo
    return busy_s


def compute_idleness(
    view: NodeView,
    task: Task,
    now_s: float,
    costs: TaskCosts,
    decode: DecodeLoad | None = None,
) -> Prediction:
    """Algorithm 1: place `task` on `view` in imagination; return II, R and its trace.

    Immediate dependency: the forward at stage s starts after the previous
    task's forward at s (pfe_s) and after this task's forward at s−1. Far
    dependency: if it would overlap a pending training backward at s, it waits
    for that backward to end. Backward time that falls between pfe_s and the
    new forward is busy, not idle, and is subtracted (offset_s).
    """
    num_stages = view.num_stages
    windows = view.windows
    arrival_s = task.arrival_s
    begin_s = max(arrival_s, now_s) + costs.start_delay_s
    idleness_s = 0.0
    walk = 0
    num_passed = 0
    begins: list[float] = []
    ends: list[float] = []
    is_empty = view.last_arrival_s is None
    for stage in range(num_stages):
        duration_s = costs.forward_s[stage]
        prev_end_s = arrival_s if is_empty else view.forward_end_s[stage]
        begin_s = max(prev_end_s, begin_s)
        end_s = begin_s + duration_s
        # Far dependencies. Backward runs from the last stage to the first, so a
        # window passed at stage s−1 ended even earlier at stage s: the walk
        # resumes where the previous stage left it (as the prototype does).
        while walk < len(windows):
            window = windows[walk]
            if end_s <= window.backward_begin_s[stage]:
                break  # fits before this backward reaches the stage
            begin_s = max(begin_s, window.backward_end_s[stage])
            end_s = begin_s + duration_s
            if stage == 0:
                num_passed = walk + 1
            walk += 1
        # Busy time in the gap [pfe_s, fb_s] is not idleness: every pending
        # backward's overlap with the gap (also windows passed at earlier
        # stages, which the prototype's offset missed) and decode iterations.
        # Without a gap there is no idleness to add (and no overlap to find):
        # on a loaded node that is most stages, and they skip the overlap sums.
        if begin_s > prev_end_s:
            offset_s = _backward_overlap_s(windows, stage, prev_end_s, begin_s)
            offset_s += _busy_overlap_s(decode, stage, prev_end_s, begin_s, now_s)
            idleness_s += max(begin_s - prev_end_s - offset_s, 0.0)
        begins.append(begin_s)
        ends.append(end_s)
        begin_s = end_s  # the next stage needs this stage's output
    window_out = (
        _backward_chain(task.task_id, ends[-1], costs.backward_s) if costs.backward_s else None
    )
    gap_s = 0.0 if view.last_arrival_s is None else max(arrival_s - view.last_arrival_s, 0.0)
    return Prediction(  # positional: this runs for every node for every task
        view.node_id,
        idleness_s,  # idleness_increase_s
        ends[-1] - arrival_s,  # response_s
        gap_s,  # arrival_gap_s
        tuple(begins),
        tuple(ends),
        window_out,
        num_passed,
        costs.time_between_tokens_s,
    )


def response_lower_bound_s(view: NodeView, task: Task, now_s: float, costs: TaskCosts) -> float:
    """A floor under `compute_idleness(view, task, now_s, costs).response_s`.

    The same float operations along the immediate dependencies only: the far
    ones (backward windows) can only delay a forward, and each step (a max, an
    addition) is monotone after rounding too, so the floor holds exactly. With
    no pending windows it is the response itself.
    """
    arrival_s = task.arrival_s
    begin_s = max(arrival_s, now_s) + costs.start_delay_s
    is_empty = view.last_arrival_s is None
    forward_end_s = view.forward_end_s
    for stage, duration_s in enumerate(costs.forward_s):
        prev_end_s = arrival_s if is_empty else forward_end_s[stage]
        if prev_end_s > begin_s:
            begin_s = prev_end_s
        begin_s = begin_s + duration_s  # this stage's end: the next one's earliest begin
    return begin_s - arrival_s


def _backward_chain(
    task_id: str, last_forward_end_s: float, backward_s: tuple[float, ...]
) -> TrainWindow:
    """Backward from the last stage to the first, each starting when the next ends."""
    num_stages = len(backward_s)
    begins = [0.0] * num_stages
    ends = [0.0] * num_stages
    begin_s = last_forward_end_s
    for stage in range(num_stages - 1, -1, -1):
        begins[stage] = begin_s
        ends[stage] = begin_s + backward_s[stage]
        begin_s = ends[stage]
    return TrainWindow(task_id, tuple(begins), tuple(ends), tuple(backward_s))
