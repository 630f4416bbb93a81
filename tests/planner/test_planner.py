"""The planner through `build_planner`: placement, deferral with aging, rejection, syncs.

Factory profile (tests/factories.py): per stage forward = 0.001·C·ℓ s, backward
= 0.002·C·ℓ s, decode step 0.01 s; 8 000 B per stage for KV/activations at
4 B per token and stage (16 000 B = 2 000 tokens per node). PlannerConfig:
slo_ttft_s = 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from factories import make_planner, make_profile, make_request, make_training

from lemix.planner.trace import compute_idleness
from lemix.reasons import NEVER_FITS
from lemix.types import Deferral, Placement, Rejection, Task, WeightSync

approx = pytest.approx
DEFER_REASON = "placing it now would make the next inference miss its SLO"


def placed_nodes(decisions: list) -> list[int]:
    return [d.node_id for d in decisions if isinstance(d, Placement)]


def submit_and_plan(planner, task: Task, now_s: float | None = None) -> list:
    now = task.arrival_s if now_s is None else now_s
    planner.submit(task, now)
    return planner.plan(now)


# ------------------------------------------------------------------- lemix


def test_lemix_places_inference_on_the_node_with_the_lowest_predicted_response() -> None:
    planner = make_planner("lemix", num_nodes=4)
    first = submit_and_plan(planner, make_request("a", 0.0, 100, 10))
    # All nodes empty and equal: ties go to node 0. R = 0.1 + 0.1.
    assert first == [Placement("a", 0, approx(0.2), first[0].score)]
    # Node 0 now holds "a". On node 0 the next request would ride a's decode
    # step (0.01 s per stage) after half an iteration (0.01 s): fb = (0.1, 0.21),
    # fe = (0.21, 0.32) → R = 0.32. On an empty node R = 0.2.
    view0 = planner.views[0]
    b = make_request("b", 0.0, 100, 10)
    on_node0 = compute_idleness(
        view0,
        b,
        0.0,
        planner.estimator.costs(view0, b, 0.0),
        planner.estimator.decode_load(view0, 0.0),
    )
    assert on_node0.response_s == approx(0.32)
    assert on_node0.forward_end_s == approx((0.21, 0.32))
    second = submit_and_plan(planner, b)
    assert len(second) == 1 and isinstance(second[0], Placement)
    assert second[0].node_id == 1
    assert second[0].predicted_response_s == approx(0.2)
    assert planner.node_of("b") == 1


def test_lemix_avoids_a_node_preloaded_with_training() -> None:
    planner = make_planner("lemix-nodeprio", num_nodes=2)
    assert placed_nodes(submit_and_plan(planner, make_training("t", 0.0, 1000))) == [0]
    decisions = submit_and_plan(planner, make_request("r", 0.5, 100, 10))
    # Node 0 is busy with t's forward until 2.0; node 1 answers in 0.2 s.
    assert decisions == [Placement("r", 1, approx(0.2), decisions[0].score)]


# ------------------------------------------------------------------- baselines


def test_mix_rr_cycles_through_nodes() -> None:
    planner = make_planner("mix-rr", num_nodes=4)
    nodes = []
    for i in range(5):
        nodes += placed_nodes(submit_and_plan(planner, make_request(f"r{i}", 0.1 * i)))
    assert nodes == [0, 1, 2, 3, 0]


def test_mix_rr_counts_training_in_the_rotation_and_never_defers() -> None:
    planner = make_planner("mix-rr", num_nodes=3)
    submit_and_plan(planner, make_request("r0", 0.0))
    decisions = submit_and_plan(planner, make_training("t0", 0.0, 1000))
    decisions += submit_and_plan(planner, make_request("r1", 0.0))
    assert placed_nodes(decisions) == [1, 2]
    assert planner.num_deferred == 0


def test_mix_luf_prefers_least_memory_used_then_fewest_tasks_then_node_id() -> None:
    planner = make_planner("mix-luf", num_nodes=4)
    nodes = []
    for i in range(3):
        nodes += placed_nodes(submit_and_plan(planner, make_request(f"r{i}", 0.0)))
    assert nodes == [0, 1, 2]
    planner.on_task_finished("r1", 1.0)
    # Nodes 1 and 3 are both empty now: the lower id wins.
    assert placed_nodes(submit_and_plan(planner, make_request("r3", 1.0))) == [1]
    assert placed_nodes(submit_and_plan(planner, make_request("r4", 1.0))) == [3]


@pytest.mark.parametrize(
    ("train_rate", "train_nodes", "serve_nodes"),
    [
        (0.3, [3, 3, 3], [0, 1, 2, 0]),
        (0.5, [2, 3, 2], [0, 1, 0, 1]),
        (0.1, [3, 3, 3], [0, 1, 2, 0]),
    ],
)
def test_separate_splits_training_and_serving_nodes(
    train_rate: float, train_nodes: list[int], serve_nodes: list[int]
) -> None:
    # train = max(1, round(N·r)) of the last nodes: N = 4, r = 0.3 → 1; r = 0.5 → 2; r = 0.1 → 1.
    planner = make_planner("separate", num_nodes=4, train_rate=train_rate)
    trained, served = [], []
    for i in range(4):
        served += placed_nodes(submit_and_plan(planner, make_request(f"r{i}", 0.0)))
        if i < 3:
            trained += placed_nodes(submit_and_plan(planner, make_training(f"t{i}", 0.0, 1000)))
    assert trained == train_nodes
    assert served == serve_nodes


def test_separate_at_train_rate_zero_serves_on_every_node_and_refuses_training() -> None:
    # No training offered: every node serves (and, in the simulator, holds no
    # training state); a training task that comes anyway is refused, not
    # parked on a serving node.
    planner = make_planner("separate", num_nodes=4, train_rate=0.0)
    served = []
    for i in range(4):
        served += placed_nodes(submit_and_plan(planner, make_request(f"r{i}", 0.0)))
    assert served == [0, 1, 2, 3]
    decisions = submit_and_plan(planner, make_training("t0", 0.0, 100))
    assert len(decisions) == 1 and isinstance(decisions[0], Rejection)
    assert decisions[0].reason.startswith("INVALID_ARGUMENT: the placement policy keeps no")


def test_separate_syncs_weights_after_exactly_k_training_tasks() -> None:
    planner = make_planner("separate", num_nodes=4, train_rate=0.3, sync_every_tasks=3)
    for i in range(7):
        submit_and_plan(planner, make_training(f"t{i}", 0.0, 100))
    submit_and_plan(planner, make_request("r0", 0.0))
    assert planner.on_task_finished("t0", 1.0) == []
    assert planner.on_task_finished("r0", 1.5) == []  # inference does not count
    assert planner.on_task_finished("t1", 2.0) == []
    assert planner.on_task_finished("t2", 3.0) == [WeightSync(3, (0, 1, 2), 3)]
    assert planner.on_task_finished("t3", 4.0, is_success=False) == []  # failed: no update
    assert planner.on_task_finished("t4", 5.0) == []
    assert planner.on_task_finished("t5", 6.0) == []
    assert planner.on_task_finished("t6", 7.0) == [WeightSync(3, (0, 1, 2), 6)]
    assert planner.on_task_finished("t6", 8.0) == []  # a second report is ignored


def test_separate_sync_source_is_the_most_updated_training_node() -> None:
    planner = make_planner("separate", num_nodes=4, train_rate=0.5, sync_every_tasks=3)
    for i in range(3):
        submit_and_plan(planner, make_training(f"t{i}", 0.0, 100))  # nodes 2, 3, 2
    planner.on_task_finished("t0", 1.0)
    planner.on_task_finished("t1", 1.0)
    assert planner.on_task_finished("t2", 1.0) == [WeightSync(2, (0, 1), 2)]


def test_colocated_policies_never_sync() -> None:
    for policy in ("lemix-nodeprio", "mix-rr", "mix-luf"):
        planner = make_planner(policy, num_nodes=4, sync_every_tasks=1)
        submit_and_plan(planner, make_training("t", 0.0, 100))
        assert planner.on_task_finished("t", 1.0) == []


def test_separate_dynamic_grows_serving_share_with_request_rate() -> None:
    planner = make_planner("separate-dynamic", num_nodes=4, request_rate_window_s=10.0)
    # 96 requests in the last 10 s → 9.6 rps; serving = ceil(4·9.6/32) = 2 nodes.
    for i in range(96):
        planner.submit(make_request(f"r{i}", 0.0), 0.0)
    decisions = planner.plan(0.0)
    assert placed_nodes(decisions) == [0, 1] * 48
    assert placed_nodes(submit_and_plan(planner, make_training("t", 0.0, 100))) == [2]


# ------------------------------------------------------------ deprioritization


def _single_node_planner(policy: str = "lemix", **overrides: object):
    """One node, one finished inference seen (prompt 100, 10 outputs)."""
    planner = make_planner(policy, num_nodes=1, max_defer_s=5.0, **overrides)
    assert placed_nodes(submit_and_plan(planner, make_request("i", 0.0, 100, 10))) == [0]
    planner.on_task_finished("i", 1.0)
    return planner


def test_long_training_that_would_make_the_probe_miss_its_slo_is_deferred() -> None:
    planner = _single_node_planner()
    # Long: fwd 1.0 s, bwd 2.0 s per stage at now = 10: fe = (11, 12), backward
    # stage 1 [12, 14], stage 0 [14, 16]. A probe inference (100 tokens) arriving
    # at 10 would start on stage 0 at 11 and on stage 1 after the backward, at 14:
    # R = 14.1 − 10 = 4.1 > 1.0.
    decisions = submit_and_plan(planner, make_training("long", 10.0, 1000))
    assert decisions == [Deferral("long", DEFER_REASON)]
    assert planner.num_deferred == 1
    assert planner.num_deferrals == 1
    assert planner.node_of("long") is None
    assert planner.next_wakeup_s() == approx(15.0)  # since + max_defer_s


def test_short_training_is_placed() -> None:
    planner = _single_node_planner()
    # Short: fwd 0.01, bwd 0.02 per stage; the probe finishes at 10.26: R = 0.26 ≤ 1.0.
    decisions = submit_and_plan(planner, make_training("short", 10.0, 10))
    assert decisions == [Placement("short", 0, approx(0.02), decisions[0].score)]
    assert planner.num_deferred == 0
    assert planner.next_wakeup_s() is None


def test_aging_places_a_deferred_task_after_max_defer_s() -> None:
    planner = _single_node_planner()
    submit_and_plan(planner, make_training("long", 10.0, 1000))
    assert placed_nodes(planner.plan(14.9)) == []
    assert planner.num_deferred == 1
    decisions = planner.plan(15.0)
    # Placed at 15 even though it still hurts: fe_1 = 17, so R = 17 − 10 = 7.0.
    assert decisions == [Placement("long", 0, approx(7.0), decisions[0].score)]
    assert planner.num_deferred == 0
    assert planner.next_wakeup_s() is None


def test_plan_at_next_wakeup_places_the_aged_task() -> None:
    """`next_wakeup_s` is when aging forces the task out: planning then must place it.

    Deferred at 0.8 with max_defer_s = 2.0: next_wakeup_s() = 0.8 + 2.0 = 2.8 and
    plan(2.8) must place it, even though in floating point 2.8 − 0.8 < 2.0.
    """
    planner = make_planner("lemix", num_nodes=1, max_defer_s=2.0)
    submit_and_plan(planner, make_request("i", 0.4, 10, 6))
    assert submit_and_plan(planner, make_training("long", 0.8, 1000)) == [
        Deferral("long", DEFER_REASON)
    ]
    wake = planner.next_wakeup_s()
    assert wake == approx(2.8)
    assert placed_nodes(planner.plan(wake)) == [0]
    assert planner.num_deferred == 0


def test_deferred_training_keeps_fifo_order() -> None:
    planner = _single_node_planner()
    submit_and_plan(planner, make_training("long", 10.0, 1000))
    # A short task behind a deferred one is not placed ahead of it.
    decisions = submit_and_plan(planner, make_training("short", 11.0, 10))
    assert placed_nodes(decisions) == []
    assert planner.num_deferred == 2
    assert planner.next_wakeup_s() == approx(15.0)
    # At 15 the head ages out and is placed; "short" is then evaluated behind it
    # and still hurts (the probe would wait for both backwards: R = 4.13), so it
    # stays deferred until its own deadline, 11 + 5 = 16.
    decisions = planner.plan(15.0)
    assert [d.task_id for d in decisions if isinstance(d, Placement)] == ["long"]
    assert planner.next_wakeup_s() == approx(16.0)
    decisions = planner.plan(16.0)
    assert decisions == [Placement("short", 0, approx(8.01), decisions[0].score)]
    assert planner.num_deferred == 0


def test_nodeprio_places_the_long_task_immediately() -> None:
    planner = _single_node_planner("lemix-nodeprio")
    decisions = submit_and_plan(planner, make_training("long", 10.0, 1000))
    assert decisions == [Placement("long", 0, approx(2.0), decisions[0].score)]
    assert planner.num_deferrals == 0


def test_no_deferral_before_any_inference_was_seen() -> None:
    planner = make_planner("lemix", num_nodes=1)
    assert placed_nodes(submit_and_plan(planner, make_training("long", 0.0, 1000))) == [0]


# ------------------------------------------------------------------ rejection


def test_request_whose_kv_can_never_fit_is_rejected_with_a_reason() -> None:
    planner = make_planner("lemix", num_nodes=2)
    # 2 000 tokens × 8 B = 16 000 B: exactly fits.
    assert placed_nodes(submit_and_plan(planner, make_request("ok", 0.0, 1500, 500))) == [0]
    decisions = submit_and_plan(planner, make_request("big", 0.0, 1500, 501))
    assert len(decisions) == 1 and isinstance(decisions[0], Rejection)
    assert decisions[0].task_id == "big"
    # Actionable: says what does not fit and what to change.
    reason = decisions[0].reason
    assert "2001 tokens of KV cache" in reason
    assert "shorten the prompt or max_tokens" in reason
    assert NEVER_FITS in reason  # the client's fault: no SLO miss (lemix.infra.telemetry)
    assert planner.node_of("big") is None


def test_training_whose_activations_can_never_fit_is_rejected() -> None:
    planner = make_planner("mix-rr", num_nodes=2)
    decisions = submit_and_plan(planner, make_training("big", 0.0, 1001, batch_size=2))
    assert len(decisions) == 1 and isinstance(decisions[0], Rejection)
    assert "2x1001 training tokens of activations" in decisions[0].reason


def test_request_whose_kv_can_never_fit_on_one_stage_is_rejected() -> None:
    """Memory is per stage GPU: a request must fit on every stage.

    KV is 2 B/token on stage 0 and 6 B/token on stage 1, each stage has 8 000 B
    for dynamic owners. 1 500 tokens need 9 000 B on stage 1 and can never be
    admitted by the node (NodeMemory.could_ever_fit is False), so the planner
    must reject the request instead of placing it.
    """
    profile = make_profile(kv_bytes_per_token=(2, 6))
    planner = make_planner("lemix", num_nodes=2, profile=profile)
    decisions = submit_and_plan(planner, make_request("big", 0.0, 1000, 500))
    assert len(decisions) == 1
    assert isinstance(decisions[0], Rejection), decisions


def test_training_whose_activations_can_never_fit_on_one_stage_is_rejected() -> None:
    """As above for activations: 6 B/token on stage 1 × 1 500 tokens = 9 000 B > 8 000 B."""
    profile = make_profile(activation_bytes_per_token=(2, 6))
    planner = make_planner("mix-rr", num_nodes=2, profile=profile)
    decisions = submit_and_plan(planner, make_training("big", 0.0, 1500))
    assert len(decisions) == 1
    assert isinstance(decisions[0], Rejection), decisions


# ------------------------------------------------------------------ determinism


@dataclass(frozen=True)
class Step:
    op: str  # "submit" | "plan" | "finish"
    now_s: float
    task: Task | None = None
    task_id: str = ""
    is_success: bool = True


def _script() -> list[Step]:
    steps: list[Step] = []
    t = 0.0
    for i in range(12):
        t += 0.35
        task = (
            make_training(f"t{i}", t, 200 + 150 * (i % 4))
            if i % 3 == 0
            else make_request(f"r{i}", t, 50 + 37 * i, 5 + i, seq=i)
        )
        steps += [Step("submit", t, task), Step("plan", t)]
        if i >= 2 and i % 2 == 0:
            done = f"r{i - 1}" if (i - 1) % 3 else f"t{i - 1}"
            steps += [
                Step("finish", t + 0.1, task_id=done, is_success=i != 6),
                Step("plan", t + 0.1),
            ]
    steps.append(Step("plan", t + 40.0))  # past every aging deadline
    return steps


def _replay(policy: str, steps: list[Step]) -> list:
    planner = make_planner(policy, num_nodes=3, train_rate=0.3, sync_every_tasks=1, max_defer_s=5.0)
    out: list = []
    for step in steps:
        if step.op == "submit":
            assert step.task is not None
            planner.submit(step.task, step.now_s)
        elif step.op == "plan":
            out.append(("plan", step.now_s, planner.plan(step.now_s), planner.next_wakeup_s()))
            while planner.is_release_pending:  # as the scheduler and the simulator do
                out.append(("plan", step.now_s, planner.plan(step.now_s), planner.next_wakeup_s()))
        else:
            out.append(
                (
                    "finish",
                    step.now_s,
                    planner.on_task_finished(step.task_id, step.now_s, step.is_success),
                )
            )
    return out


@pytest.mark.parametrize("policy", ["lemix", "lemix-paper", "separate", "mix-rr", "mix-luf"])
def test_replaying_recorded_inputs_gives_identical_decisions(policy: str) -> None:
    steps = _script()
    first = _replay(policy, steps)
    second = _replay(policy, list(steps))
    assert first == second
    decisions = [d for entry in first if entry[0] == "plan" for d in entry[2]]
    # Every submitted task got a final answer by the end (nothing lost in the queue).
    final = {d.task_id for d in decisions if isinstance(d, Placement | Rejection)}
    submitted = {s.task.task_id for s in steps if s.task is not None}
    assert final == submitted


def test_deferred_training_is_rechecked_periodically_as_predicted_work_drains() -> None:
    planner = _single_node_planner(defer_recheck_s=1.0)
    submit_and_plan(planner, make_training("long", 10.0, 1000))
    assert planner.num_deferred == 1
    # Recheck one period after the evaluation, before the 5 s aging deadline.
    assert planner.next_wakeup_s() == approx(11.0)
    # Nothing finished and nothing aged: at 10.5 the queue is not re-evaluated.
    assert planner.plan(10.5) == []
    assert planner.num_deferrals == 1
    planner.plan(11.0)  # the recheck evaluates it again (still deferred here)
    assert planner.num_deferrals == 2
    assert planner.next_wakeup_s() == approx(12.0)


def test_a_down_node_gets_no_tasks_and_none_live_means_unavailable() -> None:
    planner = make_planner("mix-rr", num_nodes=2)
    planner.on_node_health(0, False, 0.0)
    assert placed_nodes(submit_and_plan(planner, make_request("a", 0.0))) == [1]
    assert placed_nodes(submit_and_plan(planner, make_request("b", 0.0))) == [1]
    planner.on_node_health(1, False, 0.0)
    decisions = submit_and_plan(planner, make_request("c", 0.0))
    assert isinstance(decisions[0], Rejection)
    assert decisions[0].reason.startswith("UNAVAILABLE")
    planner.on_node_health(0, True, 0.0)
    assert placed_nodes(submit_and_plan(planner, make_request("d", 0.0))) == [0]


@pytest.mark.parametrize("policy", ["mix-rr-capped", "mix-luf-capped"])
def test_capped_baselines_defer_training_that_would_make_the_probe_miss(policy: str) -> None:
    """The same admission control as LeMix (issue 10): the long task of
    test_long_training_that_would_make_the_probe_miss_its_slo_is_deferred."""
    planner = _single_node_planner(policy)
    decisions = submit_and_plan(planner, make_training("long", 10.0, 1000))
    assert decisions == [Deferral("long", DEFER_REASON)]
    assert planner.num_deferrals == 1
    short = submit_and_plan(_single_node_planner(policy), make_training("short", 10.0, 10))
    assert placed_nodes(short) == [0]


def test_mix_rr_capped_keeps_round_robins_order() -> None:
    capped, plain = make_planner("mix-rr-capped", num_nodes=4), make_planner("mix-rr", num_nodes=4)
    for planner in (capped, plain):
        assert planner.policy.name in ("mix-rr-capped", "mix-rr")
    nodes = {"capped": [], "plain": []}
    for i in range(6):
        nodes["capped"] += placed_nodes(submit_and_plan(capped, make_request(f"r{i}", 0.1 * i)))
        nodes["plain"] += placed_nodes(submit_and_plan(plain, make_request(f"r{i}", 0.1 * i)))
    assert nodes["capped"] == nodes["plain"] == [0, 1, 2, 3, 0, 1]


def test_a_plan_call_stops_placing_training_at_its_budget_and_the_next_goes_on() -> None:
    bounded = make_planner("lemix", num_nodes=4, max_training_runs_per_plan=1)
    unbounded = make_planner("lemix", num_nodes=4, max_training_runs_per_plan=10**9)
    for i in range(6):
        task = make_training(f"t{i}", 0.0, 50, seq=i)
        bounded.submit(task, 0.0)
        unbounded.submit(task, 0.0)
    at_once = unbounded.plan(0.0)
    assert len(placed_nodes(at_once)) == 6 and not unbounded.is_release_pending
    calls = [bounded.plan(0.0)]
    while bounded.is_release_pending:
        assert bounded.next_wakeup_s() == 0.0  # due now
        calls.append(bounded.plan(0.0))
    # One placement per call (each took a run or more), the same ones in order.
    assert [len(placed_nodes(decisions)) for decisions in calls] == [1] * 6
    assert [d for decisions in calls for d in decisions] == at_once
    assert bounded.next_wakeup_s() is None
