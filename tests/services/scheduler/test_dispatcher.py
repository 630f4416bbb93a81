"""`GrpcDispatcher`'s channels to the executors, against a real gRPC server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import grpc.aio

from services.scheduler.adapters import GrpcDispatcher


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
