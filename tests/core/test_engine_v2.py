"""Engine v2 (issue 9): pipelined micro-batches, chunked prefill, training slices.

NodeEngine driven by hand in virtual time with `EngineDriver` from
test_engine.py (zero noise, the profile's own latency model), so times are
hand-computable sums and throughputs come from the engine's virtual clock.
"""

from __future__ import annotations

import math
import random

import pytest
from factories import make_profile, make_request, make_tiny_memory_profile, make_training
from test_engine import EngineDriver

from lemix.batching import BatchingConfig
from lemix.engine import (
    EngineConfig,
    Failed,
    Finished,
    FirstToken,
    NodeEngine,
    Outcome,
    Requeued,
    StageStart,
    TokensEmitted,
    TrainingSlice,
    WorkKind,
)
from lemix.engine_config import default_prefill_token_budget
from lemix.engine_groups import Iteration, num_balanced_joins, slice_s
from lemix.engine_memory import KV_WAIT_REASON
from lemix.memory import MemoryConfig, kv_bytes
from lemix.profile import Profile, default_profile_path, load_profile

approx = pytest.approx


def make_engine(
    profile: Profile,
    *,
    num_micro_batches: int | None = 1,
    prefill_token_budget: int | None = None,
    max_training_slice_s: float | None = None,
    max_batch_size: int = 8,
    max_wait_s: float = 2.0,
    emit_tokens: bool = False,
    is_batch_cap_per_micro_batch: bool = False,
) -> NodeEngine:
    config = EngineConfig(
        BatchingConfig(max_batch_size=max_batch_size),
        MemoryConfig(kappa=0.9, max_wait_s=max_wait_s),
        emit_tokens=emit_tokens,
        num_micro_batches=num_micro_batches,
        prefill_token_budget=prefill_token_budget,
        max_training_slice_s=max_training_slice_s,
        is_batch_cap_per_micro_batch=is_batch_cap_per_micro_batch,
    )
    return NodeEngine(0, profile, profile.ours, config)


class RecordingDriver(EngineDriver):
    """Also records, after every step, each micro-batch's running count and
    how many requests wait."""

    def __init__(self, engine: NodeEngine) -> None:
        super().__init__(engine)
        self.counts: list[tuple[float, tuple[int, ...], int]] = []

    def _absorb(self, starts: list[StageStart], outcomes: list[Outcome]) -> None:
        super()._absorb(starts, outcomes)
        counts = tuple(len(b.running) for b in self.engine.micro_batches)
        self.counts.append((self.now_s, counts, len(self.engine.waiting)))


def iterations(driver: EngineDriver, stage: int = 0) -> list[tuple[float, StageStart]]:
    return [(t, s) for t, s in driver.starts if s.kind is WorkKind.ITERATION and s.stage == stage]


# ------------------------------------------------------------ micro-batches


def _saturated_decode(
    num_micro_batches: int | None,
    *,
    is_batch_cap_per_micro_batch: bool = False,
    **profile_kwargs: float,
) -> EngineDriver:
    """16 requests (10-token prompts, 40 tokens out) at t = 0 on a node with C = 8."""
    profile = make_profile(forward_s_per_token=0.0001, **profile_kwargs)  # type: ignore[arg-type]
    engine = make_engine(
        profile,
        num_micro_batches=num_micro_batches,
        is_batch_cap_per_micro_batch=is_batch_cap_per_micro_batch,
    )
    driver = RecordingDriver(engine)
    for i in range(16):
        driver.add(make_request(f"r{i}", 0.0, 10, 40, seq=i))
    driver.run()
    assert sorted(o.num_output_tokens for _, o in driver.of(Finished)) == [40] * 16
    assert engine.is_idle
    return driver


def _num_overlaps(driver: EngineDriver) -> int:
    """Pairs of iterations of different micro-batches running at the same time
    on stage 0 and stage 1."""
    spans = [
        (t, t + s.duration_s, s.stage, s.work.micro_batch)  # type: ignore[attr-defined]
        for t, s in driver.starts
        if s.kind is WorkKind.ITERATION
    ]
    return sum(
        1
        for a in spans
        for b in spans
        if a[2] == 0 and b[2] == 1 and a[3] != b[3] and a[0] < b[1] - 1e-9 and b[0] < a[1] - 1e-9
    )


def _tokens_per_s(driver: EngineDriver) -> float:
    return 16 * 40 / max(t for t, _ in driver.of(Finished))


def test_micro_batches_run_on_different_stages_at_once_and_double_decode_throughput() -> None:
    # A decode step costs 1 ms per sequence and stage (no fixed part): the
    # regime where splitting the batch costs nothing, so M = S = 2 keeps both
    # stages busy instead of one at a time and nearly doubles tokens/s.
    kwargs = {"decode_d0_s": 0.0, "decode_d1_s": 0.001}
    v1 = _saturated_decode(1, **kwargs)
    v2 = _saturated_decode(None, **kwargs)  # None: one micro-batch per stage
    ratio = _tokens_per_s(v2) / _tokens_per_s(v1)
    assert ratio > 1.5
    assert ratio == approx(1.99, abs=0.01)  # 1.28 s vs 0.644 s of virtual time
    # Two micro-batches' iterations occupy the two stages at the same time;
    # with one micro-batch (v1) a node never runs two iterations at once.
    assert _num_overlaps(v2) > 50
    assert _num_overlaps(v1) == 0
    assert v2.engine.busy_s[0] / max(t for t, _ in v2.of(Finished)) > 0.95


def test_with_a_fixed_cost_decode_step_micro_batches_do_not_raise_throughput() -> None:
    # Where it does not help: a decode step that costs the same for 4 or 8
    # sequences (weights read once per step, as on the A100 profile, whose
    # d0 dominates). The node-wide cap C = 8 is split into two batches of 4,
    # each paying the fixed cost, so tokens/s stay the same (M = S doubles the
    # stage busy time, not the tokens).
    v1 = _saturated_decode(1, decode_d0_s=0.01)
    v2 = _saturated_decode(None, decode_d0_s=0.01)
    assert _tokens_per_s(v2) / _tokens_per_s(v1) == approx(1.0, abs=0.02)


def test_a_cap_per_micro_batch_lets_a_fixed_cost_node_double_its_tokens() -> None:
    # The same fixed-cost decode step, but C = 8 caps each micro-batch (vLLM's
    # virtual engines): the node runs 2 x 8 requests, each batch as large as
    # v1's, and both stages work at once, so tokens/s nearly double while a
    # request's time between tokens stays v1's.
    v1 = _saturated_decode(1, decode_d0_s=0.01)
    v2 = _saturated_decode(None, is_batch_cap_per_micro_batch=True, decode_d0_s=0.01)
    assert _tokens_per_s(v2) / _tokens_per_s(v1) == approx(2.0, abs=0.05)
    assert max(sum(c) for _, c, _ in v2.counts) == 16
    assert max(max(c) for _, c, _ in v2.counts) == 8
    # With one micro-batch the flag changes nothing.
    same = _saturated_decode(1, is_batch_cap_per_micro_batch=True, decode_d0_s=0.01)
    assert [t for t, _ in same.of(Finished)] == [t for t, _ in v1.of(Finished)]


