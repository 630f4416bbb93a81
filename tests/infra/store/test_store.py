"""lemix.infra.store's `Store` against a real Redis (the session's `redis_server`,
flushed per test)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis_pool import TEST_POOL_SIZE

from lemix.infra.store.base import TASKS_PER_SCRIPT_CALL
from lemix.infra.store.codec import (
    encode_fields,
    get_float,
    get_int,
    get_optional_int,
)
from lemix.infra.store.events import CursorAdvance
from lemix.infra.store.intake import INTAKE_STATE_FIELD, TaskIdConflict
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.store import Store
from lemix.infra.store.task_hash import IS_FINAL_FIELD
from lemix.types import TaskKind, TaskStatus


@pytest.fixture
def store(redis_client: aioredis.Redis) -> Store:
    return Store(redis_client, RedisKeys("lemixtest"))


def _task(task_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "kind": TaskKind.INFERENCE,
        "num_prompt_tokens": 12,
        "max_output_tokens": 4,
        "arrival_s": 1.5,
        **extra,
    }


# ------------------------------------------------------------------ construction


def test_store_needs_decoded_responses(redis_server: Any) -> None:
    raw = aioredis.Redis.from_url(redis_server.url, max_connections=TEST_POOL_SIZE)
    with pytest.raises(ValueError, match="decode_responses"):
        Store(raw)


# ------------------------------------------------------------------ intake


async def test_the_dedupe_marker_lives_for_the_idempotency_window(
    redis_client: aioredis.Redis,
) -> None:
    store = Store(redis_client, RedisKeys("lemixtest"), dedupe_ttl_s=600.0)
    assert await store.submit_task(_task("w1")) is True
    ttl_ms = await redis_client.pttl(store.keys.dedupe("w1"))
    assert 590_000 < ttl_ms <= 600_000


async def test_submit_is_idempotent_by_task_id(store: Store) -> None:
    assert await store.submit_task(_task("t1")) is True
    assert await store.submit_task(_task("t1")) is False
    # The same id for another request is a conflict, not a silent duplicate.
    with pytest.raises(TaskIdConflict, match="'t1' was already used with a different"):
        await store.submit_task(_task("t1", num_prompt_tokens=99))
    assert await store.client.xlen(store.keys.intake_stream) == 1
    with pytest.raises(ValueError, match="task_id"):
        await store.submit_task({"kind": "inference"})


async def test_a_submit_whose_append_fails_leaves_no_marker(store: Store) -> None:
    # The marker is taken before the XADD: a failed XADD must give it back,
    # or the retry would be refused as a duplicate of a task never stored.
    await store.client.set(store.keys.intake_stream, "not a stream")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await store.submit_task(_task("f1"))
    assert not await store.client.exists(store.keys.dedupe("f1"))
    await store.client.delete(store.keys.intake_stream)
    assert await store.submit_task(_task("f1")) is True
    assert await store.client.xlen(store.keys.intake_stream) == 1


async def test_racing_duplicate_submits_add_one_entry(store: Store) -> None:
    results = await asyncio.gather(*(store.submit_task(_task("same")) for _ in range(20)))
    assert sorted(results) == [False] * 19 + [True]
    assert await store.client.xlen(store.keys.intake_stream) == 1


async def test_read_and_ack_intake(store: Store) -> None:
    await store.submit_task(_task("before-group"))  # the group starts at id 0
    await store.ensure_group()
    await store.ensure_group()  # idempotent
    await store.submit_task(_task("after-group"))

    entries = await store.read_intake("sched-a", count=10)
    assert [fields["task_id"] for _, fields in entries] == ["before-group", "after-group"]
    assert get_int(entries[0][1], "num_prompt_tokens") == 12
    assert get_float(entries[0][1], "arrival_s") == 1.5
    assert await store.pending_count() == 2
    assert await store.read_intake("sched-a") == []  # nothing new

    assert await store.ack_intake([entry_id for entry_id, _ in entries]) == 2
    assert await store.pending_count() == 0
    assert await store.client.xlen(store.keys.intake_stream) == 0  # acked entries deleted
    assert await store.ack_intake([]) == 0


async def test_a_read_acks_the_last_batch_first_in_the_same_round_trip(store: Store) -> None:
    await store.ensure_group()
    await store.submit_task(_task("one"))
    [(first_id, _)] = await store.read_intake("sched-a")
    await store.submit_task(_task("two"))
    entries = await store.read_intake("sched-a", ack_first=[first_id])
    assert [f["task_id"] for _, f in entries] == ["two"]
    assert await store.pending_count() == 1  # "one" acked, "two" delivered
    assert [f["task_id"] for _, f in await store.read_intake_entries()] == ["two"]
    # Acking again (a read that failed after its acks landed is retried) is harmless.
    assert await store.read_intake("sched-a", ack_first=[first_id, entries[0][0]]) == []
    assert await store.pending_count() == 0


async def test_read_intake_blocks_until_a_task_arrives(store: Store) -> None:
    await store.ensure_group()
    reader = asyncio.create_task(store.read_intake("sched-a", block_ms=2000))
    await asyncio.sleep(0.1)
    assert not reader.done()
    await store.submit_task(_task("late"))
    entries = await asyncio.wait_for(reader, 3.0)
    assert [fields["task_id"] for _, fields in entries] == ["late"]


async def test_read_intake_recreates_a_lost_group(store: Store) -> None:
    # E.g. Redis restarted without AOF: the scheduler keeps going.
    assert await store.pending_count() == 0
    assert await store.read_intake("sched-a") == []
    await store.submit_task(_task("t1"))
    assert len(await store.read_intake("sched-a")) == 1


async def test_dead_consumers_entries_are_redelivered_by_claim_stale(store: Store) -> None:
    await store.ensure_group()
    for i in range(5):
        await store.submit_task(_task(f"t{i}"))
    taken = await store.read_intake("sched-dead", count=3)  # then it "dies": no ack
    assert len(taken) == 3

    # Too fresh to be stale: nothing moves.
    assert await store.claim_stale("sched-new", min_idle_ms=60_000) == []
    await asyncio.sleep(0.1)
    claimed = await store.claim_stale("sched-new", min_idle_ms=50, count=2)  # paged
    assert claimed == taken
    # The rest were never delivered, so they come by the normal read.
    rest = await store.read_intake("sched-new")
    assert [f["task_id"] for _, f in rest] == ["t3", "t4"]

    assert await store.pending_count() == 5
    await store.ack_intake([entry_id for entry_id, _ in claimed + rest])
    assert await store.pending_count() == 0
    assert await store.claim_stale("sched-new", min_idle_ms=0) == []


async def test_accept_task_records_state_and_acks_together(store: Store) -> None:
    await store.ensure_group()
    await store.submit_task(_task("t1"))
    [(entry_id, fields)] = await store.read_intake("sched-a")
    await store.accept_task(entry_id, fields["task_id"], {"status": "queued", "node_id": None})
    assert await store.pending_count() == 0
    state = await store.get_task_state("t1")
    assert (state["status"], state["node_id"]) == ("queued", "")


async def test_submit_writes_the_task_hash_and_says_whether_it_was_its_own(
    store: Store,
) -> None:
    await store.ensure_group()
    assert await store.submit_task(_task("fresh"))
    # A hash already holding a field the submit writes (here: a finished
    # task whose dedupe marker expired): the entry says "check it".
    await store.set_task_state("old", {"status": "completed", "is_final": "1", "attempt": 3})
    assert await store.submit_task(_task("old"))
    entries = dict((f["task_id"], f) for _, f in await store.read_intake("sched-a"))
    assert entries["fresh"][INTAKE_STATE_FIELD] == "1"
    assert entries["old"][INTAKE_STATE_FIELD] == "0"
    fresh = await store.get_task_state("fresh")
    assert (fresh["status"], fresh["attempt"], fresh["task_id"]) == ("queued", "1", "fresh")
    assert float(fresh["queued_t"]) > 0
    # The same request again writes nothing: no second entry, the hash as it was.
    await store.set_task_state("fresh", {"status": "placed"})
    assert not await store.submit_task(_task("fresh"))
    assert await store.read_intake("sched-a") == []
    assert (await store.get_task_state("fresh"))["status"] == "placed"


# ------------------------------------------------------------------ task state


async def test_task_state_merges_fields(store: Store) -> None:
    assert await store.get_task_state("nope") == {}
    assert await store.set_task_state("t1", {"status": "queued", "arrival_s": 1.0})
    assert await store.set_task_state("t1", {"status": "running", "node_id": 2})
    state = await store.get_task_state("t1")
    assert state == {"status": "running", "arrival_s": "1.0", "node_id": "2"}
    assert get_optional_int(state, "node_id") == 2
    with pytest.raises(ValueError):
        await store.set_task_state("t1", {})


async def test_finish_task_is_atomic_and_happens_once(store: Store) -> None:
    await store.set_task_state("t1", {"status": "running", "node_id": 0})
    await store.append_output("t1", {"token": "hello"})

    # A reader that polls state and output in one MULTI never sees one half.
    async def watch() -> tuple[dict[str, str], int]:
        while True:
            async with store.client.pipeline(transaction=True) as pipe:
                pipe.hgetall(store.keys.task("t1"))
                pipe.xlen(store.keys.output("t1"))
                state, num_out = await pipe.execute()
            if state.get(IS_FINAL_FIELD) == "1" or num_out > 1:
                return state, num_out
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.01)
    assert await store.finish_task(
        "t1",
        TaskStatus.COMPLETED,
        "",
        {"num_output_tokens": 1, "loss": 2.5},
        state_fields={"finish_s": 9.0},
    )
    state, num_out = await asyncio.wait_for(watcher, 3.0)
    assert state[IS_FINAL_FIELD] == "1" and num_out == 2

    assert await store.get_task_state("t1") == {
        "status": "completed",
        "reason": "",
        "node_id": "0",
        "finish_s": "9.0",
        "is_final": "1",
    }
    messages = await store.read_output("t1")
    assert [m for _, m in messages] == [
        {"token": "hello"},
        {
            "num_output_tokens": "1",
            "loss": "2.5",
            "status": "completed",
            "reason": "",
            "is_final": "1",
        },
    ]

    # A redelivered task finishing again changes nothing, nor can a late update.
    assert not await store.finish_task("t1", TaskStatus.FAILED, "node died")
    assert not await store.set_task_state("t1", {"status": "running"})
    assert (await store.get_task_state("t1"))["status"] == "completed"
    assert len(await store.read_output("t1")) == 2


async def test_finish_task_ttl_expires_state_and_output(store: Store) -> None:
    await store.finish_task("t1", TaskStatus.REJECTED, "prompt too long", ttl_s=30)
    assert 0 < await store.client.pttl(store.keys.task("t1")) <= 30_000
    assert 0 < await store.client.pttl(store.keys.output("t1")) <= 30_000
    [(_, message)] = await store.read_output("t1")
    assert message["reason"] == "prompt too long"


# ------------------------------------------------------------------ outputs


async def test_outputs_batch_is_one_round_trip(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Count pipeline executions on the real client (a spy, Redis stays real).
    num_executes = 0
    make_pipeline = store.client.pipeline

    def counting_pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = make_pipeline(*args, **kwargs)
        execute = pipe.execute

        async def counted_execute(*a: Any, **kw: Any) -> Any:
            nonlocal num_executes
            num_executes += 1
            return await execute(*a, **kw)

        pipe.execute = counted_execute  # type: ignore[method-assign]
        return pipe

    monkeypatch.setattr(store.client, "pipeline", counting_pipeline)
    num_requests, num_steps = 64, 8
    for step in range(num_steps):  # one executor iteration: a token per request
        items = [
            (f"r{i}", {"token_id": 100 + step, "t_s": step * 0.01}) for i in range(num_requests)
        ]
        entry_ids = await store.append_outputs_batch(items)
        assert len(entry_ids) == num_requests
    assert num_executes == num_steps
    assert await store.append_outputs_batch([]) == []
    assert num_executes == num_steps  # nothing to send: no round trip

    for i in (0, num_requests - 1):
        messages = await store.read_output(f"r{i}")
        assert [get_int(m, "token_id") for _, m in messages] == [100 + s for s in range(8)]


async def test_read_output_continues_from_last_id_and_blocks(store: Store) -> None:
    first = await store.append_output("r1", {"token": "a"})
    await store.append_output("r1", {"token": "b"})
    messages = await store.read_output("r1", count=1)
    assert messages == [(first, {"token": "a"})]
    rest = await store.read_output("r1", last_id=first)
    assert [m["token"] for _, m in rest] == ["b"]

    waiter = asyncio.create_task(store.read_output("r1", last_id=rest[-1][0], block_ms=2000))
    await asyncio.sleep(0.05)
    await store.append_output("r1", {"token": "c"})
    assert [m["token"] for _, m in await asyncio.wait_for(waiter, 3.0)] == ["c"]
    assert await store.read_output("r1", last_id="$", block_ms=50) == []


async def test_output_stream_is_bounded(redis_client: aioredis.Redis) -> None:
    store = Store(redis_client, RedisKeys("lemixtest"), output_maxlen=10)
    await store.append_outputs_batch([("r1", {"i": i}) for i in range(1000)])
    # MAXLEN ~ trims whole radix-tree nodes (100 entries by default): bounded, not exact.
    assert 10 <= await redis_client.xlen(store.keys.output("r1")) <= 200


async def test_finished_outputs_expire_apart_from_their_state(
    redis_client: aioredis.Redis,
) -> None:
    store = Store(redis_client, RedisKeys("lemixtest"))
    await store.finish_tasks([("e1", "completed", "")], ttl_s=60, output_ttl_s=10)
    assert 10_000 < await redis_client.pttl(store.keys.task("e1")) <= 60_000
    assert 0 < await redis_client.pttl(store.keys.output("e1")) <= 10_000
    await store.finish_tasks([("e2", "completed", "")], ttl_s=60, output_ttl_s=0)
    assert await redis_client.pttl(store.keys.output("e2")) == -1  # 0: none
    await store.finish_task("t2", "completed", "", {"n": 1})
    cursor = await store.append_completion({"task_id": "t2", "status": "completed"})
    await store.advance_completions_cursor(cursor, expire_ids=["t2"], ttl_s=60, output_ttl_s=10)
    assert 10_000 < await redis_client.pttl(store.keys.task("t2")) <= 60_000
    assert 0 < await redis_client.pttl(store.keys.output("t2")) <= 10_000
    # Not stored this time: the expiries land, the cursor and the stream stay.
    await store.finish_task("t3", "completed", "", {"n": 1})
    later = await store.append_completion({"task_id": "t3", "status": "completed"})
    await store.advance_completions_cursor(later, expire_ids=["t3"], ttl_s=60, is_stored=False)
    assert 0 < await redis_client.pttl(store.keys.task("t3")) <= 60_000
    assert await store.get_completions_cursor() == cursor
    assert await redis_client.xlen(store.keys.completions_stream) == 2
    # The same step sent ahead of the next read, in its round trip.
    await store.finish_task("t4", "completed", "", {"n": 1})
    last = await store.append_completion({"task_id": "t4", "status": "completed"})
    advance = CursorAdvance.of(last, expire_ids=["t4"], ttl_s=60, output_ttl_s=10)
    assert advance is not None
    assert await store.read_completions(last, advance_first=advance) == []
    assert 10_000 < await redis_client.pttl(store.keys.task("t4")) <= 60_000
    assert 0 < await redis_client.pttl(store.keys.output("t4")) <= 10_000
    assert await store.get_completions_cursor() == last
    assert await redis_client.xlen(store.keys.completions_stream) == 1  # trimmed before it
    assert CursorAdvance.of(last, is_stored=False) is None  # nothing to write


# ------------------------------------------------------------------ node state


async def test_node_states_expire_with_their_heartbeat(store: Store) -> None:
    await store.put_node_state(0, {"num_running": 3, "busy_fraction": 0.5}, ttl_s=1.0)
    await store.put_node_state(1, {"num_running": 1, "is_healthy": True}, ttl_s=30.0)
    states = await store.get_node_states()
    assert set(states) == {0, 1}
    assert get_int(states[0], "num_running") == 3
    assert get_float(states[0], "busy_fraction") == 0.5

    # A heartbeat replaces the whole hash: stale fields do not survive.
    await store.put_node_state(1, {"num_running": 2}, ttl_s=30.0)
    assert (await store.get_node_states())[1] == {"num_running": "2"}

    deadline = time.monotonic() + 3.0
    while 0 in await store.get_node_states():
        assert time.monotonic() < deadline, "node 0 did not expire after its 1 s TTL"
        await asyncio.sleep(0.1)
    assert set(await store.get_node_states()) == {1}

    # Heartbeating again brings the node back.
    await store.put_node_state(0, {"num_running": 0}, ttl_s=1.0)
    assert set(await store.get_node_states()) == {0, 1}


async def test_no_nodes(store: Store) -> None:
    assert await store.get_node_states() == {}


# ------------------------------------------------------------------ events, profiles, stats


async def test_events_round_trip_in_order(store: Store) -> None:
    events = [
        {"kind": "place", "task_id": f"t{i}", "node_id": i % 2, "now_s": i * 0.5} for i in range(5)
    ]
    ids = [await store.append_event(e) for e in events]
    logged = await store.read_events()
    assert [entry_id for entry_id, _ in logged] == ids
    assert [fields for _, fields in logged] == [encode_fields(e) for e in events]
    assert len(await store.read_events(start=ids[2])) == 3
    assert len(await store.read_events(count=2)) == 2


async def test_profiles_round_trip(store: Store) -> None:
    assert await store.get_profile("tiny") is None
    text = json.dumps({"model": "tiny", "alpha": [1.0, 2.0]})
    await store.put_profile("tiny", text)
    assert await store.get_profile("tiny") == text


async def test_stats_counters(store: Store) -> None:
    assert await store.get_stats() == {}
    assert await store.incr_stat("num_submitted") == 1
    assert await store.incr_stat("num_submitted", by=4) == 5
    await store.incr_stat("num_rejected")
    assert await store.get_stats() == {"num_submitted": 5, "num_rejected": 1}


async def test_namespaces_do_not_collide(redis_client: aioredis.Redis) -> None:
    a, b = Store(redis_client, RedisKeys("stack-a")), Store(redis_client, RedisKeys("stack-b"))
    assert await a.submit_task(_task("t1"))
    assert await b.submit_task(_task("t1"))
    await a.incr_stat("n")
    assert await b.get_stats() == {}
    assert all(key.startswith("stack-a:") for key in await redis_client.keys(a.keys.pattern))


async def test_completions_cursor_cancel_marks_and_epoch(redis_client) -> None:
    store = Store(redis_client)
    first = await store.append_completion({"task_id": "a", "node_id": 0, "status": "completed"})
    await store.append_completion({"task_id": "b", "node_id": 1, "status": "failed"})
    entries = await store.read_completions("0-0")
    assert [f["task_id"] for _, f in entries] == ["a", "b"]
    assert [f["task_id"] for _, f in await store.read_completions(first)] == ["b"]
    assert await store.get_completions_cursor() == "0-0"
    await store.set_completions_cursor(first)
    assert await store.get_completions_cursor() == first
    assert not await store.is_cancelled("x")
    await store.mark_cancelled("x", ttl_s=60.0)
    assert await store.is_cancelled("x")
    # The marker of a task not taken in yet creates its hash, with a TTL (the
    # task may never come); on a task already held it sets no TTL.
    assert 0 < await redis_client.pttl(store.keys.task("x")) <= 60_000
    await store.set_task_state("held", {"status": "queued"})
    await store.mark_cancelled("held", ttl_s=60.0)
    assert await store.is_cancelled("held")
    assert await redis_client.pttl(store.keys.task("held")) == -1
    assert await store.scheduler_epoch(100.0) == 100.0
    assert await store.scheduler_epoch(200.0) == 100.0  # set once, kept across restarts


async def test_append_events_keeps_order_in_one_trip(redis_client) -> None:
    store = Store(redis_client)
    await store.append_event({"i": 0})
    ids = await store.append_events([{"i": i} for i in range(1, 6)])
    assert len(ids) == 5 and await store.append_events([]) == []
    assert [int(f["i"]) for _, f in await store.read_events()] == [0, 1, 2, 3, 4, 5]


async def test_batched_state_updates(redis_client) -> None:
    store = Store(redis_client)
    await store.finish_task("done", TaskStatus.COMPLETED, "")
    assert await store.set_task_states(
        [("new", {"status": "queued"}), ("done", {"status": "queued"})]
    ) == [True, False]
    assert (await store.get_task_state("new"))["status"] == "queued"
    assert (await store.get_task_state("done"))["status"] == "completed"
    assert await store.set_task_states([]) == []


async def _script_calls(client: aioredis.Redis) -> int:
    """SCRIPT calls so far (EXISTS, LOAD, FLUSH: Redis 6 counts them as one)."""
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_script", {}).get("calls", 0))


async def test_pipelined_scripts_take_one_round_trip_and_survive_a_script_flush(
    store: Store, redis_client: aioredis.Redis
) -> None:
    # redis-py's `script(client=pipe)` sends SCRIPT EXISTS before every
    # pipeline; the store's EVALSHA pipelines do not, and a NOSCRIPT (a Redis
    # restart empties the script cache) loads the scripts and runs exactly
    # the refused commands again.
    await redis_client.script_flush()
    assert await store.set_task_states([("a", {"status": "queued"}), ("b", {"n": 1})]) == [
        True,
        True,
    ]
    before = await _script_calls(redis_client)
    assert await store.finish_tasks([("a", "completed", ""), ("b", "failed", "x")]) == [
        True,
        True,
    ]
    assert await store.set_task_states([("a", {"status": "placed"})]) == [False]
    assert await store.expire_finished_tasks(["a", "b", "c"], 60.0) == 2
    assert await store.fence_attempts([("b", 1)]) != []
    assert await _script_calls(redis_client) == before  # no SCRIPT EXISTS per pipeline
    assert (await store.get_task_state("a"))["status"] == "completed"
    assert (await store.get_task_state("b"))["n"] == "1"
    assert 0 < await redis_client.pttl(store.keys.task("a")) <= 60_000


async def test_loaded_scripts_spare_the_first_call_its_noscript(
    store: Store, redis_client: aioredis.Redis
) -> None:
    # A fresh Redis has no scripts: `load_scripts` (the executor's start)
    # caches them all, so the first scripted pipeline runs at once instead of
    # answering NOSCRIPT and loading them in the request's path.
    async def noscripts() -> int:
        stats = await redis_client.info("commandstats")
        return int(stats.get("cmdstat_evalsha", {}).get("failed_calls", 0))

    await redis_client.script_flush()
    await store.load_scripts()
    loaded, refused = await _script_calls(redis_client), await noscripts()
    assert await store.set_task_states([("a", {"status": "queued"})]) == [True]
    assert await store.finish_tasks([("a", "completed", "")]) == [True]
    assert await _script_calls(redis_client) == loaded  # no reload
    assert await noscripts() == refused  # no NOSCRIPT reply


async def test_accept_intake_checks_and_records_in_one_step(store: Store) -> None:
    await store.finish_task("done", "completed")
    await store.mark_cancelled("gone")
    await store.renew_gateway_lease("gw")
    assert await store.accept_intake([]) == []
    lookup = await store.accept_intake(
        [
            (t, {"status": "queued", "payload": "p", **({"gateway_id": g} if g else {})})
            for t, g in (("done", "gw"), ("gone", "gw"), ("new", "gw"), ("bare", ""))
        ]
        + [("orphan", {"status": "queued", "gateway_id": "gw-dead"})]
    )
    # "bare" names no gateway (no lease); "orphan" names one without a lease.
    # A task taken has its first placement numbered (attempt 1).
    assert lookup == [(True, False, True, 0), (False, True, True, 0), (False, False, True, 1)] + [
        (False, False, False, 1),
        (False, False, False, 1),
    ]
    # Only the tasks to be taken are written: a final state is kept, a
    # cancelled task's end is the scheduler's to write.
    assert (await store.get_task_state("done"))["status"] == "completed"
    assert await store.get_task_state("gone") == {"cancelled": "1"}  # the marker alone
    assert (await store.get_task_state("new"))["payload"] == "p"
    assert (await store.get_task_state("new"))["gateway_id"] == "gw"
    assert (await store.get_task_state("bare"))["status"] == "queued"
    assert (await store.get_task_state("bare"))["attempt"] == "1"
    # Taken again (a redelivery after a restart that lost the decision): the
    # next number, so a placement the lost scheduler sent is fenced.
    (again,) = await store.accept_intake([("bare", {"status": "queued"})])
    assert again.attempt == 2 and (await store.get_task_state("bare"))["attempt"] == "2"


async def test_gateway_leases_are_one_key_per_gateway(
    store: Store, redis_client: aioredis.Redis
) -> None:
    await store.renew_gateway_lease("gw-a", ttl_s=5.0)
    await store.keep_gateway_lease("gw-b", 5.0)
    assert await store.gateway_leases_held(["gw-a", "gw-b", "gw-c"]) == [True, True, False]
    assert 0 < await redis_client.pttl(store.keys.gateway_lease("gw-a")) <= 5000
    await store.drop_gateway_lease("gw-a")
    assert await store.gateway_leases_held(["gw-a", "gw-b"]) == [False, True]
    assert await store.gateway_leases_held([]) == []


async def _evalsha_calls(client: aioredis.Redis) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_batch_scripts_take_one_call_per_chunk_and_keep_per_task_answers(
    store: Store, redis_client: aioredis.Redis
) -> None:
    # More tasks than one script call takes, final / cancelled / leased ones
    # spread over the chunks: every task's answer and write is its own.
    num_tasks = TASKS_PER_SCRIPT_CALL * 2 + 5
    ids = [f"t{i}" for i in range(num_tasks)]
    for i in range(0, num_tasks, 7):
        await store.finish_task(ids[i], "completed")
    for i in range(3, num_tasks, 11):
        await store.mark_cancelled(ids[i])
    await store.renew_gateway_lease("gw")
    await store.set_task_states([("warm", {"n": 1})])  # the scripts are loaded
    before = await _evalsha_calls(redis_client)
    lookup = await store.accept_intake(
        [
            (t, {"status": "queued", "i": i, **({"gateway_id": "gw"} if i % 5 == 0 else {})})
            for i, t in enumerate(ids)
        ]
    )
    assert await _evalsha_calls(redis_client) - before == 3
    expected = [
        (i % 7 == 0, i % 11 == 3, i % 5 == 0, int(i % 7 != 0 and i % 11 != 3))
        for i in range(num_tasks)
    ]
    assert lookup == expected
    states = await store.get_task_state_hashes(ids)
    for i, state in enumerate(states):
        is_taken = not expected[i][0] and not expected[i][1]
        assert (state.get("i") == str(i)) is is_taken
    before = await _evalsha_calls(redis_client)
    done = await store.set_task_states(
        [(t, {"status": "placed", "j": i}) for i, t in enumerate(ids)]
    )
    assert await _evalsha_calls(redis_client) - before == 3
    assert done == [i % 7 != 0 for i in range(num_tasks)]
    states = await store.get_task_state_hashes(ids)
    assert [s.get("j") == str(i) for i, s in enumerate(states)] == done
