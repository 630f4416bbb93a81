"""Outgoing gRPC: one way to open a channel, one default deadline, one readiness wait.

STYLE rule 7: every outgoing call sets a deadline, `timeout=DEFAULT_DEADLINE_S`
unless the call has a reason for another (streams that last a whole generation
set their own).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lemix.infra.rpc.auth import api_key_interceptors, client_interceptors
from lemix.infra.rpc.server import MAX_MESSAGE_BYTES

# Deadline for ordinary unary calls between LeMix services, seconds. Submit
# waits for a Redis write; GetState and Dispatch answer from memory.
DEFAULT_DEADLINE_S = 10.0

# Ping an idle connection this often so a dead peer (or a NAT that forgot us)
# is noticed in ~40 s rather than at the next call; the server accepts pings
# every `server.MIN_PING_INTERVAL_MS`, which must stay below this.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000

# How long one health Check may take while `wait_for_serving` polls.
_HEALTH_CHECK_DEADLINE_S = 1.0
_POLL_INITIAL_S = 0.05
_POLL_MAX_S = 0.5


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel args for every LeMix client."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging an idle channel
    ]


def channel(
    address: str,
    *,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    extra_options: Sequence[tuple[str, int | str]] = (),
    service_token: str = "",
    credentials: grpc.ChannelCredentials | None = None,
    api_key: str = "",
) -> grpc.aio.Channel:
    """An asyncio channel to `address` ("host:port"). Close it with
    `await ch.close()` or use it as `async with channel(addr) as ch:`.

    `service_token`: the stack's token (`lemix.infra.rpc.auth`), sent on every call;
    "" sends none (the gateway's public API, or a stack left unauthenticated).
    `credentials`: None for plaintext (every internal link); TLS credentials
    (`lemix.infra.rpc.tls.client_tls(ca_file)`) for a gateway that serves TLS, whose
    certificate must then name `address`'s host.
    `api_key`: a key of a gateway started with `--api-key`, sent on every call
    as `authorization: Bearer <key>` (not with `service_token`: one header).
    """
    if not address or address.startswith(":") or ":" not in address:
        raise ValueError(f"address must be host:port, got {address!r}")
    options: list[tuple[str, int | str]] = [*channel_options(max_message_bytes), *extra_options]
    if service_token and api_key:
        raise ValueError("a channel sends either the service token or an API key, not both")
    interceptors: list[grpc.aio.ClientInterceptor] | None = None
    if service_token:
        interceptors = client_interceptors(service_token)
    elif api_key:
        interceptors = api_key_interceptors(api_key)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


async def wait_for_serving(address: str, service: str = "", timeout_s: float = 10.0) -> None:
    """Return once `address` reports `service` SERVING (""= the whole server).

    Polls the standard health service, retrying while the server is not up
    yet (UNAVAILABLE), the service is not registered yet (NOT_FOUND) or it
    reports anything but SERVING. Raises `TimeoutError` after `timeout_s`,
    naming the last thing seen.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay_s = _POLL_INITIAL_S
    last = "no answer yet"
    async with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        request = health_pb2.HealthCheckRequest(service=service)
        while True:
            remaining_s = deadline - loop.time()
            if remaining_s <= 0:
                raise TimeoutError(
                    f"{address} did not report {service or 'the server'} SERVING within "
                    f"{timeout_s:g} s (last: {last})"
                )
            try:
                reply = await stub.Check(
                    request, timeout=min(_HEALTH_CHECK_DEADLINE_S, remaining_s)
                )
            except grpc.aio.AioRpcError as err:
                last = f"{err.code().name}: {err.details()}"
            else:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            await asyncio.sleep(min(delay_s, max(0.0, deadline - loop.time())))
            delay_s = min(delay_s * 2, _POLL_MAX_S)
