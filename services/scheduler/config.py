"""The scheduler's configuration, and the ONE place that maps env vars and flags to it.

Precedence: a command-line flag, else its ``LEMIX_*`` environment variable,
else the default (lemix.infra.settings is the mechanism). Nothing is read at import
time: `from_env_and_args` reads `os.environ` (or the mapping it is given) when
called. `scripts/config_table.py` prints the README table from `_OPTIONS`.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lemix.batching import BatchingConfig
from lemix.infra import settings
from lemix.infra.rpc.auth import SERVICE_TOKEN_OPTION, check_service_token
from lemix.infra.settings import Option, port_or_off
from lemix.infra.store.keys import (
    DEFAULT_NAMESPACE,
    NODE_HEARTBEAT_TTL_S,
    STREAM_LEASE_TTL_S,
    RedisKeys,
)
from lemix.memory import MemoryConfig
from lemix.planner.base import PlannerConfig
from lemix.planner.registry import POLICIES, get_spec
from lemix.profile import Profile, default_profile_path
from lemix.slo import Slo, SloConfig, compute_slo
from lemix.types import Task, TaskKind

_LOG_LEVELS = ("debug", "info", "warning", "error")
# Redis connections the scheduler's own loops hold at most at once: the intake
# and completions loops (each parks one on a blocking read), the nodes loop,
# the event sink, and the core. The core batches its Redis I/O (one round trip
# per intake batch, placement batch or dead node) and does it sequentially
# under its lock, so Dispatch concurrency costs no connections.
NUM_LOOP_REDIS_CONNECTIONS = 5
# A blocking read must end before the socket times out, or a quiet stream
# reads as a dead server.
_SOCKET_SLACK_S = 10.0
_DEFAULT_PLANNER = PlannerConfig(num_nodes=1, num_stages=1, slo_ttft_s=1.0, slo_tbt_s=1.0)


def _default_consumer() -> str:
    return f"scheduler-{socket.gethostname()}"


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything the scheduler service needs, explicit and validated."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = a free port (the bound one is printed)
    metrics_port: int = -1  # Prometheus /metrics: 0 = a free port, -1 = off
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = DEFAULT_NAMESPACE  # Redis key prefix shared with gateway and executors
    policy: str = "lemix"
    num_nodes: int = 1
    profile_path: str = ""  # "" = lemix.profile.default_profile_path()
    # SLOs. 0 = derive both with lemix.sim.run.compute_slo from the profile:
    # multiplier × the unloaded latency of a reference request (its prompt and
    # output lengths below; 0/0 = compute_slo's default when no workload is known).
    slo_ttft_s: float = 0.0
    slo_tbt_s: float = 0.0
    slo_multiplier: float = SloConfig().multiplier
    slo_prompt_tokens: int = 0
    slo_output_tokens: int = 0
    kappa: float = MemoryConfig().kappa  # usable GPU memory fraction (the executors' κ)
    max_batch_size: int = BatchingConfig().max_batch_size  # the executors' running-batch cap
    train_rate: float = _DEFAULT_PLANNER.train_rate  # SEPARATE's training share of nodes
    sync_every_tasks: int = _DEFAULT_PLANNER.sync_every_tasks  # SEPARATE's K
    max_defer_s: float = _DEFAULT_PLANNER.max_defer_s
    defer_recheck_s: float = _DEFAULT_PLANNER.defer_recheck_s
    dispatch_deadline_s: float = 5.0  # executor Dispatch/Cancel; they answer from memory
    # A node that failed a Dispatch gets no work for this long, then again if
    # it still heartbeats (its heartbeat key may outlive a crashed executor).
    dispatch_retry_s: float = 2.0
    weight_sync_deadline_s: float = 600.0  # one SyncWeights call (saving a replica is slow)
    weight_sync_dir: str = "/tmp/lemix-weights"  # where SEPARATE's synced replicas go
    consumer: str = ""  # intake consumer name; "" = scheduler-<hostname>
    node_poll_s: float = 0.5  # how often node heartbeats are read
    read_block_s: float = 1.0  # longest blocking XREAD(GROUP); also bounds stop latency
    intake_batch: int = 100  # intake entries read per call
    # A restarted scheduler takes over intake entries a dead consumer left
    # pending this long. One scheduler runs per namespace, so at start every
    # pending entry is a dead predecessor's: 0 takes them all at once.
    claim_min_idle_s: float = 0.0
    stop_grace_s: float = 5.0  # in-flight RPCs get this long on stop
    # Dispatch RPCs in flight at once (a 10,000-sample Train places hundreds
    # in one plan); the rest wait their turn.
    max_concurrent_dispatches: int = 32
    # Times a task is placed again after its node failed a Dispatch or went
    # down, before it fails UNAVAILABLE (a task that kills every node it
    # lands on must not take the cluster down one node at a time).
    max_task_moves: int = 3
    # A node down (heartbeat expired, or reported unhealthy) gets no new work at
    # once, but loses what it holds only after this long down: a heartbeat
    # late by a GC pause or a CPU-starved second must not fail its streams.
    node_lost_after_s: float = 2.0
    # Nodes whose heartbeat is missing after a Redis error or restart (or at
    # start) are declared down only this long after Redis answers again.
    redis_outage_grace_s: float = 2 * NODE_HEARTBEAT_TTL_S
    # Submit/Cancel/GetState calls that use Redis at once; more wait here, so
    # they cannot starve the loops of pooled connections.
    max_rpc_redis_calls: int = 32
    # How often the stream leases of held inference are checked; a lapsed one
    # cancels its task (its gateway is gone).
    lease_check_s: float = STREAM_LEASE_TTL_S / 3
    # Task hashes and output streams of tasks the scheduler saw end expire
    # this long after (0 = keep forever).
    finished_task_ttl_s: float = 24 * 3600.0
    # Every this many planner events the scheduler records a snapshot of its
    # planner into the event log and trims the log before it, so a restart
    # replays at most about this many events (0 = never: the log grows).
    snapshot_every_events: int = 10_000
    log_level: str = "info"  # debug | info | warning | error
    log_format: str = "console"  # console | json
    # Sent to executors and required from the gateway (lemix.infra.rpc.auth); "" = none.
    service_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        get_spec(self.policy)  # unknown names fail here, with the list of choices
        RedisKeys(self.namespace)  # namespace must be a non-empty word
        if not 0 <= self.port < 1 << 16:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        settings.check_port_or_off("metrics_port", self.metrics_port)
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {self.num_nodes}")
        if self.slo_ttft_s < 0 or self.slo_tbt_s < 0:
            raise ValueError("slo_ttft_s and slo_tbt_s must be >= 0 (0 = derive from profile)")
        if (self.slo_ttft_s == 0) != (self.slo_tbt_s == 0):
            raise ValueError("set both slo_ttft_s and slo_tbt_s, or neither (derived)")
        if self.slo_prompt_tokens < 0 or self.slo_output_tokens < 0:
            raise ValueError("slo_prompt_tokens and slo_output_tokens must be >= 0")
        if (self.slo_prompt_tokens == 0) != (self.slo_output_tokens == 0):
            raise ValueError("set both slo_prompt_tokens and slo_output_tokens, or neither")
        positive = {
            "dispatch_deadline_s": self.dispatch_deadline_s,
            "dispatch_retry_s": self.dispatch_retry_s,
            "weight_sync_deadline_s": self.weight_sync_deadline_s,
            "node_poll_s": self.node_poll_s,
            "read_block_s": self.read_block_s,
            "intake_batch": self.intake_batch,
            "max_concurrent_dispatches": self.max_concurrent_dispatches,
            "max_rpc_redis_calls": self.max_rpc_redis_calls,
            "lease_check_s": self.lease_check_s,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        non_negative = {
            "claim_min_idle_s": self.claim_min_idle_s,
            "stop_grace_s": self.stop_grace_s,
            "max_task_moves": self.max_task_moves,
            "redis_outage_grace_s": self.redis_outage_grace_s,
            "node_lost_after_s": self.node_lost_after_s,
            "finished_task_ttl_s": self.finished_task_ttl_s,
            "snapshot_every_events": self.snapshot_every_events,
        }
        for name, value in non_negative.items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.log_level not in _LOG_LEVELS:
            raise ValueError(
                f"log_level must be one of {'|'.join(_LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.log_format not in ("console", "json"):
            raise ValueError(f"log_format must be console or json, got {self.log_format!r}")
        SloConfig(self.slo_multiplier)
        check_service_token(self.service_token)
        MemoryConfig(kappa=self.kappa)
        BatchingConfig(max_batch_size=self.max_batch_size)

    @property
    def consumer_name(self) -> str:
        return self.consumer or _default_consumer()

    @property
    def redis_max_connections(self) -> int:
        """The Redis pool's bound: the loops' connections plus the RPCs' share."""
        return NUM_LOOP_REDIS_CONNECTIONS + self.max_rpc_redis_calls

    @property
    def redis_socket_timeout_s(self) -> float:
        return self.read_block_s + _SOCKET_SLACK_S

    @property
    def resolved_profile_path(self) -> Path:
        return Path(self.profile_path) if self.profile_path else default_profile_path()

    @property
    def memory(self) -> MemoryConfig:
        """The planner's view of memory (only κ matters to it)."""
        return MemoryConfig(kappa=self.kappa)

    def slo(self, profile: Profile) -> Slo:
        """The SLO pair: given, or derived exactly as the simulator derives it."""
        if self.slo_ttft_s > 0:
            return Slo(ttft_s=self.slo_ttft_s, tbt_s=self.slo_tbt_s)
        reference: list[Task] = []
        if self.slo_prompt_tokens:
            reference = [
                Task(
                    "slo-reference",
                    TaskKind.INFERENCE,
                    0.0,
                    self.slo_prompt_tokens,
                    self.slo_output_tokens,
                )
            ]
        return compute_slo(profile, reference, SloConfig(self.slo_multiplier))

    def planner_config(self, profile: Profile) -> PlannerConfig:
        """The planner's config.

        Mirrors `lemix.sim.run.build_simulator`'s mapping field for field, so the
        live scheduler and the simulator plan alike. TODO(shared builder): once
        lemix offers one PlannerConfig builder for both, call it here instead.
        """
        slo = self.slo(profile)
        return PlannerConfig(
            num_nodes=self.num_nodes,
            num_stages=profile.num_stages,
            slo_ttft_s=slo.ttft_s,
            slo_tbt_s=slo.tbt_s,
            max_batch_size=self.max_batch_size,
            max_defer_s=self.max_defer_s,
            defer_recheck_s=self.defer_recheck_s,
            train_rate=self.train_rate,
            sync_every_tasks=self.sync_every_tasks,
        )


