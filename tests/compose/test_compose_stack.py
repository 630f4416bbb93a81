"""The shipped compose files, for real: containers, scaling, broken on purpose.

One project (`docker-compose.yml` + `docker-compose.cpu.yml`, emulated
backend, `LEMIX_NUM_NODES=3`) runs for the whole module. Its executors start
as 2 replicas and are scaled to 3 while traffic flows; then one executor
container is killed, the scheduler container restarted and the Redis container
paused for 5 s and an executor cut off the network for 5 s, each during a
load. Every case reads every task id's final
state back through the published gateway (`lemix.harness.faults.account`):
0 lost, 0 ghosts, every failure with a reason. The last test takes the
project down (`down -v`) and checks that nothing of it is left in the engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import docker
import openai
import pytest
from compose_support import REPO, ComposeProject, running_project
from conftest import RESULTS

from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc
from lemix.harness.faults import Accounting, Load, account, audit_clean, wait_ready, wait_until_held
from lemix.infra.rpc.client import channel

pytestmark = [pytest.mark.timeout(900)]

NUM_NODES = 3  # the scheduler plans over node ids 0..2; 2 replicas run at first

Fault = Callable[[gateway_pb2_grpc.GatewayStub], Awaitable[None]]


@pytest.fixture(scope="module")
def project(
    docker_client: docker.DockerClient, lemix_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ComposeProject]:
    with running_project(
        docker_client,
        f"lemixci{os.getpid()}",
        tmp_path_factory.mktemp("compose"),
        {"LEMIX_NUM_NODES": str(NUM_NODES)},
        num_executors=2,
        results=RESULTS,
    ) as stack:
        yield stack


def _record(case: str, load: Load, result: Accounting) -> None:
    by_state = result.by_state()
    failed = {
        i: info.reason
        for i, info in result.states.items()
        if info is not None and info.state != gateway_pb2.TASK_STATE_COMPLETED
    }
    RESULTS[case] = {
        "submitted": len(load.inference_ids) + len(load.training_ids),
        # Refused with UNAVAILABLE before the stack acknowledged them (the
        # client was told; the stack owes nothing): the stack knows no such id.
        "refused_before_ack": by_state.get("NOT_FOUND", 0),
        "completed": by_state.get("TASK_STATE_COMPLETED", 0),
        "failed_with_reason": len(failed) - len(result.no_reason),
        "failed_without_reason": len(result.no_reason),
        "lost": len(result.lost) + len(result.missing_training) + len(result.inconsistent),
        "reasons": sorted({reason.split(":")[0] for reason in failed.values()}),
    }


async def _load_through(
    project: ComposeProject, case: str, fault: Fault, *, num_requests: int = 60
) -> Accounting:
    """A paced mixed load (10 req/s, 1 training sample per request);
    `fault(stub)` runs during it; then every id's final state, judged."""
    async with channel(project.grpc_target) as chan:
        stub = gateway_pb2_grpc.GatewayStub(chan)
        await wait_ready(stub, timeout_s=60)
        load = Load(stub, prompt_tokens=32, max_tokens=16)
        inference = asyncio.create_task(load.generate_paced(num_requests, 0.1))
        training = asyncio.create_task(load.train(num_requests, per_call=10))
        await fault(stub)
        await asyncio.gather(inference, training)
        await load.finish_streams(timeout_s=180)
        result = await account(stub, load, timeout_s=120)
        _record(case, load, result)
        result.assert_nothing_lost()
        assert await audit_clean(stub) == []
        assert result.by_state().get("TASK_STATE_COMPLETED", 0) > len(result.states) // 2
        return result


