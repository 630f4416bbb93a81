"""Planner snapshots: a restored planner is indistinguishable from the original.

A seeded random workload (submits, plans, finishes, health flips, timer
wake-ups) drives a planner; at several points its snapshot goes through JSON
into a fresh planner, and from then on both get the same inputs and must
make identical decisions (floats included) and end with identical state.

State is compared by introspection (`_state`: every attribute of the planner,
its node views and its policy), not through `snapshot()`, so a field that
`snapshot()` leaves out shows up as a difference. `test_the_workload_moves_
every_field` makes sure each field is away from its initial value at some
checkpoint (a left-out field there could not hide behind its default), and
`test_dropping_any_field_is_detected` drops each one in turn.
"""

from __future__ import annotations

import copy
import json
import math
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import pytest
from factories import make_planner, make_request, make_training

from lemix.planner.planner import Planner
from lemix.planner.snapshot import SnapshotMismatch
from lemix.types import Decision, Placement, Task

POLICIES = [
    "lemix",
    "lemix-paper",
    "lemix-nodeprio",
    "separate",
    "separate-dynamic",
    "mix-rr",
    "mix-luf",
]
CHECKPOINTS = (40, 130, 260)
NUM_STEPS = 400
NUM_NODES = 3
# Built from the planner, never snapshot state.
_CONSTRUCTION = {
    "config",
    "estimator",
    "predictor",
    "admission",  # holds `_traffic` (compared on its own) and a cache for one time
    "_memory",
    "_threshold_bytes",
    "_kv_bytes_per_token",
    "_act_bytes_per_token",
    "_dynamic_bytes",
}


def _planner(policy: str) -> Planner:
    # Tight SLOs and short aging so deferral, aged release and the request
    # window all come into play; K = 3 so SEPARATE syncs, M = 2 so replicas
    # average; one Algorithm 1 run per plan call for training, so a call that
    # places training stops there when more is queued (`is_release_pending`).
    return make_planner(
        policy,
        num_nodes=NUM_NODES,
        slo_ttft_s=0.15,
        slo_tbt_s=0.04,
        max_defer_s=1.5,
        defer_recheck_s=0.4,
        request_rate_window_s=3.0,
        sync_every_tasks=3,
        replica_sync_every_tasks=2,
        train_rate=0.34,
        aged_release_rps_per_node=0.5,
        dynamic_full_rate_rps=4.0,
        max_training_runs_per_plan=1,
    )


def _plain(value: Any) -> Any:
    """A comparable picture of `value`: dataclasses by field (caches left out)."""
    if is_dataclass(value) and not isinstance(value, type):
        return (
            type(value).__name__,
            {f.name: _plain(getattr(value, f.name)) for f in fields(value) if f.name != "cached"},
        )
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | deque):
        return (type(value).__name__, [_plain(v) for v in value])
    if isinstance(value, set):
        return ("set", sorted(value))
    return value


def _state(planner: Planner) -> dict[str, Any]:
    """Every attribute of the planner that is state, with its views and policy."""
    state = {k: _plain(v) for k, v in vars(planner).items() if k not in _CONSTRUCTION}
    state["policy"] = _plain(planner.policy)
    return state


def _restored(snapshot: dict[str, Any], policy: str) -> Planner:
    wire = json.loads(json.dumps(snapshot, allow_nan=False))  # strict JSON, as stored
    fresh = _planner(policy)
    fresh.restore(wire)
    return fresh


@dataclass
class Workload:
    """Seeded random inputs; finishes pick among the reference planner's placements."""

    seed: int
    now_s: float = 0.0
    seq: int = 0
    placed: list[str] = field(default_factory=list)
    down: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def _task(self) -> Task:
        rng = self.rng
        self.seq += 1
        task_id = f"k{self.seq}"
        if rng.random() < 0.03:  # can never fit: rejected with a reason
            return make_training(task_id, self.now_s, 5_000, seq=self.seq)
        if rng.random() < 0.4:
            return make_training(
                task_id,
                self.now_s,
                rng.randrange(20, 400),
                batch_size=rng.choice((1, 2)),
                seq=self.seq,
            )
        return make_request(
            task_id, self.now_s, rng.randrange(10, 300), rng.randrange(1, 40), seq=self.seq
        )

    def steps(self, planner: Planner) -> Iterator[tuple[str, tuple[Any, ...]]]:
        """(method, args) forever; `note` must see each step's decisions."""
        rng = self.rng
        while True:
            self.now_s += rng.expovariate(8.0)
            roll = rng.random()
            if roll < 0.45:
                yield "submit", (self._task(), self.now_s)
            elif roll < 0.70:
                yield "plan", (self.now_s,)
            elif roll < 0.90 and self.placed:
                task_id = self.placed.pop(rng.randrange(len(self.placed)))
                yield "on_task_finished", (task_id, self.now_s, rng.random() < 0.9)
            elif roll < 0.95:
                node_id = rng.randrange(NUM_NODES)
                # A down node comes back; an up one goes down half the time.
                is_healthy = node_id in self.down or rng.random() < 0.5
                (self.down.discard if is_healthy else self.down.add)(node_id)
                yield "on_node_health", (node_id, is_healthy, self.now_s)
            else:
                wake_s = planner.next_wakeup_s()
                if wake_s is not None and wake_s > self.now_s:
                    self.now_s = wake_s  # a timer firing at the planner's deadline
                yield "plan", (self.now_s,)

    def note(self, decisions: list[Decision] | None) -> None:
        self.placed += [d.task_id for d in decisions or [] if isinstance(d, Placement)]


