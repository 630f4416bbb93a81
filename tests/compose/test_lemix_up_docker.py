"""`lemix up --runtime docker`: the process stack's topology as containers.

The CLI is run as a user runs it (a subprocess, in the foreground); it prints
READY with the published gateway address, serves a mixed load whose every id
is accounted for, and on SIGINT removes every container, network and volume
it made.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import docker
import pytest
from compose_support import LOCAL_REDIS_IMAGE, REPO, has_image
from conftest import RESULTS

from lemix._proto.lemix.v1 import gateway_pb2_grpc
from lemix.harness.faults import Load, account, audit_clean, wait_ready
from lemix.infra.rpc.client import channel
from lemix.stack.containers import PROJECT_LABEL

pytestmark = [pytest.mark.timeout(600)]


async def test_lemix_up_runtime_docker_serves_and_cleans_up(
    docker_client: docker.DockerClient, lemix_image: str, tmp_path: Path
) -> None:
    project = f"lemixup{os.getpid()}"
    redis_image = LOCAL_REDIS_IMAGE if has_image(docker_client, LOCAL_REDIS_IMAGE) else None
    command = [
        sys.executable, "-m", "lemix.cli", "up", "--runtime", "docker",
        "--image", lemix_image, "--project", project,
        "--gateway-port", "0", "--http-port", "0",
        *(["--redis-image", redis_image] if redis_image else []),
    ]  # fmt: skip
    errors = tmp_path / "up.err"
    with errors.open("w") as stderr:
        up = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert up.stdout is not None
        ready = up.stdout.readline()
        assert ready.startswith("READY gateway="), ready + errors.read_text()
        target = ready.split()[1].removeprefix("gateway=")
        async with channel(target) as chan:
            stub = gateway_pb2_grpc.GatewayStub(chan)
            await wait_ready(stub, timeout_s=60)
            load = Load(stub, prompt_tokens=32, max_tokens=16)
            await load.generate_paced(40, 0.05)
            await load.train(20, per_call=10)
            await load.finish_streams(timeout_s=120)
            result = await account(stub, load, timeout_s=120)
            result.assert_nothing_lost()
            assert await audit_clean(stub) == []
            by_state = result.by_state()
            assert by_state.get("TASK_STATE_COMPLETED", 0) == len(result.states), by_state
        RESULTS["lemix_up_docker"] = {"submitted": len(result.states), "lost": 0, **by_state}
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=120) == 0, errors.read_text()
    label = {"label": f"{PROJECT_LABEL}={project}"}
    assert docker_client.containers.list(all=True, filters=label) == []
    assert docker_client.networks.list(filters=label) == []
    assert docker_client.volumes.list(filters=label) == []
