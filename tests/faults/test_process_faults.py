"""Faults on a live stack of real processes: every task id ends final, with a reason.

Each test runs a mixed load (paced inference streams + Train calls) against
a supervised `lemix up` stack, breaks one process on purpose while it holds
work (SIGKILL, SIGSTOP; the supervisor restarts what died), then reads every
task id's state through the gateway. Passing means, id by id: nothing
acknowledged is left non-final (0 lost), no non-final task is left behind
(`AuditTasks` is empty: 0 ghosts), every failure carries a "STATUS: ..."
reason, and no request the client saw complete is recorded otherwise.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from lemix._proto.lemix.v1 import gateway_pb2
from lemix.harness.faults import (
    Load,
    account,
    audit_clean,
    fault_stack,
    final_states,
    wait_ready,
    wait_until_held,
    wait_until_placed,
)

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


async def _run_with_fault(
    tmp_path: Path, name: str, sig: int, *, resume_after_s: float | None = None
) -> None:
    async with fault_stack(tmp_path) as (stack, stub):
        await wait_ready(stub)
        load = Load(stub)
        inference = asyncio.create_task(load.generate_paced(40, 0.1))
        training = asyncio.create_task(load.train(80, per_call=10))
        if name.startswith("executor-"):
            node_id = int(name.split("-")[1])
            assert await wait_until_held(stub, node_id), f"node {node_id} never held work"
        else:
            await asyncio.sleep(1.0)
        pid = stack.pid(name)
        stack.kill(name, sig)
        if resume_after_s is not None:
            await asyncio.sleep(resume_after_s)
            stack.kill(name, signal.SIGCONT)
        else:
            await stack.wait_restarted(name, timeout_s=60)
            assert stack.pid(name) != pid
        await asyncio.gather(inference, training)
        await load.finish_streams()
        result = await account(stub, load)
        result.assert_nothing_lost()
        assert await audit_clean(stub) == []
        # The load really ran through the fault: most of it completed.
        assert result.by_state().get("TASK_STATE_COMPLETED", 0) > len(result.states) // 2


async def test_executor_sigkill_loses_nothing(tmp_path: Path) -> None:
    await _run_with_fault(tmp_path, "executor-0", signal.SIGKILL)


async def test_executor_sigstop_past_its_heartbeat_loses_nothing(tmp_path: Path) -> None:
    # 4 s stopped: well past the 1.5 s heartbeat TTL, so node 0 is declared
    # down, its work moves or fails; then it wakes up holding stale work.
    await _run_with_fault(tmp_path, "executor-0", signal.SIGSTOP, resume_after_s=4.0)


async def test_scheduler_sigkill_and_supervised_restart_loses_nothing(tmp_path: Path) -> None:
    await _run_with_fault(tmp_path, "scheduler", signal.SIGKILL)


async def test_redis_sigkill_and_aof_restart_loses_nothing(tmp_path: Path) -> None:
    await _run_with_fault(tmp_path, "redis", signal.SIGKILL)


async def test_gateway_sigkill_cancels_its_orphaned_streams(tmp_path: Path) -> None:
    async with fault_stack(tmp_path, time_scale=1.0) as (stack, stub):
        await wait_ready(stub)
        load = Load(stub)
        # Long streams (~1,000 decode steps at full profile speed): still
        # running when the gateway that reads them dies.
        ids = [load.generate(max_tokens=1000) for _ in range(6)]
        # Every stream acknowledged and running before the kill: a request
        # still inside the gateway was never acknowledged (never written).
        assert await wait_until_placed(stub, set(ids)) == set()
        stack.kill("gateway", signal.SIGKILL)
        killed_s = time.monotonic()
        await stack.wait_restarted("gateway", timeout_s=60)
        await load.finish_streams()
        assert all(load.seen[i].code == "UNAVAILABLE" for i in ids), load.seen
        # Nobody reads them any more: the scheduler cancels them once their
        # leases lapse (3 s TTL, checked every 0.5 s), long before they end.
        states = await final_states(stub, set(ids), timeout_s=30)
        ended_s = time.monotonic() - killed_s
        assert all(
            states[i] is not None
            and states[i].state  # type: ignore[union-attr]
            == gateway_pb2.TASK_STATE_CANCELLED
            for i in ids
        ), states
        assert ended_s < 20.0
        assert await audit_clean(stub) == []


async def test_ten_thousand_sample_train_every_task_ends(tmp_path: Path) -> None:
    env = {"LEMIX_MAX_TRAIN_SAMPLES": "10000"}
    async with fault_stack(tmp_path, time_scale=0.002, extra_env=env) as (_, stub):
        await wait_ready(stub)
        load = Load(stub, prompt_tokens=16)
        await load.train(10_000, per_call=10_000, deadline_s=120)
        assert len(load.training_ids) == 10_000
        result = await account(stub, load, timeout_s=240)
        result.assert_nothing_lost()
        assert result.by_state() == {"TASK_STATE_COMPLETED": 10_000}
        assert await audit_clean(stub) == []


async def test_a_flood_at_ten_times_capacity_is_refused_cleanly(tmp_path: Path) -> None:
    env = {"LEMIX_MAX_IN_FLIGHT": "32"}
    async with fault_stack(tmp_path, extra_env=env) as (_, stub):
        await wait_ready(stub)
        load = Load(stub, max_tokens=16)
        for _ in range(320):
            load.generate()
        await load.finish_streams()
        codes = {seen.code for seen in load.seen.values()}
        # Either served or refused for load, with the status a client backs off on.
        assert codes <= {"", "RESOURCE_EXHAUSTED"}, codes
        assert any(seen.code == "RESOURCE_EXHAUSTED" for seen in load.seen.values())
        assert any(seen.is_completed for seen in load.seen.values())
        result = await account(stub, load)
        result.assert_nothing_lost()
        refused = [i for i, s in load.seen.items() if s.code == "RESOURCE_EXHAUSTED"]
        # Refused before Submit: the stack never acknowledged them.
        assert all(result.states[i] is None for i in refused)
        assert await audit_clean(stub) == []
