"""`GatewayService`: the gateway's servers (gRPC, and the OpenAI-compatible HTTP
API of `gateway.http_api`, one `GatewayCore` behind both) and the clients they
hold, started and stopped as one.

    service = GatewayService(GatewayConfig(port=50051, redis_url=..., ...))
    await service.start()          # SERVING (health) once this returns
    ...
    await service.stop()           # NOT_SERVING, drain, stop, close clients

`start` reads the TLS files (if any) and pings Redis first, so a wrong path or
`redis_url` fails at start with a clear error instead of as a failed handshake
or UNAVAILABLE on every request. The scheduler need not be up
yet: Generate answers UNAVAILABLE until it is.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

import grpc.aio
import redis.asyncio as aioredis
import structlog
from aiohttp import web
from grpc_health.v1 import health
from redis.exceptions import RedisError

from gateway.config import GatewayConfig
from gateway.core import GatewayCore
from gateway.http_api import HttpApi, start_http
from gateway.observe import SloCache
from gateway.servicer import GatewayServicer
from lemix._proto.lemix.v1 import gateway_pb2_grpc, scheduler_pb2_grpc
from lemix.infra.rpc import GATEWAY_SERVICE
from lemix.infra.rpc.client import channel
from lemix.infra.rpc.server import start_server, stop_server
from lemix.infra.rpc.tls import ServerTls, load_server_tls
from lemix.infra.store.client import RedisClientConfig, connect
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.store import Store
from lemix.tokenizer import ApproxTokenizer, Tokenizer

log = structlog.get_logger(__name__)

# Redis must answer the start-up PING within this long.
REDIS_CONNECT_TIMEOUT_S = 5.0
# Beyond one connection per in-flight stream (each may hold one in XREAD BLOCK
# for the idle timeout): lease and counter upkeep, live-executor checks, stats,
# the SLO and a stream's lease take. Requests past `max_in_flight` never touch
# Redis, so this bound is not reached by load alone.
REDIS_SPARE_CONNECTIONS = 64
# A socket read may take this long beyond the longest XREAD BLOCK.
REDIS_READ_SLACK_S = 10.0


def _host_port(host: str, port: int) -> str:
    """host:port clients dial (an IPv6 host in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer a config names: "approx" (the emulated stand-in),
    "bpe:<vocab_size>", a tokenizer.json file or a model directory
    (`lemix.model.tokenizer.load_tokenizer`). Raises ValueError otherwise."""
    if name == "approx":
        return ApproxTokenizer()  # without importing the tokenizers library
    from lemix.model.tokenizer import load_tokenizer as load_real_tokenizer

    return load_real_tokenizer(name)


class GatewayService:
    """The gateway process's parts: gRPC server (Gateway + health + reflection),
    HTTP server, Redis client, scheduler channel. `tokenizer` overrides
    `config.tokenizer`."""

    def __init__(self, config: GatewayConfig, *, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._redis: aioredis.Redis | None = None
        self._channel: grpc.aio.Channel | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._servicer: GatewayServicer | None = None
        self._core: GatewayCore | None = None
        self._http: web.AppRunner | None = None
        self._port = 0
        self._http_port = 0
        self._is_serving = False  # what the HTTP /health reports
        self._stop_lock = asyncio.Lock()

    @property
    def port(self) -> int:
        """The bound port (the config's, or the free one picked for port 0)."""
        if self._port == 0:
            raise RuntimeError("GatewayService is not started")
        return self._port

    @property
    def address(self) -> str:
        """host:port gRPC clients dial (an IPv6 host in brackets)."""
        return _host_port(self.config.host, self.port)

    @property
    def http_port(self) -> int:
        """The HTTP API's bound port."""
        if self._http_port == 0:
            raise RuntimeError("GatewayService is not started")
        return self._http_port

    @property
    def http_address(self) -> str:
        """host:port of the OpenAI-compatible HTTP API (base URL `http_url` + /v1)."""
        return _host_port(self.config.host, self.http_port)

    @property
    def http_url(self) -> str:
        """http://HOST:PORT, or https:// when the gateway serves TLS."""
        scheme = "https" if self.config.is_tls_enabled else "http"
        return f"{scheme}://{self.http_address}"

    @property
    def tls_mode(self) -> str:
        """One of "off", "tls" or "mtls" (client certificates required)."""
        if not self.config.is_tls_enabled:
            return "off"
        return "mtls" if self.config.tls_client_ca_file else "tls"

    @property
    def other_addresses(self) -> dict[str, str]:
        """Listeners besides `address`, for the SERVING line (lemix.infra.service_main);
        with TLS, also `tls=tls|mtls` (both ports then speak only TLS)."""
        others = {"http": self.http_address}
        if self.config.is_tls_enabled:
            others["tls"] = self.tls_mode
        return others

    @property
    def servicer(self) -> GatewayServicer:
        if self._servicer is None:
            raise RuntimeError("GatewayService is not started")
        return self._servicer

    async def start(self) -> None:
        """Connect, then serve. Raises ValueError (bad tokenizer, a TLS file
        missing, unreadable or not a matching certificate and key), OSError
        (Redis unreachable, port busy)."""
        if self._server is not None:
            raise RuntimeError("GatewayService is already started")
        config = self.config
        tls: ServerTls | None = None
        if config.is_tls_enabled:
            tls = load_server_tls(
                config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file
            )
        tokenizer = self._tokenizer or load_tokenizer(config.tokenizer)
        try:
            # Output reads block (XREAD BLOCK) up to the stream idle timeout, so
            # the socket timeout must outlast it; every in-flight stream holds a
            # connection while it waits, so the (blocking) pool is sized from
            # the in-flight bound.
            self._redis = connect(
                RedisClientConfig(
                    url=config.redis_url,
                    max_connections=config.max_in_flight + REDIS_SPARE_CONNECTIONS,
                    socket_timeout_s=config.stream_idle_timeout_s + REDIS_READ_SLACK_S,
                    connect_timeout_s=REDIS_CONNECT_TIMEOUT_S,
                )
            )
            try:
                await self._redis.ping()
            except RedisError as exc:
                raise OSError(f"cannot reach Redis at {config.redis_url}: {exc}") from exc
            store = Store(self._redis, RedisKeys(config.namespace))
            self._channel = channel(config.scheduler_address, service_token=config.service_token)
            core = GatewayCore(
                config, store, scheduler_pb2_grpc.SchedulerStub(self._channel), tokenizer
            )
            self._core = core
            core.start()  # counters and stream leases: flushed and dropped on stop
            slo = SloCache(store)  # one SLO reader for both APIs' metrics
            self._servicer = GatewayServicer(core, slo)
            self._server, self._port, self._health = await start_server(
                [(gateway_pb2_grpc.add_GatewayServicer_to_server, self._servicer)],
                config.host,
                config.port,
                service_names=[GATEWAY_SERVICE],
                server_credentials=tls.grpc_credentials() if tls is not None else None,
            )
            api = HttpApi(core, config, is_serving=lambda: self._is_serving, slo=slo)
            self._http, self._http_port = await start_http(
                api.app(),
                config.host,
                config.http_port,
                shutdown_timeout_s=config.shutdown_grace_s,
                ssl_context=tls.ssl_context if tls is not None else None,
            )
        except BaseException:
            if self._server is not None:
                server, self._server = self._server, None
                await server.stop(None)
            await self._close_clients()
            raise
        self._is_serving = True
        log.info(
            "gateway.started",
            address=self.address,
            http=self.http_url,
            grpc_scheme="grpcs" if tls is not None else "grpc",
            tls=self.tls_mode,
            scheduler=config.scheduler_address,
            namespace=config.namespace,
            max_in_flight=config.max_in_flight,
        )

    async def stop(self) -> None:
        """NOT_SERVING, then in-flight streams (gRPC and HTTP) get
        `shutdown_grace_s` to finish (new calls are refused), then the rest are
        cancelled; their tasks are cancelled at the scheduler before the
        clients close. Idempotent."""
        async with self._stop_lock:  # a second stop waits for the first
            if self._server is None or self._health is None:
                return
            self._is_serving = False
            server, self._server = self._server, None
            http, self._http = self._http, None
            await asyncio.gather(
                stop_server(server, self._health, grace_s=self.config.shutdown_grace_s),
                http.cleanup() if http is not None else asyncio.sleep(0),
            )
            if self._servicer is not None and not await self._servicer.core.wait_idle(
                self.config.cancel_deadline_s + 1.0
            ):
                log.warning("gateway.stop_streams_left", num=self._servicer.num_in_flight)
            await self._close_clients()
            log.info("gateway.stopped")

    async def _close_clients(self) -> None:
        if self._core is not None:  # the last counters and lease drops go out first
            core, self._core = self._core, None
            await core.close()
        if self._channel is not None:
            ch, self._channel = self._channel, None
            await ch.close()
        if self._redis is not None:
            client, self._redis = self._redis, None
            await client.aclose()

    async def __aenter__(self) -> GatewayService:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
