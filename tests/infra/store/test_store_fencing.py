"""Store's fencing ops (attempt numbers) against a real Redis."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from lemix.infra.store.fencing import (
    FencedProgress,
    FinishOutcome,
    NodeEnd,
    NodeEndKind,
    PlaceOutcome,
)
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.store import Store
from lemix.infra.store.task_hash import ATTEMPT_FIELD


@pytest.fixture
def store(redis_client: aioredis.Redis) -> Store:
    return Store(redis_client, RedisKeys("fencetest"))


async def tokens_of(store: Store, task_id: str) -> list[str]:
    return [fields["n"] for _, fields in await store.read_output(task_id)]


async def test_begin_attempts_numbers_each_placement_and_checks_cancels(store: Store) -> None:
    await store.set_task_state("a", {"status": "queued"})
    await store.mark_cancelled("t")
    assert await store.begin_attempts(["a", "t"], check_cancelled=["t"]) == ([1, 1], [True])
    assert await store.begin_attempts(["a"]) == ([2], [])
    assert (await store.get_task_state("a"))[ATTEMPT_FIELD] == "2"
    assert await store.begin_attempts([]) == ([], [])


async def test_tokens_of_a_stale_attempt_are_dropped_in_one_round_trip(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.set_task_state("moved", {ATTEMPT_FIELD: 2})
    await store.set_task_state("mine", {ATTEMPT_FIELD: 1})
    await store.append_outputs_fenced([("warm-up", 0, {"n": 0})])  # loads the script
    num_calls = 0
    execute = store.client.execute_command

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal num_calls
        num_calls += 1
        return await execute(*args, **kwargs)

    monkeypatch.setattr(store.client, "execute_command", counted)
    for n in (1, 2):
        written = await store.append_outputs_fenced(
            [
                ("mine", 1, {"n": n}),
                ("moved", 1, {"n": n}),
                ("moved", 2, {"n": n}),
                ("unfenced", 0, {"n": n}),  # no hash at all: a direct dispatch
            ]
        )
        assert [w is not None for w in written] == [True, False, True, True]
    assert num_calls == 2  # one EVALSHA per iteration, nothing else
    assert await tokens_of(store, "mine") == ["1", "2"]
    assert await tokens_of(store, "moved") == ["1", "2"]  # attempt 2's only
    assert await tokens_of(store, "unfenced") == ["1", "2"]
    assert await store.append_outputs_fenced([]) == []


async def test_a_fenced_token_after_a_written_one_in_the_same_batch(store: Store) -> None:
    # The last message is fenced: the Lua reply list is cut at its first nil;
    # the store pads it back to one answer per message.
    await store.set_task_state("x", {ATTEMPT_FIELD: 3})
    written = await store.append_outputs_fenced([("x", 3, {"n": 1}), ("x", 2, {"n": 2})])
    assert written[0] is not None and written[1] is None


async def test_finish_is_written_only_for_the_current_attempt(store: Store) -> None:
    await store.set_task_state("t", {"status": "placed", ATTEMPT_FIELD: 2})
    assert (
        await store.finish_task_fenced("t", 1, "failed", "CANCELLED: moved") is FinishOutcome.FENCED
    )
    assert await store.read_output("t") == []
    assert (await store.get_task_state("t"))["status"] == "placed"
    assert (
        await store.finish_task_fenced(
            "t", 2, "completed", output_fields={"n": 4}, state_fields={"node_id": 1}
        )
        is FinishOutcome.ENDED
    )
    assert await store.finish_task_fenced("t", 2, "failed") is FinishOutcome.ALREADY_FINAL
    state = await store.get_task_state("t")
    assert (state["status"], state["node_id"], state["is_final"]) == ("completed", "1", "1")
    [(_, end)] = await store.read_output("t")
    assert (end["status"], end["n"]) == ("completed", "4")
    # finish_task's optional attempt: the same rule, as a bool.
    await store.set_task_state("u", {ATTEMPT_FIELD: 5})
    assert not await store.finish_task("u", "completed", attempt=4)
    assert await store.finish_task("u", "completed", attempt=5, ttl_s=30)
    assert 0 < await store.client.pttl(store.keys.task("u")) <= 30_000


async def test_finish_without_an_attempt_field_is_unfenced(store: Store) -> None:
    assert await store.finish_task_fenced("direct", 0, "completed") is FinishOutcome.ENDED
    assert await store.finish_task("direct2", "completed", attempt=7)


async def test_fence_makes_an_attempt_stale_and_reads_progress_atomically(store: Store) -> None:
    await store.set_task_state("streaming", {"status": "placed", ATTEMPT_FIELD: 1})
    await store.append_output("streaming", {"type": "token", "n": 1})
    await store.set_task_state("newer", {"status": "placed", ATTEMPT_FIELD: 3})
    await store.finish_task("done", "completed")
    progress = await store.fence_attempts(
        [("streaming", 1), ("newer", 2), ("done", 1), ("gone", 1)]
    )
    assert progress == [
        FencedProgress(False, "placed", True),
        FencedProgress(False, "placed", False),
        FencedProgress(True, "completed", True),  # its end message
        FencedProgress(False, "", False),
    ]
    assert (await store.get_task_state("streaming"))[ATTEMPT_FIELD] == "2"
    assert (await store.get_task_state("newer"))[ATTEMPT_FIELD] == "3"  # placed again: kept
    assert not await store.client.exists(store.keys.task("gone"))  # not created
    # The fenced attempt can no longer write; the next placement can.
    assert await store.append_outputs_fenced([("streaming", 1, {"n": 2})]) == [None]
    assert await store.begin_attempts(["streaming"]) == ([3], [])
    assert await store.append_outputs_fenced([("streaming", 3, {"n": 1})]) != [None]
    assert await store.fence_attempts([]) == []


async def test_write_node_batch_writes_tokens_ends_and_completions_in_one_call(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.set_task_state("ok", {ATTEMPT_FIELD: 1})
    await store.set_task_state("moved", {ATTEMPT_FIELD: 2})
    await store.finish_task("done", "completed")
    await store.write_node_batch([], [])  # nothing: no call

    def end(task_id: str, kind: NodeEndKind, attempt: int = 1) -> NodeEnd:
        return NodeEnd(
            task_id,
            attempt,
            kind,
            {"task_id": task_id, "attempt": attempt},
            stat=f"ended_{kind}",
            duplicate_stat="dup",
            fenced_stat="fenced",
            status="completed",
            output_fields={"n": 1},
            state_fields={"node_id": 0},
        )

    calls = 0
    real = store.client.evalsha

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return await real(*args, **kwargs)

    monkeypatch.setattr(store.client, "evalsha", counted)
    places, written, outcomes = await store.write_node_batch(
        [("ok", 1, {"n": 1}), ("moved", 1, {"n": 1})],
        [
            end("ok", NodeEndKind.FINISH),
            end("moved", NodeEndKind.FINISH),
            end("done", NodeEndKind.FINISH),
            end("train", NodeEndKind.REPORT),
            end("known", NodeEndKind.FENCED),
            end("ok", NodeEndKind.FINISH),  # a second end in the same batch
        ],
    )
    assert calls == 1
    assert places == [] and written == [True, False]
    assert outcomes == [
        FinishOutcome.ENDED,
        FinishOutcome.FENCED,
        FinishOutcome.ALREADY_FINAL,
        FinishOutcome.ENDED,
        FinishOutcome.FENCED,
        FinishOutcome.ALREADY_FINAL,
    ]
    assert await tokens_of(store, "ok") == ["1", "1"]  # its token, then its end
    assert (await store.get_task_state("ok"))["is_final"] == "1"
    assert await store.read_output("moved") == []
    assert not await store.client.exists(store.keys.task("train"))
    completions = await store.read_completions("0-0")
    assert [f["task_id"] for _, f in completions] == [
        "ok",
        "moved",
        "done",
        "train",
        "known",
        "ok",
    ]
    # Counting is the writer's: each end names its counter by its outcome.
    ok = end("ok", NodeEndKind.FINISH)
    assert [ok.counted_stat(o) for o in FinishOutcome] == ["ended_finish", "dup", "fenced"]
    assert await store.get_stats() == {}  # the script counts nothing


async def test_write_node_batch_records_placements_fenced_and_never_over_a_final_state(
    store: Store,
) -> None:
    await store.set_task_state("p", {"status": "queued", ATTEMPT_FIELD: 1})
    await store.set_task_state("moved", {"status": "queued", ATTEMPT_FIELD: 2})
    await store.set_task_state("ended", {"status": "queued", ATTEMPT_FIELD: 1})
    placed = {"status": "placed", "node_id": 3, "placed_t": 12.5}
    end = NodeEnd(
        "ended",
        1,
        NodeEndKind.FINISH,
        {"task_id": "ended", "attempt": 1},
        stat="s",
        duplicate_stat="d",
        fenced_stat="f",
        status="completed",
    )
    result = await store.write_node_batch(
        [("p", 1, {"n": 1})],
        [end],
        places=[("p", 1, placed), ("moved", 1, placed), ("gone", 1, placed)],
    )
    assert result.places == [PlaceOutcome.WRITTEN, PlaceOutcome.FENCED, PlaceOutcome.SKIPPED]
    assert result.written == [True] and result.ends == [FinishOutcome.ENDED]
    state = await store.get_task_state("p")
    assert (state["status"], state["node_id"], state["placed_t"]) == ("placed", "3", "12.5")
    assert (await store.get_task_state("moved"))["status"] == "queued"
    assert not await store.client.exists(store.keys.task("gone"))  # not created
    # A placement recorded after the task's end never overwrites it.
    again = await store.write_node_batch([], [], places=[("ended", 1, placed)])
    assert again.places == [PlaceOutcome.SKIPPED]
    assert (await store.get_task_state("ended"))["status"] == "completed"
