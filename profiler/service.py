"""The profiler service: wires config, base profile, Redis and gRPC together.

    service = ProfilerService(config)
    await service.start()        # serving
    ...
    await service.stop(grace_s)  # NOT_SERVING, in-flight runs drained, Redis closed

Start order: base profile -> Redis (pinged, so a bad URL fails fast) -> gRPC
server. Stop reverses it.
"""

from __future__ import annotations

import grpc.aio
import redis.asyncio as aioredis
import structlog
from grpc_health.v1 import health

from lemix._proto.lemix.v1 import profiler_pb2_grpc
from lemix.infra.rpc import PROFILER_SERVICE
from lemix.infra.rpc.server import start_server, stop_server
from lemix.infra.store.client import RedisClientConfig, connect
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.store import Store
from lemix.profile import Profile, load_profile
from profiler.config import ProfilerConfig
from profiler.core import ProfilerCore
from profiler.servicer import ProfilerServicer

log = structlog.get_logger(__name__)


class ProfilerService:
    """One profiler process: `ProfilerCore` behind gRPC, storing profiles in Redis."""

    def __init__(self, config: ProfilerConfig, *, base_profile: Profile | None = None) -> None:
        self.config = config
        self._base = base_profile  # None: load config.base_profile_path at start()
        self._redis: aioredis.Redis | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._bound_port: int | None = None
        self._is_started = False
        self._is_stopped = False

    @property
    def bound_port(self) -> int:
        if self._bound_port is None:
            raise RuntimeError("the profiler service is not started")
        return self._bound_port

    @property
    def address(self) -> str:
        """host:port clients dial."""
        host = self.config.host
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"{host}:{self.bound_port}"

    async def start(self) -> None:
        """Start serving; on failure, undo what was started and re-raise."""
        if self._is_started:
            raise RuntimeError("the profiler service is already started")
        self._is_started = True
        try:
            await self._start()
        except BaseException:
            await self.stop(grace_s=0.0)
            raise

    async def _start(self) -> None:
        config = self.config
        base = self._base or load_profile(config.resolved_base_profile_path)
        # Profile writes and reads, one RPC at a time; writes only (no blocking read).
        self._redis = connect(
            RedisClientConfig(config.redis_url, max_connections=4, socket_timeout_s=30.0)
        )
        await self._redis.ping()
        store = Store(self._redis, RedisKeys(config.namespace))
        core = ProfilerCore(
            store,
            base,
            config.fit_config(),
            config.measure_deadline_s,
            service_token=config.service_token,
        )
        self._server, self._bound_port, self._health = await start_server(
            [(profiler_pb2_grpc.add_ProfilerServicer_to_server, ProfilerServicer(core))],
            config.host,
            config.port,
            service_names=[PROFILER_SERVICE],
            service_token=config.service_token,
        )
        log.info("profiler.started", address=self.address, base_profile=base.name)

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, give in-flight runs up to `grace_s` (default
        `config.shutdown_grace_s`), close Redis. Safe twice and when partly started."""
        if self._is_stopped:
            return
        self._is_stopped = True
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        if self._server is not None and self._health is not None:
            await stop_server(self._server, self._health, grace_s=grace_s)
            self._server = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
        log.info("profiler.stopped")
