"""`GatewayService`: the gateway's servers (gRPC, and the OpenAI-compatible HTTP
API of `gateway.http_api`, one `GatewayCore` behind both) and the clients they
hold, started and stopped as one.

    service = GatewayService(GatewayConfig(port=50051, redis_url=..., ...))
    await service.start()          # SERVING (health) once this returns
    ...
    await service.stop()           # NOT_SERVING, drain, stop, close clients
                                   # (the shape of `lemix.infra.lifecycle`)

`start` reads the TLS files (if any) and pings Redis first, so a wrong path or
`redis_url` fails at start with a clear error instead of as a failed handshake
or UNAVAILABLE on every request. The scheduler need not be up
yet: Generate answers UNAVAILABLE until it is.
"""

from __future__ import annotations

from types import TracebackType

import structlog
from redis.exceptions import RedisError

from gateway.config import GatewayConfig
from gateway.core import GatewayCore
from gateway.http_api import HttpApi, start_http
from gateway.observe import SloCache
from gateway.servicer import GatewayServicer
from lemix._proto.lemix.v1 import gateway_pb2_grpc, scheduler_pb2_grpc
from lemix.infra.address import join_host_port
from lemix.infra.lifecycle import Service
from lemix.infra.rpc import GATEWAY_SERVICE
from lemix.infra.rpc.client import channel
from lemix.infra.rpc.server import start_server, stop_server
from lemix.infra.rpc.tls import ServerTls, load_server_tls
from lemix.infra.store.client import RedisClientConfig, connect, export_pool_metrics
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.store import Store
from lemix.tokenizer import ApproxTokenizer, Tokenizer

log = structlog.get_logger(__name__)

