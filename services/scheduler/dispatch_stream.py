"""One node's open `DispatchStream`: DispatchMany calls as messages on it.

A unary call costs grpc.aio a call's set-up on both ends; a message on an
open stream about half of that CPU (docs/control-plane.md, ninth round), and
the scheduler sends one per node per tick. `DispatchLink` numbers each call,
writes it and waits for the response carrying its number; one reader task
hands responses to their callers, in whatever order the executor answers.

Failure: when the stream ends (the node stops, the connection fails, the
caller's deadline passes and the link is dropped), every call still waiting
fails with `LinkError`; a call unanswered then may or may not have reached the
node (`NodeDispatchBatcher` reports it as maybe taken, so its attempt is
fenced). The next call opens a new stream. An executor that does not know the
method answers UNIMPLEMENTED: `LinkError.is_unimplemented`.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc
import grpc.aio

from lemix._proto.lemix.v1 import executor_pb2, executor_pb2_grpc


class LinkError(Exception):
    """The stream failed or ended before the call's response came."""

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code

    @property
    def is_unimplemented(self) -> bool:
        """The executor has no DispatchStream (an older version)."""
        return self.code is grpc.StatusCode.UNIMPLEMENTED


class DispatchLink:
    """An open DispatchStream to one executor (module doc). `call` fails
    with `LinkError` once the link is broken (`is_broken`): open another."""

    def __init__(self, stub: executor_pb2_grpc.ExecutorStub) -> None:
        self.stub = stub
        # No deadline: the stream lives as long as the link; each call has its own.
        self._call = stub.DispatchStream()
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[executor_pb2.DispatchStreamResponse]] = {}
        self._writing = asyncio.Lock()  # grpc.aio allows one write at a time
        self._error: LinkError | None = None
        self._reader = asyncio.create_task(self._read(), name="dispatch-link-reader")

    @property
    def is_broken(self) -> bool:
        return self._error is not None

    async def call(
        self, request: executor_pb2.DispatchManyRequest, timeout_s: float
    ) -> executor_pb2.DispatchStreamResponse:
        """Send one DispatchMany and wait up to `timeout_s` for its response.

        Raises `LinkError` when the stream fails first, and `TimeoutError`
        when the time runs out; the link is then broken (a node that does not
        answer in time is not sent more on this stream)."""
        if self._error is not None:
            raise self._error
        call_id = next(self._ids)
        answered = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = answered
        message = executor_pb2.DispatchStreamRequest(call_id=call_id, call=request)
        try:
            async with asyncio.timeout(timeout_s):
                async with self._writing:
                    await self._call.write(message)
                return await answered
        except TimeoutError:
            self._break(LinkError(f"no answer within {timeout_s:g} s: stream dropped"))
            raise
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # The write found the stream ended: the reader has its status.
            await asyncio.wait((self._reader,))
            raise self._error or LinkError("the stream ended") from None
        finally:
            self._waiting.pop(call_id, None)

    async def _read(self) -> None:
        try:
            async for reply in self._call:
                answered = self._waiting.pop(reply.call_id, None)
                if answered is not None and not answered.done():
                    answered.set_result(reply)
            error = LinkError("the executor ended the stream")
        except grpc.aio.AioRpcError as err:
            code = err.code()
            error = LinkError(f"{code.name}: {err.details() or code.name}", code=code)
        except Exception as exc:  # a bug here fails the waiting calls, not the loop
            error = LinkError(f"reading the stream failed: {type(exc).__name__}: {exc}")
        self._fail_waiting(error)

    def _break(self, error: LinkError) -> None:
        self._call.cancel()
        self._fail_waiting(error)

    def _fail_waiting(self, error: LinkError) -> None:
        if self._error is None:
            self._error = error
        waiting, self._waiting = self._waiting, {}
        for answered in waiting.values():
            if not answered.done():
                answered.set_exception(self._error)

    def drop(self) -> None:
        """End the stream now; calls still waiting fail (`LinkError`)."""
        self._break(LinkError("the link was closed"))

    async def close(self) -> None:
        """`drop`, and wait for the reader to finish."""
        self.drop()
        await asyncio.wait((self._reader,))