def test_micro_batches_stay_balanced_within_one_request() -> None:
    driver = _saturated_decode(None, decode_d0_s=0.0, decode_d1_s=0.001)
    # The 14 requests that arrive while both groups are in flight are spread
    # over the next boundary of each; from then on, while the node is full or
    # requests wait, the groups differ by at most one request (at the drain,
    # with nothing left to admit, they empty at their own pace).
    first_round = [t for t, counts, _ in driver.counts if counts == (4, 4)][0]
    assert first_round == approx(0.003)
    loaded = [
        c
        for t, c, num_waiting in driver.counts
        if t >= first_round and (num_waiting or sum(c) == 8)
    ]
    assert len(loaded) > 100 and all(max(c) - min(c) <= 1 for c in loaded)


def test_unequal_requests_join_the_lighter_group_by_tokens() -> None:
    # Prompts of 40..200 tokens arriving faster than they are served; memory
    # (not the cap) bounds the batch. At every boundary while requests wait,
    # the two groups' tokens held differ on average by less than the largest
    # prompt (measured: 104 tokens; transients after bursts reach 700). T_max
    # outlasts every wait, so no request is shed for KV and all 60 run.
    profile = make_profile(decode_d0_s=0.002, decode_d1_s=0.0005)
    engine = make_engine(profile, num_micro_batches=2, max_batch_size=64, max_wait_s=60.0)
    driver = RecordingDriver(engine)
    gaps: list[int] = []
    original = engine._start_iteration

    def spy(batch, now_s, outcomes):  # type: ignore[no-untyped-def]
        starts = original(batch, now_s, outcomes)
        if engine.waiting:
            loads = [b.load_tokens for b in engine.micro_batches]
            gaps.append(abs(loads[0] - loads[1]))
        return starts

    engine._start_iteration = spy  # type: ignore[method-assign]
    for i in range(60):
        prompt = (40, 120, 80, 200, 60)[i % 5]
        driver.add(make_request(f"r{i}", 0.02 * i, prompt, 10 + 7 * (i % 4), seq=i))
    driver.run()
    assert len(driver.of(Finished)) == 60 and engine.is_idle
    assert len(gaps) > 100
    assert sum(gaps) / len(gaps) < 150


def test_balance_rule_lightest_group_even_share_and_overdue_head() -> None:
    # Group 0 (load 100) is heavier than group 1 (10): it takes nothing of a
    # 50-token head unless the head fits in the even share or is overdue.
    assert num_balanced_joins(0, [100, 10], [True, True], [50], 50, False) == 0
    assert num_balanced_joins(0, [100, 10], [True, True], [50], 400, False) == 1
    assert num_balanced_joins(0, [100, 10], [True, True], [50], 50, True) == 1
    # The lighter group takes requests while it stays the lightest, then its share.
    assert num_balanced_joins(1, [100, 10], [True, True], [50, 50, 50], 150, False) == 2
    # A group that could not take a request now (full, window shut) does not
    # count as lighter.
    assert num_balanced_joins(0, [100, 10], [True, False], [50], 50, False) == 1


def test_a_burst_while_every_group_is_in_flight_spreads_over_the_next_boundaries() -> None:
    profile = make_profile(decode_d0_s=0.0, decode_d1_s=0.001, forward_s_per_token=0.0001)
    engine = make_engine(profile, num_micro_batches=2, max_batch_size=64)
    driver = RecordingDriver(engine)
    driver.add(make_request("a", 0.0, 10, 100, seq=0))
    driver.add(make_request("b", 0.0, 10, 100, seq=1))
    for i in range(20):
        driver.add(make_request(f"x{i}", 0.0005, 10, 5, seq=10 + i))
    driver.run(until_s=0.01)
    # Both groups busy with a and b when the burst lands; their next two
    # boundaries split it evenly instead of one request per boundary.
    assert [c for t, c, _ in driver.counts if t <= 0.003][-1] == (11, 11)


# ------------------------------------------------------------ chunked prefill


def test_long_prompt_is_prefilled_in_chunks_while_a_decode_keeps_emitting() -> None:
    # forward 0.001 s/token, decode 0.01 s per stage. Budget 51: the running
    # decode takes 1 token, so a 200-token prompt goes in 4 chunks of 50.
    profile = make_profile()
    engine = make_engine(profile, prefill_token_budget=51, emit_tokens=True)
    driver = RecordingDriver(engine)
    driver.add(make_request("d", 0.0, 10, 30))
    driver.add(make_request("long", 0.015, 200, 5))
    held: list[tuple[int, ...]] = []
    original = driver._absorb

    def absorb(starts: list[StageStart], outcomes: list[Outcome]) -> None:
        original(starts, outcomes)
        held.append(engine.memory.held_bytes("long"))

    driver._absorb = absorb  # type: ignore[method-assign]
    driver.run()
    chunked = [
        (t, s)
        for t, s in iterations(driver)
        if any(r.task.task_id == "long" for r in s.work.prefill)  # type: ignore[attr-defined]
    ]
    spans = [s.work.prefill_spans for _, s in chunked]  # type: ignore[attr-defined]
    assert spans == [((0, 50),), ((50, 50),), ((100, 50),), ((150, 50),)]
    assert len(chunked) == math.ceil(200 / (51 - 1))
    # Each iteration: its prefill tokens at 0.001 s plus, with decodes, a 0.01 s step.
    for _, s in iterations(driver):
        work: Iteration = s.work  # type: ignore[assignment]
        prefill_s = 0.001 * sum(n for _, n in work.prefill_spans)
        assert s.duration_s == approx(prefill_s + (0.01 if work.decode else 0.0))
    # d keeps making a token every iteration while long's chunks run.
    emitted = [(t, o) for t, o in driver.outcomes if isinstance(o, TokensEmitted)]
    ends = [t + 2 * s.duration_s for t, s in chunked]
    for end in ends:
        assert any(t == approx(end) and "d" in o.task_ids for t, o in emitted)
    # long's first token only when its last chunk's iteration ends.
    first = driver.of(FirstToken, "long")
    assert first == [(approx(ends[-1]), FirstToken("long", 0))]
    # Its KV was reserved once, whole, at admission and held through every chunk.
    need = kv_bytes(profile.memory, 205)
    assert set(held) == {(0, 0), need}
    first_held = held.index(need)
    last_held = len(held) - 1 - held[::-1].index(need)
    assert all(h == need for h in held[first_held : last_held + 1])
    assert [o for _, o in driver.of(Finished, "long")] == [Finished("long", 5)]
    assert driver.of(Finished, "d") and engine.is_idle


