"""Algorithm 1 (`compute_idleness`) and the node trace (`NodeView`) on hand-built traces.

Every expected value below is computed by hand in the comments from the rule
in paper-notes §4: fb_s = max(pfe_s, fe_{s−1}) (pfe = arrival on an empty
node), a pending backward at s that the forward would overlap pushes fb_s to
that backward's end (far dependency), II = Σ_s max(fb_s − pfe_s − offset_s, 0)
where offset_s is busy backward (or decode) time between pfe_s and fb_s, and
R = fe_{S−1} − arrival.
"""

from __future__ import annotations

import copy
import statistics

import pytest
from factories import make_request, make_training

from lemix.planner.trace import (
    DecodeLoad,
    NodeView,
    OutstandingRequest,
    TaskCosts,
    TrainWindow,
    compute_idleness,
)

approx = pytest.approx


def view_with(
    forward_end_s: list[float],
    windows: list[TrainWindow] | None = None,
    last_arrival_s: float = 0.0,
    node_id: int = 0,
) -> NodeView:
    return NodeView(
        node_id,
        len(forward_end_s),
        forward_end_s=list(forward_end_s),
        windows=list(windows or []),
        last_arrival_s=last_arrival_s,
    )


# ------------------------------------------------------------------ (a) empty node


def test_empty_node_pfe_is_arrival_and_response_is_sum_of_forwards() -> None:
    view = NodeView(3, 3)
    task = make_request("r", arrival_s=1.0)
    pred = compute_idleness(view, task, 1.0, TaskCosts(forward_s=(0.1, 0.2, 0.3)))
    # fb = (1.0, 1.1, 1.3), fe = (1.1, 1.3, 1.6); pfe_s = arrival = 1.0 on every stage,
    # so II = 0 + (1.1 − 1.0) + (1.3 − 1.0) = 0.4: only the pipeline fill, nothing else.
    assert pred.node_id == 3
    assert pred.forward_begin_s == approx((1.0, 1.1, 1.3))
    assert pred.forward_end_s == approx((1.1, 1.3, 1.6))
    assert pred.idleness_increase_s == approx(0.4)
    assert pred.response_s == approx(0.6)  # Σ forward
    assert pred.arrival_gap_s == 0.0
    assert pred.window is None
    assert pred.num_passed_windows == 0


def test_empty_single_stage_node_adds_no_idleness() -> None:
    pred = compute_idleness(
        NodeView(0, 1), make_request("r", 2.0), 2.0, TaskCosts(forward_s=(0.25,))
    )
    assert pred.idleness_increase_s == 0.0
    assert pred.response_s == approx(0.25)


def test_empty_node_start_delay_and_late_planning_count_as_idleness_and_response() -> None:
    # Planned at now = 1.5 for a task that arrived at 1.0, and it must wait 0.5 s
    # for an iteration boundary: fb_0 = 2.0, fe = (2.1, 2.3).
    pred = compute_idleness(
        NodeView(0, 2),
        make_request("r", 1.0),
        1.5,
        TaskCosts(forward_s=(0.1, 0.2), start_delay_s=0.5),
    )
    assert pred.forward_begin_s == approx((2.0, 2.1))
    assert pred.forward_end_s == approx((2.1, 2.3))
    assert pred.idleness_increase_s == approx((2.0 - 1.0) + (2.1 - 1.0))
    assert pred.response_s == approx(1.3)


# --------------------------------------------------------- (b) immediate dependency


def test_immediate_dependency_waits_for_previous_forward_on_each_stage() -> None:
    # The previous task's forward ends at 2.0 on stage 0 and 2.5 on stage 1.
    view = view_with([2.0, 2.5], last_arrival_s=0.25)
    pred = compute_idleness(view, make_request("r", 1.0), 1.0, TaskCosts(forward_s=(0.1, 0.2)))
    # stage 0: fb = max(2.0, 1.0) = 2.0, fe = 2.1; stage 1: fb = max(2.5, 2.1) = 2.5, fe = 2.7
    assert pred.forward_begin_s == approx((2.0, 2.5))
    assert pred.forward_end_s == approx((2.1, 2.7))
    assert pred.idleness_increase_s == approx(0.0)
    assert pred.response_s == approx(1.7)
    assert pred.arrival_gap_s == approx(0.75)


