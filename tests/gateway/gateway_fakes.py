"""A test double of the OTHER services for the gateway's tests.

`FakeScheduler` is a real `lemix.v1.Scheduler` gRPC servicer (Cancel,
GetState) that marks itself live and reads the intake stream the gateway
writes, as the scheduler does (the gateway's write decides duplicates and
reused ids), and for each new inference task plays its executor's part per
docs/protocol.md: token messages on ``output:{task_id}`` (the first with
``first``/``version``), then an ``end`` message written with
`Store.finish_task`. On Cancel it records the call, stops the run and writes
the executor's ``CANCELLED`` end. A `Script` says how the next tasks go
(`task_scripts` how one task id goes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import grpc.aio

from lemix._proto.lemix.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from lemix.infra.store.codec import Entry
from lemix.infra.store.store import Store
from lemix.infra.store.task_fields import task_from_fields
from lemix.infra.store.task_hash import GATEWAY_ID_FIELD
from lemix.types import Task, TaskKind, TaskPayload

if TYPE_CHECKING:
    from gateway.service import GatewayService

# `make_gateway(**config_overrides)` (tests/gateway/conftest.py).
GatewayFactory = Callable[..., Awaitable["GatewayService"]]

FAKE_NODE_ID = 7
FAKE_CONSUMER = "fake-scheduler"
STOP_READING_WAIT_S = 2.0
FAKE_WEIGHT_VERSION = 3


@dataclass
class Script:
    """How the fake executor runs each inference task."""

    num_tokens: int | None = None  # None = the task's max_output_tokens
    token_delay_s: float = 0.0
    end_status: str = "completed"
    end_reason: str = ""
    is_held: bool = False  # after the first token, wait until cancelled


@dataclass
class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    store: Store
    address: str = ""  # host:port, set once its server is up
    script: Script = field(default_factory=Script)
    task_scripts: dict[str, Script] = field(default_factory=dict)  # by task id, over `script`
    submitted: list[tuple[Task, TaskPayload]] = field(default_factory=list)  # new ids, as read
    read_at_s: dict[str, float] = field(default_factory=dict)  # monotonic, when read
    cancelled: list[tuple[str, str]] = field(default_factory=list)  # (task_id, reason)
    gateway_ids: list[str] = field(default_factory=list)  # per task read, the gateway it names
    _runs: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _intake: asyncio.Task[None] | None = None
    _is_reading: bool = False

    async def start(self) -> None:
        """Be live (the key gateways check) and read the intake as the scheduler does."""
        await self.store.ensure_group()
        await self.store.mark_scheduler_alive(ttl_s=600.0)
        self._is_reading = True
        self._intake = asyncio.create_task(self._read_intake())

    async def stop_reading(self) -> None:
        """Leave the intake alone (a test plays the scheduler itself)."""
        # First: a read whose cancellation redis-py swallows comes back, and
        # what it returns must stay in the stream (CI, 2026-12-02: a test
        # found its entries taken after this returned).
        self._is_reading = False
        if self._intake is not None:
            self._intake.cancel()
            # Bounded: a read cancelled mid-reply has been seen to never
            # settle in redis-py (CI, 2026-12-02); the test is over either way.
            await asyncio.wait({self._intake}, timeout=STOP_READING_WAIT_S)
            self._intake = None

    async def settle(self) -> None:
        """Take in every task written so far (a test reads `submitted` next)."""
        await self._take(await self.store.read_intake(FAKE_CONSUMER, count=10_000))

    async def _read_intake(self) -> None:
        while self._is_reading:
            entries = await self.store.read_intake(FAKE_CONSUMER, block_ms=20)
            if not self._is_reading:
                return  # stopped while this read was out: left in the stream
            await self._take(entries)

    async def _take(self, entries: list[Entry]) -> None:
        for _, fields in entries:
            task, payload = task_from_fields(fields)
            self.gateway_ids.append(fields.get(GATEWAY_ID_FIELD, ""))
            self.submitted.append((task, payload))
            self.read_at_s[task.task_id] = time.monotonic()
            if task.kind is TaskKind.INFERENCE:
                self._runs[task.task_id] = asyncio.create_task(self._play(task))
        if entries:
            await self.store.ack_intake([entry_id for entry_id, _ in entries])

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "gateways write the intake themselves")
        raise AssertionError  # abort raises

    async def Cancel(
        self, request: common_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.CancelResponse:
        self.cancelled.append((request.task_id, request.reason))
        run = self._runs.pop(request.task_id, None)
        if run is not None:
            run.cancel()
        await self.store.finish_task(
            request.task_id,
            "failed",
            request.reason or "CANCELLED: cancelled",
            output_fields={"type": "end", "node": FAKE_NODE_ID, "t": time.time()},
        )
        return common_pb2.CancelResponse(is_found=run is not None)

    async def GetState(
        self, request: scheduler_pb2.GetStateRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerState:
        return scheduler_pb2.SchedulerState(policy="fake")

    async def _play(self, task: Task) -> None:
        script = self.task_scripts.get(task.task_id, self.script)
        num_tokens = task.max_output_tokens if script.num_tokens is None else script.num_tokens
        for n in range(1, num_tokens + 1):
            if script.token_delay_s:
                await asyncio.sleep(script.token_delay_s)
            fields: dict[str, str | int | float] = {
                "type": "token",
                "n": n,
                "node": FAKE_NODE_ID,
                "t": time.time(),
            }
            if n == 1:
                fields |= {"first": "1", "version": FAKE_WEIGHT_VERSION}
            await self.store.append_output(task.task_id, fields)
            if n == 1 and script.is_held:
                await asyncio.Event().wait()  # until Cancel cancels this run
        await self.store.finish_task(
            task.task_id,
            script.end_status,
            script.end_reason,
            output_fields={"type": "end", "n": num_tokens, "node": FAKE_NODE_ID, "t": time.time()},
        )
        self._runs.pop(task.task_id, None)

    def cancelled_ids(self) -> list[str]:
        return [task_id for task_id, _ in self.cancelled]

    async def close(self) -> None:
        await self.stop_reading()
        runs = list(self._runs.values())
        for run in runs:
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)


async def flushed_stats(gateway: GatewayService, store: Store) -> dict[str, int]:
    """The stack's counters once `gateway`'s batched counters are written."""
    await gateway.servicer.core.counters.flush()
    return await store.get_stats()


class TcpProxy:
    """A real TCP relay to `target_port`, so a test can cut a service's
    connections (a network blip, a Redis restart as its clients see it):
    `cut()` closes every relayed connection and refuses new ones until
    `restore()`, which listens again on the same port."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def url_for(self, url: str) -> str:
        """`url` (of the target) with the proxy's address instead."""
        host, port = self.target
        return url.replace(f"{host}:{port}", f"127.0.0.1:{self.port}", 1)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        if server is not None:
            await server.wait_closed()

    async def restore(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.cut()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}
