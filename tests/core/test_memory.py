"""Node memory accounting (lemix.memory)."""

from __future__ import annotations

import pytest

from lemix.memory import (
    MemoryAccountingError,
    MemoryConfig,
    NodeMemory,
    activation_bytes,
    kv_bytes,
)
from lemix.profile import MemoryProfile


def make_memory(
    weight_bytes: tuple[int, ...] = (100, 200),
    training_state_bytes: tuple[int, ...] = (50, 50),
    host_capacity_bytes: int = 500,
) -> MemoryProfile:
    return MemoryProfile(
        capacity_bytes=1000,
        weight_bytes=weight_bytes,
        training_state_bytes=training_state_bytes,
        kv_bytes_per_token=(2, 3),
        activation_bytes_per_token=(10, 11),
        host_capacity_bytes=host_capacity_bytes,
    )


def make_node(kappa: float = 0.8, **kwargs: object) -> NodeMemory:
    return NodeMemory(make_memory(**kwargs), MemoryConfig(kappa=kappa))  # type: ignore[arg-type]


def test_threshold_is_kappa_times_capacity_and_static_is_charged() -> None:
    node = make_node(kappa=0.8)
    assert node.threshold_bytes == 800
    assert (node.used_bytes(0), node.used_bytes(1)) == (150, 250)
    assert (node.free_bytes(0), node.free_bytes(1)) == (650, 550)
    assert node.dynamic_capacity_bytes(1) == 550
    assert node.max_used_fraction() == pytest.approx(250 / 800)


def test_static_over_threshold_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="stage 1"):
        make_node(kappa=0.9, weight_bytes=(100, 880))  # 930 >= 900
    with pytest.raises(ValueError):
        make_node(kappa=0.5, weight_bytes=(100, 450))  # exactly the threshold: no room


def test_memory_config_validates() -> None:
    for kappa in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError):
            MemoryConfig(kappa=kappa)
    with pytest.raises(ValueError):
        MemoryConfig(max_wait_s=-1.0)


def test_can_admit_checks_every_stage_up_to_the_threshold() -> None:
    node = make_node()
    assert node.can_admit([650, 550])  # exactly fills both stages
    assert not node.can_admit([651, 0])
    assert not node.can_admit([0, 551])
    assert node.could_ever_fit([650, 550])
    assert not node.could_ever_fit([10, 600])


def test_admit_release_and_grow() -> None:
    node = make_node()
    node.admit("req-1", [40, 60])
    assert (node.used_bytes(0), node.used_bytes(1)) == (190, 310)
    assert node.holds("req-1") and node.held_bytes("req-1") == (40, 60)
    node.grow("req-1", [2, 3])
    assert node.held_bytes("req-1") == (42, 63)
    assert (node.used_bytes(0), node.used_bytes(1)) == (192, 313)
    assert node.release("req-1") == (42, 63)
    assert (node.used_bytes(0), node.used_bytes(1)) == (150, 250)
    assert not node.holds("req-1") and node.held_bytes("req-1") == (0, 0)


def test_double_admit_unknown_release_and_overflow_raise() -> None:
    node = make_node()
    node.admit("req-1", [1, 1])
    with pytest.raises(MemoryAccountingError):
        node.admit("req-1", [1, 1])
    with pytest.raises(MemoryAccountingError):
        node.release("nobody")
    with pytest.raises(MemoryAccountingError):
        node.grow("nobody", [1, 1])
    with pytest.raises(MemoryAccountingError):
        node.admit("too-big", [0, 550])  # 1 + 550 on stage 1 > 550 free
    assert not node.holds("too-big")
    assert node.used_bytes(1) == 251


def test_offload_and_reload_move_bytes_exactly() -> None:
    node = make_node()
    node.admit("req-1", [100, 150])
    assert node.can_offload("req-1")
    assert node.offload("req-1") == 250
    assert node.is_offloaded("req-1") and not node.holds("req-1")
    assert node.host_used_bytes == 250
    assert (node.used_bytes(0), node.used_bytes(1)) == (150, 250)
    assert node.can_reload("req-1")
    assert node.reload("req-1") == 250
    assert node.held_bytes("req-1") == (100, 150)
    assert (node.used_bytes(0), node.used_bytes(1)) == (250, 400)
    assert node.host_used_bytes == 0 and not node.is_offloaded("req-1")
    with pytest.raises(MemoryAccountingError):
        node.reload("req-1")


def test_can_offload_respects_host_capacity() -> None:
    node = make_node(host_capacity_bytes=500)
    node.admit("a", [200, 100])  # 300 bytes
    node.admit("b", [150, 100])  # 250 bytes
    assert node.can_offload("a") and node.can_offload("b")
    node.offload("a")
    assert node.host_used_bytes == 300
    assert not node.can_offload("b")  # 300 + 250 > 500
    with pytest.raises(MemoryAccountingError):
        node.offload("b")
    assert node.holds("b")
    assert not node.can_offload("nobody")


def test_reload_needs_room_and_drop_frees_host() -> None:
    node = make_node()
    node.admit("kv", [200, 200])
    node.offload("kv")
    node.admit("train", [500, 400])  # stage 0: 150 + 500 + 200 > 800 on reload
    assert not node.can_reload("kv")
    with pytest.raises(MemoryAccountingError):
        node.reload("kv")
    node.drop_offloaded("kv")
    assert node.host_used_bytes == 0 and not node.is_offloaded("kv")


def test_kv_and_activation_byte_helpers() -> None:
    mem = make_memory()
    assert kv_bytes(mem, 100) == (200, 300)
    assert activation_bytes(mem, batch_size=4, num_tokens=10) == (400, 440)
