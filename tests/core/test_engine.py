"""NodeEngine driven by hand in virtual time (no simulator).

`EngineDriver` keeps a heap of (time, kind, seq) events: a StageStart becomes a
"stage done" event at now + duration, a task becomes an "add" event, and
`next_timer_s` becomes a timer event — the same tie order as the simulator
(stage done, then timer, then arrivals). After every step it checks that no
stage's memory exceeds the threshold. Latency is the profile's own model
(zero noise), so every time below is a hand-computed sum.
"""

from __future__ import annotations

import heapq
import math

import pytest
from factories import make_profile, make_request, make_tiny_memory_profile, make_training

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
    WorkKind,
)
from lemix.engine_memory import KV_WAIT_REASON
from lemix.memory import MemoryConfig
from lemix.profile import Profile
from lemix.types import Task

approx = pytest.approx
_DONE, _TIMER, _ADD = 0, 1, 3


class EngineDriver:
    def __init__(self, engine: NodeEngine) -> None:
        self.engine = engine
        self.now_s = 0.0
        self.outcomes: list[tuple[float, Outcome]] = []
        self.starts: list[tuple[float, StageStart]] = []
        self.num_steps = 0
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._timer_at: float | None = None
        self._busy_until = [-math.inf] * engine.num_stages

    def _push(self, at_s: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at_s, kind, self._seq, payload))

    def add(self, task: Task, at_s: float | None = None) -> None:
        self._push(task.arrival_s if at_s is None else at_s, _ADD, task)

    def run(self, until_s: float = math.inf, max_steps: int = 100_000) -> None:
        while self._heap and self._heap[0][0] <= until_s:
            at_s, kind, _, payload = heapq.heappop(self._heap)
            self.now_s = at_s
            if kind == _DONE:
                starts, outcomes = self.engine.on_stage_done(payload, at_s)  # type: ignore[arg-type]
            elif kind == _ADD:
                starts, outcomes = self.engine.add_task(payload, at_s)  # type: ignore[arg-type]
            else:
                if payload != self._timer_at:
                    continue
                self._timer_at = None
                starts, outcomes = self.engine.on_timer(at_s)
            self._absorb(starts, outcomes)
            self.num_steps += 1
            assert self.num_steps < max_steps, "engine did not settle"

    def _absorb(self, starts: list[StageStart], outcomes: list[Outcome]) -> None:
        for start in starts:
            # A stage never runs two items at once.
            assert self._busy_until[start.stage] <= self.now_s + 1e-12
            self._busy_until[start.stage] = self.now_s + start.duration_s
            self.starts.append((self.now_s, start))
            self._push(self.now_s + start.duration_s, _DONE, start.stage)
        self.outcomes += [(self.now_s, o) for o in outcomes]
        memory = self.engine.memory
        for stage in range(self.engine.num_stages):
            assert memory.used_bytes(stage) <= memory.threshold_bytes
        timer = self.engine.next_timer_s()
        if timer is not None and timer > self.now_s and timer != self._timer_at:
            self._timer_at = timer
            self._push(timer, _TIMER, timer)

    def of(self, kind: type, task_id: str | None = None) -> list[tuple[float, Outcome]]:
        return [
            (t, o)
            for t, o in self.outcomes
            if isinstance(o, kind) and (task_id is None or o.task_id == task_id)
        ]  # type: ignore[attr-defined]


def make_engine(
    profile: Profile,
    *,
    max_wait_s: float = 2.0,
    is_offload_enabled: bool = True,
    stage_order: str = "inference-first",
    max_batch_size: int = 8,
    join_window_s: float | None = None,
) -> NodeEngine:
    config = EngineConfig(
        BatchingConfig(max_batch_size=max_batch_size, join_window_s=join_window_s),
        MemoryConfig(kappa=0.9, max_wait_s=max_wait_s, is_offload_enabled=is_offload_enabled),
        stage_order,
    )
    return NodeEngine(0, profile, profile.ours, config)


# ------------------------------------------------------------------ inference


