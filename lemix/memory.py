"""Memory accounting for one node: what fits, and the capacity arithmetic
(`threshold_bytes`, `dynamic_bytes`) the planner's estimates use.

Each stage GPU has a capacity; work may use at most `κ·capacity`
(`threshold_bytes`), the rest is headroom for fragmentation and transients.
Static bytes (weights, gradients, optimizer state) are charged once. Dynamic
owners (a request's KV cache, a training task's saved activations) are charged
per stage with paired verbs `can_admit / admit / release`. Offloaded KV lives in
a host ledger until reloaded. No policy re-implements this arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lemix.profile import MemoryProfile


class MemoryAccountingError(Exception):
    """Raised on accounting misuse (double admit, unknown owner, over capacity)."""


@dataclass(frozen=True)
class MemoryConfig:
    kappa: float = 0.9  # usable fraction of each GPU: M_threshold = κ·M_peak
    # T_max: how long work may wait for memory; then training gets room by KV
    # offload (or is re-queued) and a request fails (`lemix.engine_memory`).
    max_wait_s: float = 2.0
    is_offload_enabled: bool = True  # KV offload for training; False: re-queue it at T_max

    def __post_init__(self) -> None:
        if not 0.0 < self.kappa <= 1.0:
            raise ValueError("kappa must be in (0, 1]")
        if self.max_wait_s < 0:
            raise ValueError("max_wait_s must be >= 0")


def kv_bytes(memory: MemoryProfile, num_tokens: int) -> tuple[int, ...]:
    """Per-stage KV bytes of one sequence holding `num_tokens` tokens."""
    return tuple(b * num_tokens for b in memory.kv_bytes_per_token)


def activation_bytes(memory: MemoryProfile, batch_size: int, num_tokens: int) -> tuple[int, ...]:
    """Per-stage activation bytes a training task saves for its backward."""
    return tuple(b * batch_size * num_tokens for b in memory.activation_bytes_per_token)


def threshold_bytes(memory: MemoryProfile, kappa: float) -> int:
    """What work may use of each stage GPU: `κ·capacity`."""
    return int(kappa * memory.capacity_bytes)


def dynamic_bytes(memory: MemoryProfile, kappa: float, num_stages: int) -> int:
    """Bytes a node has for dynamic owners (KV, activations) over all its
    stages, counting each stage as the tightest one (the planner's view of a
    node: work spreads over every stage)."""
    threshold = threshold_bytes(memory, kappa)
    return min(threshold - memory.static_bytes(s) for s in range(num_stages)) * num_stages


class NodeMemory:
    """Per-stage GPU ledger plus a host ledger for offloaded KV."""

    def __init__(self, memory: MemoryProfile, config: MemoryConfig) -> None:
        self.profile = memory
        self.config = config
        self.num_stages = len(memory.weight_bytes)
        self.threshold_bytes = threshold_bytes(memory, config.kappa)
        self._static = [memory.static_bytes(s) for s in range(self.num_stages)]
        for stage, static in enumerate(self._static):
            if static >= self.threshold_bytes:
                raise ValueError(
                    f"stage {stage}: static memory {static} B does not fit under the "
                    f"threshold {self.threshold_bytes} B (κ={config.kappa})"
                )
        self._used = list(self._static)
        self._owners: dict[str, tuple[int, ...]] = {}
        self._host_used = 0
        self._host_owners: dict[str, int] = {}
        self._offloaded_shape: dict[str, tuple[int, ...]] = {}

    # -------------------------------------------------------------- GPU side

    def used_bytes(self, stage: int) -> int:
        return self._used[stage]

    def free_bytes(self, stage: int) -> int:
        return self.threshold_bytes - self._used[stage]

    def dynamic_capacity_bytes(self, stage: int) -> int:
        """Bytes available to dynamic owners on an otherwise empty node."""
        return self.threshold_bytes - self._static[stage]

    def max_used_fraction(self) -> float:
        return max(u / self.threshold_bytes for u in self._used)

    def could_ever_fit(self, stage_bytes: Sequence[int]) -> bool:
        return all(b <= self.dynamic_capacity_bytes(s) for s, b in enumerate(stage_bytes))

    def can_admit(self, stage_bytes: Sequence[int]) -> bool:
        return all(self._used[s] + b <= self.threshold_bytes for s, b in enumerate(stage_bytes))

    def admit(self, owner: str, stage_bytes: Sequence[int]) -> None:
        if owner in self._owners:
            raise MemoryAccountingError(f"{owner} already holds memory")
        if not self.can_admit(stage_bytes):
            raise MemoryAccountingError(f"{owner} does not fit: {list(stage_bytes)}")
        charged = tuple(int(b) for b in stage_bytes)
        for stage, nbytes in enumerate(charged):
            self._used[stage] += nbytes
        self._owners[owner] = charged

    def grow(self, owner: str, stage_bytes: Sequence[int]) -> None:
        """Charge more bytes to an existing owner (KV growing during decode)."""
        held = self._owners.get(owner)
        if held is None:
            raise MemoryAccountingError(f"{owner} holds no memory")
        for stage, nbytes in enumerate(stage_bytes):
            self._used[stage] += nbytes
        self._owners[owner] = tuple(h + int(b) for h, b in zip(held, stage_bytes, strict=True))

    def release(self, owner: str) -> tuple[int, ...]:
        charged = self._owners.pop(owner, None)
        if charged is None:
            raise MemoryAccountingError(f"{owner} holds no memory")
        for stage, nbytes in enumerate(charged):
            self._used[stage] -= nbytes
        return charged

    def holds(self, owner: str) -> bool:
        return owner in self._owners

    def held_bytes(self, owner: str) -> tuple[int, ...]:
        return self._owners.get(owner, (0,) * self.num_stages)

    # ------------------------------------------------------------- host side

    def can_offload(self, owner: str) -> bool:
        held = self._owners.get(owner)
        return held is not None and self._host_used + sum(held) <= self.profile.host_capacity_bytes

    def offload(self, owner: str) -> int:
        """Move an owner's GPU bytes to host memory; returns bytes moved."""
        if not self.can_offload(owner):
            raise MemoryAccountingError(f"{owner} cannot be offloaded")
        charged = self.release(owner)
        total = sum(charged)
        self._host_used += total
        self._host_owners[owner] = total
        self._offloaded_shape[owner] = charged
        return total

    def reload(self, owner: str) -> int:
        """Move an offloaded owner back to the GPU; returns bytes moved."""
        shape = self._offloaded_shape.get(owner)
        if shape is None:
            raise MemoryAccountingError(f"{owner} is not offloaded")
        self.admit(owner, shape)
        del self._offloaded_shape[owner]
        self._host_used -= self._host_owners.pop(owner)
        return sum(shape)

    def can_reload(self, owner: str) -> bool:
        shape = self._offloaded_shape.get(owner)
        return shape is not None and self.can_admit(shape)

    def is_offloaded(self, owner: str) -> bool:
        return owner in self._host_owners

    def drop_offloaded(self, owner: str) -> None:
        self._offloaded_shape.pop(owner, None)
        self._host_used -= self._host_owners.pop(owner, 0)

    @property
    def host_used_bytes(self) -> int:
        return self._host_used
