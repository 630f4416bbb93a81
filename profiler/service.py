"""The profiler service: wires config, base profile, Redis and gRPC together.

    service = ProfilerService(config)
    await service.start()        # serving
    ...
    await service.stop(grace_s)  # NOT_SERVING, in-flight runs drained, Redis closed

Start order: base profile -> Redis (pinged, so a bad URL fails fast) -> gRPC
server. Stop reverses it (`lemix.infra.lifecycle`).
"""

from __future__ import annotations

import structlog

from lemix._proto.lemix.v1 import profiler_pb2_grpc
from lemix.infra.address import join_host_port
from lemix.infra.lifecycle import Service
from lemix.infra.rpc import PROFILER_SERVICE
from lemix.infra.rpc.server import start_server, stop_server
from lemix.infra.store.client import RedisClientConfig, connect, export_pool_metrics
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.store import Store
from lemix.profile import Profile, load_profile
from profiler.config import ProfilerConfig
from profiler.core import ProfilerCore
from profiler.servicer import ProfilerServicer

log = structlog.get_logger(__name__)


class ProfilerService(Service):
    """One profiler process: `ProfilerCore` behind gRPC, storing profiles in Redis."""

    def __init__(self, config: ProfilerConfig, *, base_profile: Profile | None = None) -> None:
        super().__init__("profiler", default_grace_s=config.shutdown_grace_s)
        self.config = config
        self._base = base_profile  # None: load config.base_profile_path at start()
        self._bound_port: int | None = None

    @property
    def bound_port(self) -> int:
        if self._bound_port is None:
            raise RuntimeError("the profiler service is not started")
        return self._bound_port

    @property
    def address(self) -> str:
        """host:port clients dial."""
        return join_host_port(self.config.host, self.bound_port)

    async def _start(self) -> None:
        config = self.config
        base = self._base or load_profile(config.resolved_base_profile_path)
        # Profile writes and reads, one RPC at a time; writes only (no blocking read).
        redis = connect(
            RedisClientConfig(config.redis_url, max_connections=4, socket_timeout_s=30.0)
        )
        self.lifecycle.add_client("redis", redis.aclose)
        export_pool_metrics(redis)
        await redis.ping()
        store = Store(redis, RedisKeys(config.namespace))
        core = ProfilerCore(
            store,
            base,
            config.fit_config(),
            config.measure_deadline_s,
            service_token=config.service_token,
        )
        server, self._bound_port, health = await start_server(
            [(profiler_pb2_grpc.add_ProfilerServicer_to_server, ProfilerServicer(core))],
            config.host,
            config.port,
            service_names=[PROFILER_SERVICE],
            service_token=config.service_token,
        )
        self.lifecycle.on_stopping(health.enter_graceful_shutdown)
        # In-flight runs get stop()'s grace.
        self.lifecycle.add_server("grpc", lambda grace_s: stop_server(server, health, grace_s))
        log.info("profiler.started", address=self.address, base_profile=base.name)

    def _on_stopped(self) -> None:
        log.info("profiler.stopped")
