"""One node's execution mechanics as a pure state machine (S stage workers).

The simulator drives it with virtual time; the emulated executor drives it with
real sleeps. Same loop shape everywhere: the driver tells the engine what
happened (`add_task`, `on_stage_done`, `on_timer`) with `now_s`, and the
engine answers with `StageStart`s (run this stage for this long) and outcomes.

Work on a stage is non-preemptive; the next item is picked by priority
(inference iterations, then training backwards, then training forwards, then
arrival order; or plain arrival order with `stage_order="fifo"`). Inference
runs as continuous-batching iterations (`lemix.batching`), one in flight per
node because each decode step needs the previous token; training tasks are
their own forward chain (stages 0→S−1) and backward chain (S−1→0).
Memory goes through `lemix.memory.NodeMemory` only.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from lemix.batching import BatchingConfig, admit
from lemix.latency import LatencyModel
from lemix.memory import MemoryConfig, NodeMemory, activation_bytes, kv_bytes
from lemix.profile import Profile
from lemix.reasons import ReasonCode, format_reason
from lemix.types import Task

PRIO_BLOCKING, PRIO_ITERATION, PRIO_BACKWARD, PRIO_FORWARD = 0, 1, 2, 3


@dataclass(frozen=True)
class EngineConfig:
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    stage_order: str = "inference-first"  # or "fifo"
    # Training tasks admitted at once per node (None: one per stage, enough to
    # keep every stage's pipeline busy, as 1F1B does). A backlog waits unadmitted
    # and holds no memory, so it can never crowd serving out of its KV cache.
    max_training_in_flight: int | None = None
    emit_tokens: bool = False  # streaming executors need every token; the simulator does not

    def __post_init__(self) -> None:
        if self.stage_order not in ("inference-first", "fifo"):
            raise ValueError("stage_order must be 'inference-first' or 'fifo'")
        if self.max_training_in_flight is not None and self.max_training_in_flight < 1:
            raise ValueError("max_training_in_flight must be >= 1 or None")


# ----------------------------------------------------------------- outputs


class WorkKind(StrEnum):
    """What a stage runs: a backend that executes work for real dispatches on it."""

    ITERATION = "iter"  # one inference iteration (prefill and/or decode)
    FORWARD = "fwd"  # a training task's forward
    BACKWARD = "bwd"  # a training task's backward
    BLOCKING = "block"  # a node-wide blocking op (e.g. a weight sync)
    NONE = ""  # nothing to execute: wait out the duration


@dataclass(frozen=True, slots=True)
class StageStart:
    """Run `stage` for `duration_s` (predicted by the engine's latency model).

    `kind` and `work` say what runs, for backends that execute it for real
    instead of waiting out the duration.
    """

    stage: int
    duration_s: float
    kind: WorkKind = WorkKind.NONE
    work: object = None


@dataclass(frozen=True, slots=True)
class FirstToken:
    task_id: str
    weight_updates: int  # updates visible in the weights that served it


@dataclass(frozen=True, slots=True)
class Finished:
    task_id: str
    num_output_tokens: int  # 0 for training


@dataclass(frozen=True, slots=True)
class Failed:
    task_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Requeued:
    """A training task handed back to the planner (never dropped)."""

    task_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class BlockingDone:
    tag: str


@dataclass(frozen=True, slots=True)
class TokensEmitted:
    """One iteration's decode tokens (only with `EngineConfig.emit_tokens`)."""

    task_ids: tuple[str, ...]
    num_generated: tuple[int, ...]  # per task, tokens so far including this one


Outcome = FirstToken | Finished | Failed | Requeued | BlockingDone | TokensEmitted


# ------------------------------------------------------------ internal state


@dataclass(slots=True)
class _Request:
    task: Task
    since_s: float
    num_generated: int = 0
    context_tokens: int = 0
    is_cancelled: bool = False
    is_stopped: bool = False  # the model emitted end-of-sequence
    failure: str = ""  # the backend could not run it: ends Failed with this reason


@dataclass(slots=True)
class _TrainWait:
    task: Task
    memory_wait_since_s: float | None = None  # set when memory (not the cap) blocks it


@dataclass(slots=True)
class _Item:
    prio: int
    seq: int
    durations_s: tuple[float, ...]
    kind: WorkKind
    payload: object = None


@dataclass(slots=True)
class _Iteration:
    prefill: list[_Request]
    decode: list[_Request]


class NodeEngine:
    """Executes placed tasks on one node of S stages."""

    def __init__(
        self, node_id: int, profile: Profile, truth: LatencyModel, config: EngineConfig
    ) -> None:
        self.node_id = node_id
        self.profile = profile
        self.truth = truth
        self.config = config
        self.num_stages = profile.num_stages
        self.memory = NodeMemory(profile.memory, config.memory)
        self._ready: list[list[tuple[int, int, _Item]]] = [[] for _ in range(self.num_stages)]
        self._current: list[_Item | None] = [None] * self.num_stages
        self._seq = 0
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.swapped: deque[_Request] = deque()
        self._in_flight = False
        self._batch_start_s = 0.0
        self._reload_s = 0.0  # KV reload time owed by the next iteration
        self._train_waiting: deque[_TrainWait] = deque()
        self._max_training = config.max_training_in_flight or self.num_stages
        self._training: dict[str, Task] = {}
        self._blocking_left: dict[str, int] = {}
        self._blocking_apply: dict[str, int] = {}
        self.num_training_updates = 0
        self.visible_updates = 0  # updates in the serving weights
        self.is_colocated = True
        self.busy_s = [0.0] * self.num_stages
        self.num_offloads = 0
        self.num_iterations = 0

    # ------------------------------------------------------------ intake

    def add_task(self, task: Task, now_s: float) -> tuple[list[StageStart], list[Outcome]]:
        outcomes: list[Outcome] = []
        if task.is_training:
            self._train_waiting.append(_TrainWait(task))
        else:
            self.waiting.append(_Request(task, now_s))
        return self._kick(now_s, outcomes), outcomes

    def add_blocking(
        self, tag: str, durations_s: tuple[float, ...], apply_updates: int | None, now_s: float
    ) -> list[StageStart]:
        """Occupy every stage for a while (a weight save or load); see `BlockingDone`."""
        self._blocking_left[tag] = self.num_stages
        if apply_updates is not None:
            self._blocking_apply[tag] = apply_updates
        starts = []
        for stage in range(self.num_stages):
            item = self._new_item(PRIO_BLOCKING, durations_s, WorkKind.BLOCKING, tag)
            starts += self._enqueue(item, stage)
        return starts

    # ------------------------------------------------------------ progress

    def on_stage_done(self, stage: int, now_s: float) -> tuple[list[StageStart], list[Outcome]]:
        item = self._current[stage]
        if item is None:
            raise RuntimeError(f"node {self.node_id} stage {stage}: done with nothing running")
        self._current[stage] = None
        starts: list[StageStart] = []
        outcomes: list[Outcome] = []
        last = self.num_stages - 1
        if item.kind is WorkKind.ITERATION:
            if stage < last:
                starts += self._enqueue(item, stage + 1)
            else:
                self._finish_iteration(item.payload, now_s, outcomes)  # type: ignore[arg-type]
        elif item.kind is WorkKind.FORWARD:
            starts += self._enqueue(item, stage + 1) if stage < last else self._to_backward(item)
        elif item.kind is WorkKind.BACKWARD:
            if stage > 0:
                starts += self._enqueue(item, stage - 1)
            else:
                self._finish_training(item.payload, outcomes)  # type: ignore[arg-type]
        else:
            self._finish_blocking(str(item.payload), outcomes)
        starts += self._start_if_idle(stage)
        starts += self._kick(now_s, outcomes)
        return starts, outcomes

    def cancel(self, task_id: str, now_s: float) -> tuple[bool, list[StageStart], list[Outcome]]:
        """Cancel an inference request (client gone); frees its memory.

        A request inside the in-flight iteration is dropped when that iteration
        ends (its stage work cannot be taken back). Training already running
        cannot be cancelled (False); training still waiting can.
        """
        outcomes: list[Outcome] = []
        reason = format_reason(ReasonCode.CANCELLED, "cancelled by the client")
        for queue in (self.waiting, self.swapped):
            for req in queue:
                if req.task.task_id == task_id:
                    queue.remove(req)
                    if self.memory.is_offloaded(task_id):
                        self.memory.drop_offloaded(task_id)
                    outcomes.append(Failed(task_id, reason))
                    return True, self._kick(now_s, outcomes), outcomes
        for req in self.running:
            if req.task.task_id == task_id:
                if self._in_flight:
                    req.is_cancelled = True
                    return True, [], outcomes
                self.running.remove(req)
                self.memory.release(task_id)
                outcomes.append(Failed(task_id, reason))
                return True, self._kick(now_s, outcomes), outcomes
        for entry in self._train_waiting:
            if entry.task.task_id == task_id:
                self._train_waiting.remove(entry)
                outcomes.append(Failed(task_id, reason))
                return True, [], outcomes
        return False, [], outcomes

    def stop_requests(self, task_ids: Iterable[str]) -> None:
        """Requests of the in-flight iteration whose model emitted end-of-sequence:
        they finish when the iteration ends, with the tokens they have."""
        wanted = set(task_ids)
        for req in self.running:
            if req.task.task_id in wanted:
                req.is_stopped = True

    def fail_requests(self, task_ids: Iterable[str], reason: str) -> None:
        """Requests of the in-flight iteration the backend could not run: they
        end Failed (with `reason`, a "STATUS: text" string) when it ends."""
        wanted = set(task_ids)
        for req in self.running:
            if req.task.task_id in wanted and not req.failure:
                req.failure = reason

    def next_timer_s(self) -> float | None:
        """When a memory wait reaches T_max (the driver calls `on_timer` then)."""
        deadlines = []
        if self._train_waiting and self._train_waiting[0].memory_wait_since_s is not None:
            deadlines.append(
                self._train_waiting[0].memory_wait_since_s + self.config.memory.max_wait_s
            )
        if self.waiting and not self.config.memory.is_offload_enabled:
            deadlines.append(self.waiting[0].since_s + self.config.memory.max_wait_s)
        return min(deadlines) if deadlines else None

    def on_timer(self, now_s: float) -> tuple[list[StageStart], list[Outcome]]:
        outcomes: list[Outcome] = []
        if not self.config.memory.is_offload_enabled:
            self._drop_stale_waiting(now_s, outcomes)
        return self._kick(now_s, outcomes), outcomes

    # ------------------------------------------------------------ queries

    @property
    def is_idle(self) -> bool:
        return (
            not self._in_flight
            and not self.waiting
            and not self.running
            and not self.swapped
            and not self._training
            and not self._train_waiting
            and all(c is None for c in self._current)
        )

    # ------------------------------------------------------------ internals

    def _new_item(
        self, prio: int, durations_s: tuple[float, ...], kind: WorkKind, payload: object
    ) -> _Item:
        self._seq += 1
        if self.config.stage_order == "fifo" and prio != PRIO_BLOCKING:
            prio = PRIO_ITERATION
        return _Item(prio, self._seq, durations_s, kind, payload)

    def _enqueue(self, item: _Item, stage: int) -> list[StageStart]:
        heapq.heappush(self._ready[stage], (item.prio, item.seq, item))
        return self._start_if_idle(stage)

    def _start_if_idle(self, stage: int) -> list[StageStart]:
        if self._current[stage] is not None or not self._ready[stage]:
            return []
        _, _, item = heapq.heappop(self._ready[stage])
        self._current[stage] = item
        duration_s = item.durations_s[stage]
        self.busy_s[stage] += duration_s
        return [StageStart(stage, duration_s, item.kind, item.payload)]

    def _kick(self, now_s: float, outcomes: list[Outcome]) -> list[StageStart]:
        """Admit waiting training and form the next iteration where possible."""
        starts = self._admit_training(now_s, outcomes)
        if not self._in_flight:
            starts += self._start_iteration(now_s, outcomes)
        return starts

    def _admit_training(self, now_s: float, outcomes: list[Outcome]) -> list[StageStart]:
        starts: list[StageStart] = []
        max_wait_s = self.config.memory.max_wait_s
        while self._train_waiting and len(self._training) < self._max_training:
            head = self._train_waiting[0]
            task = head.task
            need = activation_bytes(self.profile.memory, task.batch_size, task.num_prompt_tokens)
            if not self.memory.can_admit(need):
                if head.memory_wait_since_s is None:
                    head.memory_wait_since_s = now_s
                # Same arithmetic as next_timer_s, so the timer's call acts.
                if now_s < head.memory_wait_since_s + max_wait_s:
                    break
                if self.config.memory.is_offload_enabled:
                    if self._in_flight:
                        break  # offload at the iteration boundary, when no KV is in use
                    if not self._offload_for(need):
                        self._train_waiting.popleft()
                        outcomes.append(
                            Requeued(task.task_id, "no activation memory even after KV offload")
                        )
                        continue
                else:
                    self._train_waiting.popleft()
                    outcomes.append(Requeued(task.task_id, "no activation memory within T_max"))
                    continue
            self._train_waiting.popleft()
            self.memory.admit(task.task_id, need)
            self._training[task.task_id] = task
            durations = tuple(
                self.truth.forward_s(s, task.batch_size, task.num_prompt_tokens)
                for s in range(self.num_stages)
            )
            starts += self._enqueue(
                self._new_item(PRIO_FORWARD, durations, WorkKind.FORWARD, task), 0
            )
        return starts

    def _offload_for(self, need: tuple[int, ...]) -> bool:
        """Move KV of running requests (newest first) to host until `need` fits.

        Called only between iterations, when none of their KV is in use. Does
        nothing when even offloading every running request would not make room."""
        running_bytes = [0] * self.num_stages
        for req in self.running:
            for stage, nbytes in enumerate(self.memory.held_bytes(req.task.task_id)):
                running_bytes[stage] += nbytes
        if any(
            self.memory.used_bytes(s) - running_bytes[s] + need[s] > self.memory.threshold_bytes
            for s in range(self.num_stages)
        ):
            return False
        for req in sorted(self.running, key=lambda r: -r.task.seq):
            if self.memory.can_admit(need):
                break
            if not self.memory.can_offload(req.task.task_id):
                continue
            moved = self.memory.offload(req.task.task_id)
            self._reload_s += moved / self.profile.transfer.host_link_bytes_s / self.num_stages
            self.running.remove(req)
            self.swapped.append(req)
            self.num_offloads += 1
        return self.memory.can_admit(need)

    def _to_backward(self, item: _Item) -> list[StageStart]:
        task: Task = item.payload  # type: ignore[assignment]
        durations = tuple(
            self.truth.backward_s(s, task.batch_size, task.num_prompt_tokens)
            + self.profile.optimizer_step_s[s]
            for s in range(self.num_stages)
        )
        return self._enqueue(
            self._new_item(PRIO_BACKWARD, durations, WorkKind.BACKWARD, task), self.num_stages - 1
        )

    def _finish_training(self, task: Task, outcomes: list[Outcome]) -> None:
        del self._training[task.task_id]
        self.memory.release(task.task_id)
        self.num_training_updates += 1
        if self.is_colocated:
            self.visible_updates = self.num_training_updates
        outcomes.append(Finished(task.task_id, 0))

    def _finish_blocking(self, tag: str, outcomes: list[Outcome]) -> None:
        self._blocking_left[tag] -= 1
        if self._blocking_left[tag] == 0:
            del self._blocking_left[tag]
            applied = self._blocking_apply.pop(tag, None)
            if applied is not None:
                self.visible_updates = applied
            outcomes.append(BlockingDone(tag))

    def _reserve(self, req: _Request) -> bool:
        need = kv_bytes(self.profile.memory, req.task.num_total_tokens)
        if not self.memory.can_admit(need):
            return False
        self.memory.admit(req.task.task_id, need)
        return True

    def _resume_swapped(self) -> None:
        while self.swapped and len(self.running) < self.config.batching.max_batch_size:
            req = self.swapped[0]
            if not self.memory.can_reload(req.task.task_id):
                break
            moved = self.memory.reload(req.task.task_id)
            self._reload_s += moved / self.profile.transfer.host_link_bytes_s / self.num_stages
            self.swapped.popleft()
            self.running.append(req)

    def _drop_stale_waiting(self, now_s: float, outcomes: list[Outcome]) -> None:
        """Wait-then-drop (memory-aware offload disabled): fail after T_max."""
        max_wait_s = self.config.memory.max_wait_s
        while self.waiting and now_s >= self.waiting[0].since_s + max_wait_s:
            req = self.waiting[0]
            if self.memory.can_admit(kv_bytes(self.profile.memory, req.task.num_total_tokens)):
                break  # it fits now; only a lack of memory drops a request
            self.waiting.popleft()
            outcomes.append(
                Failed(
                    req.task.task_id,
                    format_reason(ReasonCode.RESOURCE_EXHAUSTED, "no KV memory within T_max"),
                )
            )

    def _start_iteration(self, now_s: float, outcomes: list[Outcome]) -> list[StageStart]:
        self._resume_swapped()
        if self.swapped:
            fits: list = []  # swapped requests go first: no new admissions
        else:
            waiting = self.waiting
            head = list(waiting)[: self.config.batching.max_batch_size]
            fits = [lambda r=r: self._reserve(r) for r in head]
        decision = admit(self.config.batching, len(self.running), self._batch_start_s, fits, now_s)
        self._batch_start_s = decision.batch_start_s
        prefill = [self.waiting.popleft() for _ in range(decision.num_admitted)]
        if not self.config.memory.is_offload_enabled and decision.blocked_by == "memory":
            self._drop_stale_waiting(now_s, outcomes)
        decode = self.running
        if not prefill and not decode:
            return []
        durations = self._iteration_durations(prefill, decode)
        self.running = decode + prefill
        self._in_flight = True
        self.num_iterations += 1
        item = self._new_item(
            PRIO_ITERATION, durations, WorkKind.ITERATION, _Iteration(prefill, decode)
        )
        return self._enqueue(item, 0)

    def _iteration_durations(
        self, prefill: list[_Request], decode: list[_Request]
    ) -> tuple[float, ...]:
        truth = self.truth
        sum_context = sum(r.context_tokens for r in decode)
        reload_s, self._reload_s = self._reload_s, 0.0
        out = []
        for s in range(self.num_stages):
            d = reload_s
            if prefill:
                # Ragged (unpadded) prefill, as vLLM/SGLang run it: per-sequence
                # terms add up, the fixed per-pass cost is paid once.
                fixed_s = truth.forward_s(s, 1, 0)
                d += (
                    sum(truth.forward_s(s, 1, r.task.num_prompt_tokens) - fixed_s for r in prefill)
                    + fixed_s
                )
            if decode:
                d += truth.decode_step_s(s, len(decode), sum_context)
            out.append(d)
        return tuple(out)

    def _finish_iteration(
        self, iteration: _Iteration, now_s: float, outcomes: list[Outcome]
    ) -> None:
        self._in_flight = False
        for req in iteration.prefill:
            req.num_generated = 1
            req.context_tokens = req.task.num_prompt_tokens + 1
            if not req.failure:  # a failed request's token was never made
                outcomes.append(FirstToken(req.task.task_id, self.visible_updates))
        for req in iteration.decode:
            req.num_generated += 1
            req.context_tokens += 1
        emitted = [r for r in iteration.decode if not r.failure]
        if self.config.emit_tokens and emitted:
            outcomes.append(
                TokensEmitted(
                    tuple(r.task.task_id for r in emitted), tuple(r.num_generated for r in emitted)
                )
            )
        still = []
        for req in self.running:
            if req.is_cancelled or req.failure:
                self.memory.release(req.task.task_id)
                reason = req.failure or format_reason(
                    ReasonCode.CANCELLED, "cancelled by the client"
                )
                outcomes.append(Failed(req.task.task_id, reason))
            elif req.is_stopped or req.num_generated >= req.task.max_output_tokens:
                self.memory.release(req.task.task_id)
                outcomes.append(Finished(req.task.task_id, req.num_generated))
            else:
                still.append(req)
        self.running = still