def test_a_lone_prompt_spans_ceil_prompt_over_budget_iterations() -> None:
    profile = make_profile(forward_a_s=0.01)  # forward 0.01 + 0.001·ℓ per stage
    engine = make_engine(profile, prefill_token_budget=64)
    driver = EngineDriver(engine)
    driver.add(make_request("r", 0.0, 200, 1))
    driver.run()
    spans = [s.work.prefill_spans for _, s in iterations(driver)]  # type: ignore[attr-defined]
    assert spans == [((0, 64),), ((64, 64),), ((128, 64),), ((192, 8),)]
    assert len(spans) == math.ceil(200 / 64)
    # Each chunk pays the fixed cost once: 4·0.01 + 0.2 s per stage in all.
    assert driver.of(FirstToken) == [(approx(2 * (4 * 0.01 + 0.2)), FirstToken("r", 0))]
    assert driver.of(Finished) == [(approx(0.48), Finished("r", 1))]


def test_decodes_that_use_the_whole_budget_still_run_and_prefill_waits() -> None:
    # Budget 2: d0 and d1 (1-token prompts) prefill together, then their two
    # decodes use the whole budget, so "late" (arriving at 0.05) waits for d0
    # to finish; meanwhile both keep decoding every iteration.
    profile = make_profile()
    engine = make_engine(profile, prefill_token_budget=2)
    driver = EngineDriver(engine)
    driver.add(make_request("d0", 0.0, 1, 4, seq=0))
    driver.add(make_request("d1", 0.0, 1, 8, seq=1))
    driver.add(make_request("late", 0.05, 10, 1, seq=9))
    driver.run()
    works: list[tuple[float, Iteration]] = [(t, s.work) for t, s in iterations(driver)]  # type: ignore[misc]
    d0_done_s = driver.of(Finished, "d0")[0][0]
    both_s = [t for t, w in works if len(w.decode) == 2][0]
    before = [w for t, w in works if both_s <= t < d0_done_s]
    assert before and all(len(w.decode) == 2 and not w.prefill for w in before)
    late = [
        (t, w.prefill_spans) for t, w in works if any(r.task.task_id == "late" for r in w.prefill)
    ]
    assert late[0][0] == approx(d0_done_s)
    # With one decode left the budget leaves 1 token a step; then 2 when d1 is done.
    assert sum(n for _, spans in late for _, n in spans) == 10
    assert all(len(w.decode) + sum(n for _, n in w.prefill_spans) <= 2 for _, w in works)
    finished = {o.task_id: o.num_output_tokens for _, o in driver.of(Finished)}
    assert finished == {"d0": 4, "d1": 8, "late": 1}
    assert engine.is_idle


# ------------------------------------------------------------ training slices


def test_a_long_training_pass_runs_in_slices_that_add_up_to_the_whole() -> None:
    # 1000 tokens: forward 1.0 s, backward 2.0 s, optimizer step 0.4 s per stage.
    profile = make_profile(optimizer_step_s=0.4)
    unsliced = EngineDriver(make_engine(profile))
    unsliced.add(make_training("t", 0.0, 1000))
    unsliced.run()
    sliced_engine = make_engine(profile, max_training_slice_s=0.3)
    sliced = EngineDriver(sliced_engine)
    sliced.add(make_training("t", 0.0, 1000))
    sliced.run()
    pieces = [(s.stage, s.kind, s.work, s.duration_s) for _, s in sliced.starts]
    fwd0 = [p for p in pieces if p[0] == 0 and p[1] is WorkKind.FORWARD]
    bwd0 = [p for p in pieces if p[0] == 0 and p[1] is WorkKind.BACKWARD]
    opt0 = [p for p in pieces if p[0] == 0 and p[1] is WorkKind.OPTIMIZER]
    assert [(w.index, w.count) for _, _, w, _ in fwd0] == [(i, 4) for i in range(4)]  # ceil(1/0.3)
    assert [(w.index, w.count) for _, _, w, _ in bwd0] == [(i, 7) for i in range(7)]  # ceil(2/0.3)
    assert [(w.index, w.count) for _, _, w, _ in opt0] == [(i, 2) for i in range(2)]  # ceil(.4/.3)
    assert all(isinstance(w, TrainingSlice) and w.task.task_id == "t" for _, _, w, _ in pieces)
    assert [d for *_, d in fwd0] == approx([0.25] * 4)
    assert [d for *_, d in bwd0] == approx([2.0 / 7] * 7)
    assert [d for *_, d in opt0] == approx([0.2] * 2)
    for stage in (0, 1):
        for kind in (WorkKind.FORWARD, WorkKind.BACKWARD, WorkKind.OPTIMIZER):
            whole = [
                s.duration_s for _, s in unsliced.starts if s.stage == stage and s.kind is kind
            ]
            parts = [d for st, k, _, d in pieces if st == stage and k is kind]
            assert sum(parts) == approx(whole[0], rel=1e-12)
    assert sliced_engine.busy_s == approx(unsliced.engine.busy_s, rel=1e-12)
    # Alone on the node, slicing changes nothing but the pieces.
    assert sliced.of(Finished) == [(approx(unsliced.of(Finished)[0][0]), Finished("t", 0))]
    # Without the knob the payload is the Task itself (v1).
    assert all(s.work.task_id == "t" for _, s in unsliced.starts)  # type: ignore[attr-defined]


def test_slices_sum_exactly_and_never_exceed_the_cap() -> None:
    for duration_s in (0.1, 0.089, 1.0, 2.0 / 3.0, 7.123):
        count = math.ceil(duration_s / 0.01)
        parts = [slice_s(duration_s, i, count) for i in range(count)]
        assert math.fsum(parts) == approx(duration_s, rel=1e-14)
        assert max(parts) <= 0.01 + 1e-12


def test_an_iteration_submitted_mid_training_waits_at_most_one_slice() -> None:
    profile = make_profile()  # forward 0.001 s/token: a 1000-token forward is 1.0 s
    # Unsliced, r waits for the whole 1 s forward on stage 0 and again for it on
    # stage 1 (first token at 2.01); sliced (0.25 s slices), r's iteration
    # starts when the first slice ends and reaches stage 1 before t's forward.
    for max_slice_s, expected_start_s, first_token_s in ((None, 1.0, 2.01), (0.3, 0.25, 0.27)):
        engine = make_engine(profile, max_training_slice_s=max_slice_s)
        driver = EngineDriver(engine)
        driver.add(make_training("t", 0.0, 1000))
        driver.add(make_request("r", 0.1, 10, 1))
        driver.run()
        (first_iteration_s, _), *_ = iterations(driver)
        assert first_iteration_s == approx(expected_start_s)
        assert driver.of(FirstToken)[0][0] == approx(first_token_s)
        assert len(driver.of(Finished)) == 2 and engine.is_idle