def test_immediate_dependency_on_own_previous_stage_opens_idleness() -> None:
    view = view_with([2.0, 2.05])
    pred = compute_idleness(view, make_request("r", 1.0), 1.0, TaskCosts(forward_s=(0.1, 0.2)))
    # stage 1: fb = max(2.05, fe_0 = 2.1) = 2.1 → 0.05 s idle after the previous forward.
    assert pred.forward_begin_s == approx((2.0, 2.1))
    assert pred.forward_end_s == approx((2.1, 2.3))
    assert pred.idleness_increase_s == approx(0.05)
    assert pred.response_s == approx(1.3)


# ------------------------------------------------------------ (c) far dependency


def test_far_dependency_moves_forward_behind_pending_backward() -> None:
    # A training task W (the last one placed): fe = (1.0, 1.5); its backward runs
    # stage 1 [1.5, 2.5] then stage 0 [2.5, 3.0].
    window = TrainWindow(
        "w", backward_begin_s=(2.5, 1.5), backward_end_s=(3.0, 2.5), backward_s=(0.5, 1.0)
    )
    view = view_with([1.0, 1.5], [window])
    pred = compute_idleness(view, make_request("r", 1.0), 1.0, TaskCosts(forward_s=(0.2, 0.3)))
    # stage 0: fb = 1.0, fe = 1.2 ≤ bb_0 = 2.5 → fits before the backward; idle 0.
    # stage 1: fb = max(1.5, 1.2) = 1.5, fe = 1.8 > bb_1 = 1.5 → far dependency:
    #   fb = be_1 = 2.5, fe = 2.8; offset = 1.0 (pfe 1.5 ≤ bb_1); idle = 2.5 − 1.5 − 1.0 = 0.
    assert pred.forward_begin_s == approx((1.0, 2.5))
    assert pred.forward_end_s == approx((1.2, 2.8))
    assert pred.idleness_increase_s == approx(0.0)
    assert pred.response_s == approx(1.8)
    assert pred.num_passed_windows == 0  # stage 0 did not pass W's backward


def test_far_dependency_with_two_windows_walks_both() -> None:
    # Two pending backwards on stage 1 that the new forward would overlap in turn.
    w1 = TrainWindow("w1", (3.0, 1.0), (3.5, 2.0), (0.5, 1.0))
    w2 = TrainWindow("w2", (5.0, 2.2), (5.5, 3.2), (0.5, 1.0))
    view = view_with([0.5, 1.0], [w1, w2])
    pred = compute_idleness(view, make_request("r", 0.5), 0.5, TaskCosts(forward_s=(0.1, 0.5)))
    # stage 0: fb = 0.5, fe = 0.6 ≤ bb_0(w1) = 3.0 → break.
    # stage 1: fb = max(1.0, 0.6) = 1.0, fe = 1.5 > 1.0 → fb = 2.0, fe = 2.5 (offset +1.0);
    #   fe 2.5 > bb_1(w2) = 2.2 → fb = 3.2, fe = 3.7 (offset +1.0);
    #   idle = 3.2 − 1.0 − 2.0 = 0.2 (the gap [2.0, 2.2] between the two backwards).
    assert pred.forward_begin_s == approx((0.5, 3.2))
    assert pred.forward_end_s == approx((0.6, 3.7))
    assert pred.idleness_increase_s == approx(0.2)
    assert pred.response_s == approx(3.2)


# --------------------------------------------------------- (d) backward offset


def test_backward_between_pfe_and_new_forward_is_subtracted() -> None:
    # W: fe = (1.0, 1.2), backward stage 1 [1.2, 1.6], stage 0 [1.6, 2.0]. Then an
    # inference I2 was placed behind it with fe = (1.1, 1.7): pfe = (1.1, 1.7).
    window = TrainWindow("w", (1.6, 1.2), (2.0, 1.6), (0.4, 0.4))
    view = view_with([1.1, 1.7], [window], last_arrival_s=1.0)
    pred = compute_idleness(view, make_request("r", 1.5), 1.5, TaskCosts(forward_s=(0.3, 0.1)))
    # stage 0: fb = max(1.1, 1.5) = 1.5, fe = 1.8 > bb_0 = 1.6 → fb = be_0 = 2.0, fe = 2.3;
    #   pfe 1.1 ≤ bb_0 → offset 0.4; idle = 2.0 − 1.1 − 0.4 = 0.5 (the real gap [1.1, 1.6]).
    # stage 1: fb = max(1.7, 2.3) = 2.3, fe = 2.4; W's stage-1 backward ended before pfe
    #   → no offset; idle = 2.3 − 1.7 = 0.6.
    assert pred.forward_begin_s == approx((2.0, 2.3))
    assert pred.forward_end_s == approx((2.3, 2.4))
    assert pred.idleness_increase_s == approx(1.1)
    assert pred.response_s == approx(0.9)
    assert pred.arrival_gap_s == approx(0.5)
    assert pred.num_passed_windows == 1  # stage 0 went past W's backward


