"""`lemix audit` as a user runs it (a subprocess) against a whole stack in this
process (`task_stack`): its output and its exit status (0 none, 1 some, 2 an
error it explains)."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from task_stack import TaskStack, eventually, start_stack

from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc
from lemix.cli.main import main
from lemix.infra.rpc.client import channel
from lemix.infra.store.server import EmbeddedRedis

REPO_ROOT = Path(__file__).resolve().parents[2]


async def _audit(*args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `lemix audit ARGS`."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lemix.cli",
        "audit",
        *args,
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.fixture
async def slow_stack(redis_server: EmbeddedRedis, tmp_path: Path) -> AsyncIterator[TaskStack]:
    """One node 1,000x slower than the profile: training stays placed on it."""
    stack = await start_stack(
        redis_server.url, f"audit-{uuid.uuid4().hex[:8]}", tmp_path, time_scale=100.0
    )
    try:
        yield stack
    finally:
        await stack.close()


@pytest.mark.slow
async def test_audit_exit_status_follows_what_it_finds(
    slow_stack: TaskStack, tmp_path: Path
) -> None:
    target = slow_stack.gateways[0].address
    status, out, err = await _audit("--target", target, "--older-than", "0")
    assert (status, err) == (0, "") and "no non-final task older than 0 s" in out

    async with channel(target) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        sample = gateway_pb2.TrainSample(sample_id="audit-0", token_ids=[7] * 200)
        (task_id,) = (
            await stub.Train(gateway_pb2.TrainRequest(samples=[sample]), timeout=10)
        ).task_ids

        async def is_placed() -> bool:
            info = await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), timeout=5)
            return info.state == gateway_pb2.TASK_STATE_PLACED

        await eventually(is_placed, what=f"{task_id} placed")

    out_json = tmp_path / "audit" / "stuck.json"
    status, out, _ = await _audit("--target", target, "--older-than", "0", "--json", str(out_json))
    assert status == 1
    assert task_id in out and "placed" in out and "1 non-final task(s) older than 0 s" in out
    body = json.loads(out_json.read_text())
    ((row,),) = [body["tasks"]]
    assert (row["task_id"], row["state"], row["node_id"]) == (task_id, "placed", 0)
    assert row["age_s"] >= 0 and body["older_than_s"] == 0

    # The same task is younger than an hour: nothing to report.
    status, out, _ = await _audit("--target", target, "--older-than", "3600")
    assert status == 0 and task_id not in out


async def test_audit_errors_exit_2_with_a_message(tmp_path: Path) -> None:
    status, out, err = await _audit("--target", "127.0.0.1:1", "--deadline", "5")
    assert status == 2 and out == ""
    assert "cannot audit the gateway at 127.0.0.1:1: UNAVAILABLE" in err
    assert "Traceback" not in err


def test_audit_usage_errors_exit_2() -> None:
    assert main(["audit", "--target", "no-port"]) == 2
    assert main(["audit", "--target", "h:1", "--older-than", "-5"]) == 2
    assert main(["audit", "--target", "h:1", "--limit", "0"]) == 2