# ------------------------------------------------------------ cancel


def test_cancel_in_an_in_flight_group_ends_at_its_iteration_and_spares_the_other() -> None:
    profile = make_profile(decode_d0_s=0.0, decode_d1_s=0.001, forward_s_per_token=0.0001)
    engine = make_engine(profile, num_micro_batches=2)
    driver = EngineDriver(engine)
    for i in range(4):
        driver.add(make_request(f"r{i}", 0.0, 10, 20, seq=i))
    driver.run(until_s=0.05)
    groups = [[r.task.task_id for r in b.running] for b in engine.micro_batches]
    assert all(groups) and all(b.is_in_flight for b in engine.micro_batches)
    # Cancel one request of each group; stage 0 runs one group's iteration and
    # the other group's waits for stage 1 (or is queued behind it).
    now_s = driver.now_s
    victims = [groups[0][0], groups[1][0]]
    for victim in victims:
        found, starts, outcomes = engine.cancel(victim, now_s)
        assert found and starts == [] and outcomes == []
    driver.run()
    failed = driver.of(Failed)
    assert sorted(o.task_id for _, o in failed) == sorted(victims)
    assert all(o.reason.startswith("CANCELLED") for _, o in failed)
    # Each ends when its own group's in-flight iteration leaves the last stage.
    for group, victim in enumerate(victims):
        ends = [
            t + s.duration_s
            for t, s in iterations(driver, stage=1)
            if s.work.micro_batch == group and t + s.duration_s > now_s  # type: ignore[attr-defined]
        ]
        assert driver.of(Failed, victim)[0][0] == approx(ends[0])
    finished = {o.task_id: o.num_output_tokens for _, o in driver.of(Finished)}
    assert finished == {t: 20 for g in groups for t in g if t not in victims}
    assert engine.is_idle
    assert engine.memory.used_bytes(0) == engine.memory.used_bytes(1) == 1_000


def test_cancel_a_request_still_waiting_for_a_group_is_immediate() -> None:
    profile = make_profile()
    engine = make_engine(profile, num_micro_batches=2, max_batch_size=2)
    driver = EngineDriver(engine)
    for i in range(3):
        driver.add(make_request(f"r{i}", 0.0, 10, 5, seq=i))
    driver.run(until_s=0.001)
    assert [r.task.task_id for r in engine.waiting] == ["r2"]
    found, _, outcomes = engine.cancel("r2", driver.now_s)
    assert found and outcomes == [Failed("r2", "CANCELLED: cancelled by the client")]
    driver.run()
    assert sorted(o.task_id for _, o in driver.of(Finished)) == ["r0", "r1"]
    assert engine.is_idle


def test_cancel_a_request_mid_chunked_prefill() -> None:
    engine = make_engine(make_profile(), prefill_token_budget=32)
    driver = EngineDriver(engine)
    driver.add(make_request("r", 0.0, 200, 5))
    driver.run(until_s=0.1)  # chunk 2 of 7 in flight
    assert engine.cancel("r", driver.now_s)[0]
    driver.run()
    assert driver.of(Failed) == [(approx(0.128), Failed("r", "CANCELLED: cancelled by the client"))]
    assert driver.of(FirstToken) == [] and engine.is_idle
    assert engine.memory.used_bytes(0) == 1_000


# ------------------------------------------------------------ v1 and all together


def test_v2_paths_with_room_to_spare_reproduce_v1_exactly() -> None:
    # One micro-batch, a budget no prompt reaches and slices no pass reaches:
    # the v2 code paths must give v1's starts and outcomes, in order.
    def run(**knobs: object) -> EngineDriver:
        engine = make_engine(make_tiny_memory_profile(), max_wait_s=0.3, max_batch_size=4, **knobs)  # type: ignore[arg-type]
        driver = EngineDriver(engine)
        for i in range(8):
            driver.add(make_request(f"r{i}", 0.1 * i, 100 + 20 * (i % 3), 10 + 5 * (i % 4), seq=i))
            if i % 3 == 0:
                driver.add(make_training(f"t{i}", 0.1 * i + 0.05, 150 + 50 * (i % 2), seq=100 + i))
        driver.run()
        return driver

    v1 = run()
    v2 = run(prefill_token_budget=10_000, max_training_slice_s=100.0)
    assert v2.outcomes == v1.outcomes
    assert [(t, s.stage, s.duration_s, s.kind) for t, s in v2.starts] == [
        (t, s.stage, s.duration_s, s.kind) for t, s in v1.starts
    ]
    assert v2.engine.num_offloads == v1.engine.num_offloads


@pytest.mark.parametrize("num_micro_batches", [2, 3, None])
def test_everything_at_once_under_memory_pressure_ends_everything_and_stays_in_memory(
    num_micro_batches: int | None,
) -> None:
    """Every knob, tiny memory, T_max = 0.3 s: every task ends once; a request
    either completes with all its tokens or, held back by memory after
    arrival + T_max, fails with RESOURCE_EXHAUSTED; the node ends holding its
    weights."""
    engine = make_engine(
        make_tiny_memory_profile(),
        num_micro_batches=num_micro_batches,
        prefill_token_budget=48,
        max_training_slice_s=0.05,
        max_wait_s=0.3,
        max_batch_size=4,
    )
    driver = EngineDriver(engine)  # asserts used <= threshold and one item per stage
    arrivals = {}
    for i in range(12):
        request = make_request(f"r{i}", 0.07 * i, 60 + 45 * (i % 4), 5 + 7 * (i % 5), seq=i)
        arrivals[request.task_id] = request.arrival_s
        driver.add(request)
        if i % 3 == 1:
            driver.add(make_training(f"t{i}", 0.07 * i + 0.03, 120 + 60 * (i % 2), seq=100 + i))
    driver.run()
    ends = driver.of(Finished) + driver.of(Failed) + driver.of(Requeued)
    assert sorted(o.task_id for _, o in ends) == sorted([*arrivals, "t1", "t4", "t7", "t10"])
    for _, o in driver.of(Finished):
        if o.task_id.startswith("r"):
            assert o.num_output_tokens == 5 + 7 * (int(o.task_id[1:]) % 5)
    shed = {o.task_id: t for t, o in driver.of(Failed)}
    assert all(o.reason == KV_WAIT_REASON for _, o in driver.of(Failed))  # type: ignore[attr-defined]
    # At T_max, or at the first event after it when memory holds the request
    # back (at T_max it fitted but waited for a boundary; training took the room).
    assert all(0.3 - 1e-9 <= t - arrivals[task_id] < 0.4 for task_id, t in shed.items())
    assert 0 < len(shed) < 12  # memory binds, and the bound sheds only some
    assert {o.task_id for _, o in driver.of(FirstToken)} == set(arrivals) - set(shed)
    assert engine.is_idle
    assert engine.memory.host_used_bytes == 0