def test_backward_offset_on_later_stage_after_stage0_passed_the_window() -> None:
    """The offset rule holds on every stage, also after stage 0 walked past the window.

    W is the last task placed: fe = (1.0, 1.2) and its backward occupies stage 1
    [1.2, 1.6] and stage 0 [1.6, 2.0]. A new forward (arrival 1.5, 0.3 s + 0.1 s)
    collides with W's stage-0 backward and moves to 2.0, so on stage 1 it starts
    at 2.3. Between pfe_1 = 1.2 and fb_1 = 2.3 stage 1 is busy with W's backward
    for 0.4 s, which is not idleness (paper-notes §3(b); trace.py docstring).
    Expected: stage 0 idle 2.0 − 1.0 − 0.4 = 0.6, stage 1 idle 2.3 − 1.2 − 0.4 =
    0.7, II = 1.3.
    """
    window = TrainWindow("w", (1.6, 1.2), (2.0, 1.6), (0.4, 0.4))
    view = view_with([1.0, 1.2], [window])
    pred = compute_idleness(view, make_request("r", 1.5), 1.5, TaskCosts(forward_s=(0.3, 0.1)))
    assert pred.forward_begin_s == approx((2.0, 2.3))
    assert pred.forward_end_s == approx((2.3, 2.4))
    assert pred.idleness_increase_s == approx(0.6 + 0.7)


# ----------------------------------------------------- (e) training backward chain


def test_training_task_appends_its_backward_chain_last_stage_first() -> None:
    view = NodeView(0, 3)
    task = make_training("t", arrival_s=0.0, num_tokens=100)
    costs = TaskCosts(forward_s=(0.1, 0.2, 0.3), backward_s=(0.4, 0.5, 0.6))
    pred = compute_idleness(view, task, 0.0, costs)
    assert pred.forward_end_s == approx((0.1, 0.3, 0.6))
    window = pred.window
    assert window is not None
    assert window.task_id == "t"
    # bb_2 = fe_2 = 0.6, be_2 = 1.2; bb_1 = 1.2, be_1 = 1.7; bb_0 = 1.7, be_0 = 2.1
    assert window.backward_begin_s == approx((1.7, 1.2, 0.6))
    assert window.backward_end_s == approx((2.1, 1.7, 1.2))
    assert window.backward_s == (0.4, 0.5, 0.6)
    # R is the forward response; the backward does not count towards it.
    assert pred.response_s == approx(0.6)


def test_inference_task_has_no_window() -> None:
    pred = compute_idleness(NodeView(0, 2), make_request("r"), 0.0, TaskCosts(forward_s=(0.1, 0.1)))
    assert pred.window is None


# ------------------------------------------------------------- (f) decode-aware


def test_decode_busy_time_is_not_idleness() -> None:
    # pfe = (0.5, 0.6); the new request arrives at 1.0 and waits 0.4 s for a batch
    # slot, so fb = (1.4, 1.5), fe = (1.5, 1.7).
    view = view_with([0.5, 0.6])
    task = make_request("r", 1.0)
    costs = TaskCosts(forward_s=(0.1, 0.2), start_delay_s=0.4)
    plain = compute_idleness(view, task, 1.0, costs)
    # Without decode: idle = (1.4 − 0.5) + (1.5 − 0.6) = 1.8.
    assert plain.idleness_increase_s == approx(1.8)
    # Decode keeps stage 0 busy 50 % and stage 1 busy 25 % of the time until 1.2;
    # only the future counts ([now, until] = [1.0, 1.2]):
    #   stage 0: 0.2 × 0.5 = 0.1 busy → idle 0.8; stage 1: 0.2 × 0.25 = 0.05 → 0.85.
    decode = DecodeLoad(busy_fraction=(0.5, 0.25), until_s=1.2)
    pred = compute_idleness(view, task, 1.0, costs, decode)
    assert pred.idleness_increase_s == approx(0.8 + 0.85)
    assert pred.forward_begin_s == plain.forward_begin_s
    assert pred.response_s == approx(plain.response_s) == approx(0.7)


