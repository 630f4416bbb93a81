"""`GrpcDispatcher`'s channels to the executors, against a real gRPC server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import grpc.aio

from lemix._proto.lemix.v1 import executor_pb2, executor_pb2_grpc
from lemix.types import Placement, Task, TaskKind
from services.scheduler.adapters import GrpcDispatcher
from services.scheduler.ports import DispatchError, TaskRefused


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
    refuses the tasks named in `refuse` (per task, as the real one does)."""

    def __init__(self, *, knows_many: bool = True) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.refuse: dict[str, str] = {}
        self.records: set[str] = set()  # tasks whose placed state it says it writes
        self.knows_many = knows_many

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
    assert executor.calls == [("DispatchMany", ["a", "b", "c"])]
    # Each caller learns whether the executor records its placement.
    assert outcomes[0] is False and outcomes[2] is True
    refused = outcomes[1]
    assert isinstance(refused, TaskRefused) and refused.status == "INVALID_ARGUMENT"
    assert "max_output_tokens must be > 0" in refused.reason
    # A lone dispatch is a plain Dispatch.
    executor.calls.clear()
    assert await _dispatch_all(executor, tmp_path, ["d"]) == [True]
    assert executor.calls == [("Dispatch", ["d"])]


async def test_an_executor_without_dispatch_many_gets_one_dispatch_each(tmp_path: Path) -> None:
    executor = RecordingExecutor(knows_many=False)
    executor.refuse["y"] = "no"
    outcomes = await _dispatch_all(executor, tmp_path, ["x", "y"])
    assert executor.calls == [("Dispatch", ["x"]), ("Dispatch", ["y"])]
    assert outcomes[0] is False and isinstance(outcomes[1], TaskRefused)