# ------------------------------------------------------------ default budget


def test_default_prefill_token_budget_follows_the_documented_rule() -> None:
    # A100 Llama-2-7B: a 512-token chunk is 23 ms, a batch-32 decode step at
    # 512 context 8.5 ms (×3 = 25.6 ms); 1024 tokens would be 45 ms.
    assert default_prefill_token_budget(load_profile(default_profile_path())) == 512
    # Test profile: forward 0.001 s/token vs 3 × 0.01 s → 30 tokens: the floor, 32.
    assert default_prefill_token_budget(make_profile()) == 32
    # A decode step of 0.1 s: 3 × 0.1 / 0.001 = 300 tokens → 256.
    assert default_prefill_token_budget(make_profile(decode_d0_s=0.1)) == 256


def test_iteration_payload_names_its_micro_batch_and_whole_prompt_spans() -> None:
    engine = make_engine(make_profile(), num_micro_batches=None)
    driver = EngineDriver(engine)
    driver.add(make_request("a", 0.0, 30, 2))
    driver.add(make_request("b", 0.0, 40, 2))
    driver.run()
    first = [s.work for _, s in iterations(driver)][:2]
    assert all(isinstance(w, Iteration) for w in first)
    assert [(w.micro_batch, w.prefill_spans) for w in first] == [(0, ((0, 30),)), (1, ((0, 40),))]  # type: ignore[union-attr]


def _assert_each_stage_steps_one_tasks_gradients_at_a_time(
    driver: EngineDriver, num_stages: int
) -> None:
    """On every stage a training task's backward is followed by its optimizer
    step with no other task's backward or step in between (their gradients
    would mix), and each finished task stepped every stage once."""
    finished = {o.task_id for _, o in driver.outcomes if isinstance(o, Finished)}
    for stage in range(num_stages):
        holder = None  # the task whose gradients the stage holds, not yet applied
        steps: dict[str, int] = {}
        for _, start in driver.starts:
            if start.stage != stage or start.kind not in (WorkKind.BACKWARD, WorkKind.OPTIMIZER):
                continue
            work = start.work
            task_id = work.task.task_id if isinstance(work, TrainingSlice) else work.task_id
            assert holder in (None, task_id), f"stage {stage}: {task_id} mixes with {holder}"
            holder = task_id
            if start.kind is WorkKind.OPTIMIZER:
                last = not isinstance(work, TrainingSlice) or work.index == work.count - 1
                if last:
                    holder = None
                    steps[task_id] = steps.get(task_id, 0) + 1
        assert holder is None
        assert all(steps.get(t, 0) == 1 for t in finished if t.startswith("t"))


@pytest.mark.parametrize("seed", range(40))
def test_random_mixes_of_every_knob_end_every_task_exactly_once(seed: int) -> None:
    """Random workloads, knobs and cancels: every task ends once (Finished,
    Failed or Requeued), finished requests have all their tokens, and the node
    ends idle holding only its weights (the driver checks memory and one item
    per stage after every step)."""
    rng = random.Random(seed)
    profile = rng.choice([make_tiny_memory_profile(), make_tiny_memory_profile(3), make_profile()])
    config = EngineConfig(
        BatchingConfig(
            max_batch_size=rng.choice([1, 2, 4, 8]), join_window_s=rng.choice([None, 0.1])
        ),
        MemoryConfig(
            kappa=0.9, max_wait_s=rng.choice([0.2, 3.0]), is_offload_enabled=rng.random() < 0.6
        ),
        stage_order=rng.choice(["inference-first", "fifo"]),
        emit_tokens=True,
        num_micro_batches=rng.choice([1, 2, 3, None]),
        prefill_token_budget=rng.choice([None, 1, 7, 48]),
        max_training_slice_s=rng.choice([None, 0.01, 0.05]),
        is_decode_gathered=rng.random() < 0.5,
        decode_pace_s=rng.choice([None, 0.005, 0.03]),
        training_order=rng.choice(["backward-first", "forward-first"]),
        spare_training_in_flight=rng.choice([0, 1, 2]),
    )
    engine = NodeEngine(0, profile, profile.ours, config)
    driver = EngineDriver(engine)
    tasks = {}
    cancels = []
    for i in range(rng.randint(1, 16)):
        at_s = rng.random() * 2
        if rng.random() < 0.25:
            task = make_training(f"t{i}", at_s, rng.randint(20, 400), rng.randint(1, 2), seq=i)
        else:
            task = make_request(f"r{i}", at_s, rng.randint(1, 300), rng.randint(1, 40), seq=i)
        tasks[task.task_id] = task
        driver.add(task)
        if rng.random() < 0.15:
            cancels.append((at_s + rng.random() * 0.5, task.task_id))
    for at_s, task_id in sorted(cancels):
        driver.run(until_s=at_s)
        driver.now_s = max(driver.now_s, at_s)
        _, starts, outcomes = engine.cancel(task_id, driver.now_s)
        driver._absorb(starts, outcomes)
    driver.run()
    ends = [o for _, o in driver.outcomes if isinstance(o, Finished | Failed | Requeued)]
    assert sorted(o.task_id for o in ends) == sorted(tasks)
    for o in ends:
        if isinstance(o, Finished) and o.task_id.startswith("r"):
            assert o.num_output_tokens == tasks[o.task_id].max_output_tokens
    first = [o.task_id for _, o in driver.outcomes if isinstance(o, FirstToken)]
    assert len(first) == len(set(first))
    _assert_each_stage_steps_one_tasks_gradients_at_a_time(driver, engine.num_stages)
    assert engine.is_idle and engine.memory.host_used_bytes == 0
    assert all(
        engine.memory.used_bytes(s) == profile.memory.weight_bytes[s]
        for s in range(engine.num_stages)
    )


# ------------------------------------------------------------ memory with micro-batches