def test_single_request_prefill_then_decode_with_hand_computed_timings() -> None:
    # forward = a_s + 0.001·ℓ with a = (0.01, 0.02); decode = 0.01 + 0.002·C + 0.0001·Σctx
    profile = make_profile(
        forward_a_s=(0.01, 0.02), decode_d0_s=0.01, decode_d1_s=0.002, decode_d2_s=0.0001
    )
    engine = make_engine(profile)
    driver = EngineDriver(engine)
    driver.add(make_request("r", 0.0, num_prompt_tokens=100, max_output_tokens=4))
    driver.run()
    # Prefill: 0.11 on stage 0 + 0.12 on stage 1 → first token at 0.23.
    assert driver.of(FirstToken) == [(approx(0.23), FirstToken("r", 0))]
    # Decode k = 1..3 runs with context 100 + k: per stage 0.012 + 0.0001·(100 + k).
    decode_s = [2 * (0.012 + 0.0001 * (100 + k)) for k in (1, 2, 3)]
    assert decode_s == approx([0.0442, 0.0444, 0.0446])
    finished = driver.of(Finished)
    assert finished == [(approx(0.23 + sum(decode_s)), Finished("r", 4))]
    assert finished[0][0] == approx(0.3632)
    assert engine.num_iterations == 4  # one prefill + three decode iterations
    # Stage order: every iteration visits stage 0 then stage 1.
    assert [s.stage for _, s in driver.starts] == [0, 1] * 4
    assert [t for t, _ in driver.starts] == approx(
        [0.0, 0.11, 0.23, 0.2521, 0.2742, 0.2964, 0.3186, 0.3409]
    )
    assert engine.is_idle
    assert engine.memory.used_bytes(0) == 1_000  # only the weights are left
    assert engine.busy_s == approx([0.11 + 0.0666, 0.12 + 0.0666])


def test_requests_join_the_running_batch_at_iteration_boundaries() -> None:
    profile = make_profile()  # forward 0.001·ℓ, decode 0.01 per stage
    engine = make_engine(profile)
    driver = EngineDriver(engine)
    driver.add(make_request("a", 0.0, 100, 3))
    driver.add(make_request("b", 0.05, 100, 1))
    driver.run()
    # a prefills [0, 0.2]; b arrives mid-iteration and joins the next one, which
    # prefills b (0.1 per stage) and decodes a (0.01 per stage): [0.2, 0.42].
    assert driver.of(FirstToken) == [
        (approx(0.2), FirstToken("a", 0)),
        (approx(0.42), FirstToken("b", 0)),
    ]
    # b wanted one token: done at its prefill. a's third token: [0.42, 0.44].
    assert driver.of(Finished) == [
        (approx(0.42), Finished("b", 1)),
        (approx(0.44), Finished("a", 3)),
    ]


# ------------------------------------------------------------------ training


def test_training_runs_forward_then_backward_and_updates_weights() -> None:
    profile = make_profile(optimizer_step_s=(0.05, 0.03))
    engine = make_engine(profile)
    driver = EngineDriver(engine)
    driver.add(make_training("t", 0.0, num_tokens=100, batch_size=2))
    driver.run()
    # fwd 0.001·2·100 = 0.2 per stage; bwd 0.002·2·100 = 0.4; then each stage's
    # optimizer step, which stage 0's backward does not wait for.
    assert [(t, s.stage, s.kind, s.duration_s) for t, s in driver.starts] == [
        (0.0, 0, WorkKind.FORWARD, approx(0.2)),
        (approx(0.2), 1, WorkKind.FORWARD, approx(0.2)),
        (approx(0.4), 1, WorkKind.BACKWARD, approx(0.4)),
        (approx(0.8), 1, WorkKind.OPTIMIZER, approx(0.03)),
        (approx(0.8), 0, WorkKind.BACKWARD, approx(0.4)),
        (approx(1.2), 0, WorkKind.OPTIMIZER, approx(0.05)),
    ]
    assert driver.of(Finished) == [(approx(1.25), Finished("t", 0))]
    assert engine.num_training_updates == 1
    assert engine.visible_updates == 1  # co-located: serving sees the update at once
    assert engine.memory.used_bytes(0) == engine.memory.used_bytes(1) == 1_000
    assert engine.is_idle


