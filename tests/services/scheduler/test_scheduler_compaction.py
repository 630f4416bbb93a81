"""Event-log compaction: snapshots in the log, the log trimmed, restarts bounded.

The pure parts (`SnapshottingSink`, `recover`) with a recorded planner; the
service against a real Redis and real gRPC with fake executors
(test_scheduler_service's `FakeExecutor`). Outcomes are checked per task id.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import redis.asyncio as aioredis
from factories import make_planner, make_request, make_training
from test_scheduler_service import (
    PROFILE,
    Stack,
    fresh_planner,
    read_events,
    wait_until,
)

from lemix.infra.store.codec import Entry, encode_fields
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.server import EmbeddedRedis
from lemix.infra.store.store import Store
from lemix.infra.store.task_fields import task_to_fields
from lemix.planner.recording import (
    Event,
    RecordingPlanner,
    decision_key,
    recorded_decision_keys,
    replay,
)
from lemix.types import Task, TaskKind, TaskPayload
from services.scheduler.adapters import RedisEventSink
from services.scheduler.codec import event_to_fields, events_from_entries, events_from_fields
from services.scheduler.config import SchedulerConfig
from services.scheduler.recovery import (
    SNAPSHOT_MARKER,
    START_MARKER,
    LogTally,
    SnapshottingSink,
    check_config,
    events_to_recover,
    recover,
    start_event,
)
from services.scheduler.service import SchedulerService

EVERY = 25  # snapshot_every_events in the service tests: many snapshots per test


@pytest.fixture
async def stack(redis_server: EmbeddedRedis, redis_client: aioredis.Redis) -> AsyncIterator[Stack]:
    namespace = f"compact-{uuid.uuid4().hex[:8]}"
    s = Stack(redis_server.url, Store(redis_client, RedisKeys(namespace)), namespace)
    try:
        yield s
    finally:
        await s.close()


# ------------------------------------------------------------------ pure parts


def _record(
    every: int, num_tasks: int = 30
) -> tuple[list[Event], RecordingPlanner, SnapshottingSink]:
    """A planner driven through a SnapshottingSink; every event, as stored."""
    events: list[Event] = []
    planner = make_planner("lemix", num_nodes=2, max_defer_s=0.5)
    sink = SnapshottingSink(
        lambda e: events.append(json.loads(json.dumps(e))),
        planner,
        LogTally(),
        snapshot_every_events=every,
        wall_clock=lambda: 0.0,
    )
    sink(start_event(planner.config, "lemix", 0.0))
    live = RecordingPlanner(planner, sink)
    for i in range(num_tasks):
        now_s = 0.1 * i
        task = (
            make_training(f"t{i}", now_s, 150, seq=i)
            if i % 3 == 0
            else make_request(f"r{i}", now_s, 40 + 7 * i, 6, seq=i)
        )
        live.submit(task, now_s)
        live.plan(now_s)
        if i % 4 == 3:  # finish the oldest placement still held
            held = sorted(planner._task_node)
            if held:
                live.on_task_finished(held[0], now_s + 0.05)
        if i == 10:
            live.on_node_health(1, False, now_s)
        if i == 20:
            live.on_node_health(1, True, now_s)
    return events, live, sink


def _entries(events: list[Event]) -> list[Entry]:
    """The events as stream entries, as Redis returns them."""
    return [(f"{i}-0", encode_fields(event_to_fields(e))) for i, e in enumerate(events)]


def test_a_snapshot_is_recorded_every_n_events_before_the_next_one() -> None:
    events, _, sink = _record(every=10)
    positions = [i for i, e in enumerate(events) if SNAPSHOT_MARKER in e]
    assert sink.num_snapshots == len(positions) >= 5
    # Exactly 10 ordinary events before each snapshot (since the previous one).
    starts = [-1, *positions]
    assert all(b - a - 1 == 10 for a, b in zip(starts, positions, strict=False))


@pytest.mark.parametrize("every", [1, 7, 40])
def test_recovery_from_the_last_snapshot_equals_the_full_replay(every: int) -> None:
    events, live, sink = _record(every)
    full = make_planner("lemix", num_nodes=2, max_defer_s=0.5)
    from_full = recover([e for e in events if SNAPSHOT_MARKER not in e], full)
    last = max(i for i, e in enumerate(events) if SNAPSHOT_MARKER in e)
    compacted = make_planner("lemix", num_nodes=2, max_defer_s=0.5)
    from_snapshot = recover(events[last:], compacted)
    assert from_snapshot.is_from_snapshot and not from_full.is_from_snapshot
    assert compacted.snapshot() == full.snapshot() == live.planner.snapshot()
    assert from_snapshot.tally == from_full.tally == sink.tally
    assert [t.task_id for t in from_snapshot.tasks] == [t.task_id for t in from_full.tasks]
    assert from_snapshot.num_events <= every
    # The same next decisions, floats included.
    for planner in (compacted, full):
        planner.submit(make_request("next", 9.0, 77, 5, seq=99), 9.0)
    assert compacted.plan(9.0) == full.plan(9.0)


def test_recovery_reads_from_the_last_of_several_snapshots() -> None:
    # A trim that failed (or a crash before it) leaves older snapshots behind.
    events, live, _ = _record(every=9)
    entries = _entries(events)
    wanted = max(i for i, e in enumerate(events) if SNAPSHOT_MARKER in e)
    assert sum(SNAPSHOT_MARKER in e for e in events[:wanted]) >= 2
    assert events_to_recover(entries) == events[wanted:]
    planner = make_planner("lemix", num_nodes=2, max_defer_s=0.5)
    recover(events_to_recover(entries), planner)
    assert planner.snapshot() == live.planner.snapshot()


def test_the_config_check_survives_the_start_marker_being_trimmed() -> None:
    events, live, _ = _record(every=5)
    tail = events_to_recover(_entries(events))
    assert not any(START_MARKER in e for e in tail)
    check_config(tail, live.planner.config, "lemix")
    with pytest.raises(ValueError, match="policy"):
        check_config(tail, live.planner.config, "mix-rr")
    with pytest.raises(ValueError, match="max_defer_s"):
        check_config(tail, replace(live.planner.config, max_defer_s=9.0), "lemix")


def test_snapshot_every_events_is_validated() -> None:
    with pytest.raises(ValueError, match="snapshot_every_events"):
        SnapshottingSink(
            lambda e: None,
            make_planner(),
            LogTally(),
            snapshot_every_events=-1,
            wall_clock=lambda: 0.0,
        )
    with pytest.raises(ValueError, match="snapshot_every_events"):
        SchedulerConfig(snapshot_every_events=-5)


# ------------------------------------------------------------------ the service


async def _intake(store: Store, task_id: str, training: bool = False, tokens: int = 40) -> None:
    """Submit straight into the intake stream, as the scheduler's Submit does."""
    kind = TaskKind.TRAINING if training else TaskKind.INFERENCE
    payload = TaskPayload(reference_token_ids=(1, 2)) if training else TaskPayload()
    await store.submit_task(
        task_to_fields(Task(task_id, kind, 0.0, tokens, 0 if training else 6), payload)
    )