def test_training_offloads_kv_of_the_group_at_its_boundary_while_the_other_runs() -> None:
    # Tiny memory: 800 B per stage for KV and activations; four requests of
    # 150 + 50 tokens fill it, two per micro-batch. Training of 200 tokens
    # waits T_max = 0.5 s, then at the next boundary of either group that
    # group's newest request goes to the host, though the other group is in
    # flight (with one micro-batch it waits for a moment when nothing runs).
    engine = make_engine(make_tiny_memory_profile(), num_micro_batches=2, max_wait_s=0.5)
    driver = EngineDriver(engine)
    for i in range(4):
        driver.add(make_request(f"r{i}", 0.0, 150, 50, seq=i + 1))
    driver.add(make_training("t", 1.0, 200, seq=10))
    driver.run()
    forward = [t for t, s in driver.starts if s.kind is WorkKind.FORWARD]
    assert engine.num_offloads == 1
    assert 1.5 <= forward[0] < 1.6
    finished = {o.task_id: o.num_output_tokens for _, o in driver.of(Finished)}
    assert finished == {"r0": 50, "r1": 50, "r2": 50, "r3": 50, "t": 0}
    assert engine.is_idle and engine.memory.host_used_bytes == 0


def test_training_that_cannot_fit_even_after_offload_is_requeued_while_groups_run() -> None:
    # 900 tokens of activations > 800 B: no offload can make room. With two
    # micro-batches always in flight it is handed back at T_max, not held.
    engine = make_engine(make_tiny_memory_profile(), num_micro_batches=2, max_wait_s=0.5)
    driver = EngineDriver(engine)
    driver.add(make_request("r0", 0.0, 100, 100, seq=1))
    driver.add(make_request("r1", 0.0, 100, 100, seq=2))
    driver.add(make_training("t", 0.1, 900, seq=10))
    driver.run()
    assert driver.of(Requeued) == [
        (approx(0.6), Requeued("t", "no activation memory even after KV offload"))
    ]
    assert driver.of(Finished, "r0")[0][0] > 0.6


# ------------------------------------------------------------ pipelined chunks


def _chunk_iterations(
    driver: EngineDriver, task_id: str, stage: int
) -> list[tuple[float, StageStart]]:
    return [
        (t, s)
        for t, s in iterations(driver, stage)
        if any(r.task.task_id == task_id for r in s.work.prefill)  # type: ignore[attr-defined]
    ]


def _lone_prompt_on_two_groups(num_output_tokens: int) -> tuple[NodeEngine, EngineDriver]:
    """Request "r" (200 prompt tokens) alone on two groups at a 64-token
    budget, forward 0.01 + 0.001·ℓ s per stage: chunks of 64, 64, 64, 8."""
    engine = make_engine(
        make_profile(forward_a_s=0.01), num_micro_batches=2, prefill_token_budget=64
    )
    driver = EngineDriver(engine)
    driver.add(make_request("r", 0.0, 200, num_output_tokens))
    return engine, driver


def test_a_long_prompts_chunks_flow_through_the_pipeline_in_both_groups() -> None:
    # forward 0.01 + 0.001·ℓ per stage, budget 64: chunks of 64, 64, 64, 8
    # (0.074, 0.074, 0.074, 0.018 s a stage). Alone in one group they run one
    # after another through both stages: first token at 2 × 0.24 = 0.48 s.
    # Riding both groups, chunk k+1 runs on stage 0 while chunk k is on
    # stage 1: stage 0 is busy 0-0.148 (chunks 0, 1), 0.148-0.222 (chunk 2,
    # formed when chunk 0 came back), 0.222-0.240 (chunk 3, when chunk 1
    # did); stage 1 runs them in order and ends chunk 3 at 0.296 + 0.018.
    engine, driver = _lone_prompt_on_two_groups(num_output_tokens=1)
    driver.run()
    on_0 = _chunk_iterations(driver, "r", 0)
    on_1 = _chunk_iterations(driver, "r", 1)
    spans = [s.work.prefill_spans for _, s in on_0]  # type: ignore[attr-defined]
    assert spans == [((0, 64),), ((64, 64),), ((128, 64),), ((192, 8),)]
    groups = [s.work.micro_batch for _, s in on_0]  # type: ignore[attr-defined]
    assert groups == [0, 1, 0, 1]
    # Each stage runs the chunks in the order they were formed...
    assert [s.work.prefill_spans for _, s in on_1] == spans  # type: ignore[attr-defined]
    # ...and chunk k+1 starts on stage 0 before chunk k has left stage 1.
    for (start_next, _), (start_1, s_1) in zip(on_0[1:], on_1, strict=False):
        assert start_next < start_1 + s_1.duration_s
    assert [t for t, _ in on_0] == approx([0.0, 0.074, 0.148, 0.222])
    assert driver.of(FirstToken) == [(approx(0.314), FirstToken("r", 0))]
    # One token asked for, one made: it ends with that chunk, no decode step.
    assert driver.of(Finished) == [(approx(0.314), Finished("r", 1))]
    assert len(iterations(driver)) == 4 and engine.is_idle
    assert engine.memory.used_bytes(0) == 1_000


def test_cancel_while_a_chunk_rides_the_other_group_ends_it_once_that_chunk_is_back() -> None:
    engine, driver = _lone_prompt_on_two_groups(num_output_tokens=5)
    driver.run(until_s=0.1)  # chunk 0 (group 0) on stage 1, chunk 1 (group 1) on stage 0
    assert engine.cancel("r", driver.now_s)[0]
    driver.run()
    # Group 0's iteration comes back at 0.148 with chunk 1 still out: r waits,
    # takes no more chunks, and ends when group 1's iteration is back.
    assert driver.of(Failed) == [(approx(0.222), Failed("r", "CANCELLED: cancelled by the client"))]
    assert driver.of(FirstToken) == [] and driver.of(Finished) == []
    assert len(iterations(driver)) == 2 and engine.is_idle
    assert engine.memory.used_bytes(0) == 1_000


def test_a_prompt_with_a_chunk_out_in_the_other_group_is_not_offloaded() -> None:
    # At 0.30 group 0 is back and idle (r's last chunk rides group 1 until
    # 0.314): r's KV is in use by that chunk, so offloading must not take it,
    # even for a need that only offloading r would make room for.
    engine, driver = _lone_prompt_on_two_groups(num_output_tokens=5)
    driver.run(until_s=0.30)
    home = engine.micro_batches[0]
    (req,) = home.running
    assert not home.is_in_flight and req.has_chunk_in_flight
    memory = engine.memory
    held = memory.held_bytes("r")
    need = tuple(
        memory.threshold_bytes - memory.used_bytes(s) + held[s] for s in range(engine.num_stages)
    )
    assert not memory.can_admit(need)
    assert not engine.batcher.memory_waits.offload_for(need, [home])
    assert memory.held_bytes("r") == held and not engine.swapped
    driver.run()
    assert driver.of(FirstToken) and [o for _, o in driver.of(Finished)] == [Finished("r", 5)]


