"""One stage's KV cache: per-request buffers, offload to host and back.

Each request gets, per layer of the stage, K and V buffers of shape
``[num_kv_heads, capacity, head_dim]`` sized once at admission to its prompt +
max_tokens, the same bytes `lemix.memory.kv_bytes` reserves in the engine's
ledger. Decoding appends in place (no reallocation, no copy of the past), and
attention reads a view of the first `length` positions.

Offload moves a waiting request's buffers to the host device (``cpu`` on a
GPU node) and reload brings them back bit-for-bit; on a CPU-only node "host"
is the same memory, so the move is a copy that the accounting still books.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass
class RequestKV:
    """One request's cache on one stage."""

    keys: list[torch.Tensor]  # per stage layer: [kv_heads, capacity, head_dim]
    values: list[torch.Tensor]
    length: int = 0  # positions filled
    is_offloaded: bool = False

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class KVStore:
    """KV buffers of every request held on one stage."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        host_device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.host_device = torch.device(host_device)
        self._entries: dict[str, RequestKV] = {}
        self._lock = threading.Lock()  # stage threads and the event loop both touch it
        self.device_bytes = 0
        self.host_bytes = 0

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def allocate(self, key: str, capacity: int) -> RequestKV:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        shape = (self.num_kv_heads, capacity, self.head_dim)
        entry = RequestKV(
            keys=[
                torch.empty(shape, dtype=self.dtype, device=self.device)
                for _ in range(self.num_layers)
            ],
            values=[
                torch.empty(shape, dtype=self.dtype, device=self.device)
                for _ in range(self.num_layers)
            ],
        )
        with self._lock:
            if key in self._entries:
                raise KeyError(f"KV for {key!r} already allocated")
            self._entries[key] = entry
            self.device_bytes += entry.num_bytes
        return entry

    def get(self, key: str) -> RequestKV:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"no KV cache for {key!r} on this stage")
        if entry.is_offloaded:
            raise RuntimeError(f"KV cache of {key!r} is offloaded; reload it first")
        return entry

    def has(self, key: str) -> bool:
        return key in self._entries

    def free(self, key: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return
            if entry.is_offloaded:
                self.host_bytes -= entry.num_bytes
            else:
                self.device_bytes -= entry.num_bytes

    def offload(self, key: str) -> int:
        """Move `key`'s buffers to the host; returns the bytes moved."""
        return self._move(key, to_host=True)

    def reload(self, key: str) -> int:
        """Move `key`'s buffers back to the stage device; returns the bytes moved."""
        return self._move(key, to_host=False)

    def _move(self, key: str, *, to_host: bool) -> int:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.is_offloaded == to_host:
                return 0
            target = self.host_device if to_host else self.device
            # .clone() on a same-device move: the copy is the point (a separate
            # host buffer), and the old buffer is released with the list.
            entry.keys = [t.to(target, copy=True) for t in entry.keys]
            entry.values = [t.to(target, copy=True) for t in entry.values]
            entry.is_offloaded = to_host
            nbytes = entry.num_bytes
            sign = 1 if to_host else -1
            self.host_bytes += sign * nbytes
            self.device_bytes -= sign * nbytes
            return nbytes