def test_replay_cli_and_the_openai_client_through_published_ports(
    project: ComposeProject, tmp_path: Path
) -> None:
    out = tmp_path / "replay.json"
    replay = subprocess.run(
        [sys.executable, "-m", "lemix.cli", "replay", "--target", project.grpc_target,
         "--poisson", "5", "--train-rate", "0.3", "--duration", "8", "--seed", "1",
         "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]
    (metrics,) = json.loads(out.read_text())
    assert metrics["lost_task_ids"] == [] and metrics["num_completed"] > 0, metrics

    client = openai.OpenAI(base_url=f"{project.http_base_url}/v1", api_key="unused", timeout=60)
    (model,) = [m.id for m in client.models.list().data]
    completion = client.completions.create(model=model, prompt="Hello", max_tokens=8)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    chunks = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    RESULTS["replay_cli"] = {
        "submitted": metrics["num_inference"] + metrics["num_training"],
        "completed": metrics["num_completed"],
        "failed": metrics["num_failed"],
        "rejected": metrics["num_rejected"],
        "lost": len(metrics["lost_task_ids"]),
    }


async def test_scale_executors_2_to_3_while_traffic_flows(project: ComposeProject) -> None:
    assert set(project.node_ids()) == {0, 1}

    async def scale(stub: gateway_pb2_grpc.GatewayStub) -> None:
        await asyncio.sleep(1.0)
        took_s = await asyncio.to_thread(project.up, NUM_NODES, "--no-recreate")
        RESULTS["scale_seconds"] = round(took_s, 1)
        await asyncio.to_thread(project.wait_for_claim, 2)

    # 20 s of load: the new replica starts, claims id 2 and then takes work.
    result = await _load_through(project, "scale_2_to_3", scale, num_requests=200)
    assert set(project.node_ids()) == {0, 1, 2}
    # The new node is served work: some of this load completed on node 2.
    on_new = [
        i
        for i, info in result.states.items()
        if info is not None and info.HasField("node_id") and info.node_id == 2
    ]
    assert on_new, "the scaled-out executor (node 2) received no work"
    RESULTS["scale_2_to_3"]["completed_on_new_node"] = len(on_new)


async def test_kill_an_executor_container(project: ComposeProject) -> None:
    async def kill(stub: gateway_pb2_grpc.GatewayStub) -> None:
        assert await wait_until_held(stub, 0), "node 0 never held work"
        project.node_ids()[0].kill()

    await _load_through(project, "executor_kill", kill)
    # Back to 3 executors for the cases after this one (the restart policy
    # leaves a killed container stopped; `up` starts it and it reclaims its id).
    await asyncio.to_thread(project.up, NUM_NODES)
    await asyncio.to_thread(project.wait_for_claim, 0)


async def test_restart_the_scheduler_container(project: ComposeProject) -> None:
    async def restart(stub: gateway_pb2_grpc.GatewayStub) -> None:
        await asyncio.sleep(1.5)
        await asyncio.to_thread(project.container("scheduler").restart, timeout=10)

    await _load_through(project, "scheduler_restart", restart)


async def test_pause_the_redis_container_for_5_s(project: ComposeProject) -> None:
    async def pause(stub: gateway_pb2_grpc.GatewayStub) -> None:
        await asyncio.sleep(1.5)
        redis = project.container("redis")
        redis.pause()
        try:
            await asyncio.sleep(5.0)
        finally:
            redis.unpause()

    await _load_through(project, "redis_pause_5s", pause)


async def test_cut_an_executor_off_the_network_for_5_s(project: ComposeProject) -> None:
    async def partition(stub: gateway_pb2_grpc.GatewayStub) -> None:
        assert await wait_until_held(stub, 1), "node 1 never held work"
        container = project.node_ids()[1]
        await asyncio.to_thread(project.partition, container, 5.0)

    await _load_through(project, "executor_partition_5s", partition)


def test_down_leaves_nothing_behind(project: ComposeProject) -> None:
    start_s = time.monotonic()
    project.down()
    RESULTS["down_seconds"] = round(time.monotonic() - start_s, 1)
    assert project.leftovers() == {"containers": [], "volumes": [], "networks": []}