async def _complete(stack: Stack, service: SchedulerService, task_ids: list[str]) -> None:
    """What an executor does at a task's end, for those placed now."""
    for task_id in task_ids:
        node_id = service.core.node_of(task_id)
        if node_id is None:
            continue
        await stack.store.finish_task(task_id, "completed", "", {"type": "end", "n": 6})
        await stack.store.append_completion(
            {"task_id": task_id, "node_id": node_id, "status": "completed", "reason": ""}
        )


async def _is_bounded(store: Store) -> bool:
    return await store.events_length() <= EVERY + 1


async def test_a_restart_from_a_compacted_log_is_the_full_replay(stack: Stack) -> None:
    for node_id in (0, 1):
        await stack.start_executor(node_id)
    old = await stack.start_service(snapshot_every_events=EVERY)
    ids = [f"a{i}" for i in range(40)]
    for i, task_id in enumerate(ids):
        await _intake(stack.store, task_id, training=i % 5 == 0, tokens=30 + i)
    await wait_until(lambda: all(old.core.knows(t) for t in ids[-3:]), what="intake")
    done = [t for t in ids[:20] if old.core.node_of(t) is not None]
    await _complete(stack, old, done)
    await wait_until(lambda: not any(old.core.knows(t) for t in done), what="completions applied")
    await old.snapshot()  # GetState: everything recorded is stored
    await wait_until(lambda: _is_bounded(stack.store), what="the log trimmed")
    assert old.events.num_snapshots_stored >= 4 and old.events.num_trimmed_entries > 5
    await old.stop()
    old_planner = old.core.planner.planner

    # The trimmed log restores what the live planner (= the full replay) had.
    entries = await stack.store.read_events()
    assert len(entries) <= EVERY + 1
    planner = fresh_planner(old.config)
    recovered = recover(events_to_recover(entries), planner)
    assert recovered.is_from_snapshot
    assert planner.snapshot() == old_planner.snapshot()
    assert recovered.tally == old.recorder.tally

    new = await stack.start_service(snapshot_every_events=1000)
    assert new.is_recovered_from_snapshot and new.num_recovered_events <= EVERY
    held = [t for t in ids if old.core.knows(t)]
    assert held and [t for t in ids if new.core.knows(t)] == held
    assert (new.core.num_placed, new.core.num_rejected) == (
        old.recorder.tally.num_placed,
        old.recorder.tally.num_rejected,
    )

    # The next decisions are what the old planner would have made.
    twin = copy.deepcopy(old_planner)
    await _intake(stack.store, "after", tokens=77)
    await wait_until(lambda: new.core.node_of("after") is not None, what="placement")
    await new.snapshot()
    events = await read_events(stack.store)
    run = max(i for i, e in enumerate(events) if START_MARKER in e)
    tail = events[run:]
    assert not any(SNAPSHOT_MARKER in e for e in tail)
    assert [decision_key(d) for d in replay(tail, twin)] == recorded_decision_keys(tail)
    assert ("Placement", "after", new.core.node_of("after")) in recorded_decision_keys(tail)