def test_first_token_reports_updates_visible_at_the_time() -> None:
    engine = make_engine(make_profile())
    driver = EngineDriver(engine)
    driver.add(make_training("t", 0.0, 10))  # done at 0.06
    driver.add(make_request("r", 1.0, 10, 1))
    driver.run()
    assert driver.of(FirstToken) == [(approx(1.02), FirstToken("r", 1))]


def test_inference_iteration_goes_before_ready_training_on_a_stage() -> None:
    engine = make_engine(make_profile())
    driver = EngineDriver(engine)
    driver.add(make_training("t1", 0.0, 100))  # fwd 0.1, bwd 0.2 per stage
    driver.add(make_training("t2", 0.0, 100))
    driver.add(make_request("r", 0.0, 50, 1))  # prefill 0.05 per stage
    driver.run()
    starts = [(round(t, 9), s.stage, round(s.duration_s, 9)) for t, s in driver.starts]
    # At 0.1 stage 0 frees: both t2's forward and r's iteration are ready; the
    # iteration (0.05) goes first. At 0.2 stage 1 frees with t1's backward and r's
    # iteration ready: the iteration goes first again.
    assert starts[:5] == [
        (0.0, 0, 0.1),
        (0.1, 1, 0.1),
        (0.1, 0, 0.05),
        (0.15, 0, 0.1),
        (0.2, 1, 0.05),
    ]
    assert driver.of(FirstToken) == [(approx(0.25), FirstToken("r", 0))]
    assert len(driver.of(Finished)) == 3


def test_fifo_stage_order_runs_in_arrival_order() -> None:
    engine = make_engine(make_profile(), stage_order="fifo")
    driver = EngineDriver(engine)
    driver.add(make_training("t1", 0.0, 100))
    driver.add(make_training("t2", 0.0, 100))
    driver.add(make_request("r", 0.0, 50, 1))
    driver.run()
    starts = [(round(t, 9), s.stage, round(s.duration_s, 9)) for t, s in driver.starts]
    assert starts[:3] == [(0.0, 0, 0.1), (0.1, 1, 0.1), (0.1, 0, 0.1)]  # t2 before r
    assert driver.of(FirstToken)[0][0] > 0.25


# ------------------------------------------------------------------ memory


def _three_running_requests(driver: EngineDriver) -> None:
    # Tiny memory: threshold 900 B, 100 B weights → 800 B per stage for dynamic
    # owners; each request holds 150 + 50 = 200 tokens × 1 B of KV per stage.
    for i in range(3):
        driver.add(make_request(f"r{i}", 0.0, 150, 50, seq=i + 1))


def test_training_waits_then_kv_is_offloaded_and_everything_completes() -> None:
    engine = make_engine(make_tiny_memory_profile(), max_wait_s=0.51)
    driver = EngineDriver(engine)
    _three_running_requests(driver)
    # 400 tokens of activations: 600 B of KV + 400 B > 800 B, so it must wait.
    driver.add(make_training("t", 1.0, 400, seq=10))
    driver.run(until_s=1.0)
    assert engine.memory.used_bytes(0) == 100 + 600
    assert engine.next_timer_s() == approx(1.51)
    driver.run()
    # Training started only after T_max, at an iteration boundary, once the
    # newest request's KV went to the host.
    # Decode iterations (0.02 s) end at 0.92 + 0.02·k; the first boundary after
    # the 1.51 deadline is 1.52, where the 0.4 s forward starts on stage 0.
    fwd_starts = [(t, s.stage) for t, s in driver.starts if s.duration_s == approx(0.4)]
    assert fwd_starts == [(approx(1.52), 0), (approx(1.92), 1)]
    assert engine.num_offloads == 1
    # Every request still completes with its full token count; training too.
    finished = {o.task_id: o.num_output_tokens for _, o in driver.of(Finished)}
    assert finished == {"r0": 50, "r1": 50, "r2": 50, "t": 0}
    assert driver.of(Failed) == [] and driver.of(Requeued) == []
    assert engine.num_training_updates == 1
    assert engine.is_idle
    assert engine.memory.host_used_bytes == 0
    assert engine.memory.used_bytes(0) == engine.memory.used_bytes(1) == 100


