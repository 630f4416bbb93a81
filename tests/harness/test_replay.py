"""`lemix replay` against a whole stack in this process (`task_stack`): every
task is accounted for by id, with unique ids per run, and a task left without
a final state is reported lost and listed by id.

Each test checks the replay's numbers against what the stack itself holds,
read from Redis by task id (every task hash of the run's namespace).
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis_pool import TEST_POOL_SIZE
from task_stack import TaskStack, start_stack

from gateway.tasks import INFO_FIELDS
from lemix.harness.replay import ReplayConfig, format_lost, run_replay
from lemix.infra.store.codec import Fields
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.server import EmbeddedRedis
from lemix.infra.store.store import Store
from lemix.types import Task, TaskKind, TaskRecord, TaskStatus
from lemix.workload import WorkloadConfig, build_workload


@pytest.fixture
def namespace() -> str:
    return f"replay-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def store(redis_server: EmbeddedRedis, namespace: str) -> AsyncIterator[Store]:
    client = aioredis.Redis.from_url(
        redis_server.url, decode_responses=True, max_connections=TEST_POOL_SIZE
    )
    try:
        yield Store(client, RedisKeys(namespace))
    finally:
        await client.aclose()


async def _stack_tasks(store: Store) -> dict[str, Fields]:
    """Every task hash of the namespace, by task id."""
    found: dict[str, Fields] = {}
    cursor = 0
    while True:
        cursor, batch = await store.scan_task_states(cursor, INFO_FIELDS)
        found.update(batch)
        if cursor == 0:
            return found


def _config(stack: TaskStack, **overrides: object) -> ReplayConfig:
    values: dict = {
        "target": stack.gateways[0].address,
        "drain_timeout_s": 20.0,
        "show_progress": False,
        "lookup_deadline_s": 2.0,
        **overrides,
    }
    return ReplayConfig(**values)


async def _replay(config: ReplayConfig, tasks: list[Task]) -> tuple[dict, list[TaskRecord]]:
    records: list[TaskRecord] = []
    metrics = await run_replay(
        config,
        tasks,
        request_rate=1.0,
        train_rate=0.0,
        duration_s=max(t.arrival_s for t in tasks) + 1,
        seed=0,
        records_out=records,
    )
    return metrics, records


def _workload() -> list[Task]:
    workload = build_workload(
        WorkloadConfig(
            request_rate=12.0, train_rate=0.25, duration_s=1.5, seed=4, max_total_tokens=256
        )
    )
    tasks = list(workload.tasks)
    assert any(t.is_training for t in tasks) and any(not t.is_training for t in tasks)
    return tasks


def _training(n: int, num_tokens: int = 200) -> list[Task]:
    return [
        Task(
            task_id=f"trn-{i:06d}",
            kind=TaskKind.TRAINING,
            arrival_s=0.05 * i,
            num_prompt_tokens=num_tokens,
        )
        for i in range(n)
    ]


@pytest.mark.slow
async def test_a_healthy_run_loses_nothing_and_every_id_is_final(
    redis_server: EmbeddedRedis, namespace: str, tmp_path: Path, store: Store
) -> None:
    stack = await start_stack(redis_server.url, namespace, tmp_path)
    try:
        tasks = _workload()
        first, records = await _replay(_config(stack), tasks)
        second, records_again = await _replay(_config(stack), tasks)  # same seed, new run
    finally:
        await stack.close()
    for metrics in (first, second):
        assert metrics["num_lost"] == 0 and metrics["lost_task_ids"] == []
        assert metrics["num_completed"] == len(tasks)
        assert re.fullmatch(r"[0-9a-f]{8}", metrics["run_id"])
    assert first["run_id"] != second["run_id"]
    # Unique ids per run: the rerun's tasks are new tasks, not idempotent repeats.
    ids, ids_again = {r.task_id for r in records}, {r.task_id for r in records_again}
    assert len(ids) == len(ids_again) == len(tasks) and not ids & ids_again
    assert all(r.task_id.startswith(first["run_id"] + "-") for r in records)
    # The stack agrees, by id: every task of both runs has a final state.
    held = await _stack_tasks(store)
    num_training = sum(t.is_training for t in tasks)
    assert len(held) == 2 * len(tasks)
    assert sum(f.get("kind") == "training" for f in held.values()) == 2 * num_training
    assert {f.get("status") for f in held.values()} == {"completed"}
    assert all(f.get("is_final") == "1" for f in held.values())
    inference_ids = {r.task_id for r in records + records_again if r.kind is TaskKind.INFERENCE}
    assert inference_ids <= set(held)


async def test_a_task_left_without_a_final_state_is_lost_and_listed(
    redis_server: EmbeddedRedis, namespace: str, tmp_path: Path, store: Store
) -> None:
    # A node 1,000x slower than the profile: training stays on it past the drain.
    stack = await start_stack(redis_server.url, namespace, tmp_path, time_scale=100.0)
    try:
        metrics, records = await _replay(_config(stack, drain_timeout_s=0.5), _training(3))
        held = await _stack_tasks(store)
    finally:
        await stack.close()
    # The lost ids are exactly the stack's task ids, none of which is final.
    assert metrics["num_lost"] == 3 == len(metrics["lost_task_ids"])
    assert set(metrics["lost_task_ids"]) == set(held)
    assert all(f.get("is_final") != "1" for f in held.values())
    assert all(r.status is None and r.reason.startswith("no final state: ") for r in records)
    assert any("last seen placed on node 0" in r.reason for r in records)
    text = format_lost(metrics)
    assert f"run id: {metrics['run_id']}" in text and "lost tasks: 3" in text
    assert all(task_id in text for task_id in metrics["lost_task_ids"])


@pytest.mark.slow
async def test_a_gateway_that_dies_mid_run_fails_calls_not_the_replay(
    redis_server: EmbeddedRedis, namespace: str, tmp_path: Path
) -> None:
    stack = await start_stack(redis_server.url, namespace, tmp_path)
    try:
        tasks = [
            *_training(4, num_tokens=16),
            *(
                Task(
                    task_id=f"inf-{i:06d}",
                    kind=TaskKind.INFERENCE,
                    arrival_s=0.1 * i,
                    num_prompt_tokens=8,
                    max_output_tokens=4,
                )
                for i in range(30)
            ),
        ]
        tasks.sort(key=lambda t: t.arrival_s)
        replay = asyncio.create_task(_replay(_config(stack, drain_timeout_s=1.0), tasks))
        gateway = stack.gateways.pop()
        # Arrivals run for 3 s: stop the gateway a third of the way in.
        await asyncio.sleep(1.0)
        assert not replay.done()
        await gateway.stop()
        metrics, records = await asyncio.wait_for(replay, 60)
    finally:
        await stack.close()
    assert not replay.exception()
    lost = [r for r in records if r.status is None]
    assert 0 < metrics["num_lost"] == len(lost) == len(metrics["lost_task_ids"])
    # Whatever could not be looked up says so; nothing is silently counted done.
    assert all(r.reason for r in lost)
    assert any("could not be looked up" in r.reason for r in lost)
    completed = [r for r in records if r.status is TaskStatus.COMPLETED]
    assert all(r.kind is TaskKind.INFERENCE for r in completed)  # stream ends, not guesses
    assert len(completed) + len(lost) + metrics["num_rejected"] + metrics["num_failed"] == len(
        tasks
    )


def test_tasks_that_did_not_complete_are_summed_up_by_status_and_code() -> None:
    from lemix.harness.replay import end_reasons

    def record(task_id: str, status: TaskStatus | None, reason: str = "") -> TaskRecord:
        return TaskRecord(task_id, TaskKind.INFERENCE, 0.0, 8, status=status, reason=reason)

    records = [
        record("a", TaskStatus.COMPLETED),
        record("b", TaskStatus.REJECTED, "RESOURCE_EXHAUSTED: 9000 tokens of KV cache need"),
        record("c", TaskStatus.REJECTED, "RESOURCE_EXHAUSTED: again"),
        record("d", TaskStatus.FAILED, "UNAVAILABLE: node 1 died"),
        record("e", TaskStatus.FAILED, "no code here"),
        record("f", None, "no final state: last seen queued"),  # lost: listed by id
    ]
    reasons = end_reasons(records)
    assert reasons == {
        "failed UNAVAILABLE": {"count": 1, "example": "UNAVAILABLE: node 1 died"},
        "failed UNKNOWN": {"count": 1, "example": "no code here"},
        "rejected RESOURCE_EXHAUSTED": {
            "count": 2,
            "example": "RESOURCE_EXHAUSTED: 9000 tokens of KV cache need",
        },
    }
    text = format_lost({"run_id": "r", "lost_task_ids": [], "end_reasons": reasons})
    assert "rejected RESOURCE_EXHAUSTED: 2 (e.g. 'RESOURCE_EXHAUSTED: 9000" in text