def test_cancel_with_its_group_idle_but_a_chunk_out_waits_for_that_chunk() -> None:
    # At 0.30 r's group is idle and its last chunk rides group 1 until 0.314:
    # the cancel cannot free KV that chunk uses, so r ends when it is back.
    engine, driver = _lone_prompt_on_two_groups(num_output_tokens=5)
    driver.run(until_s=0.30)
    assert engine.cancel("r", driver.now_s)[0]
    assert engine.memory.held_bytes("r") != (0, 0)
    driver.run()
    assert driver.of(Failed) == [(approx(0.314), Failed("r", "CANCELLED: cancelled by the client"))]
    assert driver.of(Finished) == [] and engine.is_idle
    assert engine.memory.used_bytes(0) == 1_000


@pytest.mark.parametrize("seed", range(6))
def test_borrowed_chunks_never_make_an_iteration_longer_than_one_in_flight(seed: int) -> None:
    """An iteration that carries another group's chunk is planned no longer
    than the longest iteration in flight when it forms (the bubble it fills),
    so borrowing never lengthens the pipeline's turn."""
    rng = random.Random(seed)
    profile = make_profile(forward_a_s=0.01)
    engine = make_engine(
        profile, num_micro_batches=rng.choice([2, 3]), prefill_token_budget=rng.choice([48, 128])
    )
    batcher = engine.batcher
    checked: list[tuple[float, float]] = []
    form = batcher.form_iteration

    def checked_form(batch, now_s, outcomes):  # type: ignore[no-untyped-def]
        limit_s = max(
            (b.planned_s for b in batcher.micro_batches if b is not batch and b.is_in_flight),
            default=0.0,
        )
        formed = form(batch, now_s, outcomes)
        if formed is not None:
            iteration = formed[0]
            if any(r.micro_batch != batch.index for r in iteration.prefill):
                checked.append((batch.planned_s, limit_s))
        return formed

    batcher.form_iteration = checked_form  # type: ignore[method-assign]
    driver = EngineDriver(engine)
    for i in range(12):
        driver.add(make_request(f"r{i}", rng.random(), rng.randint(1, 400), rng.randint(1, 20)))
    driver.run()
    assert checked, "no chunk was borrowed: the test shows nothing"
    assert all(planned_s <= limit_s + 1e-12 for planned_s, limit_s in checked)
    assert engine.is_idle


# ------------------------------------------------------------ gathered decodes


def _gathering_run(
    *, is_decode_gathered: bool, with_training: bool, decode_pace_s: float | None = None
) -> tuple[NodeEngine, EngineDriver, list[object]]:
    """Two groups (C = 8 each), a 48-token budget, 10 ms slices; eight requests arriving
    over 0.2 s and, with training, four long training tasks from t = 0 so the
    node trains throughout. Checks after every step that each running request
    is in exactly one group, the one it names."""
    profile = make_profile()  # a decode step costs 10 ms whatever the batch
    config = EngineConfig(
        BatchingConfig(max_batch_size=8),
        MemoryConfig(kappa=0.9, max_wait_s=2.0),
        num_micro_batches=2,
        prefill_token_budget=48,
        max_training_slice_s=0.01,
        is_batch_cap_per_micro_batch=True,  # room for all eight in the decode group
        is_decode_gathered=is_decode_gathered,
        decode_pace_s=decode_pace_s,
    )
    engine = NodeEngine(0, profile, profile.ours, config)
    formed: list[object] = []
    form = engine.batcher.form_iteration

    def recording_form(batch, now_s, outcomes):  # type: ignore[no-untyped-def]
        result = form(batch, now_s, outcomes)
        if result is not None:
            formed.append((engine.batcher.is_gathering, result[0]))
        for group in engine.micro_batches:
            for req in group.running:
                assert req.micro_batch == group.index
        ids = [r.task.task_id for g in engine.micro_batches for r in g.running]
        assert len(ids) == len(set(ids)), "a request in two groups"
        return result

    engine.batcher.form_iteration = recording_form  # type: ignore[method-assign]
    driver = EngineDriver(engine)
    if with_training:
        for i in range(4):
            driver.add(make_training(f"t{i}", 0.0, 600, seq=100 + i))
    for i in range(8):
        driver.add(make_request(f"r{i}", 0.025 * i, 60 + 10 * i, 12, seq=i))
    driver.run()
    return engine, driver, formed


def test_gathered_decodes_run_in_one_group_while_the_node_trains() -> None:
    """While training is on the node every decode step is in group 0 and every
    request joins group 1; every request still gets all its tokens."""
    engine, driver, formed = _gathering_run(is_decode_gathered=True, with_training=True)
    gathering = [it for is_on, it in formed if is_on]
    assert len(gathering) > 20, "the node stopped training too early to show anything"
    decoding = [it for it in gathering if it.decode]  # type: ignore[attr-defined]
    assert decoding and all(it.micro_batch == 0 for it in decoding)  # type: ignore[attr-defined]
    joined_in = {
        r.task.task_id: it.micro_batch  # type: ignore[attr-defined]
        for it in reversed(gathering)
        for r, (start, _) in zip(it.prefill, it.prefill_spans, strict=True)  # type: ignore[attr-defined]
        if start == 0
    }
    assert joined_in and set(joined_in.values()) == {1}
    finished = {o.task_id: o for _, o in driver.of(Finished)}
    assert all(finished[f"r{i}"].num_output_tokens == 12 for i in range(8))  # type: ignore[attr-defined]
    assert engine.is_idle


def test_gathered_decodes_take_fewer_decode_steps_and_leave_training_more_time() -> None:
    """With a decode step of fixed cost, one decode group instead of two runs
    fewer decode iterations for the same tokens, and the training that
    shares the stages finishes sooner."""
    runs = {on: _gathering_run(is_decode_gathered=on, with_training=True) for on in (False, True)}

    def num_decode_iterations(formed: list[object]) -> int:
        return sum(1 for _, it in formed if it.decode)  # type: ignore[attr-defined]

    def training_done_s(driver: EngineDriver) -> float:
        return max(t for t, o in driver.of(Finished) if o.task_id.startswith("t"))

    assert num_decode_iterations(runs[True][2]) < 0.8 * num_decode_iterations(runs[False][2])
    assert training_done_s(runs[True][1]) < training_done_s(runs[False][1])


def test_without_training_gathered_decodes_change_nothing() -> None:
    """Serving alone: the flag leaves every stage start exactly as without it."""
    _, off, _ = _gathering_run(is_decode_gathered=False, with_training=False)
    _, on, _ = _gathering_run(is_decode_gathered=True, with_training=False)
    assert [(t, s.stage, s.duration_s) for t, s in on.starts] == [
        (t, s.stage, s.duration_s) for t, s in off.starts
    ]


