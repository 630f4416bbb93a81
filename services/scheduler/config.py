"""The scheduler's configuration, and the ONE place that maps env vars and flags to it.

Precedence: a command-line flag, else its ``LEMIX_*`` environment variable,
else the default (lemix.infra.settings is the mechanism). Nothing is read at import
time: `from_env_and_args` reads `os.environ` (or the mapping it is given) when
called. The fields every service shares (host, ports, Redis, logging, the
service token, the drain grace) come from `lemix.infra.config`;
`scripts/config_table.py` prints the docs/configuration.md table from `_OPTIONS`.

`shutdown_grace_s` was `stop_grace_s` here: ``--stop-grace-s`` and
``LEMIX_STOP_GRACE_S`` are still read, as deprecated aliases (with a warning).
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lemix.batching import BatchingConfig
from lemix.infra import settings
from lemix.infra.config import COMMON_CLI_DEFAULTS, SCHEDULER, CommonServiceConfig, common_options
from lemix.infra.engine_options import ENGINE_OPTIONS, EngineKnobs
from lemix.infra.settings import Option, option
from lemix.infra.store.keys import NODE_HEARTBEAT_TTL_S, STREAM_LEASE_TTL_S
from lemix.memory import MemoryConfig
from lemix.planner.base import PlannerConfig
from lemix.planner.configure import build_planner_config, resolve_training_nodes
from lemix.planner.registry import POLICIES, get_spec
from lemix.profile import Profile, default_profile_path
from lemix.slo import Slo, SloConfig, compute_slo
from lemix.types import Task, TaskKind

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
class SchedulerConfig(CommonServiceConfig):
    """Everything the scheduler service needs, explicit and validated.

    From CommonServiceConfig: `shutdown_grace_s` is what in-flight RPCs get on
    stop; `service_token` is sent to executors and required from the gateway.
    """

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
    # The executors' engine v2 knobs (lemix.infra.engine_options), so the
    # planner models the engine the nodes run; the defaults are engine v2, the
    # auto ones resolved from the profile as the executors resolve them (an
    # auto training slice from the profile's default SLO, not `slo()`: an
    # executor knows no LEMIX_SLO_*).
    num_micro_batches: int = EngineKnobs().num_micro_batches
    prefill_token_budget: int = EngineKnobs().prefill_token_budget
    train_slice_s: float = EngineKnobs().train_slice_s
    batch_cap: str = EngineKnobs().batch_cap
    gather_decodes: str = EngineKnobs().gather_decodes  # on | off
    decode_pace_s: float = EngineKnobs().decode_pace_s  # profile s; 0 = off, -1 = auto
    training_order: str = EngineKnobs().training_order  # forward-first | backward-first
    spare_training: int = EngineKnobs().spare_training  # tasks beyond one per stage
    train_rate: float = _DEFAULT_PLANNER.train_rate  # SEPARATE's training share of nodes
    sync_every_tasks: int = _DEFAULT_PLANNER.sync_every_tasks  # SEPARATE's K
    # Co-located policies: nodes that train (all, auto or a count; the rest
    # only serve and get weight syncs every K), and the admission scope.
    training_nodes: str = "all"
    admission: str = "node"
    replica_sync_every_tasks: int = 0  # M: average the trainers' replicas; 0 = off
    max_defer_s: float = _DEFAULT_PLANNER.max_defer_s
    defer_recheck_s: float = _DEFAULT_PLANNER.defer_recheck_s
    max_training_runs_per_plan: int = _DEFAULT_PLANNER.max_training_runs_per_plan
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
    # Handled intake entries are acked and deleted with the first intake read
    # once the oldest waited this long (or a read's worth is waiting): one
    # XACK + XDEL for several requests under load, where every batch of one
    # paid both, and once the event log has stored what they caused (its
    # own 20 ms coalescing: write-ahead). An ack waits for a read, so up to
    # `read_block_s` when idle; an unacked entry is redelivered after a
    # crash and recognised then.
    intake_ack_delay_s: float = 0.02
    # A restarted scheduler takes over intake entries a dead consumer left
    # pending this long. One scheduler runs per namespace, so at start every
    # pending entry is a dead predecessor's: 0 takes them all at once.
    claim_min_idle_s: float = 0.0
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
    # How often the leases of the gateways streaming held inference are
    # checked; a lapsed one cancels their tasks (the gateway is gone).
    lease_check_s: float = STREAM_LEASE_TTL_S / 3
    # Task hashes of tasks the scheduler saw end expire this long after
    # (0 = keep forever): GetTask and the audit read final states there.
    finished_task_ttl_s: float = 24 * 3600.0
    # Their output streams expire this long after (0 = with the hash): an
    # idempotent retry replays the output until then. The one expiry of a
    # stream (gateways do not expire what they read), so tokens do not stay
    # in Redis memory for a day at the serving rate.
    output_retain_s: float = 300.0
    # Every this many planner events the scheduler records a snapshot of its
    # planner into the event log and trims the log before it, so a restart
    # replays at most about this many events (0 = never: the log grows).
    snapshot_every_events: int = 10_000

    @property
    def output_ttl_s(self) -> float:
        """How long an ended task's output stream is kept (0: forever)."""
        return self.output_retain_s or self.finished_task_ttl_s

    def __post_init__(self) -> None:
        super().__post_init__()
        get_spec(self.policy)  # unknown names fail here, with the list of choices
        self.engine_knobs()  # the engine knobs' own range checks
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {self.num_nodes}")
        resolve_training_nodes(self.training_nodes, self.num_nodes, self.train_rate)
        if self.admission not in ("node", "cluster"):
            raise ValueError(f"admission must be node or cluster, got {self.admission!r}")
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
            "intake_ack_delay_s": self.intake_ack_delay_s,
            "max_task_moves": self.max_task_moves,
            "redis_outage_grace_s": self.redis_outage_grace_s,
            "node_lost_after_s": self.node_lost_after_s,
            "finished_task_ttl_s": self.finished_task_ttl_s,
            "output_retain_s": self.output_retain_s,
            "snapshot_every_events": self.snapshot_every_events,
        }
        for name, value in non_negative.items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        SloConfig(self.slo_multiplier)
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
        """The planner's config, mapped exactly as the simulator maps its own
        (`lemix.planner.configure.build_planner_config`), so both plan alike."""
        return build_planner_config(
            num_nodes=self.num_nodes,
            profile=profile,
            slo=self.slo(profile),
            max_batch_size=self.max_batch_size,
            max_defer_s=self.max_defer_s,
            defer_recheck_s=self.defer_recheck_s,
            max_training_runs_per_plan=self.max_training_runs_per_plan,
            train_rate=self.train_rate,
            sync_every_tasks=self.sync_every_tasks,
            training_nodes=self.training_nodes,
            is_admission_cluster_wide=self.admission == "cluster",
            replica_sync_every_tasks=self.replica_sync_every_tasks or None,
            **self.planner_engine_knobs(profile),
        )

    def planner_engine_knobs(self, profile: Profile) -> dict[str, Any]:
        """The executors' resolved engine knobs that the planner models: all
        but the training order and the spare training tasks, on which no
        predicted cost depends (the planner's training load comes from its
        placements, not from how many run at once)."""
        knobs = self.engine_knobs().resolve(profile)
        del knobs["training_order"], knobs["spare_training_in_flight"]
        return knobs

    def engine_knobs(self) -> EngineKnobs:
        return EngineKnobs.of(self)