def _call(planner: Planner, method: str, args: tuple[Any, ...]) -> Any:
    result = getattr(planner, method)(*args)
    return result, planner.next_wakeup_s()


def _run(policy: str, seed: int) -> Iterator[tuple[int, Planner, Workload]]:
    """Yield (step, planner, workload) at each checkpoint while driving the workload."""
    planner = _planner(policy)
    workload = Workload(seed)
    for step, (method, args) in enumerate(workload.steps(planner)):
        if step in CHECKPOINTS:
            yield step, planner, workload
        if step == NUM_STEPS:
            return
        result, _ = _call(planner, method, args)
        workload.note(result)


def _continue_both(
    original: Planner, restored: Planner, workload: Workload, num_steps: int
) -> None:
    """Feed both the same further inputs; every result must be identical."""
    for i, (method, args) in enumerate(workload.steps(original)):
        if i == num_steps:
            return
        expected = _call(original, method, args)
        got = _call(restored, method, args)
        assert got == expected, f"{method}{args[:1]} diverged after restore"
        workload.note(expected[0])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", [1, 2])
def test_a_restored_planner_decides_exactly_like_the_original(policy: str, seed: int) -> None:
    num_decisions = 0
    for step, planner, workload in _run(policy, seed):
        restored = _restored(planner.snapshot(), policy)
        assert _state(restored) == _state(planner), f"state lost at step {step}"
        twin_workload = Workload(
            seed=1000 + step,
            now_s=workload.now_s,
            seq=10_000 * step,
            placed=list(workload.placed),
            down=set(workload.down),
        )
        # An exact copy (not via the snapshot) goes on ahead; the checkpointed
        # planner itself continues the run to the next checkpoint.
        original = copy.deepcopy(planner)
        _continue_both(original, restored, twin_workload, num_steps=150)
        assert _state(restored) == _state(original)
        assert restored.snapshot() == original.snapshot()
        num_decisions += original.views[0].num_placed + original.num_deferrals
    assert num_decisions > 0


def _fresh_snapshot(policy: str) -> dict[str, Any]:
    return _planner(policy).snapshot()


def _leaves(snapshot: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(name, value) of every top-level field and every node-view field."""
    for key, value in snapshot.items():
        if key == "views":
            for i, view in enumerate(value):
                for view_key, view_value in view.items():
                    yield f"views.{i}.{view_key}", view_value
        else:
            yield key, value


_CONSTANT = {"version", "fingerprint", "policy", "config"}


def _is_constant(name: str) -> bool:
    return name in _CONSTANT or name.endswith((".node_id", ".num_stages"))


def _moved_fields() -> dict[str, set[str]]:
    """Per policy, the fields that left their initial value at some checkpoint."""
    moved: dict[str, set[str]] = {}
    for policy in POLICIES:
        fresh = dict(_leaves(_fresh_snapshot(policy)))
        for seed in (1, 2):
            for _, planner, _ in _run(policy, seed):
                moved.setdefault(policy, set()).update(
                    name for name, value in _leaves(planner.snapshot()) if value != fresh[name]
                )
    return moved


def test_the_workload_moves_every_field() -> None:
    moved = _moved_fields()
    everything = {
        name.replace(".0.", ".*.").replace(".1.", ".*.").replace(".2.", ".*.")
        for names in moved.values()
        for name in names
    }
    wanted = {
        name.replace(".0.", ".*.")
        for name, _ in _leaves(_fresh_snapshot("lemix"))
        if not _is_constant(name) and ".1." not in name and ".2." not in name
    }
    assert wanted - everything == set(), "the workload never moves these fields"


@pytest.mark.parametrize("policy", ["lemix", "separate", "mix-rr"])
def test_dropping_any_field_is_detected(policy: str) -> None:
    """As if `snapshot()` had left a field out: the restored planner keeps its
    initial value there, and the comparison above must notice."""
    fresh = _fresh_snapshot(policy)
    _, planner, _ = next(s for s in _run(policy, seed=1) if s[0] == CHECKPOINTS[-1])
    snapshot = planner.snapshot()
    num_checked = 0
    for key in snapshot:
        if key in _CONSTANT or snapshot[key] == fresh[key]:
            continue
        for view_key in snapshot["views"][0] if key == "views" else [None]:
            dropped = json.loads(json.dumps(snapshot))
            if view_key is None:
                dropped[key] = fresh[key]
            else:
                if _is_constant(f"views.0.{view_key}"):
                    continue
                for i, view in enumerate(dropped["views"]):
                    view[view_key] = fresh["views"][i][view_key]
                if dropped == snapshot:
                    continue
            assert _state(_restored(dropped, policy)) != _state(planner), (key, view_key)
            num_checked += 1
    assert num_checked >= 15


def test_a_snapshot_is_strict_json_with_empty_nodes_as_null() -> None:
    snapshot = _planner("lemix").snapshot()
    text = json.dumps(snapshot, allow_nan=False)
    assert json.loads(text)["views"][0]["forward_end_s"] == [None, None]
    restored = _restored(snapshot, "lemix")
    assert all(x == -math.inf for x in restored.views[0].forward_end_s)


def test_a_snapshot_only_restores_into_the_same_setup() -> None:
    snapshot = _planner("lemix").snapshot()
    with pytest.raises(SnapshotMismatch, match="policy"):
        _planner("mix-rr").restore(snapshot)
    other = make_planner("lemix", num_nodes=NUM_NODES + 1)
    with pytest.raises(SnapshotMismatch, match="num_nodes"):
        other.restore(snapshot)
    with pytest.raises(SnapshotMismatch, match="format"):
        _planner("lemix").restore({**snapshot, "version": 99})