# ------------------------------------------------------------ paced decodes

PACE_S = 0.05  # a decode step costs 10 ms per stage, a slice 10 ms: rounds come ~30 ms apart


def _decode_group_starts(driver: EngineDriver) -> list[float]:
    """When each iteration of the decode group (group 0) started on stage 0."""
    return [
        t
        for t, s in iterations(driver)
        if isinstance(s.work, Iteration) and s.work.micro_batch == 0 and s.work.decode
    ]


def test_paced_decodes_start_a_pace_apart_while_the_node_trains() -> None:
    """Gathered decode rounds start at least the pace apart (never sooner),
    and the held group starts on the timer, at its previous start plus the
    pace, when the stage is free; every request still gets all its tokens."""
    engine, driver, formed = _gathering_run(
        is_decode_gathered=True, with_training=True, decode_pace_s=PACE_S
    )
    starts = _decode_group_starts(driver)
    assert len(starts) > 10, "too few decode rounds to show anything"
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert min(gaps) >= PACE_S - 1e-12
    assert sum(1 for g in gaps if g == approx(PACE_S)) >= len(gaps) // 2, gaps
    finished = {o.task_id: o for _, o in driver.of(Finished)}
    assert all(finished[f"r{i}"].num_output_tokens == 12 for i in range(8))  # type: ignore[attr-defined]
    assert engine.is_idle and engine.batcher.paced_until_s is None


def test_paced_decodes_run_fewer_rounds_and_the_training_ends_sooner() -> None:
    """The same work: unpaced, rounds come sooner than the pace (else the test
    shows nothing); paced, fewer rounds carry the same tokens, so the training
    on the node ends sooner."""
    unpaced = _gathering_run(is_decode_gathered=True, with_training=True)[1]
    paced = _gathering_run(is_decode_gathered=True, with_training=True, decode_pace_s=PACE_S)[1]

    def training_done_s(driver: EngineDriver) -> float:
        return max(t for t, o in driver.of(Finished) if o.task_id.startswith("t"))

    starts = _decode_group_starts(unpaced)
    assert min(b - a for a, b in zip(starts, starts[1:], strict=False)) < PACE_S
    assert len(_decode_group_starts(paced)) < len(starts)
    assert training_done_s(paced) < training_done_s(unpaced)


def test_without_training_a_pace_changes_nothing() -> None:
    """Serving alone nothing is gathered, so nothing is paced: every stage
    start is as without a pace."""
    _, off, _ = _gathering_run(is_decode_gathered=True, with_training=False)
    _, on, _ = _gathering_run(is_decode_gathered=True, with_training=False, decode_pace_s=PACE_S)
    assert [(t, s.stage, s.duration_s) for t, s in on.starts] == [
        (t, s.stage, s.duration_s) for t, s in off.starts
    ]


# ------------------------------------------------------------ spare training


class InFlightDriver(EngineDriver):
    """Also records, after every step, how many training tasks are in flight
    and whether a request was waiting."""

    def __init__(self, engine: NodeEngine) -> None:
        super().__init__(engine)
        self.in_flight: list[tuple[float, int, bool]] = []

    def _absorb(self, starts: list[StageStart], outcomes: list[Outcome]) -> None:
        super()._absorb(starts, outcomes)
        engine = self.engine
        is_waiting = bool(engine.waiting or engine.swapped)
        self.in_flight.append((self.now_s, len(engine._training), is_waiting))


def _spare_engine(spare: int, max_batch_size: int = 8, max_wait_s: float = 5.0) -> NodeEngine:
    """Tiny memory (800 B of KV and activations per stage, 1 B per token),
    S = 2 stages: at most two training tasks, plus `spare` while memory is."""
    profile = make_tiny_memory_profile()
    config = EngineConfig(
        BatchingConfig(max_batch_size=max_batch_size),
        MemoryConfig(kappa=0.9, max_wait_s=max_wait_s),
        spare_training_in_flight=spare,
    )
    return NodeEngine(0, profile, profile.ours, config)


@pytest.mark.parametrize(
    ("num_tokens", "spare", "expected"),
    [
        (100, 0, 2),  # the cap: one per stage
        (100, 1, 3),  # 300 B held, 500 free >= 30% of 800: one spare
        (100, 2, 4),
        (250, 1, 3),  # 500 held, 300 free >= 240, and 250 fit
        (300, 1, 2),  # 600 held, 200 free < 240: no spare
    ],
)
def test_spare_training_is_admitted_only_while_memory_is_spare(
    num_tokens: int, spare: int, expected: int
) -> None:
    engine = _spare_engine(spare)
    driver = InFlightDriver(engine)
    for i in range(5):
        driver.add(make_training(f"t{i}", 0.0, num_tokens, seq=i))
    driver.run()
    assert max(n for _, n, _ in driver.in_flight) == expected
    assert len(driver.of(Finished)) == 5 and engine.is_idle


def test_no_spare_training_while_a_request_waits() -> None:
    """One request runs (C = 1) and another waits: training stays at the cap
    until nothing waits, then a spare task joins."""
    engine = _spare_engine(1, max_batch_size=1)
    driver = InFlightDriver(engine)
    driver.add(make_request("r0", 0.0, 50, 4))
    driver.add(make_request("r1", 0.0, 50, 4, seq=1))
    for i in range(6):
        driver.add(make_training(f"t{i}", 0.0, 100, seq=10 + i))
    driver.run()
    assert any(w for _, _, w in driver.in_flight), "no request ever waited: the test shows nothing"
    assert all(n <= 2 for _, n, w in driver.in_flight if w)
    assert max(n for _, n, _ in driver.in_flight) == 3
    finished = {o.task_id for _, o in driver.of(Finished)}
    assert finished == {"r0", "r1", *(f"t{i}" for i in range(6))}


def test_a_spare_task_that_does_not_fit_waits_for_a_slot_not_for_memory() -> None:
    """Two small tasks leave 600 B free (spare by the fraction) but the next
    needs 700: it is not admitted as a spare (where a wait for memory would
    end at T_max, long before a slot frees, in a requeue) but when a slot
    frees, and it finishes."""
    engine = _spare_engine(1, max_wait_s=0.001)
    driver = InFlightDriver(engine)
    for i, num_tokens in enumerate((100, 100, 700)):
        driver.add(make_training(f"t{i}", 0.0, num_tokens, seq=i))
    driver.run()
    assert max(n for _, n, _ in driver.in_flight) == 2
    assert not driver.of(Requeued)
    assert {o.task_id for _, o in driver.of(Finished)} == {"t0", "t1", "t2"}
