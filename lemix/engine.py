"""One node's execution mechanics as a pure state machine (S stage workers).

The simulator drives it with virtual time; the emulated executor drives it with
real sleeps. Same loop shape everywhere: the driver tells the engine what
happened (`add_task`, `on_stage_done`, `on_timer`) with `now_s`, and the
engine answers with `StageStart`s (run this stage for this long) and outcomes.

Work on a stage is non-preemptive; the next item is picked by priority
(`lemix.engine_stages`: inference iterations, then training optimizer steps,
backwards, forwards (forwards before backwards with
`training_order="forward-first"`), then arrival order; or plain arrival
order with `stage_order="fifo"`). Inference runs as continuous-batching iterations
(`lemix.batching`) in M micro-batches, each with one iteration in flight
because each decode step needs the previous token (`EngineConfig`'s M = 1: one
iteration in flight per node, the v1 engine; every entry point passes engine
v2's M = S, `lemix.engine_config`); training tasks are their own forward chain
(stages 0→S−1) and backward chain (S−1→0), optionally in slices, plus an
optimizer step on each stage once its backward has handed the gradient on.
The step is not on the backward chain (stage s−1 starts its backward as soon
as stage s's backward ends, not a step later), as pipeline trainers keep it
out of it (Megatron steps after a batch's last backward); the gradients have
a buffer of their own in the memory model (`training_state_bytes`), so
holding them until the step costs nothing more. A task's update is visible
once every stage has stepped. Micro-batches, chunked prefill and training
slices are described in `lemix.engine_groups`, which holds their rules.
Memory goes through `lemix.memory.NodeMemory` only; waits for it (bounded by
T_max) and KV offload are `lemix.engine_memory`'s.

This module routes work between stages and runs training and blocking ops; the
rest is in its own module:
- `lemix.engine_config`: `EngineConfig` and the default prefill token budget;
- `lemix.engine_outputs`: what the engine answers (`StageStart`, outcomes);
- `lemix.engine_stages`: each stage's ready queue, priorities and slices;
- `lemix.engine_batcher`: the waiting queue, micro-batches and iterations.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from lemix.engine_batcher import RequestBatcher
from lemix.engine_config import SPARE_TRAINING_FREE_FRACTION, EngineConfig
from lemix.engine_groups import Iteration, MicroBatch, Request
from lemix.engine_memory import MemoryWaits, TrainingRoom
from lemix.engine_outputs import (
    BlockingDone,
    Failed,
    Finished,
    FirstToken,
    Outcome,
    Requeued,
    StageStart,
    TokensEmitted,
    TrainingSlice,
    WorkKind,
)
from lemix.engine_stages import (
    PRIO_BACKWARD,
    PRIO_BLOCKING,
    PRIO_FORWARD,
    PRIO_ITERATION,
    PRIO_OPTIMIZER,
    StageQueues,
    WorkItem,
)
from lemix.latency import LatencyModel
from lemix.memory import NodeMemory, activation_bytes
from lemix.profile import Profile
from lemix.reasons import ReasonCode, format_reason
from lemix.types import Task

# The engine's interface: `NodeEngine`, its config, and what its methods take and
# answer (defined in `lemix.engine_config` and `lemix.engine_outputs`), so a
# driver (the simulator, the executor's backends) imports one module.
__all__ = [
    "BlockingDone",
    "EngineConfig",
    "Failed",
    "Finished",
    "FirstToken",
    "NodeEngine",
    "Outcome",
    "Requeued",
    "StageStart",
    "TokensEmitted",
    "TrainingSlice",
    "WorkKind",
]


@dataclass(slots=True)
class _TrainWait:
    task: Task
    memory_wait_since_s: float | None = None  # set when memory (not the cap) blocks it


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
        self.stages = StageQueues(
            self.num_stages,
            config.stage_order,
            config.max_training_slice_s,
            config.training_order,
        )
        self.memory_waits = MemoryWaits(self.memory, profile, config.memory)
        self.batcher = RequestBatcher(
            profile,
            truth,
            config,
            self.memory,
            self.memory_waits,
            has_training=lambda: bool(self._training or self._train_waiting),
        )
        # The batcher's queue and micro-batches (the same objects), for drivers and tests.
        self.waiting = self.batcher.waiting
        self.micro_batches = self.batcher.micro_batches
        self._train_waiting: deque[_TrainWait] = deque()
        self._max_training = config.max_training_in_flight or self.num_stages
        self._training: dict[str, Task] = {}
        # Training task id -> stages whose optimizer step has not ended yet.
        self._steps_left: dict[str, int] = {}
        self._blocking_left: dict[str, int] = {}
        self._blocking_apply: dict[str, int] = {}
        self.num_training_updates = 0
        self.visible_updates = 0  # updates in the serving weights
        self.is_colocated = True
        self.busy_s = self.stages.busy_s  # per stage, the work started on it so far
        self.num_iterations = 0

    @property
    def swapped(self) -> deque[Request]:
        """Requests whose KV is on the host, oldest offload first."""
        return self.memory_waits.swapped

    @property
    def num_offloads(self) -> int:
        """Requests whose KV went to host memory so far."""
        return self.memory_waits.num_offloads

    # ------------------------------------------------------------ intake

    def add_task(self, task: Task, now_s: float) -> tuple[list[StageStart], list[Outcome]]:
        outcomes: list[Outcome] = []
        if task.is_training:
            self._train_waiting.append(_TrainWait(task))
        else:
            self.waiting.append(Request(task, now_s))
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
            item = self.stages.new_item(PRIO_BLOCKING, durations_s, WorkKind.BLOCKING, tag)
            starts += self.stages.enqueue(item, stage)
        return starts

    # ------------------------------------------------------------ progress

    def on_stage_done(self, stage: int, now_s: float) -> tuple[list[StageStart], list[Outcome]]:
        item = self.stages.finish(stage)
        if item is None:
            raise RuntimeError(f"node {self.node_id} stage {stage}: done with nothing running")
        starts: list[StageStart] = []
        outcomes: list[Outcome] = []
        last = self.num_stages - 1
        if item.kind is WorkKind.ITERATION:
            if stage < last:
                starts += self.stages.enqueue(item, stage + 1)
            else:
                iteration: Iteration = item.payload  # type: ignore[assignment]
                self.batcher.finish_iteration(iteration, self.visible_updates, outcomes)
        elif item.has_more_slices:
            self.stages.requeue_next_slice(item, stage)
        elif item.kind is WorkKind.FORWARD:
            starts += (
                self.stages.enqueue(item, stage + 1) if stage < last else self._to_backward(item)
            )
        elif item.kind is WorkKind.BACKWARD:
            starts += self._to_optimizer(item.payload, stage)  # type: ignore[arg-type]
            if stage > 0:
                starts += self.stages.enqueue(item, stage - 1)
        elif item.kind is WorkKind.OPTIMIZER:
            task: Task = item.payload  # type: ignore[assignment]
            self._steps_left[task.task_id] -= 1
            if not self._steps_left[task.task_id]:
                self._finish_training(task, outcomes)
        else:
            self._finish_blocking(str(item.payload), outcomes)
        starts += self.stages.start_if_idle(stage)
        starts += self._kick(now_s, outcomes)
        return starts, outcomes

    def cancel(
        self, task_id: str, now_s: float, reason: str = ""
    ) -> tuple[bool, list[StageStart], list[Outcome]]:
        """Cancel an inference request (client gone); frees its memory.

        A request of a micro-batch whose iteration is in flight, or with a
        prefill chunk in another group's iteration, is dropped when that
        iteration ends (its stage work cannot be taken back). Training
        already running cannot be cancelled (False); training still waiting can.
        """
        outcomes: list[Outcome] = []
        # The canceller's reason (e.g. the gateway's "a stop sequence ended
        # it"), without a status prefix of its own; a default when none given.
        detail = reason.removeprefix(f"{ReasonCode.CANCELLED.value}: ").strip()
        reason = format_reason(ReasonCode.CANCELLED, detail or "cancelled by the client")
        for queue in (self.waiting, self.swapped):
            for req in queue:
                if req.task.task_id == task_id:
                    queue.remove(req)
                    if self.memory.is_offloaded(task_id):
                        self.memory.drop_offloaded(task_id)
                    outcomes.append(Failed(task_id, reason))
                    return True, self._kick(now_s, outcomes), outcomes
        for batch in self.micro_batches:
            for req in batch.running:
                if req.task.task_id == task_id:
                    if batch.is_in_flight or req.has_chunk_in_flight:
                        req.is_cancelled = True
                        req.cancel_reason = reason
                        return True, [], outcomes
                    batch.running.remove(req)
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
        """Requests of an in-flight iteration whose model emitted end-of-sequence:
        they finish when the iteration ends, with the tokens they have."""
        wanted = set(task_ids)
        for batch in self.micro_batches:
            for req in batch.running:
                if req.task.task_id in wanted:
                    req.is_stopped = True

    def fail_requests(self, task_ids: Iterable[str], reason: str) -> None:
        """Requests of an in-flight iteration the backend could not run: they
        end Failed (with `reason`, a "STATUS: text" string) when it ends."""
        wanted = set(task_ids)
        for batch in self.micro_batches:
            for req in batch.running:
                if req.task.task_id in wanted and not req.failure:
                    req.failure = reason

    def next_timer_s(self) -> float | None:
        """When a memory wait reaches T_max or paced decodes may start (the
        driver calls `on_timer` then)."""
        waits = self.memory_waits
        deadlines = []
        if self._train_waiting and self._train_waiting[0].memory_wait_since_s is not None:
            deadlines.append(waits.deadline_s(self._train_waiting[0].memory_wait_since_s))
        if self.waiting:
            deadlines.append(waits.deadline_s(self.waiting[0].since_s))
        if self.batcher.paced_until_s is not None:
            deadlines.append(self.batcher.paced_until_s)
        return min(deadlines) if deadlines else None

    def on_timer(self, now_s: float) -> tuple[list[StageStart], list[Outcome]]:
        outcomes: list[Outcome] = []
        self.batcher.shed_overdue_requests(now_s, outcomes)
        return self._kick(now_s, outcomes), outcomes

    # ------------------------------------------------------------ queries

    @property
    def running(self) -> list[Request]:
        """The running requests of every micro-batch (a new list)."""
        return self.batcher.running

    @property
    def num_running(self) -> int:
        return self.batcher.num_running

    @property
    def is_idle(self) -> bool:
        return (
            not any(batch.is_in_flight or batch.running for batch in self.micro_batches)
            and not self.waiting
            and not self.swapped
            and not self._training
            and not self._train_waiting
            and self.stages.is_idle
        )

    # ------------------------------------------------------------ internals

    def _kick(self, now_s: float, outcomes: list[Outcome]) -> list[StageStart]:
        """Admit waiting training and form the next iteration where possible."""
        starts = self._admit_training(now_s, outcomes)
        for batch in self.micro_batches:
            if not batch.is_in_flight:
                starts += self._start_iteration(batch, now_s, outcomes)
        return starts

    def _admit_training(self, now_s: float, outcomes: list[Outcome]) -> list[StageStart]:
        starts: list[StageStart] = []
        waits = self.memory_waits
        while self._train_waiting:
            head = self._train_waiting[0]
            task = head.task
            need = activation_bytes(self.profile.memory, task.batch_size, task.num_prompt_tokens)
            if not self._has_training_room(need):
                break
            if not self.memory.can_admit(need):
                if head.memory_wait_since_s is None:
                    head.memory_wait_since_s = now_s
                if not waits.is_overdue(head.memory_wait_since_s, now_s):
                    break
                room = waits.make_training_room(need, self.micro_batches)
                if room is TrainingRoom.WAIT:
                    break
                if room is TrainingRoom.NO_ROOM:
                    self._train_waiting.popleft()
                    reason = (
                        "no activation memory even after KV offload"
                        if self.config.memory.is_offload_enabled
                        else "no activation memory within T_max"
                    )
                    outcomes.append(Requeued(task.task_id, reason))
                    continue
            self._train_waiting.popleft()
            self.memory.admit(task.task_id, need)
            self._training[task.task_id] = task
            durations = tuple(
                self.truth.forward_s(s, task.batch_size, task.num_prompt_tokens)
                for s in range(self.num_stages)
            )
            item = self.stages.new_item(PRIO_FORWARD, durations, WorkKind.FORWARD, task)
            starts += self.stages.enqueue(item, 0)
        return starts

    def _has_training_room(self, need: tuple[int, ...]) -> bool:
        """Room for one more training task in flight, whose activations take
        `need`: under the cap, or one of `EngineConfig.spare_training_in_flight`
        beyond it while memory is spare (no request waits to join or to get its
        KV back, every stage has `SPARE_TRAINING_FREE_FRACTION` of its dynamic
        memory free, and `need` fits now: a spare task never waits for memory,
        so it never has KV offloaded for it)."""
        num_training = len(self._training)
        if num_training < self._max_training:
            return True
        if num_training >= self._max_training + self.config.spare_training_in_flight:
            return False
        if self.waiting or self.swapped:
            return False
        memory = self.memory
        return memory.can_admit(need) and all(
            memory.free_bytes(s) >= SPARE_TRAINING_FREE_FRACTION * memory.dynamic_capacity_bytes(s)
            for s in range(self.num_stages)
        )

    def _to_backward(self, item: WorkItem) -> list[StageStart]:
        task: Task = item.payload  # type: ignore[assignment]
        durations = tuple(
            self.truth.backward_s(s, task.batch_size, task.num_prompt_tokens)
            for s in range(self.num_stages)
        )
        self._steps_left[task.task_id] = self.num_stages
        backward = self.stages.new_item(PRIO_BACKWARD, durations, WorkKind.BACKWARD, task)
        return self.stages.enqueue(backward, self.num_stages - 1)

    def _to_optimizer(self, task: Task, stage: int) -> list[StageStart]:
        """`task`'s optimizer step on `stage`, whose backward just ended."""
        durations = tuple(
            self.profile.optimizer_step_s[s] if s == stage else 0.0 for s in range(self.num_stages)
        )
        step = self.stages.new_item(PRIO_OPTIMIZER, durations, WorkKind.OPTIMIZER, task)
        return self.stages.enqueue(step, stage)

    def _finish_training(self, task: Task, outcomes: list[Outcome]) -> None:
        del self._training[task.task_id]
        del self._steps_left[task.task_id]
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

    def _start_iteration(
        self, batch: MicroBatch, now_s: float, outcomes: list[Outcome]
    ) -> list[StageStart]:
        """Start `batch`'s next iteration on stage 0, if it has one."""
        formed = self.batcher.form_iteration(batch, now_s, outcomes)
        if formed is None:
            return []
        iteration, durations = formed
        self.num_iterations += 1
        item = self.stages.new_item(PRIO_ITERATION, durations, WorkKind.ITERATION, iteration)
        return self.stages.enqueue(item, 0)
