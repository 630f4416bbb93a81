"""Waits for memory in one node's engine, each bounded by T_max, and the KV
that moves to host memory and back (`lemix.engine.NodeEngine` applies them).

T_max is `MemoryConfig.max_wait_s`. The two kinds of work that wait for
memory end a wait differently:

Training (waits for activation room)
    After T_max the memory-aware runtime (`is_offload_enabled`) moves the KV
    of running requests, newest first, to host memory until the activations
    fit, at an iteration boundary of their micro-batch (their KV is not in use
    then). Training that offloading could not fit, or any training at T_max
    with offload off, is handed back to the planner (re-queued, never lost).

Inference (waits for KV room)
    A request that has waited T_max (from its arrival at the node) and is
    still held back by memory, because its KV does not fit or because
    swapped-out requests, which come back first, are queued ahead of it, fails
    with RESOURCE_EXHAUSTED (`KV_WAIT_REASON`), in either runtime. The head of
    the waiting queue is judged at its T_max (the engine's timer) and at every
    iteration boundary after it; one that fits then but waits for a boundary or
    a batch slot is judged again at the next, and one behind the head when it
    reaches the head, so a shed can come a little after T_max. It never
    waits without a bound, and it never makes a running request give up its
    KV: the running requests arrived first. This is what FCFS serving systems
    do. vLLM preempts (recompute, or swap to host) only to let *running*
    requests keep decoding, newest first, and a waiting request never evicts a
    running one under FCFS; queue time is bounded outside the engine, by a
    queue timeout (Triton's dynamic batcher: `default_timeout_microseconds`
    with `timeout_action: REJECT`) or an overload answer (TGI's 429). Evicting
    for a waiting request instead would serve, at T_max, one that has mostly
    missed its TTFT SLO already (T_max = 2 s; the long-output workload's TTFT
    SLO is 0.29 s) and stall one that was on time, and under overload the next
    request due would evict the one just admitted, the newest (measured in
    docs/results.md, "A memory-bound configuration"). Shedding lets the
    client retry elsewhere, later or shorter, and keeps the admitted
    requests' TTFT within T_max. Waits for a batch slot (the cap C) are not memory waits: requests
    finish, so they end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from enum import StrEnum

from lemix.engine_groups import MicroBatch, Request
from lemix.memory import MemoryConfig, NodeMemory, kv_bytes
from lemix.profile import Profile
from lemix.reasons import ReasonCode, format_reason

# A request that waited T_max for KV: what it lacked and what the client can do.
KV_WAIT_REASON = format_reason(
    ReasonCode.RESOURCE_EXHAUSTED,
    "no KV memory within T_max: the node's KV cache stayed full; "
    "retry later, on another replica, or with fewer max_tokens",
)


class TrainingRoom(StrEnum):
    """What becomes of training whose wait for activation memory reached T_max."""

    FITS = "fits"  # it fits now (KV was offloaded for it): admit it
    WAIT = "wait"  # room can be made at a later iteration boundary
    NO_ROOM = "no-room"  # hand it back to the planner


class MemoryWaits:
    """One node's swapped-out requests, KV offload and reload, and the T_max
    bounds on waits for memory (see the module docstring)."""

    def __init__(self, memory: NodeMemory, profile: Profile, config: MemoryConfig) -> None:
        self.memory = memory
        self.config = config
        self._memory_profile = profile.memory
        self._host_link_bytes_s = profile.transfer.host_link_bytes_s
        self._num_stages = profile.num_stages
        self.swapped: deque[Request] = deque()  # KV on the host, oldest offload first
        self.num_offloads = 0
        self._reload_s = 0.0  # transfer time owed by the next iteration

    # ------------------------------------------------------------ deadlines

    def is_overdue(self, since_s: float, now_s: float) -> bool:
        """Whether a wait that began at `since_s` has reached T_max (the same
        arithmetic as `deadline_s`, so a timer set there acts)."""
        return now_s >= since_s + self.config.max_wait_s

    def deadline_s(self, since_s: float) -> float:
        return since_s + self.config.max_wait_s

    # ------------------------------------------------------------ inference

    def shed_overdue(self, waiting: deque[Request], now_s: float) -> list[Request]:
        """Take from the head of `waiting` the requests that have waited T_max
        and are still held back by memory; the engine fails them with
        `KV_WAIT_REASON`. Stops at the first one that is not overdue or whose
        KV fits with no swapped-out request ahead of it."""
        shed: list[Request] = []
        while waiting and self.is_overdue(waiting[0].since_s, now_s):
            need = kv_bytes(self._memory_profile, waiting[0].task.num_total_tokens)
            if not self.swapped and self.memory.can_admit(need):
                break  # memory no longer holds it back (the cap or window may)
            shed.append(waiting.popleft())
        return shed

    def resume(self, batch: MicroBatch, room: int) -> None:
        """Swapped-out requests come back into the forming `batch` first, up
        to `room` of them, oldest offload first, while their KV fits."""
        while self.swapped and room > 0:
            req = self.swapped[0]
            if not self.memory.can_reload(req.task.task_id):
                break
            moved = self.memory.reload(req.task.task_id)
            self._reload_s += self._transfer_s(moved)
            self.swapped.popleft()
            req.micro_batch = batch.index
            batch.running.append(req)
            room -= 1

    def take_reload_s(self) -> float:
        """The KV transfer time owed so far, once: the next iteration pays it."""
        reload_s, self._reload_s = self._reload_s, 0.0
        return reload_s

    # ------------------------------------------------------------ training

    def make_training_room(
        self, need: tuple[int, ...], micro_batches: Sequence[MicroBatch]
    ) -> TrainingRoom:
        """Training that needs `need` bytes per stage has waited T_max: offload
        KV for it where the runtime may (see the module docstring)."""
        if not self.config.is_offload_enabled:
            return TrainingRoom.NO_ROOM
        idle = [b for b in micro_batches if not b.is_in_flight]
        if self.offload_for(need, idle):
            return TrainingRoom.FITS
        if len(idle) == len(micro_batches):
            return TrainingRoom.NO_ROOM  # every request could move and it still would not fit
        # Some micro-batch is in flight, so its KV cannot move now. With one
        # micro-batch wait for its boundary; with more, some may always be in
        # flight, so what offloading every request could not fit goes back now.
        if len(micro_batches) > 1 and not self.can_make_room(need, micro_batches):
            return TrainingRoom.NO_ROOM
        return TrainingRoom.WAIT

    def offload_for(self, need: tuple[int, ...], batches: Sequence[MicroBatch]) -> bool:
        """Move KV of the running requests of `batches` (newest first) to host
        until `need` fits; whether it fits.

        Called only for micro-batches between iterations, when none of their KV
        is in use but that of a prompt whose chunk rides another group's
        iteration (`Request.has_chunk_in_flight`), which stays. Does nothing
        when even offloading all the others would not make room."""
        if not self.can_make_room(need, batches, is_in_use_kept=True):
            return False
        by_index = {batch.index: batch for batch in batches}
        candidates = [
            req for batch in batches for req in batch.running if not req.has_chunk_in_flight
        ]
        for req in sorted(candidates, key=lambda r: -r.task.seq):
            if self.memory.can_admit(need):
                break
            if not self.memory.can_offload(req.task.task_id):
                continue
            moved = self.memory.offload(req.task.task_id)
            self._reload_s += self._transfer_s(moved)
            by_index[req.micro_batch].running.remove(req)
            self.swapped.append(req)
            self.num_offloads += 1
        return self.memory.can_admit(need)

    def can_make_room(
        self, need: tuple[int, ...], batches: Sequence[MicroBatch], *, is_in_use_kept: bool = False
    ) -> bool:
        """Whether offloading every running request of `batches` would fit
        `need` (with `is_in_use_kept`, every one but those with a chunk in flight)."""
        running_bytes = [0] * self._num_stages
        for batch in batches:
            for req in batch.running:
                if is_in_use_kept and req.has_chunk_in_flight:
                    continue
                for stage, nbytes in enumerate(self.memory.held_bytes(req.task.task_id)):
                    running_bytes[stage] += nbytes
        return not any(
            self.memory.used_bytes(s) - running_bytes[s] + need[s] > self.memory.threshold_bytes
            for s in range(self._num_stages)
        )

    def _transfer_s(self, num_bytes: int) -> float:
        # The stages' GPUs move their shares over their own host links at once.
        return num_bytes / self._host_link_bytes_s / self._num_stages
