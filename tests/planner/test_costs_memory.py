"""The decode-aware costs' wait for KV memory follows the engine's bound: a
request waits at most T_max for KV (`lemix.engine_memory`), never for ever;
the wait for a batch slot has no such bound.

Each held request is 100 prompt + 10 output tokens (110 of KV); the
estimator's KV room is 550 tokens, so 5 fit.
"""

from __future__ import annotations

import pytest
from factories import make_request
from test_costs_engine_v2 import estimator, view_with

KV_ROOM_TOKENS = 550
NUM_HELD = 12


def _start_delay_s(**kw: object) -> float:
    est = estimator(kv_capacity_tokens=KV_ROOM_TOKENS, **kw)
    view = view_with(NUM_HELD)
    return est.costs(view, make_request("new", 0.0, 100, 10), 0.0).start_delay_s


def _queue_wait_s(num_slots: int, max_batch_size: int = 64) -> float:
    # (held − slots + 1) ahead, one slot freeing every 10·period/slots seconds.
    period_s = estimator(max_batch_size=max_batch_size).period_s(view_with(NUM_HELD))
    return (NUM_HELD - num_slots + 1) * 10 * period_s / num_slots


def test_kv_wait_without_a_bound_grows_with_the_queue() -> None:
    half_period_s = 0.5 * estimator().period_s(view_with(NUM_HELD))
    assert _start_delay_s() == pytest.approx(half_period_s + _queue_wait_s(5))
    assert _start_delay_s(is_memory_aware=False) == pytest.approx(half_period_s)


def test_kv_wait_stops_at_t_max() -> None:
    unbounded_s = _queue_wait_s(5)
    half_period_s = 0.5 * estimator().period_s(view_with(NUM_HELD))
    max_kv_wait_s = unbounded_s / 4
    assert _start_delay_s(max_kv_wait_s=max_kv_wait_s) == pytest.approx(
        half_period_s + max_kv_wait_s
    )
    # A bound the queue does not reach changes nothing.
    assert _start_delay_s(max_kv_wait_s=10 * unbounded_s) == pytest.approx(
        half_period_s + unbounded_s
    )


def test_the_wait_for_a_batch_slot_is_not_bounded_by_t_max() -> None:
    # A cap of 4 binds before KV (5 fit): the slot wait stands, T_max or not.
    half_period_s = 0.5 * estimator(max_batch_size=4).period_s(view_with(NUM_HELD))
    delay_s = _start_delay_s(max_batch_size=4, max_kv_wait_s=0.001)
    assert delay_s == pytest.approx(half_period_s + _queue_wait_s(4, max_batch_size=4))
    assert delay_s > half_period_s + 0.001
