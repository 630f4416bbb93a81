"""The decode-aware costs model the engine the nodes run (issue 9): micro-batch
rounds, a per-micro-batch cap, chunked prefill and training slices.

Hand-computable profile: a decode step costs d0 + d1·batch per stage (no
context term), so every expected number below is a sum of those terms.
"""

from __future__ import annotations

import math

import pytest
from factories import make_profile, make_request, make_training

from lemix.planner.base import PlannerConfig
from lemix.planner.costs import DecodeAwareCostEstimator
from lemix.planner.trace import NodeView, Prediction

D0_S, D1_S = 0.01, 0.001
PROFILE = make_profile(decode_d0_s=D0_S, decode_d1_s=D1_S, forward_s_per_token=0.0001)


def estimator(**kw: object) -> DecodeAwareCostEstimator:
    args: dict[str, object] = {"kv_capacity_tokens": 10**9, "max_batch_size": 64, **kw}
    return DecodeAwareCostEstimator(PROFILE.ours, PROFILE.optimizer_step_s, **args)  # type: ignore[arg-type]


def _prediction(work_s: float = 0.0) -> Prediction:
    return Prediction(0, 0.0, 0.0, 0.0, (0.0, 0.0), (work_s, work_s), None, 0)


def view_with(num_requests: int) -> NodeView:
    view = NodeView(0, 2)
    for i in range(num_requests):
        view.commit(make_request(f"r{i}", 0.0, 100, 10), _prediction())
    return view


def step(batch: int) -> float:
    return D0_S + D1_S * batch


def test_one_micro_batch_is_the_v1_formula() -> None:
    est = estimator()
    view = view_with(32)
    assert est.iteration_s(view) == pytest.approx((step(32), step(32)))
    assert est.period_s(view) == pytest.approx(2 * step(32))


def test_two_micro_batches_split_the_batch_and_keep_both_stages_busy() -> None:
    est = estimator(num_micro_batches=2)
    view = view_with(32)
    # Each stage runs two group steps of 16 per round; a request waits a round.
    assert est.iteration_s(view) == pytest.approx((2 * step(16), 2 * step(16)))
    assert est.period_s(view) == pytest.approx(2 * step(16))
    # Less than v1's 2·step(32): the round is shorter because the fixed cost
    # is paid by smaller batches on both stages at once.
    assert est.period_s(view) < estimator().period_s(view)
    # One request cannot be split: a lone request's period is v1's.
    lone = view_with(1)
    assert est.period_s(lone) == pytest.approx(estimator().period_s(lone))


def test_cap_per_micro_batch_admits_m_times_c_before_a_slot_wait() -> None:
    config = PlannerConfig(
        num_nodes=1,
        num_stages=2,
        slo_ttft_s=1.0,
        slo_tbt_s=0.1,
        max_batch_size=8,
        num_micro_batches=2,
        is_batch_cap_per_micro_batch=True,
    )
    assert config.max_running_per_node == 16
    node_cap = estimator(max_batch_size=8, num_micro_batches=2)
    group_cap = estimator(max_batch_size=config.max_running_per_node, num_micro_batches=2)
    view = view_with(12)
    task = make_request("new", 0.0, 100, 10)
    # 12 held: the node-wide cap of 8 makes the newcomer wait for slots; a cap
    # of 8 per micro-batch has room for 16.
    assert (
        node_cap.costs(view, task, 0.0).start_delay_s
        > group_cap.costs(view, task, 0.0).start_delay_s
    )
    assert group_cap.costs(view, task, 0.0).start_delay_s == pytest.approx(
        0.5 * group_cap.period_s(view)
    )


def test_chunked_prefill_delays_the_first_token_by_the_extra_iterations() -> None:
    view = view_with(8)
    task = make_request("long", 0.0, 1000, 10)
    whole = estimator().costs(view, task, 0.0)
    chunked = estimator(prefill_token_budget=256).costs(view, task, 0.0)
    extra_iterations = math.ceil(1000 / 256) - 1
    assert chunked.start_delay_s - whole.start_delay_s == pytest.approx(
        extra_iterations * estimator().period_s(view)
    )
    short = make_request("short", 0.0, 200, 10)
    assert estimator(prefill_token_budget=256).costs(view, short, 0.0).start_delay_s == (
        pytest.approx(estimator().costs(view, short, 0.0).start_delay_s)
    )