# Redis must answer the start-up PING within this long.
REDIS_CONNECT_TIMEOUT_S = 5.0
# The pool: up to `gateway.reader.MAX_LANES` connections for the output reader's
# blocking XREADs (streams do not hold one each), the rest for short calls (a reader's wake
# or lease write, lease and counter upkeep, live-executor checks, stats, the SLO, task
# lookups). Past the bound a call waits for a connection (back-pressure, up
# to the pool timeout) instead of opening one per concurrent request.
REDIS_POOL_CONNECTIONS = 64
# A socket read may take this long beyond the longest XREAD BLOCK.
REDIS_READ_SLACK_S = 10.0


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer a config names: "approx" (the emulated stand-in),
    "bpe:<vocab_size>", a tokenizer.json file or a model directory
    (`lemix.model.tokenizer.load_tokenizer`). Raises ValueError otherwise."""
    if name == "approx":
        return ApproxTokenizer()  # without importing the tokenizers library
    from lemix.model.tokenizer import load_tokenizer as load_real_tokenizer

    return load_real_tokenizer(name)


class GatewayService(Service):
    """The gateway process's parts: gRPC server (Gateway + health + reflection),
    HTTP server, Redis client, scheduler channel. `tokenizer` overrides
    `config.tokenizer`."""

    def __init__(self, config: GatewayConfig, *, tokenizer: Tokenizer | None = None) -> None:
        super().__init__("gateway", default_grace_s=config.shutdown_grace_s)
        self.config = config
        self._tokenizer = tokenizer
        self._servicer: GatewayServicer | None = None
        self._port = 0
        self._http_port = 0
        self._is_serving = False  # what the HTTP /health reports

    @property
    def port(self) -> int:
        """The bound port (the config's, or the free one picked for port 0)."""
        if self._port == 0:
            raise RuntimeError("GatewayService is not started")
        return self._port

    @property
    def address(self) -> str:
        """host:port gRPC clients dial (an IPv6 host in brackets)."""
        return join_host_port(self.config.host, self.port)

    @property
    def http_port(self) -> int:
        """The HTTP API's bound port."""
        if self._http_port == 0:
            raise RuntimeError("GatewayService is not started")
        return self._http_port

    @property
    def http_address(self) -> str:
        """host:port of the OpenAI-compatible HTTP API (base URL `http_url` + /v1)."""
        return join_host_port(self.config.host, self.http_port)

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

    async def _start(self) -> None:
        """Connect, then serve. Raises ValueError (bad tokenizer, a TLS file
        missing, unreadable or not a matching certificate and key), OSError
        (Redis unreachable, port busy)."""
        config = self.config
        tls: ServerTls | None = None
        if config.is_tls_enabled:
            tls = load_server_tls(
                config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file
            )
        tokenizer = self._tokenizer or load_tokenizer(config.tokenizer)
        # The output reader's XREAD blocks up to the stream idle timeout, so
        # the socket timeout must outlast it.
        redis = connect(
            RedisClientConfig(
                url=config.redis_url,
                max_connections=REDIS_POOL_CONNECTIONS,
                socket_timeout_s=config.stream_idle_timeout_s + REDIS_READ_SLACK_S,
                connect_timeout_s=REDIS_CONNECT_TIMEOUT_S,
            )
        )
        self.lifecycle.add_client("redis", redis.aclose)
        export_pool_metrics(redis)
        try:
            await redis.ping()
        except RedisError as exc:
            raise OSError(f"cannot reach Redis at {config.redis_url}: {exc}") from exc
        store = Store(redis, RedisKeys(config.namespace), dedupe_ttl_s=config.idempotency_window_s)
        scheduler = channel(config.scheduler_address, service_token=config.service_token)
        self.lifecycle.add_client("scheduler channel", scheduler.close)
        core = GatewayCore(config, store, scheduler_pb2_grpc.SchedulerStub(scheduler), tokenizer)
        core.start()  # counters and the stream lease: flushed and dropped on stop
        # Closed before the channel: streams still open cancel their tasks at
        # the scheduler, and the last counters and lease drops go out.
        self.lifecycle.add_client("core", lambda: self._close_core(core))
        self.lifecycle.on_stopping(self._refuse)  # first: the HTTP /health answers 503
        slo = SloCache(store)  # one SLO reader for both APIs' metrics
        self._servicer = GatewayServicer(core, slo)
        server, self._port, health = await start_server(
            [(gateway_pb2_grpc.add_GatewayServicer_to_server, self._servicer)],
            config.host,
            config.port,
            service_names=[GATEWAY_SERVICE],
            server_credentials=tls.grpc_credentials() if tls is not None else None,
            api_keys=config.api_keys,
        )
        self.lifecycle.on_stopping(health.enter_graceful_shutdown)
        self.lifecycle.add_server("grpc", lambda grace_s: stop_server(server, health, grace_s))
        api = HttpApi(core, config, is_serving=lambda: self._is_serving, slo=slo)
        http, self._http_port = await start_http(
            api.app(),
            config.host,
            config.http_port,
            shutdown_timeout_s=config.shutdown_grace_s,
            ssl_context=tls.ssl_context if tls is not None else None,
        )
        # Its streams get the grace given to start_http.
        self.lifecycle.add_server("http", lambda _grace_s: http.cleanup())
        self._is_serving = True
        log.info(
            "gateway.started",
            address=self.address,
            http=self.http_url,
            grpc_scheme="grpcs" if tls is not None else "grpc",
            tls=self.tls_mode,
            num_api_keys=len(config.api_keys),  # how many, never which
            scheduler=config.scheduler_address,
            namespace=config.namespace,
            max_in_flight=config.max_in_flight,
        )

    def _refuse(self) -> None:
        self._is_serving = False

    async def _close_core(self, core: GatewayCore) -> None:
        """In-flight streams (gRPC and HTTP, their servers stopped by now) get
        until their tasks are cancelled at the scheduler; then the upkeep ends."""
        if not await core.wait_idle(self.config.cancel_deadline_s + 1.0):
            log.warning("gateway.stop_streams_left", num=core.num_in_flight)
        await core.close()

    def _on_stopped(self) -> None:
        log.info("gateway.stopped")

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