# ------------------------------------------------------------------ env + CLI


def _with_old_names(opt: Option) -> Option:
    """The scheduler's drain grace was `stop_grace_s`; its old flag and variable
    stay accepted (deprecated, with a warning) until deployments have moved."""
    if opt.field != "shutdown_grace_s":
        return opt
    return dataclasses.replace(
        opt, deprecated_flags=("--stop-grace-s",), deprecated_envs=("LEMIX_STOP_GRACE_S",)
    )


_OPTIONS: tuple[Option, ...] = (
    *map(_with_old_names, common_options(SCHEDULER)),
    option("policy", "LEMIX_POLICY", str, f"placement policy: {', '.join(POLICIES)}"),
    option("num_nodes", "LEMIX_NUM_NODES", int, "executor nodes (ids 0..N-1)"),
    option("profile_path", "LEMIX_PROFILE", str, "profile JSON (default: the shipped A100 one)"),
    option("slo_ttft_s", "LEMIX_SLO_TTFT_S", float, "TTFT SLO in s (0 = derive from the profile)"),
    option("slo_tbt_s", "LEMIX_SLO_TBT_S", float, "TBT SLO in s (0 = derive from the profile)"),
    option("slo_multiplier", "LEMIX_SLO_MULTIPLIER", float, "derived SLO = k x unloaded latency"),
    option(
        "slo_prompt_tokens",
        "LEMIX_SLO_PROMPT_TOKENS",
        int,
        "reference prompt length for derived SLOs (0 = compute_slo default)",
    ),
    option(
        "slo_output_tokens",
        "LEMIX_SLO_OUTPUT_TOKENS",
        int,
        "reference output length for derived SLOs (0 = compute_slo default)",
    ),
    option("kappa", "LEMIX_KAPPA", float, "usable fraction of each GPU's memory"),
    option("max_batch_size", "LEMIX_MAX_BATCH_SIZE", int, "executors' running-batch cap"),
    *ENGINE_OPTIONS,
    option("train_rate", "LEMIX_TRAIN_RATE", float, "SEPARATE: training share of nodes"),
    option("sync_every_tasks", "LEMIX_SYNC_EVERY_TASKS", int, "SEPARATE: weight sync period K"),
    option(
        "training_nodes",
        "LEMIX_TRAINING_NODES",
        str,
        "nodes that train: all, auto (SEPARATE's split) or a count",
    ),
    option(
        "admission",
        "LEMIX_ADMISSION",
        str,
        "defer training if the next request would miss on its node (node) or everywhere (cluster)",
    ),
    option(
        "replica_sync_every_tasks",
        "LEMIX_REPLICA_SYNC_EVERY_TASKS",
        int,
        "average the training nodes' replicas every M training tasks (0 = off)",
    ),
    option("max_defer_s", "LEMIX_MAX_DEFER_S", float, "longest a training task is deferred"),
    option(
        "defer_recheck_s", "LEMIX_DEFER_RECHECK_S", float, "re-evaluate deferred training every"
    ),
    option(
        "max_training_runs_per_plan",
        "LEMIX_MAX_TRAINING_RUNS_PER_PLAN",
        int,
        "Algorithm 1 runs one plan call spends placing training before it yields to the event loop",
    ),
    option("dispatch_deadline_s", "LEMIX_DISPATCH_DEADLINE_S", float, "deadline of executor calls"),
    option(
        "dispatch_retry_s",
        "LEMIX_DISPATCH_RETRY_S",
        float,
        "pause before a node that failed a dispatch gets work again",
    ),
    option(
        "weight_sync_deadline_s",
        "LEMIX_WEIGHT_SYNC_DEADLINE_S",
        float,
        "deadline of one SyncWeights call",
    ),
    option("weight_sync_dir", "LEMIX_WEIGHT_SYNC_DIR", str, "where synced weights are saved"),
    option("consumer", "LEMIX_SCHEDULER_CONSUMER", str, "intake consumer name"),
    option("node_poll_s", "LEMIX_NODE_POLL_S", float, "node heartbeat poll period"),
    option("read_block_s", "LEMIX_READ_BLOCK_S", float, "longest blocking Redis read"),
    option("intake_batch", "LEMIX_INTAKE_BATCH", int, "intake entries per read"),
    option(
        "intake_ack_delay_s",
        "LEMIX_INTAKE_ACK_DELAY_S",
        float,
        "how long a handled intake entry's ack waits at least, for others to share it",
    ),
    option(
        "claim_min_idle_s",
        "LEMIX_CLAIM_MIN_IDLE_S",
        float,
        "take over intake entries pending this long at start",
    ),
    option(
        "max_concurrent_dispatches",
        "LEMIX_MAX_CONCURRENT_DISPATCHES",
        int,
        "executor Dispatch calls in flight at once",
    ),
    option(
        "max_task_moves",
        "LEMIX_MAX_TASK_MOVES",
        int,
        "re-placements of a task after node failures before it fails",
    ),
    option(
        "node_lost_after_s",
        "LEMIX_NODE_LOST_AFTER_S",
        float,
        "a node down this long loses its tasks (re-queued or failed)",
    ),
    option(
        "redis_outage_grace_s",
        "LEMIX_REDIS_OUTAGE_GRACE_S",
        float,
        "after a Redis outage, wait this long before declaring silent nodes down",
    ),
    option(
        "max_rpc_redis_calls",
        "LEMIX_MAX_RPC_REDIS_CALLS",
        int,
        "scheduler RPCs using Redis at once (sizes the Redis pool)",
    ),
    option(
        "lease_check_s",
        "LEMIX_LEASE_CHECK_S",
        float,
        "how often the gateway leases of held requests are checked",
    ),
    option(
        "finished_task_ttl_s",
        "LEMIX_FINISHED_TASK_TTL_S",
        float,
        "finished tasks' state expires after (0 = never)",
    ),
    option(
        "output_retain_s",
        "LEMIX_OUTPUT_RETAIN_S",
        float,
        "finished tasks' output streams expire after (0 = with their state)",
    ),
    option(
        "snapshot_every_events",
        "LEMIX_SNAPSHOT_EVERY_EVENTS",
        int,
        "snapshot the planner into the event log and trim it every N events (0 = never)",
    ),
)

# `python -m services.scheduler` serves metrics unless told not to.
_CLI_DEFAULTS: dict[str, Any] = dict(COMMON_CLI_DEFAULTS)


def env_table() -> list[tuple[str, str, str]]:
    """(flag, env var, help) for every option: for docs and `--help`."""
    return [(o.flag, o.env, o.help) for o in _OPTIONS]


SPEC = settings.ConfigSpec(
    SchedulerConfig,
    _OPTIONS,
    prog="python -m services.scheduler",
    description="LeMix global scheduler: intake -> planner -> executor dispatch.",
    cli_defaults=_CLI_DEFAULTS,
)
build_parser = SPEC.build_parser
# `--help` and usage errors exit through argparse (status 0 and 2); a bad
# value raises `ValueError` naming the flag and its environment variable.
from_env_and_args = SPEC.parse
