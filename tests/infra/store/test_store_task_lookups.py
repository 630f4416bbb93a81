"""`Store`'s task lookups (get_task_states, scan_task_states,
read_intake_entries) against a real Redis."""

from __future__ import annotations

import redis.asyncio as aioredis

from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.store import Store
from lemix.infra.store.tasks import StoredTask


async def _scan_all(store: Store, count: int = 2) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {}
    cursor = 0
    while True:
        cursor, batch = await store.scan_task_states(cursor, ["status", "node_id"], count)
        found.update(batch)
        if cursor == 0:
            return found


async def test_get_task_states_reads_hash_marker_and_output(redis_client: aioredis.Redis) -> None:
    store = Store(redis_client, RedisKeys("lk"))
    assert await store.submit_task({"task_id": "a", "kind": "training"})
    await store.set_task_state("b", {"status": "placed", "node_id": 2, "payload": "x" * 100})
    await store.append_output("b", {"type": "token", "n": 1})
    states = await store.get_task_states(["a", "b", "c"], ["status", "node_id", "reason"])
    assert states == [
        # The submit writes the task's hash, queued, with its intake entry.
        StoredTask({"status": "queued"}, is_submitted=True, has_output=False),
        StoredTask({"status": "placed", "node_id": "2"}, is_submitted=False, has_output=True),
        StoredTask({}, is_submitted=False, has_output=False),
    ]
    assert await store.get_task_states([], ["status"]) == []


async def test_scan_finds_every_task_hash_of_its_namespace_only(
    redis_client: aioredis.Redis,
) -> None:
    # Glob characters in a namespace are matched literally.
    store = Store(redis_client, RedisKeys("ns*[1]"))
    other = Store(redis_client, RedisKeys("nsX1"))  # unescaped, the pattern would match it
    for i in range(7):
        await store.set_task_state(f"t{i}", {"status": "queued"})
    await other.set_task_state("elsewhere", {"status": "queued"})
    await store.append_output("t0", {"type": "token"})  # a stream, not a task hash
    found = await _scan_all(store)
    assert found == {f"t{i}": {"status": "queued"} for i in range(7)}


async def test_read_intake_entries_oldest_first(redis_client: aioredis.Redis) -> None:
    store = Store(redis_client, RedisKeys("in"))
    for i in range(3):
        assert await store.submit_task({"task_id": f"q{i}", "kind": "inference"})
    entries = await store.read_intake_entries()
    assert [fields["task_id"] for _, fields in entries] == ["q0", "q1", "q2"]
    assert [f["task_id"] for _, f in await store.read_intake_entries(count=2)] == ["q0", "q1"]
    first_id = entries[0][0]
    assert [f["task_id"] for _, f in await store.read_intake_entries(end=first_id)] == ["q0"]