def test_training_slices_bound_the_stall_an_inference_iteration_sees() -> None:
    view = view_with(8)
    item_s = 0.2
    view.commit(make_training("t0", 0.0, 100), _prediction(work_s=2 * item_s), now_s=0.0)
    task = make_request("new", 0.0, 100, 10)
    whole = estimator().costs(view, task, 0.0).time_between_tokens_s
    sliced = estimator(max_training_slice_s=0.02).costs(view, task, 0.0).time_between_tokens_s
    assert whole > sliced
    busy_fraction, mean_item_s = view.training_load(0.0, 10.0)
    assert mean_item_s > 0.02
    # The stall term is S · u · w with w = one slice instead of the whole item.
    assert whole - sliced == pytest.approx(2 * busy_fraction * (mean_item_s - 0.02))


def test_with_slices_an_inference_waits_one_slice_not_the_queued_training() -> None:
    # One node, a long training task queued on it: Algorithm 1's FIFO trace
    # puts the next request's forward after the training forward; the engine
    # (inference first at every slice boundary) makes it wait one slice per
    # stage at most, and that is what the planner now predicts.
    from factories import make_planner

    from lemix.types import Placement

    def response_after_training(slice_s: float | None) -> float:
        planner = make_planner("lemix", num_nodes=1, profile=PROFILE, max_training_slice_s=slice_s)
        planner.submit(make_training("t0", 0.0, 1000), 0.0)
        assert any(isinstance(d, Placement) for d in planner.plan(0.0))
        request = make_request("r0", 0.0, 100, 10)
        view = planner.views[0]
        return planner.predictor.predict(view, request, 0.0).response_s

    trace_s = response_after_training(None)
    sliced_s = response_after_training(0.01)
    # The training forward is 1000 tokens x 0.1 ms per stage: 0.1 s ahead in
    # the trace at each stage; with slices the request waits 2 x 0.01 s.
    assert trace_s > 0.1
    costs = estimator().costs(view_with(0), make_request("r0", 0.0, 100, 10), 0.0)
    assert sliced_s == pytest.approx(sum(costs.forward_s) + 2 * 0.01, rel=0.05)
    assert sliced_s < trace_s


def test_gathered_decodes_on_a_training_node_predict_one_group_and_fewer_stalls() -> None:
    view = view_with(32)
    view.commit(make_training("t0", 0.0, 100), _prediction(work_s=0.4), now_s=0.0)
    task = make_request("new", 0.0, 100, 10)
    kw: dict[str, object] = {"num_micro_batches": 2, "max_training_slice_s": 0.02}
    split = estimator(**kw)
    gathered = estimator(**kw, is_decode_gathered=True)
    busy_fraction, _ = view.training_load(0.0, 10.0)
    stall_s = 0.02 * min(busy_fraction, 1.0)
    # Split: two groups of 16 or 17 (33 after the join), a full slice per stage.
    assert split.costs(view, task, 0.0).time_between_tokens_s == pytest.approx(
        2 * step(17) + 2 * stall_s
    )
    # Gathered: one group of all 33 through both stages, (S + 1) / 2 slices.
    assert gathered.costs(view, task, 0.0).time_between_tokens_s == pytest.approx(
        2 * step(33) + 1.5 * stall_s
    )
    assert gathered.stall_stages(2, True) == 1.5 and gathered.stall_stages(2, False) == 2
    # Without training on the node nothing is gathered: the split model.
    idle = view_with(32)
    assert gathered.costs(idle, task, 0.0).time_between_tokens_s == pytest.approx(
        split.costs(idle, task, 0.0).time_between_tokens_s
    )


def test_paced_decodes_on_a_training_node_predict_no_tbt_below_the_pace() -> None:
    """A paced node that trains: a token comes no sooner than the pace, for a
    joiner and for the running batch once training joins; without training
    (nothing gathered, nothing paced) or below the pace, as unpaced."""
    view = view_with(32)
    view.commit(make_training("t0", 0.0, 100), _prediction(work_s=0.4), now_s=0.0)
    task = make_request("new", 0.0, 100, 10)
    kw: dict[str, object] = {
        "num_micro_batches": 2,
        "max_training_slice_s": 0.02,
        "is_decode_gathered": True,
    }
    unpaced = estimator(**kw)
    natural_s = unpaced.costs(view, task, 0.0).time_between_tokens_s
    slow = estimator(**kw, decode_pace_s=2 * natural_s)
    fast = estimator(**kw, decode_pace_s=0.5 * natural_s)
    assert slow.costs(view, task, 0.0).time_between_tokens_s == pytest.approx(2 * natural_s)
    assert fast.costs(view, task, 0.0).time_between_tokens_s == pytest.approx(natural_s)
    idle = view_with(32)
    assert slow.costs(idle, task, 0.0).time_between_tokens_s == pytest.approx(
        unpaced.costs(idle, task, 0.0).time_between_tokens_s
    )
    assert slow.paced_tbt_s(0.0, is_training=True) == 2 * natural_s
    assert slow.paced_tbt_s(0.0, is_training=False) == 0.0
