"""Start and stop a LeMix gRPC server the same way in every service.

Every server gets: the service's own servicers, standard gRPC health checking
(every named service and "" set SERVING once bound), server reflection, one
message-size limit, keepalive settings that match `lemix.infra.rpc.client.channel`,
INVALID_ARGUMENT for a request that does not parse (`lemix.infra.rpc.guard`), the
service token on internal servers (`lemix.infra.rpc.auth`), and a shutdown that
flips health to NOT_SERVING before it drains.

    server, port, health = await start_server(
        [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer)],
        "0.0.0.0", 0, service_names=[SCHEDULER_SERVICE],
        service_token=config.service_token,  # None on the public gateway
        server_credentials=None,  # plaintext; TLS: lemix.infra.rpc.tls
    )
    ...
    await stop_server(server, health, grace_s=5.0)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import grpc.aio
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lemix.infra.address import join_host_port
from lemix.infra.rpc.auth import SERVICE_TOKEN_ENV
from lemix.infra.rpc.guard import MalformedRequests, RequireApiKey, RequireServiceToken

log = structlog.get_logger(__name__)

# Largest message either side sends or accepts. Bigger ones fail with
# RESOURCE_EXHAUSTED from gRPC itself; the handler never runs. 16 MiB holds a
# 128k-token prompt's ids several times over; weights never travel over gRPC.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# Clients ping every `client.KEEPALIVE_TIME_MS` (30 s); the server must accept
# pings at least that often or it answers GOAWAY "too_many_pings".
MIN_PING_INTERVAL_MS = 10_000

# Calls gRPC core holds for the application before it starts refusing them.
MAX_PENDING_REQUESTS = 20_000

# `add_FooServicer_to_server` from a generated *_pb2_grpc module.
AddServicerFn = Callable[[Any, grpc.aio.Server], None]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel args for every LeMix server."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        # No GOAWAY for "too many pings": a process starved of CPU (a node busy
        # with a model on its cores) reads two delayed keepalive pings back to
        # back, and the strike would drop every call on the channel.
        ("grpc.http2.max_ping_strikes", 0),
        # gRPC sets SO_REUSEPORT by default, so a second server on a fixed,
        # busy port would bind silently and steal half the connections.
        ("grpc.so_reuseport", 0),
        # gRPC core itself CANCELs calls that wait, unread by the application,
        # past 1,000 (its default): a burst of 1,500 Generates lost ~60 that
        # way, with no status the client can act on. The services refuse
        # excess load themselves (the gateway's in-flight bound answers
        # RESOURCE_EXHAUSTED without I/O), so let every call reach them.
        ("grpc.server.max_pending_requests", MAX_PENDING_REQUESTS),
        ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_REQUESTS),
    ]


async def start_server(
    servicers: Sequence[tuple[AddServicerFn, Any]],
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    service_names: Sequence[str],
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    service_token: str | None = None,
    server_credentials: grpc.ServerCredentials | None = None,
    api_keys: tuple[str, ...] = (),
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start a gRPC server; return it, its bound port and its health servicer.

    `servicers` pairs each generated `add_*Servicer_to_server` with its servicer;
    `service_names` are their full names (e.g. "lemix.v1.Scheduler"), set
    SERVING in health checking and listed by reflection. `port=0` picks a free
    port. Raises `OSError` if the address cannot be bound.

    `service_token`: None for a public server (the gateway's API); for an
    internal one (scheduler, executor, profiler) the stack's token, which
    every call but health checks must then carry, or "" to leave it open,
    which logs a warning.

    `server_credentials`: None serves plaintext (internal services, and the
    gateway unless given a certificate); TLS credentials
    (`lemix.infra.rpc.tls.ServerTls.grpc_credentials`) serve TLS only, on the same port.

    `api_keys`: the public gateway's keys (`lemix.infra.rpc.auth.ApiKeyCheck`);
    when given, every call but health checks and reflection must carry one.
    """
    if not service_names:
        raise ValueError("start_server needs service_names (e.g. ['lemix.v1.Scheduler'])")
    interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequests()]
    if service_token:  # outermost: an unauthenticated request is not even parsed
        interceptors.insert(0, RequireServiceToken(service_token))
    elif service_token == "":
        log.warning(
            "rpc.unauthenticated_server",
            services=list(service_names),
            hint=f"internal RPCs are unauthenticated: anyone who reaches this port "
            f"can call them; set {SERVICE_TOKEN_ENV} to the same token on every "
            f"service of the stack",
        )
    if api_keys:  # the public gateway's: outermost as well
        interceptors.insert(0, RequireApiKey(api_keys))
    server = grpc.aio.server(options=server_options(max_message_bytes), interceptors=interceptors)
    for add, servicer in servicers:
        add(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    target = join_host_port(host, port)
    try:
        if server_credentials is None:
            bound_port = server.add_insecure_port(target)
        else:
            bound_port = server.add_secure_port(target, server_credentials)
    except RuntimeError as exc:  # newer grpcio raises; older ones return 0
        raise OSError(f"cannot bind gRPC server to {target}: {exc}") from exc
    if bound_port == 0:
        raise OSError(f"cannot bind gRPC server to {target} (port in use?)")
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "rpc.server_started",
        address=join_host_port(host, bound_port),
        services=service_names,
        scheme="grpc" if server_credentials is None else "grpcs",
    )
    return server, bound_port, health_servicer


async def stop_server(
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    grace_s: float = 5.0,
    *,
    drain_s: float = 0.0,
) -> None:
    """Flip every service to NOT_SERVING, then stop.

    `drain_s` keeps accepting calls that long after the flip, so clients and
    load balancers polling health move away before the listener closes; then
    in-flight calls get up to `grace_s` to finish before they are cancelled.
    """
    await health_servicer.enter_graceful_shutdown()
    if drain_s > 0:
        await asyncio.sleep(drain_s)
    await server.stop(grace_s)
    log.info("rpc.server_stopped", grace_s=grace_s)