def test_decode_load_after_the_gap_does_not_reduce_idleness() -> None:
    view = view_with([0.5, 0.6])
    costs = TaskCosts(forward_s=(0.1, 0.2), start_delay_s=0.4)
    decode = DecodeLoad(busy_fraction=(1.0, 1.0), until_s=0.9)  # ended before now = 1.0
    pred = compute_idleness(view, make_request("r", 1.0), 1.0, costs, decode)
    assert pred.idleness_increase_s == approx(1.8)


# ------------------------------------------------------ (g) purity and copies


def _loaded_view() -> NodeView:
    view = NodeView(1, 2)
    view.commit(
        make_training("t0", 0.0, 100),
        compute_idleness(
            view, make_training("t0", 0.0, 100), 0.0, TaskCosts((0.1, 0.1), (0.2, 0.2))
        ),
    )
    req = make_request("r0", 0.05, 50, 20)
    view.commit(req, compute_idleness(view, req, 0.05, TaskCosts((0.05, 0.05))))
    return view


def test_compute_idleness_does_not_mutate_the_view() -> None:
    view = _loaded_view()
    before = copy.deepcopy(view)
    task = make_training("t1", 0.1, 300)
    compute_idleness(
        view, task, 0.1, TaskCosts((0.3, 0.3), (0.6, 0.6)), DecodeLoad((0.5, 0.5), 10.0)
    )
    assert view == before


def test_copy_is_independent_of_the_original() -> None:
    view = _loaded_view()
    before = copy.deepcopy(view)
    clone = view.copy()
    assert clone == view
    # Mutate every container of the copy, directly and through commit/finish.
    clone.forward_end_s[0] = 99.0
    clone.windows.append(TrainWindow("x", (1.0, 1.0), (2.0, 2.0), (1.0, 1.0)))
    clone.requests["extra"] = OutstandingRequest(1, 1)
    clone.training_tasks["extra-t"] = 5
    task = make_training("t9", 0.2, 100)
    clone.commit(task, compute_idleness(clone, task, 0.2, TaskCosts((0.1, 0.1), (0.2, 0.2))))
    clone.finish("r0")
    clone.finish("t0")
    assert view == before
    assert clone != view


def test_commit_on_a_copy_leaves_other_copies_alone() -> None:
    # The prototype's shallow copy made every task's predicted trace alias one list.
    view = _loaded_view()
    a, b = view.copy(), view.copy()
    task = make_request("r1", 0.1, 10, 1)
    a.commit(task, compute_idleness(a, task, 0.1, TaskCosts((0.5, 0.5))))
    assert b.forward_end_s == view.forward_end_s
    assert "r1" not in b.requests and "r1" not in view.requests
    assert b.num_placed == view.num_placed == 2


# -------------------------------------------- (h) passed windows, commit, Welford


def test_commit_drops_passed_windows_and_appends_the_new_one() -> None:
    w_old = TrainWindow("w", (1.6, 1.2), (2.0, 1.6), (0.4, 0.4))
    view = view_with([1.1, 1.7], [w_old], last_arrival_s=1.0)
    view.training_tasks["w"] = 100
    task = make_training("t", 1.5, 300)
    pred = compute_idleness(view, task, 1.5, TaskCosts((0.3, 0.1), (0.2, 0.2)))
    # As in the offset test: stage 0 goes past W's backward → 1 passed window.
    assert pred.num_passed_windows == 1
    view.commit(task, pred)
    assert [w.task_id for w in view.windows] == ["t"]
    assert view.windows[0].backward_begin_s == approx((2.6, 2.4))
    assert view.forward_end_s == approx([2.3, 2.4])
    assert view.last_arrival_s == 1.5
    assert view.training_tasks["t"] == 300