@pytest.mark.parametrize("is_offload_enabled", [True, False], ids=["offload", "no-offload"])
def test_a_request_without_kv_fails_at_t_max_in_either_runtime(is_offload_enabled: bool) -> None:
    """The request-side bound: "big" waits T_max for KV, then fails with
    RESOURCE_EXHAUSTED. The running requests free their KV only at ~1.9 s, so
    a wait without a bound would end in a completion instead; and the
    memory-aware runtime does not evict a running request for it."""
    engine = make_engine(
        make_tiny_memory_profile(), max_wait_s=0.51, is_offload_enabled=is_offload_enabled
    )
    driver = EngineDriver(engine)
    _three_running_requests(driver)
    driver.add(make_request("big", 1.0, 250, 50, seq=4))  # 300 B: 600 + 300 > 800
    driver.run(until_s=1.0)
    assert engine.next_timer_s() == approx(1.51)
    driver.run()
    assert driver.of(Failed) == [(approx(1.51), Failed("big", KV_WAIT_REASON))]
    finished = {o.task_id: o.num_output_tokens for _, o in driver.of(Finished)}
    assert finished == {"r0": 50, "r1": 50, "r2": 50}
    assert engine.num_offloads == 0
    assert engine.is_idle


def test_a_request_queued_behind_swapped_out_requests_fails_at_t_max() -> None:
    """Swapped-out requests come back before new ones join, so a request whose
    KV would fit still waits for memory behind them, and that wait is bounded
    too. Three requests of 100 + 100 tokens hold 600 B; training of 350 tokens
    gets room at 1.52 by offloading r2 (750 B used); "small" (50 B) arrives
    at 1.6 and would fit, but r2 comes back only when r0 or r1 ends (~4.6)."""
    engine = make_engine(make_tiny_memory_profile(), max_wait_s=0.51)
    driver = EngineDriver(engine)
    for i in range(3):
        driver.add(make_request(f"r{i}", 0.0, 100, 100, seq=i + 1))
    driver.add(make_training("t", 1.0, 350, seq=10))
    driver.add(make_request("small", 1.6, 30, 20, seq=11))
    driver.run(until_s=1.6)
    assert [r.task.task_id for r in engine.swapped] == ["r2"]
    assert engine.memory.free_bytes(0) >= 50
    driver.run()
    assert driver.of(Failed) == [(approx(2.11), Failed("small", KV_WAIT_REASON))]
    finished = {o.task_id: o.num_output_tokens for _, o in driver.of(Finished)}
    assert finished == {"r0": 100, "r1": 100, "r2": 100, "t": 0}
    assert engine.is_idle and engine.memory.host_used_bytes == 0


def test_without_offload_training_without_memory_is_requeued_not_lost() -> None:
    engine = make_engine(make_tiny_memory_profile(), max_wait_s=0.51, is_offload_enabled=False)
    driver = EngineDriver(engine)
    _three_running_requests(driver)
    driver.add(make_training("t", 1.0, 400, seq=10))
    driver.run()
    assert driver.of(Requeued) == [
        (approx(1.51), Requeued("t", "no activation memory within T_max"))
    ]
    assert engine.num_training_updates == 0
    assert engine.is_idle  # handed back to the planner, not held
    assert len(driver.of(Finished)) == 3


@pytest.mark.parametrize("is_offload_enabled", [True, False], ids=["offload", "no-offload"])
def test_request_that_fits_after_others_finish_waits_instead_of_failing(
    is_offload_enabled: bool,
) -> None:
    # T_max is long enough for the running requests to finish and free KV.
    engine = make_engine(
        make_tiny_memory_profile(), max_wait_s=10.0, is_offload_enabled=is_offload_enabled
    )
    driver = EngineDriver(engine)
    _three_running_requests(driver)
    driver.add(make_request("big", 1.0, 250, 50, seq=4))
    driver.run()
    finished = {o.task_id: o.num_output_tokens for _, o in driver.of(Finished)}
    assert finished == {"r0": 50, "r1": 50, "r2": 50, "big": 50}
    assert driver.of(Failed) == []


