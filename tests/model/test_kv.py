"""The stage KV pool: runs, reuse, growth, offload and reload."""

from __future__ import annotations

import pytest
import torch

from lemix.model.kv import KVStore


def _store(initial_slots: int = 0) -> KVStore:
    return KVStore(2, 2, 4, dtype=torch.float32, device="cpu", initial_slots=initial_slots)


def _fill(store: KVStore, key: str, seed: int) -> list[torch.Tensor]:
    entry = store.get(key)
    generator = torch.Generator().manual_seed(seed)
    for t in (*entry.keys, *entry.values):
        t.copy_(torch.randn(t.shape, generator=generator))
    return [t.clone() for t in (*entry.keys, *entry.values)]


def _contents(store: KVStore, key: str) -> list[torch.Tensor]:
    entry = store.get(key)
    return [t.clone() for t in (*entry.keys, *entry.values)]


def test_views_write_into_the_pool_and_shapes_are_per_request() -> None:
    store = _store()
    entry = store.allocate("a", 5)
    assert entry.keys[0].shape == (2, 5, 4)  # [kv_heads, capacity, head_dim]
    entry.keys[1][:, 3] = 7.0
    k1, _ = store.layer_views(1)
    assert torch.equal(k1[entry.base + 3], torch.full((2, 4), 7.0))
    assert store.device_bytes == 5 * store.bytes_per_token()


def test_growth_keeps_every_run_and_freed_runs_merge_for_reuse() -> None:
    store = _store(initial_slots=4)
    store.allocate("a", 3)
    before = _fill(store, "a", 0)
    store.allocate("b", 6)  # does not fit: the pool grows
    assert store.num_slots >= 9
    assert all(torch.equal(x, y) for x, y in zip(before, _contents(store, "a"), strict=True))
    store.allocate("c", 2)
    num_slots = store.num_slots
    store.free("a")
    store.free("b")  # a's and b's runs merge into one of 9
    assert store.allocate("d", 9).base == 0
    assert store.num_slots == num_slots
    with pytest.raises(KeyError, match="already"):
        store.allocate("d", 1)


def test_offload_reload_round_trip_is_bit_exact_and_booked() -> None:
    store = _store()
    per_token = store.bytes_per_token()
    store.allocate("a", 6)
    store.allocate("b", 4)
    a = _fill(store, "a", 1)
    b = _fill(store, "b", 2)
    store.get("a").length = 5
    assert store.offload("a") == 6 * per_token
    assert store.offload("a") == 0  # already there
    assert (store.device_bytes, store.host_bytes) == (4 * per_token, 6 * per_token)
    with pytest.raises(RuntimeError, match="offloaded"):
        store.get("a")
    store.allocate("c", 6)  # takes a's freed run
    _fill(store, "c", 3)
    assert store.reload("a") == 6 * per_token  # so a lands elsewhere
    assert all(torch.equal(x, y) for x, y in zip(a, _contents(store, "a"), strict=True))
    assert all(torch.equal(x, y) for x, y in zip(b, _contents(store, "b"), strict=True))
    assert store.get("a").length == 5
    for key in ("a", "b", "c"):
        store.free(key)
    assert (store.device_bytes, store.host_bytes) == (0, 0)
    assert store.num_slots == 0  # idle: the grown pool is released
    store.allocate("x", 1)
    store.offload("x")
    store.free("x")  # freeing an offloaded run books the host side
    assert (store.device_bytes, store.host_bytes) == (0, 0)
