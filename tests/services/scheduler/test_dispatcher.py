"""`GrpcDispatcher`'s channels to the executors, against a real gRPC server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

import grpc
import grpc.aio
import pytest
from waiting import wait_until

from lemix._proto.lemix.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from lemix.types import Placement, Task, TaskKind
from services.scheduler.adapters import GrpcDispatcher
from services.scheduler.dispatch_stream import DispatchLink, LinkError
from services.scheduler.ports import DispatchError, TaskRefused

T = TypeVar("T")


async def test_a_new_node_address_starts_connecting_before_any_dispatch(tmp_path: Path) -> None:
    # The node's first Dispatch must not also pay the TCP and HTTP/2
    # handshakes: the channel connects when the address is learned. A lazy
    # channel stays IDLE until its first call, and this test then times out.
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    dispatcher = GrpcDispatcher(
        deadline_s=1.0, weight_sync_deadline_s=1.0, weight_sync_dir=str(tmp_path)
    )
    try:
        address = f"127.0.0.1:{port}"
        await dispatcher.set_address(0, address)
        ch = dispatcher._channels[address]
        async with asyncio.timeout(5.0):
            while (state := ch.get_state()) is not grpc.ChannelConnectivity.READY:
                await ch.wait_for_state_change(state)
        await dispatcher.set_address(0, address)  # a heartbeat again: the same channel
        assert dispatcher._channels == {address: ch}
    finally:
        await dispatcher.close()
        await server.stop(None)


class RecordingExecutor(executor_pb2_grpc.ExecutorServicer):
    """A test double of the executor: records each call's task ids and
    refuses the tasks named in `refuse` (per task, as the real one does).
    While `answering` is clear, stream calls are read but not answered."""

    def __init__(self, *, knows_stream: bool = True, knows_many: bool = True) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.refuse: dict[str, str] = {}
        self.records: set[str] = set()  # tasks whose placed state it says it writes
        self.knows_stream = knows_stream
        self.knows_many = knows_many
        self.num_streams = 0
        self.answering = asyncio.Event()
        self.answering.set()

    async def Dispatch(
        self, request: executor_pb2.DispatchRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.DispatchResponse:
        self.calls.append(("Dispatch", [request.task.task_id]))
        if request.task.task_id in self.refuse:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.refuse[request.task.task_id])
        return executor_pb2.DispatchResponse(
            is_accepted=True, is_placement_recorded=request.task.task_id in self.records
        )

    async def DispatchMany(
        self, request: executor_pb2.DispatchManyRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.DispatchManyResponse:
        if not self.knows_many:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        self.calls.append(("DispatchMany", [d.task.task_id for d in request.dispatches]))
        return self._answer(request)

    async def DispatchStream(
        self,
        requests: AsyncIterator[executor_pb2.DispatchStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[executor_pb2.DispatchStreamResponse]:
        if not self.knows_stream:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        self.num_streams += 1
        async for request in requests:
            self.calls.append(("DispatchStream", [d.task.task_id for d in request.call.dispatches]))
            await self.answering.wait()
            reply = self._answer(request.call)
            yield executor_pb2.DispatchStreamResponse(call_id=request.call_id, reply=reply)

    def _answer(
        self, request: executor_pb2.DispatchManyRequest
    ) -> executor_pb2.DispatchManyResponse:
        results = [
            executor_pb2.DispatchResult(
                error_code="INVALID_ARGUMENT", error_message=self.refuse[d.task.task_id]
            )
            if d.task.task_id in self.refuse
            else executor_pb2.DispatchResult(
                is_accepted=True, is_placement_recorded=d.task.task_id in self.records
            )
            for d in request.dispatches
        ]
        return executor_pb2.DispatchManyResponse(results=results)


async def _dispatch_all(
    executor: RecordingExecutor, tmp_path: Path, task_ids: list[str]
) -> list[BaseException | bool]:
    """Dispatch every task to node 0 at once, as the core sends a round."""
    server = grpc.aio.server()
    executor_pb2_grpc.add_ExecutorServicer_to_server(executor, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    dispatcher = GrpcDispatcher(
        deadline_s=5.0, weight_sync_deadline_s=1.0, weight_sync_dir=str(tmp_path)
    )
    try:
        await dispatcher.set_address(0, f"127.0.0.1:{port}")

        async def one(task_id: str) -> BaseException | bool:
            task = Task(task_id, TaskKind.INFERENCE, 0.0, 4, 2)
            try:
                return await dispatcher.dispatch(Placement(task_id, 0, 0.1, 0.0), task)
            except DispatchError as exc:
                return exc

        return list(await asyncio.gather(*(one(t) for t in task_ids)))
    finally:
        await dispatcher.close()
        await server.stop(None)


async def test_one_ticks_dispatches_to_a_node_go_as_one_call(tmp_path: Path) -> None:
    executor = RecordingExecutor()
    executor.refuse["b"] = "max_output_tokens must be > 0"
    executor.records = {"c", "d"}
    outcomes = await _dispatch_all(executor, tmp_path, ["a", "b", "c"])
    assert executor.calls == [("DispatchStream", ["a", "b", "c"])]
    # Each caller learns whether the executor records its placement.
    assert outcomes[0] is False and outcomes[2] is True
    refused = outcomes[1]
    assert isinstance(refused, TaskRefused) and refused.status == "INVALID_ARGUMENT"
    assert "max_output_tokens must be > 0" in refused.reason
    # A lone dispatch goes on the stream too.
    executor.calls.clear()
    assert await _dispatch_all(executor, tmp_path, ["d"]) == [True]
    assert executor.calls == [("DispatchStream", ["d"])]


async def test_an_executor_without_dispatch_stream_gets_dispatch_many(tmp_path: Path) -> None:
    executor = RecordingExecutor(knows_stream=False)
    executor.refuse["b"] = "no"
    outcomes = await _dispatch_all(executor, tmp_path, ["a", "b"])
    assert executor.calls == [("DispatchMany", ["a", "b"])]
    assert outcomes[0] is False and isinstance(outcomes[1], TaskRefused)
    executor.calls.clear()
    assert await _dispatch_all(executor, tmp_path, ["c"]) == [False]
    assert executor.calls == [("Dispatch", ["c"])]


async def test_an_executor_without_dispatch_many_gets_one_dispatch_each(tmp_path: Path) -> None:
    executor = RecordingExecutor(knows_stream=False, knows_many=False)
    executor.refuse["y"] = "no"
    outcomes = await _dispatch_all(executor, tmp_path, ["x", "y"])
    assert executor.calls == [("Dispatch", ["x"]), ("Dispatch", ["y"])]
    assert outcomes[0] is False and isinstance(outcomes[1], TaskRefused)


async def _start(executor: RecordingExecutor, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    executor_pb2_grpc.add_ExecutorServicer_to_server(executor, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def _dispatch(dispatcher: GrpcDispatcher, task_id: str) -> BaseException | bool:
    task = Task(task_id, TaskKind.INFERENCE, 0.0, 4, 2)
    try:
        return await dispatcher.dispatch(Placement(task_id, 0, 0.1, 0.0), task)
    except DispatchError as exc:
        return exc


async def _silent_node(
    tmp_path: Path, *, deadline_s: float
) -> tuple[RecordingExecutor, grpc.aio.Server, int, GrpcDispatcher]:
    """Node 0: an executor that reads stream calls and answers none (until
    `answering` is set), and a dispatcher that knows its address."""
    executor = RecordingExecutor()
    executor.answering.clear()
    server, port = await _start(executor)
    dispatcher = GrpcDispatcher(
        deadline_s=deadline_s, weight_sync_deadline_s=1.0, weight_sync_dir=str(tmp_path)
    )
    await dispatcher.set_address(0, f"127.0.0.1:{port}")
    return executor, server, port, dispatcher


async def test_a_call_the_stream_drops_unanswered_fails_as_maybe_taken(tmp_path: Path) -> None:
    # The executor read the call and went away before answering: the task
    # may run there, so it must be fenced (maybe taken), not just moved.
    executor, server, port, dispatcher = await _silent_node(tmp_path, deadline_s=10.0)
    try:
        pending = asyncio.create_task(_dispatch(dispatcher, "a"))
        await wait_until(lambda: executor.calls == [("DispatchStream", ["a"])])
        await server.stop(None)
        outcome = await asyncio.wait_for(pending, 5.0)
        assert isinstance(outcome, DispatchError) and not isinstance(outcome, TaskRefused)
        assert outcome.is_maybe_taken
        # The node comes back: the next dispatch opens a new stream.
        executor.answering.set()
        server, _ = await _start(executor, port)
        assert await asyncio.wait_for(_dispatch(dispatcher, "b"), 5.0) is False
        assert executor.num_streams == 2
    finally:
        await dispatcher.close()
        await server.stop(None)


async def test_a_call_past_its_deadline_fails_as_maybe_taken_and_drops_the_stream(
    tmp_path: Path,
) -> None:
    executor, server, _, dispatcher = await _silent_node(tmp_path, deadline_s=0.2)
    try:
        outcome = await _dispatch(dispatcher, "slow")
        assert isinstance(outcome, DispatchError) and outcome.is_maybe_taken
        assert "DEADLINE_EXCEEDED" in str(outcome)
        executor.answering.set()  # the node answers again: a new stream carries the next call
        assert await _dispatch(dispatcher, "next") is False
        assert executor.num_streams == 2
    finally:
        await dispatcher.close()
        await server.stop(None)


class ReversingExecutor(executor_pb2_grpc.ExecutorServicer):
    """Reads two stream calls, answers the second first; each result names its task."""

    async def DispatchStream(
        self,
        requests: AsyncIterator[executor_pb2.DispatchStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[executor_pb2.DispatchStreamResponse]:
        calls = [request async for request in _take(requests, 2)]
        for request in reversed(calls):
            names = [
                executor_pb2.DispatchResult(error_code="X", error_message=d.task.task_id)
                for d in request.call.dispatches
            ]
            reply = executor_pb2.DispatchManyResponse(results=names)
            yield executor_pb2.DispatchStreamResponse(call_id=request.call_id, reply=reply)


async def _take(items: AsyncIterator[T], num: int) -> AsyncIterator[T]:
    async for item in items:
        yield item
        num -= 1
        if num == 0:
            return


async def test_a_links_calls_are_matched_to_their_answers_by_id() -> None:
    server = grpc.aio.server()
    executor_pb2_grpc.add_ExecutorServicer_to_server(ReversingExecutor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    link = DispatchLink(executor_pb2_grpc.ExecutorStub(ch))
    try:

        def call(*task_ids: str) -> executor_pb2.DispatchManyRequest:
            return executor_pb2.DispatchManyRequest(
                dispatches=[
                    executor_pb2.DispatchRequest(task=common_pb2.Task(task_id=t)) for t in task_ids
                ]
            )

        first, second = await asyncio.wait_for(
            asyncio.gather(link.call(call("a"), 5.0), link.call(call("b", "c"), 5.0)), 5.0
        )
        assert [r.error_message for r in first.reply.results] == ["a"]
        assert [r.error_message for r in second.reply.results] == ["b", "c"]
        # The executor ended the stream after two calls: the link is broken.
        await wait_until(lambda: link.is_broken)
        with pytest.raises(LinkError):
            await link.call(call("d"), 5.0)
    finally:
        await link.close()
        await ch.close()
        await server.stop(None)
