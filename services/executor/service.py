"""The executor service: wires config, engine, driver, Redis and gRPC together.

    service = ExecutorService(config)
    await service.start()        # serving; heartbeats running
    ...
    await service.stop(grace_s)  # NOT_SERVING, node state gone, work drained

Start order: profile -> engine -> Redis (pinged, so a bad URL fails fast) ->
driver -> gRPC server -> first heartbeat -> heartbeat loop. Stop
(`lemix.infra.lifecycle`): new work refused and health NOT_SERVING, then the
heartbeat stops and the node state is withdrawn, so the scheduler stops
placing work here while what is running drains; then the server (calls in
flight get `_RPC_GRACE_S`) and Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time

import structlog

from lemix._proto.lemix.v1 import executor_pb2_grpc
from lemix.engine import NodeEngine
from lemix.infra import telemetry
from lemix.infra.address import join_host_port
from lemix.infra.lifecycle import Service
from lemix.infra.rpc import EXECUTOR_SERVICE
from lemix.infra.rpc.server import start_server, stop_server
from lemix.infra.store.client import RedisClientConfig, connect, export_pool_metrics
from lemix.infra.store.codec import FieldValue
from lemix.infra.store.heartbeat import heartbeat_fields
from lemix.infra.store.keys import RedisKeys
from lemix.infra.store.model_limits import model_limit_fields
from lemix.infra.store.store import Store
from lemix.noise import NoisyLatency
from lemix.profile import Profile, default_profile_path, load_profile
from services.executor.backends import EmulatedBackend, ExecutorBackend
from services.executor.config import ExecutorConfig
from services.executor.node import ExecutorNode
from services.executor.servicer import ExecutorServicer
from services.executor.sink import RedisOutcomeSink

log = structlog.get_logger(__name__)

# The last node-state write lives this long: effectively a delete through
# `Store.put_node_state`, so the scheduler sees the node gone at once.
_GONE_TTL_S = 0.001
# How long stop() waits for a heartbeat write in progress.
_HEARTBEAT_STOP_S = 2.0
# Redis connections of one executor process (see `_start`).
_REDIS_MAX_CONNECTIONS = 8
# How long stop() gives in-flight RPCs after the work has drained.
_RPC_GRACE_S = 1.0


def node_state_fields(node: ExecutorNode) -> dict[str, FieldValue]:
    """One heartbeat of `node` (`lemix.infra.store.heartbeat`), stamped now,
    with its model's limits (`lemix.infra.store.model_limits`)."""
    fields = heartbeat_fields(
        node.snapshot(), address=node.address, num_stages=node.engine.num_stages, t=time.time()
    )
    fields.update(model_limit_fields(node.backend.model_limits()))
    return fields