@pytest.mark.parametrize(
    ("max_wait_s", "shed"),
    [(10.0, set()), (0.3, {"r3", "r4", "r5", "r6", "r7"})],
    ids=["t-max-outlasts-the-waits", "t-max-short"],
)
def test_memory_never_exceeds_the_threshold_under_mixed_pressure(
    max_wait_s: float, shed: set[str]
) -> None:
    """Requests and training compete for 800 B per stage. With a long T_max
    every request waits for KV and completes; with a short one the requests
    still short of KV at arrival + T_max fail with RESOURCE_EXHAUSTED then,
    and the rest complete with all their tokens."""
    engine = make_engine(make_tiny_memory_profile(), max_wait_s=max_wait_s, max_batch_size=4)
    driver = EngineDriver(engine)
    arrivals = {}
    for i in range(8):
        request = make_request(f"r{i}", 0.1 * i, 100 + 20 * (i % 3), 10 + 5 * (i % 4), seq=i)
        arrivals[request.task_id] = request.arrival_s
        driver.add(request)
        if i % 3 == 0:
            driver.add(make_training(f"t{i}", 0.1 * i + 0.05, 150 + 50 * (i % 2), seq=100 + i))
    driver.run()  # EngineDriver asserts used ≤ threshold after every step
    ends = driver.of(Finished) + driver.of(Failed) + driver.of(Requeued)
    assert len(ends) == 8 + 3
    assert driver.of(Requeued) == []
    assert {o.task_id: t for t, o in driver.of(Failed)} == {
        task_id: approx(arrivals[task_id] + max_wait_s) for task_id in shed
    }
    assert all(o.reason == KV_WAIT_REASON for _, o in driver.of(Failed))  # type: ignore[attr-defined]
    finished = {o.task_id for _, o in driver.of(Finished)}
    assert finished == {f"r{i}" for i in range(8)} - shed | {"t0", "t3", "t6"}
    for _, o in driver.of(Finished):
        if o.task_id.startswith("r"):
            i = int(o.task_id[1:])
            assert o.num_output_tokens == 10 + 5 * (i % 4)
    assert engine.is_idle


@pytest.mark.parametrize("since_s", [1.0, 0.8])
def test_on_timer_at_next_timer_s_drops_and_requeues_after_exactly_t_max(since_s: float) -> None:
    """`next_timer_s` says when a wait reaches T_max; `on_timer` then must act.

    Tiny memory, offload off, T_max = 2 s. Training "t" (600 tokens) holds 600 B
    of activations from 0 until its backward ends at 3.6 (fwd 0.6 s, bwd 1.2 s
    per stage). At `since_s` a request needing 250 B of KV and a training task
    needing 300 B arrive; neither fits (600 + 250 > 800). At since + 2.0 the
    request must fail with RESOURCE_EXHAUSTED and the training be re-queued.
    The deadline is the same number `next_timer_s` returns, whatever rounding
    `since + T_max` has (0.8 + 2.0 = 2.8, but 2.8 − 0.8 < 2.0 in floating point).
    """
    engine = make_engine(make_tiny_memory_profile(), max_wait_s=2.0, is_offload_enabled=False)
    driver = EngineDriver(engine)
    driver.add(make_training("t", 0.0, 600))
    driver.add(make_request("r", since_s, 200, 50))
    driver.add(make_training("t2", since_s, 300))
    driver.run(until_s=since_s)
    deadline = engine.next_timer_s()
    assert deadline == since_s + 2.0
    driver.run()
    assert driver.of(Failed) == [(deadline, Failed("r", KV_WAIT_REASON))]
    assert driver.of(Requeued) == [(deadline, Requeued("t2", "no activation memory within T_max"))]
    assert driver.of(Finished) == [(approx(3.6), Finished("t", 0))]


def test_on_timer_with_offload_requeues_training_when_nothing_can_be_offloaded() -> None:
    # As above with offload on: no KV is held, so nothing can make room at T_max.
    engine = make_engine(make_tiny_memory_profile(), max_wait_s=2.0)
    driver = EngineDriver(engine)
    driver.add(make_training("t", 0.0, 600))
    driver.add(make_training("t2", 0.8, 300))
    driver.run()
    assert driver.of(Requeued) == [
        (0.8 + 2.0, Requeued("t2", "no activation memory even after KV offload"))
    ]