# ------------------------------------------------------------------ env + CLI


def _option(field: str, env: str, parse: Callable[[str], Any], help: str) -> Option:
    """The scheduler's flags are its field names, dashed."""
    return Option(field, f"--{field.replace('_', '-')}", env, parse, help, metavar=field.upper())


_OPTIONS: tuple[Option, ...] = (
    _option("host", "LEMIX_SCHEDULER_HOST", str, "address to bind the gRPC server to"),
    _option("port", "LEMIX_SCHEDULER_PORT", int, "gRPC port (0 = a free port)"),
    _option(
        "metrics_port",
        "LEMIX_SCHEDULER_METRICS_PORT",
        port_or_off,
        "Prometheus /metrics port (0 = a free port, -1 = off)",
    ),
    _option("redis_url", "LEMIX_REDIS_URL", str, "Redis URL, e.g. redis://host:6379/0"),
    _option("namespace", "LEMIX_NAMESPACE", str, "Redis key namespace shared by the stack"),
    _option("policy", "LEMIX_POLICY", str, f"placement policy: {', '.join(POLICIES)}"),
    _option("num_nodes", "LEMIX_NUM_NODES", int, "executor nodes (ids 0..N-1)"),
    _option("profile_path", "LEMIX_PROFILE", str, "profile JSON (default: the shipped A100 one)"),
    _option("slo_ttft_s", "LEMIX_SLO_TTFT_S", float, "TTFT SLO in s (0 = derive from the profile)"),
    _option("slo_tbt_s", "LEMIX_SLO_TBT_S", float, "TBT SLO in s (0 = derive from the profile)"),
    _option("slo_multiplier", "LEMIX_SLO_MULTIPLIER", float, "derived SLO = k x unloaded latency"),
    _option(
        "slo_prompt_tokens",
        "LEMIX_SLO_PROMPT_TOKENS",
        int,
        "reference prompt length for derived SLOs (0 = compute_slo default)",
    ),
    _option(
        "slo_output_tokens",
        "LEMIX_SLO_OUTPUT_TOKENS",
        int,
        "reference output length for derived SLOs (0 = compute_slo default)",
    ),
    _option("kappa", "LEMIX_KAPPA", float, "usable fraction of each GPU's memory"),
    _option("max_batch_size", "LEMIX_MAX_BATCH_SIZE", int, "executors' running-batch cap"),
    _option("train_rate", "LEMIX_TRAIN_RATE", float, "SEPARATE: training share of nodes"),
    _option("sync_every_tasks", "LEMIX_SYNC_EVERY_TASKS", int, "SEPARATE: weight sync period K"),
    _option("max_defer_s", "LEMIX_MAX_DEFER_S", float, "longest a training task is deferred"),
    _option(
        "defer_recheck_s", "LEMIX_DEFER_RECHECK_S", float, "re-evaluate deferred training every"
    ),
    _option(
        "dispatch_deadline_s", "LEMIX_DISPATCH_DEADLINE_S", float, "deadline of executor calls"
    ),
    _option(
        "dispatch_retry_s",
        "LEMIX_DISPATCH_RETRY_S",
        float,
        "pause before a node that failed a dispatch gets work again",
    ),
    _option(
        "weight_sync_deadline_s",
        "LEMIX_WEIGHT_SYNC_DEADLINE_S",
        float,
        "deadline of one SyncWeights call",
    ),
    _option("weight_sync_dir", "LEMIX_WEIGHT_SYNC_DIR", str, "where synced weights are saved"),
    _option("consumer", "LEMIX_SCHEDULER_CONSUMER", str, "intake consumer name"),
    _option("node_poll_s", "LEMIX_NODE_POLL_S", float, "node heartbeat poll period"),
    _option("read_block_s", "LEMIX_READ_BLOCK_S", float, "longest blocking Redis read"),
    _option("intake_batch", "LEMIX_INTAKE_BATCH", int, "intake entries per read"),
    _option(
        "claim_min_idle_s",
        "LEMIX_CLAIM_MIN_IDLE_S",
        float,
        "take over intake entries pending this long at start",
    ),
    _option("stop_grace_s", "LEMIX_STOP_GRACE_S", float, "grace for in-flight RPCs on stop"),
    _option(
        "max_concurrent_dispatches",
        "LEMIX_MAX_CONCURRENT_DISPATCHES",
        int,
        "executor Dispatch calls in flight at once",
    ),
    _option(
        "max_task_moves",
        "LEMIX_MAX_TASK_MOVES",
        int,
        "re-placements of a task after node failures before it fails",
    ),
    _option(
        "node_lost_after_s",
        "LEMIX_NODE_LOST_AFTER_S",
        float,
        "a node down this long loses its tasks (re-queued or failed)",
    ),
    _option(
        "redis_outage_grace_s",
        "LEMIX_REDIS_OUTAGE_GRACE_S",
        float,
        "after a Redis outage, wait this long before declaring silent nodes down",
    ),
    _option(
        "max_rpc_redis_calls",
        "LEMIX_MAX_RPC_REDIS_CALLS",
        int,
        "scheduler RPCs using Redis at once (sizes the Redis pool)",
    ),
    _option(
        "lease_check_s",
        "LEMIX_LEASE_CHECK_S",
        float,
        "how often stream leases of held requests are checked",
    ),
    _option(
        "finished_task_ttl_s",
        "LEMIX_FINISHED_TASK_TTL_S",
        float,
        "finished tasks' state and output expire after (0 = never)",
    ),
    _option(
        "snapshot_every_events",
        "LEMIX_SNAPSHOT_EVERY_EVENTS",
        int,
        "snapshot the planner into the event log and trim it every N events (0 = never)",
    ),
    _option("log_level", "LEMIX_LOG_LEVEL", str, "debug|info|warning|error"),
    _option("log_format", "LEMIX_LOG_FORMAT", str, "console|json"),
    SERVICE_TOKEN_OPTION,
)

# `python -m services.scheduler` serves metrics unless told not to.
_CLI_DEFAULTS: dict[str, Any] = {"metrics_port": 0}


def env_table() -> list[tuple[str, str, str]]:
    """(flag, env var, help) for every option: for docs and `--help`."""
    return [(o.flag, o.env, o.help) for o in _OPTIONS]


def build_parser(prog: str = "python -m services.scheduler") -> argparse.ArgumentParser:
    """The scheduler's flags; every default is None so env and defaults can apply."""
    return settings.build_parser(
        SchedulerConfig,
        _OPTIONS,
        prog=prog,
        cli_defaults=_CLI_DEFAULTS,
        description="LeMix global scheduler: intake -> planner -> executor dispatch.",
    )


def from_env_and_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> SchedulerConfig:
    """Parse flags (`argv`, default sys.argv[1:]) over env vars (default os.environ).

    `--help` and usage errors exit through argparse (status 0 and 2); a bad
    value raises `ValueError` naming the flag and its environment variable.
    """
    return settings.parse_settings(
        SchedulerConfig, build_parser(), _OPTIONS, argv, env, _CLI_DEFAULTS
    )