class ExecutorService(Service):
    """One executor process: a node engine behind gRPC, reporting to Redis."""

    def __init__(self, config: ExecutorConfig, *, profile: Profile | None = None) -> None:
        super().__init__("executor", default_grace_s=config.shutdown_grace_s)
        self.config = config
        self._profile = profile  # None: load config.profile_path at start()
        self.node: ExecutorNode | None = None
        self._store: Store | None = None
        self._sink: RedisOutcomeSink | None = None
        self._bound_port: int | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._heartbeat_stop = asyncio.Event()
        self._num_offloads_seen = 0

    @property
    def bound_port(self) -> int:
        """The gRPC port actually bound (config.port, or the free one picked)."""
        if self._bound_port is None:
            raise RuntimeError("the executor service is not started")
        return self._bound_port

    @property
    def address(self) -> str:
        """host:port this node advertises (and the scheduler dials)."""
        if self.node is None or not self.node.address:
            raise RuntimeError("the executor service is not started")
        return self.node.address

    @property
    def store(self) -> Store:
        if self._store is None:
            raise RuntimeError("the executor service is not started")
        return self._store

    async def _start(self) -> None:
        config = self.config
        profile = self._profile or load_profile(config.profile_path or default_profile_path())
        backend: ExecutorBackend = EmulatedBackend()
        if config.backend == "torch":
            from services.executor.torch_setup import build_torch_node

            node_id = config.node_id
            # Building the model (and a first-use tokenizer) takes seconds: off the loop.
            backend, profile = await asyncio.to_thread(
                build_torch_node,
                config.torch_config(),
                profile,
                on_training_loss=lambda loss: telemetry.observe_training_loss(node_id, loss),
                on_inference_loss=lambda loss: telemetry.observe_inference_loss(node_id, loss),
            )
        truth = NoisyLatency(
            profile.ours, config.latency_noise_cv, random.Random(config.seed + config.node_id)
        )
        engine = NodeEngine(config.node_id, profile, truth, config.engine_config(profile))
        # Writers only: the outcome sink (one batch at a time), the heartbeat
        # loop and the odd RPC-side read; a few spare for overlap. Writes
        # only, so no blocking read needs the socket timeout to outlast it.
        redis = connect(
            RedisClientConfig(
                config.redis_url, max_connections=_REDIS_MAX_CONNECTIONS, socket_timeout_s=30.0
            )
        )
        self.lifecycle.add_client("redis", redis.aclose)
        export_pool_metrics(redis)
        await redis.ping()
        self._store = Store(redis, RedisKeys(config.namespace))
        # Cached before the first request: a fresh Redis would answer its
        # first script call NOSCRIPT, a round trip more in that request's path.
        await self._store.load_scripts()
        self._sink = RedisOutcomeSink(self._store, config.node_id, backend=backend)
        node = self.node = ExecutorNode(
            engine,
            backend,
            self._sink,
            time_scale=config.time_scale,
            stage_timeout_s=config.stage_timeout_s,
        )
        self.lifecycle.on_stopping(node.begin_stop)  # Dispatch answers UNAVAILABLE
        await node.start()
        self.lifecycle.add_work("node", self._stop_node)
        servicer = ExecutorServicer(node, weight_sync_dir=config.weight_sync_dir)
        self.lifecycle.on_stopping(servicer.end_streams)
        server, self._bound_port, health = await start_server(
            [(executor_pb2_grpc.add_ExecutorServicer_to_server, servicer)],
            config.host,
            config.port,
            service_names=[EXECUTOR_SERVICE],
            service_token=config.service_token,
        )
        self.lifecycle.on_stopping(health.enter_graceful_shutdown)
        # The work drained, calls still in flight get a fixed grace, not stop()'s.
        self.lifecycle.add_server(
            "grpc", lambda _grace_s: stop_server(server, health, grace_s=_RPC_GRACE_S)
        )
        host = config.advertised_host(socket.gethostname())
        node.address = join_host_port(host, self._bound_port)
        await self._put_state()  # live in Redis before anyone is told we serve
        self._heartbeat = asyncio.create_task(
            self._heartbeat_loop(), name=f"node{config.node_id}-heartbeat"
        )
        self.lifecycle.add_work("heartbeat", self._stop_heartbeat)
        log.info(
            "executor.started",
            node=config.node_id,
            address=node.address,
            profile=profile.name,
            stages=profile.num_stages,
            backend=config.backend,
            time_scale=config.time_scale,
        )

    async def _stop_node(self, grace_s: float) -> None:
        """Let held work drain for up to `grace_s`, end the rest, close the backend."""
        assert self.node is not None  # registered once it exists
        await self.node.stop(grace_s)
        self.node.backend.close()
        await self._flush_counters()  # what the last writes counted

    async def _stop_heartbeat(self, grace_s: float) -> None:
        """Stop beating, then withdraw the node state (the scheduler sees it gone)."""
        if self._heartbeat is None:
            return
        # Asked to stop, not cancelled: a cancellation can be lost inside a
        # redis-py call on Python 3.11 (see NodeDriver.stop).
        self._heartbeat_stop.set()
        await asyncio.wait({self._heartbeat}, timeout=_HEARTBEAT_STOP_S)
        if not self._heartbeat.done():
            self._heartbeat.cancel()
        self._heartbeat = None
        await self._withdraw_state()

    def _on_stopped(self) -> None:
        log.info("executor.stopped", node=self.config.node_id)

    # ------------------------------------------------------------ heartbeats

    async def _put_state(self) -> None:
        assert self.node is not None and self._store is not None  # set by _start
        fields = node_state_fields(self.node)
        self._export_metrics(fields)
        await self._store.put_node_state(
            self.config.node_id, fields, ttl_s=self.config.heartbeat_ttl_s
        )

    def _export_metrics(self, fields: dict[str, FieldValue]) -> None:
        """This heartbeat's gauges, and the KV offloads since the last one."""
        assert self.node is not None
        engine = self.node.engine
        stages = range(engine.num_stages)
        telemetry.set_node_state(
            self.config.node_id,
            busy_fraction=float(fields["busy_fraction"] or 0.0),
            num_running=int(fields["num_running"] or 0),
            num_waiting=int(fields["num_waiting"] or 0),
            used_bytes=[engine.memory.used_bytes(s) for s in stages],
            capacity_bytes=[engine.memory.threshold_bytes for _ in stages],
        )
        telemetry.set_measured_memory(self.config.node_id, self.node.backend.used_bytes())
        telemetry.observe_kv_offloads(
            self.config.node_id, engine.num_offloads - self._num_offloads_seen
        )
        self._num_offloads_seen = engine.num_offloads

    async def _heartbeat_loop(self) -> None:
        stop = self._heartbeat_stop
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.config.heartbeat_s)
            if stop.is_set():
                return
            try:
                await self._put_state()
            except Exception as exc:  # Redis hiccup: keep beating; the TTL tells the truth
                log.warning(
                    "executor.heartbeat_failed",
                    node=self.config.node_id,
                    error=f"{type(exc).__name__}: {exc}",
                )
            await self._flush_counters()

    async def _flush_counters(self) -> None:
        """Write the sink's counters (statistics: kept for the next flush on
        a Redis error, lost only if the process dies first)."""
        if self._sink is None:
            return
        try:
            await self._sink.counters.flush()
        except Exception as exc:
            log.warning(
                "executor.counters_flush_failed",
                node=self.config.node_id,
                pending=self._sink.counters.pending,
                error=f"{type(exc).__name__}: {exc}",
            )

    async def _withdraw_state(self) -> None:
        """A last, unhealthy node state that expires at once: the node is gone."""
        if self.node is None or self._store is None:
            return
        try:
            await self._store.put_node_state(
                self.config.node_id, node_state_fields(self.node), ttl_s=_GONE_TTL_S
            )
        except Exception as exc:  # it expires within the TTL anyway
            log.warning(
                "executor.withdraw_failed",
                node=self.config.node_id,
                error=f"{type(exc).__name__}: {exc}",
            )
