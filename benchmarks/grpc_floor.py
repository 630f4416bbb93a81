"""What grpc.aio itself costs per call on this host: the floor under the control plane.

A server process and this client, both on uvloop (the services' loop), one
loopback channel, a tiny payload, an open-loop rate like `control_plane.py`'s.
Three shapes, each the one a hop of the request path uses:

  unary        a unary call (the scheduler's Dispatch before 12-03; Cancel, Submit)
  server-stream a call answered by one streamed message (the gateway's Generate
               of one token)
  stream-msg   one request and one reply message on a long-lived bidirectional
               stream (the scheduler's DispatchStream since 12-03)

For each, the CPU milliseconds per call of the server process and of the
client process (`/proc` and `time.process_time`), alternated `--repeats`
times so a change in the host's speed hits every shape alike.

    .venv/bin/python benchmarks/grpc_floor.py --rate 200 --json runs/bench/grpc_floor.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.host_load import describe, host_load  # noqa: E402
from lemix.infra.service_main import loop_factory  # noqa: E402
from lemix.report.metrics import format_table  # noqa: E402

SHAPES = ("unary", "server-stream", "stream-msg")
_SERVICE = "floor.Floor"
_REPLY = b"r" * 16
_REQUEST = b"q" * 64
_WARM_UP_CALLS = 50
_SERVER_START_S = 30.0


def _identity(data: bytes) -> bytes:
    return data


async def _serve(port_file: Path) -> None:
    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return _REPLY

    async def server_stream(
        request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        yield _REPLY

    async def bidi(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for _ in requests:
            yield _REPLY

    handlers = grpc.method_handlers_generic_handler(
        _SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, _identity, _identity),
            "ServerStream": grpc.unary_stream_rpc_method_handler(
                server_stream, _identity, _identity
            ),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi, _identity, _identity),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handlers,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_file.write_text(str(port))
    await server.wait_for_termination()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(
    channel: grpc.aio.Channel, shape: str, rate: float, num_calls: int, server_pid: int
) -> dict[str, Any]:
    unary = channel.unary_unary(f"/{_SERVICE}/Unary", _identity, _identity)
    server_stream = channel.unary_stream(f"/{_SERVICE}/ServerStream", _identity, _identity)
    stream = channel.stream_stream(f"/{_SERVICE}/Bidi", _identity, _identity)()

    async def call_unary() -> None:
        await unary(_REQUEST, timeout=10.0)

    async def call_server_stream() -> None:
        async for _ in server_stream(_REQUEST, timeout=10.0):
            pass

    async def message() -> None:  # one in flight at a time on the stream
        await stream.write(_REQUEST)
        await stream.read()

    one: Callable[[], Awaitable[None]] = {
        "unary": call_unary,
        "server-stream": call_server_stream,
        "stream-msg": message,
    }[shape]
    for _ in range(_WARM_UP_CALLS):
        await one()
    server0, client0 = _cpu_s(server_pid), time.process_time()
    start = time.perf_counter()
    if shape == "stream-msg":
        for i in range(num_calls):
            await one()
            await asyncio.sleep(max(0.0, start + (i + 1) / rate - time.perf_counter()))
    else:
        calls = []
        for i in range(num_calls):
            calls.append(asyncio.ensure_future(one()))
            await asyncio.sleep(max(0.0, start + (i + 1) / rate - time.perf_counter()))
        await asyncio.gather(*calls)
    wall_s = time.perf_counter() - start
    server_ms = (_cpu_s(server_pid) - server0) * 1e3 / num_calls
    client_ms = (time.process_time() - client0) * 1e3 / num_calls
    await stream.done_writing()
    return {
        "shape": shape,
        "rate": rate,
        "num_calls": num_calls,
        "achieved_rps": num_calls / wall_s,
        "server_cpu_ms": server_ms,
        "client_cpu_ms": client_ms,
        "both_cpu_ms": server_ms + client_ms,
    }


async def _run(args: argparse.Namespace, port_file: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)], env=env)
    try:
        deadline = time.monotonic() + _SERVER_START_S
        while not port_file.exists() or not port_file.read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the benchmark's gRPC server did not start")
            await asyncio.sleep(0.05)
        rows: list[dict[str, Any]] = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port_file.read_text()}") as channel:
            for _ in range(args.repeats):
                for shape in SHAPES:
                    rows.append(
                        await _measure(channel, shape, args.rate, args.num_calls, server.pid)
                    )
        return rows
    finally:
        server.kill()
        server.wait()


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for shape in SHAPES:
        mine = [r for r in rows if r["shape"] == shape]
        out.append(
            {
                "shape": shape,
                "runs": len(mine),
                "server": statistics.median(r["server_cpu_ms"] for r in mine),
                "client": statistics.median(r["client_cpu_ms"] for r in mine),
                "both": statistics.median(r["both_cpu_ms"] for r in mine),
                "both_min": min(r["both_cpu_ms"] for r in mine),
                "both_max": max(r["both_cpu_ms"] for r in mine),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=200.0, help="calls per second")
    parser.add_argument("--num-calls", type=int, default=1000, help="calls per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the shapes")
    parser.add_argument("--json", type=Path, help="write the rows and the summary here")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the server process
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=loop_factory("uvloop")) as runner:  # the services' loop
        if args.serve is not None:
            runner.run(_serve(args.serve))
            return
        load = host_load()
        print(describe(load))
        with tempfile.TemporaryDirectory(prefix="lemix-grpc-floor-") as tmp:
            rows = runner.run(_run(args, Path(tmp) / "port"))
    summary = _summary(rows)
    print(
        f"grpc.aio CPU per call at {args.rate:g}/s, median of {args.repeats} "
        "(ms; server process + client process)"
    )
    print(
        format_table(
            summary,
            [
                ("shape", "shape"),
                ("runs", "runs"),
                ("server", "server"),
                ("client", "client"),
                ("both", "both"),
                ("both_min", "both min"),
                ("both_max", "both max"),
            ],
        )
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": "grpc_floor",
            "host_at_start": load,
            "grpc": grpc.__version__,
            "python": sys.version.split()[0],
            "rows": rows,
            "summary": summary,
        }
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
