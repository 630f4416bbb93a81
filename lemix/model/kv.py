"""One stage's KV cache: one pool per stage, a contiguous run of it per request.

The stage's K and V live in one tensor, ``pool [num_layers, 2, num_slots,
num_kv_heads, head_dim]`` (2: K then V). A slot holds one token's K/V for
every head; a request owns a contiguous run of slots ``[base, base +
capacity)``, sized once at admission to its prompt + max_tokens, the bytes
`lemix.memory.kv_bytes` reserves in the engine's ledger. Because every
request's cache sits in the same tensor, a stage writes the new K/V of all
requests of an iteration with one indexed copy per layer and gathers the
caches of all decode steps with one `index_select` per layer
(`lemix.model.staged`): the Python work per layer does not grow with the
batch. Contiguous runs (rather than paged blocks) keep each request's cache a
plain view, ``keys[layer] [kv_heads, capacity, head_dim]``, for callers that
read or fill one request's cache directly.

Runs are handed out first-fit from a free list whose neighbours merge on
free. When no free run fits, the pool grows (to at least twice its size, so
growth copies amortise) and keeps every slot index: a request's `base` stays
valid; once no request holds a run, it shrinks back. Growth slack and
fragmentation can leave the pool larger than the booked bytes: `device_bytes`
books what the requests reserve (what the ledger checks), `pool_bytes` is what
the tensor really holds.

Offload copies a waiting request's run to its own host buffer (``cpu`` on a
GPU node) and frees the run; reload takes a new run and copies the buffer back
bit-for-bit. On a CPU-only node "host" is the same memory, so the move is a
copy that the accounting still books.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


@dataclass
class RequestKV:
    """One request's cache on one stage: a run of the stage's pool, or a host copy."""

    store: KVStore = field(repr=False)
    capacity: int  # slots reserved (tokens)
    base: int = -1  # first slot of its run in the pool; -1 while offloaded
    length: int = 0  # positions filled
    host: torch.Tensor | None = field(default=None, repr=False)
    # ^ while offloaded: [num_layers, 2, capacity, kv_heads, head_dim] on the host device

    @property
    def is_offloaded(self) -> bool:
        return self.host is not None

    def _run(self) -> torch.Tensor:
        """[num_layers, 2, capacity, kv_heads, head_dim]: a view of where the cache lives."""
        if self.host is not None:
            return self.host
        return self.store.pool[:, :, self.base : self.base + self.capacity]

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per stage layer: a view [kv_heads, capacity, head_dim] (writes go to the cache)."""
        return [layer[0].transpose(0, 1) for layer in self._run()]

    @property
    def values(self) -> list[torch.Tensor]:
        return [layer[1].transpose(0, 1) for layer in self._run()]

    @property
    def num_bytes(self) -> int:
        return self.capacity * self.store.bytes_per_token()


class KVStore:
    """KV of every request held on one stage, in one pool tensor."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        host_device: torch.device | str = "cpu",
        initial_slots: int = 0,
    ) -> None:
        if initial_slots < 0:
            raise ValueError(f"initial_slots must be >= 0, got {initial_slots}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.host_device = torch.device(host_device)
        # Zeros, not empty: a padded gather may read a slot nobody wrote, and
        # its (masked) value must be finite or 0 * NaN poisons the output.
        self._initial_slots = initial_slots
        self.pool = self._zeros(initial_slots)
        self._views = self._layer_views()
        self._free: list[tuple[int, int]] = [(0, initial_slots)] if initial_slots else []
        self._entries: dict[str, RequestKV] = {}
        self._lock = threading.Lock()  # stage threads and the event loop both touch it
        # Held by a stage's forward and by pool growth: growing copies the pool,
        # and a write into the old tensor during the copy would be lost.
        self.pool_lock = threading.Lock()
        self.device_bytes = 0
        self.host_bytes = 0

    @property
    def num_slots(self) -> int:
        return self.pool.shape[2]

    @property
    def pool_bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V over every slot: [num_slots, kv_heads, head_dim] each."""
        return self._views[layer]

    def _layer_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Made once per pool tensor: a stage asks for them every layer of every forward.
        return [(layer[0], layer[1]) for layer in self.pool]

    def allocate(self, key: str, capacity: int) -> RequestKV:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        with self._lock:
            if key in self._entries:
                raise KeyError(f"KV for {key!r} already allocated")
            entry = RequestKV(self, capacity, base=self._take(capacity))
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
                entry.host = None
            else:
                self.device_bytes -= entry.num_bytes
                self._give_back(entry.base, entry.capacity)
                self._shrink_if_idle()
            entry.base = -1

    def offload(self, key: str) -> int:
        """Move `key`'s cache to the host; returns the bytes moved."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.is_offloaded:
                return 0
            # A copy into a buffer of its own, so the run can go back to the pool.
            entry.host = entry._run().to(self.host_device, copy=True)
            self._give_back(entry.base, entry.capacity)
            entry.base = -1
            self.host_bytes += entry.num_bytes
            self.device_bytes -= entry.num_bytes
            self._shrink_if_idle()
            return entry.num_bytes

    def reload(self, key: str) -> int:
        """Move `key`'s cache back into the pool; returns the bytes moved."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.host is None:
                return 0
            host, entry.host = entry.host, None
            entry.base = self._take(entry.capacity)
            entry._run().copy_(host)
            self.host_bytes -= entry.num_bytes
            self.device_bytes += entry.num_bytes
            return entry.num_bytes

    def _zeros(self, num_slots: int) -> torch.Tensor:
        shape = (self.num_layers, 2, num_slots, self.num_kv_heads, self.head_dim)
        # A plain tensor even when a reload grows the pool inside a stage's
        # inference_mode: an inference tensor could not be written outside it.
        with torch.inference_mode(False):
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _take(self, capacity: int) -> int:
        """First slot of a free run of `capacity` slots (first fit); grows the pool if
        none fits. Caller holds the lock."""
        for i, (start, size) in enumerate(self._free):
            if size >= capacity:
                if size == capacity:
                    del self._free[i]
                else:
                    self._free[i] = (start + capacity, size - capacity)
                return start
        self._grow(capacity)
        return self._take(capacity)

    def _grow(self, capacity: int) -> None:
        """Enlarge the pool so its free tail holds `capacity` slots; slot indices stay."""
        old = self.num_slots
        tail = self._free[-1][1] if self._free and sum(self._free[-1]) == old else 0
        new = max(2 * old, old + capacity - tail)
        with self.pool_lock:
            pool = self._zeros(new)
            pool[:, :, :old] = self.pool
            self.pool = pool
            self._views = self._layer_views()
        self._give_back(old, new - old)

    def _shrink_if_idle(self) -> None:
        """Back to the initial pool once no request holds a run: growth slack
        would otherwise stay allocated on the device for good. Caller holds the lock."""
        if self.device_bytes or self.num_slots == self._initial_slots:
            return
        with self.pool_lock:
            self.pool = self._zeros(self._initial_slots)
            self._views = self._layer_views()
        self._free = [(0, self._initial_slots)] if self._initial_slots else []

    def _give_back(self, start: int, size: int) -> None:
        """Return a run to the free list, merged with free neighbours. Caller holds the lock."""
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < start:
            i += 1
        free.insert(i, (start, size))
        if i + 1 < len(free) and start + size == free[i + 1][0]:
            free[i] = (start, size + free[i + 1][1])
            del free[i + 1]
        if i > 0 and sum(free[i - 1]) == free[i][0]:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]