def test_commit_keeps_windows_the_task_did_not_pass() -> None:
    window = TrainWindow("w", (2.5, 1.5), (3.0, 2.5), (0.5, 1.0))
    view = view_with([1.0, 1.5], [window])
    task = make_request("r", 1.0)
    pred = compute_idleness(view, task, 1.0, TaskCosts(forward_s=(0.2, 0.3)))
    assert pred.num_passed_windows == 0
    view.commit(task, pred)
    assert view.windows == [window]


def test_later_stage0_forward_passes_an_earlier_backward() -> None:
    view = NodeView(0, 2)
    t0 = make_training("t0", 0.0, 100)
    view.commit(t0, compute_idleness(view, t0, 0.0, TaskCosts((0.1, 0.1), (0.2, 0.2))))
    # t0: fe = (0.1, 0.2), backward stage 1 [0.2, 0.4], stage 0 [0.4, 0.6].
    assert view.windows[0].backward_end_s == approx((0.6, 0.4))
    t1 = make_training("t1", 0.5, 100)
    pred = compute_idleness(view, t1, 0.5, TaskCosts((0.1, 0.1), (0.2, 0.2)))
    # stage 0: fb = 0.5, fe = 0.6 > bb_0 = 0.4 → fb = be_0 = 0.6, fe = 0.7; t0 passed.
    # stage 1: fb = max(0.2, 0.7) = 0.7, fe = 0.8. Backward: [0.8, 1.0] then [1.0, 1.2].
    assert pred.num_passed_windows == 1
    assert pred.forward_end_s == approx((0.7, 0.8))
    view.commit(t1, pred)
    assert [w.task_id for w in view.windows] == ["t1"]
    assert view.windows[0].backward_end_s == approx((1.2, 1.0))


def test_finish_and_prune_forget_windows() -> None:
    w_a = TrainWindow("a", (0.4, 0.2), (0.6, 0.4), (0.2, 0.2))
    w_b = TrainWindow("b", (0.9, 0.7), (1.1, 0.9), (0.2, 0.2))
    view = view_with([0.1, 0.2], [w_a, w_b])
    view.training_tasks.update({"a": 100, "b": 100})
    view.prune(0.6)  # a backward ending at 0.6 has not ended before 0.6: kept
    assert [w.task_id for w in view.windows] == ["a", "b"]
    view.prune(0.7)
    assert [w.task_id for w in view.windows] == ["b"]
    view.finish("b")
    assert view.windows == [] and view.training_tasks == {"a": 100}


def test_welford_mean_and_std_match_statistics() -> None:
    view = NodeView(0, 2)
    lengths = [100, 200, 400, 50, 333, 7]
    assert view.length_std == 0.0
    for i, length in enumerate(lengths):
        task = (
            make_training(f"t{i}", float(i), length)
            if i % 2
            else make_request(f"r{i}", float(i), length, 5)
        )
        view.commit(task, compute_idleness(view, task, float(i), TaskCosts((0.1, 0.1))))
        assert view.num_lengths == i + 1
        assert view.length_mean == approx(statistics.mean(lengths[: i + 1]))
        expected_std = statistics.stdev(lengths[: i + 1]) if i else 0.0
        assert view.length_std == approx(expected_std)
    assert view.num_placed == 6
    assert view.num_outstanding == 6


def test_request_aggregates_follow_commit_and_finish() -> None:
    view = NodeView(0, 2)
    for task_id, prompt, out in (("a", 100, 10), ("b", 50, 30), ("c", 20, 30)):
        task = make_request(task_id, 0.0, prompt, out)
        view.commit(task, compute_idleness(view, task, 0.0, TaskCosts((0.1, 0.1))))
    assert (view.sum_request_prompt_tokens, view.sum_request_output_tokens) == (170, 70)
    assert view.max_request_output_tokens == 30
    view.finish("b")
    assert (view.sum_request_prompt_tokens, view.sum_request_output_tokens) == (120, 40)
    assert view.max_request_output_tokens == 30  # "c" still holds 30
    view.finish("c")
    assert view.max_request_output_tokens == 10
    view.finish("a")
    assert (
        view.sum_request_prompt_tokens,
        view.sum_request_output_tokens,
        view.max_request_output_tokens,
    ) == (0, 0, 0)
    view.finish("unknown")  # finishing an unknown task is a no-op
    assert view.requests == {}
