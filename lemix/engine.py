"""One node's execution mechanics as a pure state machine (S stage workers).

The simulator drives it with virtual time; the emulated executor drives it with
real sleeps. Same loop shape everywhere: the driver tells the engine what
happened (`add_task`, `on_stage_done`, `on_timer`) with `now_s`, and the
engine answers with `StageStart`s (run this stage for this long) and outcomes.

Work on a stage is non-preemptive; the next item is picked by priority
(inference iterations, then training backwards, then training forwards, then
arrival order; or plain arrival order with `stage_order="fifo"`). Inference
runs as continuous-batching iterations (`lemix.batching`) in M micro-batches,
each with one iteration in flight because each decode step needs the previous
token (M = 1 by default: one iteration in flight per node, the v1 engine);
training tasks are their own forward chain (stages 0→S−1) and backward chain
(S−1→0), optionally in slices. Micro-batches, chunked prefill and training
slices are described in `lemix.engine_groups`, which holds their rules.
Memory goes through `lemix.memory.NodeMemory` only; waits for it (bounded by
T_max) and KV offload are `lemix.engine_memory`'s.
"""

from __future__ import annotations

import functools
import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import islice

from lemix.batching import BatchingConfig, admit
from lemix.engine_groups import (
    Iteration,
    MicroBatch,
    Request,
    fit_prefill_chunk,
    iteration_durations,
    micro_batch_cap,
    num_balanced_joins,
    num_slices,
    num_within_budget,
    slice_s,
    take_chunks,
)
from lemix.engine_memory import KV_WAIT_REASON, MemoryWaits, TrainingRoom
from lemix.latency import LatencyModel
from lemix.memory import MemoryConfig, NodeMemory, activation_bytes, kv_bytes
from lemix.profile import Profile
from lemix.reasons import ReasonCode, format_reason
from lemix.types import Task

PRIO_BLOCKING, PRIO_ITERATION, PRIO_BACKWARD, PRIO_FORWARD = 0, 1, 2, 3

# `default_prefill_token_budget`: a prefill chunk may cost this many batch-32
# decode steps at a 512-token context on the same stage.
CHUNK_DECODE_STEP_MULTIPLE = 3.0


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
    # Engine v2 (issue 9). The defaults reproduce the v1 engine exactly.
    # Inference micro-batches in flight per node (None: one per stage, so all
    # stages work at once); 1 = one iteration in flight per node (v1).
    num_micro_batches: int | None = 1
    # Tokens one iteration may carry (decode steps count one each; prefill is
    # chunked to fit the rest); None = whole prompts, no chunking (v1).
    prefill_token_budget: int | None = None
    # Longest uninterrupted piece of a training forward/backward on one stage:
    # longer ones run in slices, and inference iterations may run between
    # slices; None = a stage's whole training pass at once (v1).
    max_training_slice_s: float | None = None
    # What `batching.max_batch_size` (C) caps with micro-batches: False = the
    # node's running requests, split evenly (each group holds ceil(C / M));
    # True = each micro-batch's own iteration, as vLLM's pipeline-parallel
    # virtual engines do (one scheduler per stage, each with its own
    # max_num_seqs), so the node may hold M × C when KV memory allows. Equal
    # with M = 1.
    is_batch_cap_per_micro_batch: bool = False

    def __post_init__(self) -> None:
        if self.stage_order not in ("inference-first", "fifo"):
            raise ValueError("stage_order must be 'inference-first' or 'fifo'")
        if self.max_training_in_flight is not None and self.max_training_in_flight < 1:
            raise ValueError("max_training_in_flight must be >= 1 or None")
        if self.num_micro_batches is not None and self.num_micro_batches < 1:
            raise ValueError(
                f"num_micro_batches must be >= 1 or None, got {self.num_micro_batches}"
            )
        if self.prefill_token_budget is not None and self.prefill_token_budget < 1:
            raise ValueError(
                f"prefill_token_budget must be >= 1 tokens or None, got {self.prefill_token_budget}"
            )
        if self.max_training_slice_s is not None and not self.max_training_slice_s > 0:
            raise ValueError(
                f"max_training_slice_s must be > 0 s or None, got {self.max_training_slice_s}"
            )


