"""A client generated from protos/ alone talks to a running gateway.

What a user of another language does: run protoc (here grpc_tools.protoc)
over the .proto files, with nothing of this repository's Python, into an
empty directory; then call Generate (one choice, then n = 2) and GetTask on a
live stack (real Redis, scheduler, emulated executor, gateway over gRPC). The client runs in its own
interpreter whose `lemix` package is the generated one, so it cannot lean on
the checked-in stubs in lemix/_proto.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from task_stack import TaskStack, start_stack

from lemix.infra.store.server import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "protos"
CLIENT_TIMEOUT_S = 60.0

CLIENT = r"""
import json, sys, time
import grpc
import lemix
from lemix.v1 import gateway_pb2, gateway_pb2_grpc

address, out_dir = sys.argv[1], sys.argv[2]
assert lemix.__file__.startswith(out_dir), lemix.__file__  # the generated package
with grpc.insecure_channel(address) as channel:
    stub = gateway_pb2_grpc.GatewayStub(channel)
    request = gateway_pb2.GenerateRequest(
        request_id="protoc-client-1", prompt_token_ids=[5] * 8, max_tokens=4
    )
    messages = list(stub.Generate(request, timeout=30))
    task_id = messages[-1].request_id
    choices = gateway_pb2.GenerateRequest(
        request_id="protoc-client-n", prompt_token_ids=[5] * 8, max_tokens=2, n=2
    )
    finals = [m for m in stub.Generate(choices, timeout=30) if m.is_finished]
    deadline = time.monotonic() + 10
    while True:
        info = stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), timeout=5)
        if info.is_final or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    try:
        stub.GetTask(gateway_pb2.GetTaskRequest(task_id=""), timeout=5)
        empty_code = "OK"
    except grpc.RpcError as err:
        empty_code = err.code().name
print(json.dumps({
    "task_id": task_id,
    "is_finished": messages[-1].is_finished,
    "num_output_tokens": messages[-1].num_output_tokens,
    "state": gateway_pb2.TaskState.Name(info.state),
    "info_tokens": info.num_output_tokens,
    "empty_code": empty_code,
    "choices": sorted([m.index, m.request_id, m.num_output_tokens] for m in finals),
}))
"""


def _generate_client(out: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            *protos,
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    # protoc writes modules, not packages: make lemix/ and lemix/v1/ regular
    # packages, so they win over any installed `lemix` on the path.
    for package in (out / "lemix", out / "lemix" / "v1"):
        (package / "__init__.py").touch()


@pytest.fixture
async def stack(
    redis_server: EmbeddedRedis, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[TaskStack]:
    s = await start_stack(redis_server.url, f"protoc-{request.node.name[:20]}", tmp_path)
    try:
        yield s
    finally:
        await s.close()


async def test_a_client_generated_from_protos_alone_calls_the_gateway(
    stack: TaskStack, tmp_path: Path
) -> None:
    out = tmp_path / "client"
    out.mkdir()
    _generate_client(out)
    assert (out / "lemix" / "v1" / "gateway_pb2_grpc.py").is_file()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(out)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CLIENT,
        stack.gateways[0].address,
        str(out),
        cwd=out,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), CLIENT_TIMEOUT_S)
    assert process.returncode == 0, stderr.decode()
    result = json.loads(stdout.decode().strip().splitlines()[-1])
    assert result == {
        "task_id": "protoc-client-1",
        "is_finished": True,
        "num_output_tokens": 4,
        "state": "TASK_STATE_COMPLETED",
        "info_tokens": 4,
        "empty_code": "INVALID_ARGUMENT",
        "choices": [[0, "protoc-client-n", 2], [1, "protoc-client-n.1", 2]],
    }