async def test_a_restart_mid_load_loses_nothing(stack: Stack) -> None:
    for node_id in (0, 1):
        await stack.start_executor(node_id)
    ids = [f"m{i}" for i in range(90)]

    async def load() -> None:  # tasks keep arriving across the restart
        for i, task_id in enumerate(ids):
            await _intake(stack.store, task_id, training=i % 4 == 0, tokens=20 + i % 50)
            await asyncio.sleep(0.002)

    loader = asyncio.create_task(load())
    old = await stack.start_service(snapshot_every_events=EVERY)
    await wait_until(lambda: sum(old.core.knows(t) for t in ids) >= 30, what="load")
    await old.stop(grace_s=0.1)
    assert old.events.num_snapshots_stored >= 1
    new = await stack.start_service(snapshot_every_events=EVERY)
    assert new.is_recovered_from_snapshot
    held_before = [t for t in ids if old.core.knows(t)]
    assert all(new.core.knows(t) for t in held_before), "a held task was lost in the restart"
    await loader

    async def all_final() -> bool:
        await _complete(stack, new, [t for t in ids if new.core.knows(t)])
        states = await stack.store.get_task_states(ids, ["is_final", "status"])
        return all(s.fields.get("is_final") == "1" for s in states)

    await wait_until(all_final, timeout_s=20.0, what="every task final")
    states = await stack.store.get_task_states(ids, ["status"])
    assert {t: s.fields.get("status") for t, s in zip(ids, states, strict=True)} == {
        t: "completed" for t in ids
    }
    await new.snapshot()
    await wait_until(lambda: _is_bounded(stack.store), what="the log trimmed")


