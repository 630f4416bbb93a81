"""What the executor's RPCs act on: one node's engine, driver and bookkeeping.

`ExecutorNode` owns the `NodeDriver` (which owns the `NodeEngine`) and adds the
little the service needs around it, none of it scheduling:

* idempotent dispatch: a redelivered `Dispatch` of a task the node holds (or
  just finished) is accepted and not run twice, unless it is a later attempt
  (the scheduler moved the task away and back): the stale one is let go
  first;
* fencing (docs/protocol.md): the attempt each held task was dispatched
  with, for the sink (`attempt_of`); a task the sink found fenced is
  cancelled here (`on_fenced`), which frees its KV;
* the placed state: a fencing sink records each task this node takes
  (`NodeDriver.note_placed`) with its next write, so the scheduler need
  not write it after the Dispatch (`records_placement`);
* a refusal up front of work that could never fit the node's memory, which
  would otherwise wait forever;
* waiting for a weight save/load (`BlockingDone`) before answering;
* the `NodeSnapshot` heartbeats and `GetNodeState` report;
* on shutdown, an `UNAVAILABLE` end for inference still held, and a requeue
  of training still held, so no client waits on a dead node.

What differs between an emulated node and one running a real model lives in
its `ExecutorBackend` (services/executor/backends/): stage execution, the
per-task model state, measuring, the weight files. The weight transfer time
the engine books is the profile's (host link bandwidth) for both.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Iterable

import structlog

from lemix.engine import (
    BlockingDone,
    Failed,
    Finished,
    FirstToken,
    NodeEngine,
    Requeued,
    TokensEmitted,
)
from lemix.infra import telemetry
from lemix.infra.rpc.errors import InvalidArgument, ResourceExhausted, Unavailable
from lemix.memory import activation_bytes, kv_bytes
from lemix.profile import Profile
from lemix.types import NodeSnapshot, Task, TaskPayload
from services.executor.backends.base import ExecutorBackend
from services.executor.convert import (
    MeasureResult,
    MeasureSpec,
    SyncDirection,
    WeightSyncResult,
    WeightSyncSpec,
)
from services.executor.driver import NodeDriver, OutcomeSink, SinkItem
from services.executor.sink import LedgerSink

log = structlog.get_logger(__name__)

# Ids of finished tasks remembered so a late duplicate Dispatch is not re-run.
_RECENT_DONE_MAX = 10_000
# busy_fraction is measured over about this many profile seconds.
BUSY_WINDOW_S = 5.0
_IDLE_POLL_S = 0.01
# How long a Dispatch of a later attempt waits for the stale one to leave
# (its cancel's end to be written); running training cannot be cancelled.
_RELEASE_WAIT_S = 1.0


class BusyMeter:
    """Recent busy share of the stages, from the engine's cumulative busy time.

    The engine credits a stage's busy time when work starts, so a sample can
    run ahead of the clock; the fraction is clamped to [0, 1].
    """

    def __init__(self, window_s: float = BUSY_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()  # (now_s, mean busy_s)

    def update(self, now_s: float, busy_s: float) -> float:
        self._samples.append((now_s, busy_s))
        while len(self._samples) > 2 and self._samples[1][0] <= now_s - self.window_s:
            self._samples.popleft()
        t0_s, busy0_s = self._samples[0]
        if now_s <= t0_s:
            return 0.0
        return min(1.0, max(0.0, (busy_s - busy0_s) / (now_s - t0_s)))


class _ObservedSink:
    """Passes batches to the real sink, tells the node what ended and counts
    it in `lemix.infra.telemetry` (once per batch written: a failed write is retried
    by the driver and counted when it succeeds)."""

    def __init__(self, node: ExecutorNode, inner: OutcomeSink) -> None:
        self._node = node
        self._inner = inner
        self._num_tokens: dict[str, int] = {}  # tokens counted so far, by live task id

    async def write(self, batch: list[tuple[float, SinkItem]]) -> None:
        # A weight sync waits on the stages, not on Redis: resolve it first.
        self._node.on_blocking_done(o.tag for _, o in batch if isinstance(o, BlockingDone))
        await self._inner.write(batch)
        self._observe(batch)  # before on_ended: it needs the tasks still held
        self._node.on_ended(o.task_id for _, o in batch if isinstance(o, Finished | Failed))
        # Requeued training comes back under the same id: do not treat it as a duplicate.
        self._node.on_ended(
            (o.task_id for _, o in batch if isinstance(o, Requeued)), is_final=False
        )

    def _observe(self, batch: list[tuple[float, SinkItem]]) -> None:
        node_id = self._node.node_id
        for _, outcome in batch:
            if isinstance(outcome, FirstToken):
                self._count_tokens(outcome.task_id, 1)
            elif isinstance(outcome, TokensEmitted):
                for task_id, n in zip(outcome.task_ids, outcome.num_generated, strict=True):
                    self._count_tokens(task_id, n)
            elif isinstance(outcome, Finished | Failed | Requeued):
                task = self._node.held_task(outcome.task_id)
                if isinstance(outcome, Finished):
                    self._count_tokens(outcome.task_id, outcome.num_output_tokens)
                is_training = task.is_training if task else isinstance(outcome, Requeued)
                outcome_name = {
                    Finished: telemetry.COMPLETED,
                    Failed: telemetry.FAILED,
                    Requeued: "requeued",
                }[type(outcome)]
                if self._node.is_fenced(outcome.task_id):
                    outcome_name = "fenced"  # it ended elsewhere, not here
                telemetry.observe_task_ended(
                    node_id,
                    "training" if is_training else "inference",
                    outcome_name,
                    num_samples=task.batch_size if task else 0,
                )
                self._num_tokens.pop(outcome.task_id, None)

    def _count_tokens(self, task_id: str, num_so_far: int) -> None:
        seen = self._num_tokens.get(task_id, 0)
        if num_so_far > seen:
            telemetry.observe_tokens(self._node.node_id, num_so_far - seen)
            self._num_tokens[task_id] = num_so_far


class ExecutorNode:
    """One node: dispatch, cancel, report, sync weights, measure."""

    def __init__(
        self,
        engine: NodeEngine,
        backend: ExecutorBackend,
        sink: OutcomeSink,
        *,
        time_scale: float = 1.0,
        stage_timeout_s: float = 300.0,
    ) -> None:
        self.engine = engine
        # A stage item running longer than this (wall s) means a hung stage:
        # the node reports itself unhealthy so the scheduler stops placing on it.
        self.stage_timeout_s = stage_timeout_s
        self.profile: Profile = engine.profile
        self.node_id = engine.node_id
        self.sink = sink
        self.backend = backend
        self.driver = NodeDriver(engine, backend, _ObservedSink(self, sink), time_scale=time_scale)
        self.address = ""  # host:port, set once the gRPC server is bound
        self.is_stopping = False
        self._held: dict[str, Task] = {}  # dispatched and not ended, by id
        self._attempts: dict[str, int] = {}  # each held task's attempt (0: none sent)
        self._fenced: set[str] = set()  # held tasks the sink found placed again elsewhere
        self._releasing: dict[str, asyncio.Future[None]] = {}  # stale attempts on their way out
        # Token ids and sampling, kept for backends that run a real model.
        self.payloads: dict[str, TaskPayload] = {}
        self._recent_done: OrderedDict[str, int] = OrderedDict()  # id -> its attempt
        self._blocking: dict[str, asyncio.Future[None]] = {}
        self._sync_seq = itertools.count(1)
        self._busy = BusyMeter()
        # A fencing sink also records each task's placed state (the
        # Dispatch's reply says so: the scheduler then writes none).
        self.records_placement = isinstance(sink, LedgerSink)
        if isinstance(sink, LedgerSink):
            sink.bind(self)  # attempts to the sink, fenced tasks back to us

    async def start(self) -> None:
        await self.driver.start()

    # ------------------------------------------------------------ RPC actions

    def dispatch(self, task: Task, payload: TaskPayload, attempt: int = 0) -> bool:
        """Run `task` as placement `attempt`; False when it is a duplicate (held
        or just finished, at this attempt or a later one).

        Raises `Unavailable` while stopping, or while an earlier attempt of the
        task is still held (`accept` lets it go first), and `ResourceExhausted`
        when the task could never fit this node's memory.
        """
        task_id = task.task_id
        if self.is_stopping:
            raise Unavailable(f"executor node {self.node_id} is shutting down")
        held = self._attempts.get(task_id) if task_id in self._held else None
        if held is not None and attempt > held:
            raise Unavailable(
                f"task {task_id!r}: its attempt {held} still runs on node "
                f"{self.node_id}; place attempt {attempt} elsewhere"
            )
        done = self._recent_done.get(task_id)
        if held is not None or (done is not None and attempt <= done):
            log.info(
                "executor.duplicate_dispatch", node=self.node_id, task_id=task_id, attempt=attempt
            )
            return False
        self._check_could_fit(task)
        self.backend.on_dispatch(task, payload)  # InvalidArgument when it can't run
        self._recent_done.pop(task_id, None)  # a later attempt: this is a new placement
        self._held[task_id] = task
        self._attempts[task_id] = attempt
        self.payloads[task_id] = payload
        if self.records_placement:
            self.driver.note_placed(task_id, time.time())
        self.driver.add_task(task)
        return True

    async def accept(self, task: Task, payload: TaskPayload, attempt: int) -> bool:
        """`dispatch`, after letting go of an earlier attempt of the task still
        held here (it was moved away and back; its writes are fenced): that one
        is cancelled, and this waits up to `_RELEASE_WAIT_S` for its end."""
        held = self._attempts.get(task.task_id)
        if task.task_id in self._held and held is not None and attempt > held:
            await self._release(task.task_id)
        return self.dispatch(task, payload, attempt)

    async def _release(self, task_id: str) -> None:
        gone = self._releasing.get(task_id)
        if gone is None:
            gone = self._releasing[task_id] = asyncio.get_running_loop().create_future()
            self.driver.cancel(task_id)  # its end goes through the sink (fenced)
        try:
            await asyncio.wait_for(asyncio.shield(gone), _RELEASE_WAIT_S)
        except TimeoutError:
            raise Unavailable(
                f"task {task_id!r}: an earlier attempt still runs on node {self.node_id} "
                "(running training cannot be cancelled); place it elsewhere"
            ) from None

    def cancel(self, task_id: str, reason: str = "") -> bool:
        """Cancel a held task; its `end` (CANCELLED, with `reason` when given)
        follows through the sink."""
        return self.driver.cancel(task_id, reason)

    async def sync_weights(self, spec: WeightSyncSpec) -> WeightSyncResult:
        """Occupy every stage for the weight transfer; return when all are done.

        LOAD makes `spec.weight_version` the version later first tokens carry.
        The engine books each stage's weights moving over the host link; the
        backend moves real weights (or none, emulated). A caller that gives up
        (deadline) does not undo it; the stages still run it.
        """
        if self.is_stopping:
            raise Unavailable(f"executor node {self.node_id} is shutting down")
        weight_bytes = self.profile.memory.weight_bytes
        rate = self.profile.transfer.host_link_bytes_s
        num_reads = max(1, len(spec.sources))  # an average reads every replica's save
        durations_s = tuple(num_reads * nbytes / rate for nbytes in weight_bytes)
        tag = f"{spec.direction}-{spec.weight_version}-{next(self._sync_seq)}"
        # InvalidArgument (no location for a real model) before anything is booked.
        self.backend.prepare_sync(tag, spec.direction, spec.location, spec.sources)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._blocking[tag] = done
        start_s = self.driver.now_s()
        apply = spec.weight_version if spec.direction is SyncDirection.LOAD else None
        try:
            self.driver.add_blocking(tag, durations_s, apply)
            await done
        finally:
            self._blocking.pop(tag, None)
        log.info(
            "executor.weights_synced",
            node=self.node_id,
            direction=str(spec.direction),
            version=spec.weight_version,
            location=spec.location,
        )
        return WeightSyncResult(self.driver.now_s() - start_s, num_reads * sum(weight_bytes))

    async def measure(self, spec: MeasureSpec) -> MeasureResult:
        """Profiling: a real model times the stage; the emulated backend returns
        samples of the engine's ground-truth latency, so a profiler fitting
        them recovers the profile this node was given."""
        if spec.stage >= self.engine.num_stages:
            raise InvalidArgument(
                f"stage {spec.stage} out of range; this node has {self.engine.num_stages} stages"
            )
        return await self.backend.measure(spec)

    def snapshot(self) -> NodeSnapshot:
        """The node's state now, in engine (profile) seconds."""
        engine = self.engine
        now_s = self.driver.now_s()
        running = engine.running
        kv_per_stage = [0] * engine.num_stages
        for req in running:
            for stage, nbytes in enumerate(engine.memory.held_bytes(req.task.task_id)):
                kv_per_stage[stage] += nbytes
        mean_busy_s = sum(engine.busy_s) / engine.num_stages
        return NodeSnapshot(
            node_id=self.node_id,
            now_s=now_s,
            num_running=len(running),
            # Swapped-out requests wait too (for their KV to come back).
            num_waiting=len(engine.waiting) + len(engine.swapped),
            sum_context_tokens=sum(
                max(r.context_tokens, r.task.num_prompt_tokens) for r in running
            ),
            max_remaining_decode_tokens=max(
                (r.task.max_output_tokens - r.num_generated for r in running), default=0
            ),
            kv_used_bytes=max(kv_per_stage, default=0),
            memory_capacity_bytes=engine.memory.threshold_bytes,
            busy_fraction=self._busy.update(now_s, mean_busy_s),
            num_training_updates=engine.num_training_updates,
            is_healthy=not self.is_stopping and not self.is_stage_hung,
        )

    @property
    def is_stage_hung(self) -> bool:
        return self.driver.longest_running_stage_s() > self.stage_timeout_s

    # ------------------------------------------------------------ sink hooks

    def on_blocking_done(self, tags: Iterable[str]) -> None:
        for tag in tags:
            done = self._blocking.get(tag)
            if done is not None and not done.done():
                done.set_result(None)

    def held_task(self, task_id: str) -> Task | None:
        """The dispatched task, while this node holds it."""
        return self._held.get(task_id)

    def attempt_of(self, task_id: str) -> int:
        """The attempt a held task was dispatched with (0: none sent)."""
        return self._attempts.get(task_id, 0)

    def is_fenced(self, task_id: str) -> bool:
        return task_id in self._fenced

    def on_fenced(self, task_id: str) -> None:
        """The sink found the task placed again elsewhere: drop it here (the
        cancel frees its KV; its end is fenced too). Running training cannot
        be cancelled: it ends by itself, unwritten. (A task whose end was
        fenced is gone from the engine already: the cancel finds nothing.)"""
        if task_id in self._held and task_id not in self._fenced:
            self._fenced.add(task_id)
            self.driver.cancel(task_id)

    def on_ended(self, task_ids: Iterable[str], *, is_final: bool = True) -> None:
        """The node no longer holds these tasks; final ones are remembered so a
        late duplicate Dispatch is not run again."""
        for task_id in task_ids:
            if self._held.pop(task_id, None) is not None:
                attempt = self._attempts.pop(task_id, 0)
                self._fenced.discard(task_id)
                self.payloads.pop(task_id, None)
                self.backend.forget(task_id)
                gone = self._releasing.pop(task_id, None)
                if gone is not None and not gone.done():
                    gone.set_result(None)
                if not is_final:
                    continue
                self._recent_done[task_id] = attempt
                if len(self._recent_done) > _RECENT_DONE_MAX:
                    self._recent_done.popitem(last=False)

    # ------------------------------------------------------------ shutdown

    def begin_stop(self) -> None:
        """Refuse new work from now on (Dispatch answers UNAVAILABLE)."""
        self.is_stopping = True

    async def stop(self, grace_s: float) -> None:
        """Let held work finish for up to `grace_s`, stop the driver, then end
        what is still held: inference fails UNAVAILABLE, training is requeued."""
        self.begin_stop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while not self.engine.is_idle and loop.time() < deadline:
            await asyncio.sleep(_IDLE_POLL_S)
        await self.driver.stop(drain_timeout_s=max(0.0, deadline - loop.time()))
        for tag, done in list(self._blocking.items()):
            if not done.done():
                done.set_exception(
                    Unavailable(
                        f"executor node {self.node_id} shut down before weight sync {tag} finished"
                    )
                )
        now_s = self.driver.now_s()
        reason = f"UNAVAILABLE: executor node {self.node_id} shut down"
        leftovers: list[tuple[float, SinkItem]] = [
            (now_s, Requeued(task_id, reason) if task.is_training else Failed(task_id, reason))
            for task_id, task in self._held.items()
        ]
        if leftovers:
            log.warning("executor.ended_held_tasks", node=self.node_id, count=len(leftovers))
            try:
                await self.sink.write(leftovers)
            except Exception:  # Redis gone too: nothing else can record them
                log.exception("executor.leftover_write_failed", node=self.node_id)
            self.on_ended(list(self._held), is_final=False)

    # ------------------------------------------------------------ internals

    def _check_could_fit(self, task: Task) -> None:
        memory = self.engine.memory
        if task.is_training:
            need = activation_bytes(self.profile.memory, task.batch_size, task.num_prompt_tokens)
            what = "activations"
        else:
            need = kv_bytes(self.profile.memory, task.num_total_tokens)
            what = "KV cache"
        if not memory.could_ever_fit(need):
            stage = max(range(len(need)), key=lambda s: need[s] - memory.dynamic_capacity_bytes(s))
            raise ResourceExhausted(
                f"task {task.task_id!r}: its {what} needs {need[stage]} B on stage {stage} but "
                f"node {self.node_id} can hold at most {memory.dynamic_capacity_bytes(stage)} B "
                "there; shorten it"
            )