def default_prefill_token_budget(profile: Profile) -> int:
    """A per-iteration token budget derived from the profile alone.

    The largest power of two n (32 ≤ n ≤ 16384) such that, on every stage, the
    forward of one n-token chunk takes at most `CHUNK_DECODE_STEP_MULTIPLE`
    (3) × a decode step of a batch of 32 at a 512-token context. An iteration
    that carries such a chunk along with a full decode batch then costs at most
    4 decode steps, so a chunk stretches the running requests' time between
    tokens by a bounded factor instead of by a whole prompt's prefill. On the
    shipped A100 Llama-2-7B profiles this gives 512 tokens, Sarathi-Serve's
    budget for strict TBT SLOs on that hardware (its relaxed setting and vLLM's
    chunked-prefill defaults are 2048 and up); H100 gives 1024, the CPU
    tiny-llama profile 256. Falls back to 32 when even that is too long.
    """
    model = profile.ours
    budget = 32
    for exponent in range(5, 15):
        num_tokens = 2**exponent
        if all(
            model.forward_s(s, 1, num_tokens)
            <= CHUNK_DECODE_STEP_MULTIPLE * model.decode_step_s(s, 32, 32 * 512)
            for s in range(profile.num_stages)
        ):
            budget = num_tokens
        else:
            break
    return budget


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
    instead of waiting out the duration: an `Iteration` (ITERATION), the
    training `Task` (FORWARD/BACKWARD; a `TrainingSlice` of it when
    `max_training_slice_s` is set), or a blocking op's tag.
    """

    stage: int
    duration_s: float
    kind: WorkKind = WorkKind.NONE
    work: object = None


@dataclass(frozen=True, slots=True)
class TrainingSlice:
    """Slice `index` of `count` of a training forward/backward on one stage:
    its `index`-th layer group of `count` equal ones (and, for a backward, that
    group's optimizer update)."""

    task: Task
    index: int
    count: int


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
    # Training slices on the stage the item is on (count 0: not started there).
    slice_index: int = 0
    slice_count: int = 0


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
        self.waiting: deque[Request] = deque()
        self.memory_waits = MemoryWaits(self.memory, profile, config.memory)
        num_micro_batches = config.num_micro_batches or self.num_stages
        self.micro_batches = [MicroBatch(i) for i in range(num_micro_batches)]
        cap = config.batching.max_batch_size
        if config.is_batch_cap_per_micro_batch:
            self._node_cap, self._micro_batch_cap = cap * num_micro_batches, cap
        else:
            self._node_cap = cap
            self._micro_batch_cap = micro_batch_cap(cap, num_micro_batches)
        self._train_waiting: deque[_TrainWait] = deque()
        self._max_training = config.max_training_in_flight or self.num_stages
        self._training: dict[str, Task] = {}
        self._blocking_left: dict[str, int] = {}
        self._blocking_apply: dict[str, int] = {}
        self.num_training_updates = 0
        self.visible_updates = 0  # updates in the serving weights
        self.is_colocated = True
        self.busy_s = [0.0] * self.num_stages
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
                self._finish_iteration(item.payload, outcomes)  # type: ignore[arg-type]
        elif item.kind in (WorkKind.FORWARD, WorkKind.BACKWARD) and (
            item.slice_index + 1 < item.slice_count
        ):
            # More slices on this stage: back in the queue, so anything of a
            # higher priority that became ready goes first.
            item.slice_index += 1
            heapq.heappush(self._ready[stage], (item.prio, item.seq, item))
        elif item.kind is WorkKind.FORWARD:
            item.slice_count = 0
            starts += self._enqueue(item, stage + 1) if stage < last else self._to_backward(item)
        elif item.kind is WorkKind.BACKWARD:
            item.slice_count = 0
            if stage > 0:
                starts += self._enqueue(item, stage - 1)
            else:
                self._finish_training(item.payload, outcomes)  # type: ignore[arg-type]
        else:
            self._finish_blocking(str(item.payload), outcomes)
        starts += self._start_if_idle(stage)
        starts += self._kick(now_s, outcomes)
        return starts, outcomes

    def cancel(
        self, task_id: str, now_s: float, reason: str = ""
    ) -> tuple[bool, list[StageStart], list[Outcome]]:
        """Cancel an inference request (client gone); frees its memory.

        A request of a micro-batch whose iteration is in flight is dropped when
        that iteration ends (its stage work cannot be taken back). Training
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
                    if batch.is_in_flight:
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
        """When a memory wait reaches T_max (the driver calls `on_timer` then)."""
        waits = self.memory_waits
        deadlines = []
        if self._train_waiting and self._train_waiting[0].memory_wait_since_s is not None:
            deadlines.append(waits.deadline_s(self._train_waiting[0].memory_wait_since_s))
        if self.waiting:
            deadlines.append(waits.deadline_s(self.waiting[0].since_s))
        return min(deadlines) if deadlines else None

    def on_timer(self, now_s: float) -> tuple[list[StageStart], list[Outcome]]:
        outcomes: list[Outcome] = []
        self._shed_overdue_requests(now_s, outcomes)
        return self._kick(now_s, outcomes), outcomes

    # ------------------------------------------------------------ queries

    @property
    def running(self) -> list[Request]:
        """The running requests of every micro-batch (a new list)."""
        return [req for batch in self.micro_batches for req in batch.running]

    @property
    def num_running(self) -> int:
        return sum(len(batch.running) for batch in self.micro_batches)

    @property
    def is_idle(self) -> bool:
        return (
            not any(batch.is_in_flight or batch.running for batch in self.micro_batches)
            and not self.waiting
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
        work = item.payload
        max_slice_s = self.config.max_training_slice_s
        if max_slice_s is not None and item.kind in (WorkKind.FORWARD, WorkKind.BACKWARD):
            if item.slice_count == 0:  # the first slice on this stage
                item.slice_index, item.slice_count = 0, num_slices(duration_s, max_slice_s)
            duration_s = slice_s(duration_s, item.slice_index, item.slice_count)
            work = TrainingSlice(item.payload, item.slice_index, item.slice_count)  # type: ignore[arg-type]
        self.busy_s[stage] += duration_s
        return [StageStart(stage, duration_s, item.kind, work)]

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
        while self._train_waiting and len(self._training) < self._max_training:
            head = self._train_waiting[0]
            task = head.task
            need = activation_bytes(self.profile.memory, task.batch_size, task.num_prompt_tokens)
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
            starts += self._enqueue(
                self._new_item(PRIO_FORWARD, durations, WorkKind.FORWARD, task), 0
            )
        return starts

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

    def _reserve(self, req: Request) -> bool:
        need = kv_bytes(self.profile.memory, req.task.num_total_tokens)
        if not self.memory.can_admit(need):
            return False
        self.memory.admit(req.task.task_id, need)
        return True

    def _shed_overdue_requests(self, now_s: float, outcomes: list[Outcome]) -> None:
        """Fail the requests that waited T_max for KV memory (`lemix.engine_memory`)."""
        for req in self.memory_waits.shed_overdue(self.waiting, now_s):
            outcomes.append(Failed(req.task.task_id, KV_WAIT_REASON))

    def _start_iteration(
        self, batch: MicroBatch, now_s: float, outcomes: list[Outcome]
    ) -> list[StageStart]:
        """Form `batch`'s next iteration: its decodes, prefill chunks, new joins."""
        self.memory_waits.resume(
            batch,
            min(self._node_cap - self.num_running, self._micro_batch_cap - len(batch.running)),
        )
        budget = self.config.prefill_token_budget
        decode = [r for r in batch.running if r.is_prefilled]
        partial = [r for r in batch.running if not r.is_prefilled]
        prefill_budget = None if budget is None else max(budget - len(decode), 0)
        fit = None
        if budget is not None:
            fit = functools.partial(fit_prefill_chunk, self.profile.ours, self.num_stages)
        chunks, num_used = take_chunks(partial, prefill_budget, fit)
        if prefill_budget is not None:
            prefill_budget -= num_used
        if self.swapped:
            fits: list = []  # swapped requests go first: no new admissions
        else:
            fits = [
                lambda r=r: self._reserve(r)
                for r in self._join_candidates(batch, now_s, prefill_budget)
            ]
        decision = admit(self.config.batching, len(batch.running), batch.batch_start_s, fits, now_s)
        batch.batch_start_s = decision.batch_start_s
        joined = [self.waiting.popleft() for _ in range(decision.num_admitted)]
        if decision.blocked_by == "memory" or self.swapped:
            self._shed_overdue_requests(now_s, outcomes)
        for req in joined:
            req.micro_batch = batch.index
        chunks += take_chunks(joined, prefill_budget, fit)[0]
        if not chunks and not decode:
            return []
        reload_s = self.memory_waits.take_reload_s()  # owed once, by this iteration
        durations = iteration_durations(self.truth, self.num_stages, chunks, decode, reload_s)
        batch.running = decode + partial + joined
        batch.is_in_flight = True
        self.num_iterations += 1
        iteration = Iteration(
            [c.request for c in chunks],
            decode,
            batch.index,
            tuple((c.start, c.num_tokens) for c in chunks),
        )
        item = self._new_item(PRIO_ITERATION, durations, WorkKind.ITERATION, iteration)
        return self._enqueue(item, 0)

    def _join_candidates(
        self, batch: MicroBatch, now_s: float, prefill_budget: int | None
    ) -> list[Request]:
        """The head of the waiting queue `batch` may take, before memory and the
        join window (`admit` checks those): within the node's cap C, the
        micro-batch's share of it, the prefill budget and the balance rule."""
        num_free = self._node_cap - self.num_running
        room = min(num_free, self._micro_batch_cap - len(batch.running))
        if room <= 0:
            return []
        head = list(islice(self.waiting, room))
        head = head[: num_within_budget([r.task.num_prompt_tokens for r in head], prefill_budget)]
        if len(self.micro_batches) == 1 or not head:
            return head
        window_s = self.config.batching.join_window_s
        is_eligible = [
            len(b.running) < self._micro_batch_cap
            and (window_s is None or not b.running or b.batch_start_s + window_s > now_s)
            for b in self.micro_batches
        ]
        num_waiting_tokens = self._admissible_prompt_tokens(num_free)
        num = num_balanced_joins(
            batch.index,
            [b.load_tokens for b in self.micro_batches],
            is_eligible,
            [r.task.num_prompt_tokens for r in head],
            num_waiting_tokens,
            is_head_overdue=head[0].num_passed_over >= len(self.micro_batches),
        )
        if num == 0:
            head[0].num_passed_over += 1
        return head[:num]

    def _admissible_prompt_tokens(self, num_free: int) -> int:
        """Prompt tokens of the waiting requests the node could admit now (the
        head, up to `num_free` of them, while their KV fits in free memory):
        what the balance rule's even share is taken over."""
        free = [self.memory.free_bytes(s) for s in range(self.num_stages)]
        total = 0
        for req in islice(self.waiting, num_free):
            need = kv_bytes(self.profile.memory, req.task.num_total_tokens)
            if any(n > f for n, f in zip(need, free, strict=True)):
                break
            free = [f - n for n, f in zip(need, free, strict=True)]
            total += req.task.num_prompt_tokens
        return total

    def _finish_iteration(self, iteration: Iteration, outcomes: list[Outcome]) -> None:
        batch = self.micro_batches[iteration.micro_batch]
        batch.is_in_flight = False
        for req, (start, num_tokens) in zip(
            iteration.prefill, iteration.prefill_spans, strict=True
        ):
            req.num_prefilled = start + num_tokens
            if req.num_prefilled < req.task.num_prompt_tokens:
                req.context_tokens = req.num_prefilled  # more chunks to come
                continue
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
        for req in batch.running:
            if req.is_cancelled or req.failure:
                self.memory.release(req.task.task_id)
                reason = (
                    req.failure
                    or req.cancel_reason
                    or format_reason(ReasonCode.CANCELLED, "cancelled by the client")
                )
                outcomes.append(Failed(req.task.task_id, reason))
            elif req.is_prefilled and (
                req.is_stopped or req.num_generated >= req.task.max_output_tokens
            ):
                self.memory.release(req.task.task_id)
                outcomes.append(Finished(req.task.task_id, req.num_generated))
            else:
                still.append(req)
        batch.running = still