async def test_a_restart_with_another_policy_is_refused_after_compaction(stack: Stack) -> None:
    await stack.start_executor(0)
    old = await stack.start_service(num_nodes=1, snapshot_every_events=5)
    for i in range(6):
        await _intake(stack.store, f"p{i}")
    await wait_until(lambda: old.core.knows("p5"), what="intake")
    await old.snapshot()
    await wait_until(lambda: old.events.num_trimmed_entries > 0, what="a trim")
    await old.stop()
    assert not any(START_MARKER in e for e in await read_events(stack.store))
    service = SchedulerService(stack.config(num_nodes=1, policy="mix-rr"), profile=PROFILE)
    stack.services.append(service)
    with pytest.raises(ValueError, match="policy"):
        await service.start()


async def test_the_sink_trims_after_a_snapshot_and_stops_even_mid_trim(
    redis_client: aioredis.Redis,
) -> None:
    store = Store(redis_client, RedisKeys(f"sink-{uuid.uuid4().hex[:8]}"))
    for _ in range(5):
        sink = RedisEventSink(store)
        sink.start()
        for i in range(2000):
            sink({"input": "plan", "now_s": float(i)})
        sink({SNAPSHOT_MARKER: {"n": 1}})
        sink({"input": "plan", "now_s": 1e6})
        await sink.flush()
        # The trim runs after the flush returned: stop lands on it (a
        # cancellation swallowed inside redis-py must not hang the stop; and
        # wait_for cannot bound it: stop suppresses the CancelledError).
        stopping = asyncio.create_task(sink.stop())
        done, _ = await asyncio.wait({stopping}, timeout=3.0)
        assert done, "stop waits on a swallowed cancellation"
        await wait_until(lambda: _length_is(store, 2), what="the trim")
        assert sink.num_snapshots_stored == 1
    events = [f for _, f in await store.read_events()]
    assert [json.loads(f["json"]) for f in events] == [
        {SNAPSHOT_MARKER: {"n": 1}},
        {"input": "plan", "now_s": 1e6},
    ]


async def _length_is(store: Store, n: int) -> bool:
    return await store.events_length() == n


async def test_the_sink_packs_a_drain_into_entries_a_snapshot_alone(
    redis_client: aioredis.Redis,
) -> None:
    store = Store(redis_client, RedisKeys(f"pack-{uuid.uuid4().hex[:8]}"))
    sink = RedisEventSink(store)
    recorded: list[dict[str, object]] = [{"input": "plan", "now_s": float(i)} for i in range(600)]
    recorded.insert(300, {SNAPSHOT_MARKER: {"n": 1}})
    recorded.append({"input": "text", "s": "a\nb"})  # a newline inside an event
    for event in recorded:  # buffered before the sink runs: one drain takes them all
        sink(event)
    sink.start()
    await sink.flush()
    await sink.stop()
    entries = await store.read_events()
    # 500 per round trip, at most 250 per entry, the snapshot apart, never dropped
    # or reordered; the trim after the snapshot left it and what follows.
    assert events_from_entries(entries) == recorded[300:]
    assert [len(events_from_fields(f)) for _, f in entries] == [1, 199, 102]
    assert events_to_recover(entries) == recorded[300:]


async def test_the_sink_gathers_events_nobody_waits_for_and_appends_at_once_for_a_flush(
    redis_client: aioredis.Redis,
) -> None:
    store = Store(redis_client, RedisKeys(f"gather-{uuid.uuid4().hex[:8]}"))
    sink = RedisEventSink(store, coalesce_s=0.3)
    sink.start()
    try:
        for i in range(3):  # a tick apart: without gathering, three entries
            sink({"input": "plan", "now_s": float(i)})
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert await store.events_length() == 0  # still gathering
        await wait_until(lambda: _length_is(store, 1), what="one entry for the three")
        sink({"input": "plan", "now_s": 3.0})
        await asyncio.wait_for(sink.flush(), 0.2)  # a waiter: appended at once
        assert await store.events_length() == 2
    finally:
        await sink.stop()
    assert [len(events_from_fields(f)) for _, f in await store.read_events()] == [3, 1]
