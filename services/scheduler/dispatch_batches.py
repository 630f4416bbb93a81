"""Dispatches to one node gathered per event-loop tick into one `DispatchMany`.

The core sends a planning round's placements concurrently (one `dispatch`
call per task, bounded by its dispatch slots), so the calls of one round
reach `GrpcDispatcher` in the same tick. `NodeDispatchBatcher` queues each
call's request and, on the next tick, sends everything queued for the node
as one `DispatchMany` (at most `MAX_DISPATCHES_PER_CALL` per call) on the
node's open `DispatchStream` (`dispatch_stream.DispatchLink`), then settles
each caller with its own outcome (whether the executor records the task's
placed state itself, `DispatchResponse.is_placement_recorded`): a task the
executor refused fails only that call (`TaskRefused`, or a node-fault
`DispatchError` when its status says the node cannot take it), a failed
call fails every task it carried. A call the stream dropped unanswered (the
node stopped, the connection failed, no answer within the deadline) may
have reached the node: its tasks fail as maybe taken, so their attempts are
fenced before they go elsewhere.

Older executors: one without `DispatchStream` (UNIMPLEMENTED) is sent unary
`DispatchMany` calls from then on (a lone request as a plain `Dispatch`,
failures mapped by `dispatch_error`); one without `DispatchMany` either,
plain Dispatches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import grpc.aio
import structlog

from lemix._proto.lemix.v1 import executor_pb2, executor_pb2_grpc
from services.scheduler.dispatch_stream import DispatchLink, LinkError
from services.scheduler.ports import DispatchError, TaskRefused

log = structlog.get_logger(__name__)

# One DispatchMany carries at most this many tasks: a call's payload stays
# small (gRPC's default limit is 4 MiB a message), and the executor answers
# it within the same deadline as one Dispatch.
MAX_DISPATCHES_PER_CALL = 64

# Status names a task's result may carry that mean "this node cannot take
# it now" (it is shutting down, or an earlier attempt still runs there): the
# task goes elsewhere, as when its Dispatch fails UNAVAILABLE.
_NODE_FAULT_NAMES = frozenset({grpc.StatusCode.UNAVAILABLE.name})

Pending = tuple[executor_pb2.DispatchRequest, "asyncio.Future[bool]"]
# A Dispatch's outcome: whether the executor records the placement, or why it failed.
Outcome = bool | Exception


class NodeDispatchBatcher:
    """Per node: the Dispatch requests of one tick, sent together (module doc).

    `stub_of(node_id)` gives the node's executor stub (raising
    `DispatchError` when it has no address); `error_of(node_id, err)` maps a
    failed call (`adapters.dispatch_error`).
    """

    def __init__(
        self,
        stub_of: Callable[[int], executor_pb2_grpc.ExecutorStub],
        error_of: Callable[[int, grpc.aio.AioRpcError], DispatchError],
        deadline_s: float,
    ) -> None:
        self._stub_of = stub_of
        self._error_of = error_of
        self.deadline_s = deadline_s
        self._queued: dict[int, list[Pending]] = {}
        self._sending: set[asyncio.Task[None]] = set()
        self._links: dict[int, DispatchLink] = {}  # each node's open DispatchStream
        self._is_stream_unknown: set[int] = set()  # nodes without DispatchStream
        self._is_many_unknown: set[int] = set()  # nodes without DispatchMany either

    async def dispatch(self, node_id: int, request: executor_pb2.DispatchRequest) -> bool:
        """Send `request` to the node with the others of this tick; True when
        the executor records the task's placed state itself. Raises
        `TaskRefused` or `DispatchError` as a Dispatch of its own would."""
        stub = self._stub_of(node_id)  # no address: fails this call alone, at once
        loop = asyncio.get_running_loop()
        queued = self._queued.get(node_id)
        if queued is None:
            queued = self._queued[node_id] = []
            loop.call_soon(self._send_queued, node_id, stub)
        done: asyncio.Future[bool] = loop.create_future()
        queued.append((request, done))
        return await done

    def _send_queued(self, node_id: int, stub: executor_pb2_grpc.ExecutorStub) -> None:
        queued = self._queued.pop(node_id, [])
        for start in range(0, len(queued), MAX_DISPATCHES_PER_CALL):
            chunk = queued[start : start + MAX_DISPATCHES_PER_CALL]
            task = asyncio.create_task(self._send(node_id, stub, chunk))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(
        self, node_id: int, stub: executor_pb2_grpc.ExecutorStub, chunk: list[Pending]
    ) -> None:
        live = [(request, done) for request, done in chunk if not done.done()]
        if not live:
            return  # every caller went away (cancelled) before the send
        requests = [request for request, _ in live]
        try:
            if node_id not in self._is_stream_unknown:
                outcomes = await self._streamed(node_id, stub, requests)
            else:
                outcomes = await self._unary(node_id, stub, requests)
        except Exception as exc:  # not an RPC error: a bug here fails the calls, not the loop
            outcomes = [exc] * len(live)
        for (_, done), outcome in zip(live, outcomes, strict=True):
            if done.done():
                continue
            if isinstance(outcome, Exception):
                done.set_exception(outcome)
            else:
                done.set_result(outcome)

    async def _streamed(
        self,
        node_id: int,
        stub: executor_pb2_grpc.ExecutorStub,
        requests: list[executor_pb2.DispatchRequest],
    ) -> list[Outcome]:
        link = self._links.get(node_id)
        if link is None or link.is_broken or link.stub is not stub:
            if link is not None:
                link.drop()  # broken already, or the node moved to another address
            link = self._links[node_id] = DispatchLink(stub)
        call = executor_pb2.DispatchManyRequest(dispatches=requests)
        try:
            response = await link.call(call, self.deadline_s)
        except TimeoutError:
            error = DispatchError(
                f"DEADLINE_EXCEEDED: node {node_id} did not answer within {self.deadline_s:g} s",
                is_maybe_taken=True,
            )
            return [error] * len(requests)
        except LinkError as exc:
            if not exc.is_unimplemented:
                error = DispatchError(
                    f"dispatch stream to node {node_id}: {exc}", is_maybe_taken=True
                )
                return [error] * len(requests)
            log.info("dispatch_stream_unknown", node_id=node_id)  # an older executor
            self._is_stream_unknown.add(node_id)
            return await self._unary(node_id, stub, requests)
        if response.error_code:  # the call failed as a whole, as a DispatchMany would
            failed = executor_pb2.DispatchResult(
                error_code=response.error_code, error_message=response.error_message
            )
            return [_outcome(node_id, failed)] * len(requests)
        return self._outcomes(node_id, response.reply, len(requests))

    async def _unary(
        self,
        node_id: int,
        stub: executor_pb2_grpc.ExecutorStub,
        requests: list[executor_pb2.DispatchRequest],
    ) -> list[Outcome]:
        if len(requests) == 1 or node_id in self._is_many_unknown:
            return [await self._one(node_id, stub, request) for request in requests]
        return await self._many(node_id, stub, requests)

    async def _one(
        self,
        node_id: int,
        stub: executor_pb2_grpc.ExecutorStub,
        request: executor_pb2.DispatchRequest,
    ) -> Outcome:
        try:
            reply = await stub.Dispatch(request, timeout=self.deadline_s)
        except grpc.aio.AioRpcError as err:
            return self._error_of(node_id, err)
        if not reply.is_accepted:
            return TaskRefused("FAILED_PRECONDITION", f"node {node_id} did not accept the task")
        return reply.is_placement_recorded

    async def _many(
        self,
        node_id: int,
        stub: executor_pb2_grpc.ExecutorStub,
        requests: list[executor_pb2.DispatchRequest],
    ) -> list[Outcome]:
        try:
            reply = await stub.DispatchMany(
                executor_pb2.DispatchManyRequest(dispatches=requests), timeout=self.deadline_s
            )
        except grpc.aio.AioRpcError as err:
            if err.code() is not grpc.StatusCode.UNIMPLEMENTED:
                return [self._error_of(node_id, err)] * len(requests)
            log.info("dispatch_many_unknown", node_id=node_id)  # an older executor
            self._is_many_unknown.add(node_id)
            return [await self._one(node_id, stub, request) for request in requests]
        return self._outcomes(node_id, reply, len(requests))

    @staticmethod
    def _outcomes(
        node_id: int, reply: executor_pb2.DispatchManyResponse, num_requests: int
    ) -> list[Outcome]:
        if len(reply.results) != num_requests:
            error = DispatchError(
                f"node {node_id} answered {len(reply.results)} results "
                f"for {num_requests} dispatches"
            )
            return [error] * num_requests
        return [_outcome(node_id, result) for result in reply.results]

    async def close(self) -> None:
        """Wait for the calls on their way (their callers get their outcomes),
        then end every node's stream."""
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
        links, self._links = self._links, {}
        for link in links.values():
            await link.close()


def _outcome(node_id: int, result: executor_pb2.DispatchResult) -> Outcome:
    if result.is_accepted:
        return result.is_placement_recorded
    code = result.error_code or "FAILED_PRECONDITION"
    message = result.error_message or "did not accept the task"
    if code in _NODE_FAULT_NAMES:  # the executor answered: it did not take it
        return DispatchError(f"{code}: {message}")
    return TaskRefused(code, f"node {node_id} refused the task: {message}")
