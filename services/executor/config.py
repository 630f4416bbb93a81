"""The executor's configuration: one frozen dataclass, and the ONE place that
maps ``LEMIX_*`` environment variables and command-line flags onto it.

Precedence: a flag given on the command line, else its environment variable,
else the default (lemix.infra.settings is the mechanism). Nothing is read at import
time; `from_env_and_args` reads `os.environ` when called (or the mapping it is
given, for tests). The fields every service shares (host, ports, Redis,
logging, the service token, the drain grace) come from `lemix.infra.config`;
`scripts/config_table.py` prints the docs/configuration.md table from `_OPTIONS`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lemix.batching import BatchingConfig
from lemix.engine import EngineConfig
from lemix.infra import settings
from lemix.infra.config import COMMON_CLI_DEFAULTS, EXECUTOR, CommonServiceConfig, common_options
from lemix.infra.engine_options import ENGINE_OPTIONS, EngineKnobs
from lemix.infra.settings import Option, boolean, check_finite
from lemix.memory import MemoryConfig
from lemix.profile import Profile

if TYPE_CHECKING:
    from services.executor.torch_setup import TorchBackendConfig

BACKENDS = ("emulated", "torch")
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")
_MAX_NODE_ID = (1 << 32) - 1  # NodeState.node_id is a uint32 on the wire
_TTL_PER_HEARTBEAT = 3.0  # docs/protocol.md: heartbeat TTL defaults to 3x the period


@dataclass(frozen=True)
class ExecutorConfig(CommonServiceConfig):
    """Everything one executor process (one node) needs. Times are wall seconds
    unless they say otherwise; engine times (`join_window_s`, `max_wait_s`) are
    profile seconds, which `time_scale` shrinks or stretches.

    From CommonServiceConfig: `port` 0 = any free port (see
    ExecutorService.bound_port); `shutdown_grace_s` is how long stop() lets
    running work finish; `service_token` must be on every call but health
    checks ("" = unauthenticated)."""

    node_id: int = 0
    profile_path: Path | None = None  # None = lemix.profile.default_profile_path()
    backend: str = "emulated"
    time_scale: float = 1.0  # wall seconds per profile second (emulated backend)
    latency_noise_cv: float = 0.0  # emulated truth = profile x lognormal noise of this CV
    seed: int = 0  # the noise RNG is seeded with seed + node_id
    heartbeat_s: float = 0.5  # node-state write period
    node_ttl_s: float | None = None  # node-state TTL; None = 3 x heartbeat_s
    max_batch_size: int = BatchingConfig().max_batch_size  # C
    join_window_s: float | None = None  # T_w (profile s); None = join at any iteration
    kappa: float = MemoryConfig().kappa  # usable fraction of each stage GPU
    max_wait_s: float = MemoryConfig().max_wait_s  # T_max (profile s)
    is_offload_enabled: bool = True  # False: wait-then-drop
    advertise_host: str = ""  # host others dial; "" = host (or this machine's name)
    stage_timeout_s: float = 300.0  # a stage item running longer marks the node unhealthy
    # SyncWeights reads and writes only under this directory (the scheduler's
    # weight_sync_dir, the same LEMIX_WEIGHT_SYNC_DIR): any other location is refused.
    weight_sync_dir: str = "/tmp/lemix-weights"
    # torch backend (see services/executor/torch_setup.py)
    model: str = "tiny-llama"  # a preset name or a local checkpoint directory
    tokenizer: str = "bpe:8192"  # the gateway must use the same
    devices: str = ""  # per stage, comma-separated; "" = cuda:0..S-1 if present, else cpu
    dtype: str = ""  # "" = bfloat16 on GPU, float32 on CPU
    model_seed: int = 0  # preset init; equal on every node so replicas start equal
    learning_rate: float = 1e-3
    max_grad_norm: float = 1.0
    memory_budget_bytes: int = 0  # per stage on CPU; 0 = 4 GiB
    torch_threads: int = 0  # intra-op threads; 0 = torch's default
    # Engine v2 (lemix.engine.EngineConfig; issue 9), the default; sentinels,
    # not None, because a flag parsed to None counts as not given
    # (lemix.infra.settings). The auto ones resolve from the profile exactly
    # as the scheduler's (lemix.infra.engine_options).
    num_micro_batches: int = EngineKnobs().num_micro_batches  # 0 = one per stage
    prefill_token_budget: int = EngineKnobs().prefill_token_budget  # 0 = off, -1 = auto
    # profile s; 0 = off, -1 = auto (a quarter of the TBT SLO the profile gives)
    train_slice_s: float = EngineKnobs().train_slice_s
    batch_cap: str = EngineKnobs().batch_cap  # node | micro-batch
    gather_decodes: str = EngineKnobs().gather_decodes  # on | off
    decode_pace_s: float = EngineKnobs().decode_pace_s  # profile s; 0 = off, -1 = auto
    training_order: str = EngineKnobs().training_order  # forward-first | backward-first
    spare_training: int = EngineKnobs().spare_training  # tasks beyond one per stage

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.node_id <= _MAX_NODE_ID:
            raise ValueError(f"node_id must be in [0, {_MAX_NODE_ID}], got {self.node_id}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        check_finite("time_scale", self.time_scale, allow_zero=False)
        check_finite("latency_noise_cv", self.latency_noise_cv, allow_zero=True)
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        check_finite("heartbeat_s", self.heartbeat_s, allow_zero=False)
        if self.node_ttl_s is not None and not self.node_ttl_s > self.heartbeat_s:
            raise ValueError(
                f"node_ttl_s ({self.node_ttl_s}) must exceed heartbeat_s ({self.heartbeat_s}), "
                "or the node would flicker dead between heartbeats"
            )
        if any(ch.isspace() for ch in self.advertise_host):
            raise ValueError(f"advertise_host must not contain spaces: {self.advertise_host!r}")
        check_finite("stage_timeout_s", self.stage_timeout_s, allow_zero=False)
        if not self.weight_sync_dir or "\0" in self.weight_sync_dir:
            raise ValueError(f"weight_sync_dir must name a directory, got {self.weight_sync_dir!r}")
        self._check_engine_knobs()
        # batching/memory ranges are checked by their own configs
        self._engine_config(None)
        if self.backend == "torch":
            if self.time_scale != 1.0:
                raise ValueError(
                    "time_scale applies to the emulated backend only; the torch "
                    "backend runs in real time (leave it at 1)"
                )
            self.torch_config()

    def _check_engine_knobs(self) -> None:
        self.engine_knobs()  # their own range checks

    def engine_knobs(self) -> EngineKnobs:
        """The engine v2 options (shared with the scheduler: lemix.infra.engine_options)."""
        return EngineKnobs.of(self)

    def torch_config(self) -> TorchBackendConfig:
        from services.executor.torch_setup import TorchBackendConfig

        return TorchBackendConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            devices=self.devices,
            dtype=self.dtype,
            seed=self.model_seed,
            learning_rate=self.learning_rate,
            max_grad_norm=self.max_grad_norm,
            memory_budget_bytes=self.memory_budget_bytes,
            num_threads=self.torch_threads,
        )

    # ------------------------------------------------------------ derived

    @property
    def heartbeat_ttl_s(self) -> float:
        """TTL of each node-state write: `node_ttl_s`, or 3 x `heartbeat_s`."""
        return (
            self.node_ttl_s
            if self.node_ttl_s is not None
            else (_TTL_PER_HEARTBEAT * self.heartbeat_s)
        )

    def engine_config(self, profile: Profile) -> EngineConfig:
        """The node engine's config (streaming executors need every token);
        `profile` resolves an auto prefill token budget."""
        return self._engine_config(profile)

    def _engine_config(self, profile: Profile | None) -> EngineConfig:
        return EngineConfig(
            batching=BatchingConfig(self.max_batch_size, self.join_window_s),
            memory=MemoryConfig(self.kappa, self.max_wait_s, self.is_offload_enabled),
            emit_tokens=True,
            **self.engine_knobs().resolve(profile),
        )

    def advertised_host(self, fallback_host: str) -> str:
        """The host part of the address this node advertises: `advertise_host`,
        else `host` unless it is a wildcard, else `fallback_host`."""
        if self.advertise_host:
            return self.advertise_host
        return fallback_host if self.host in _WILDCARD_HOSTS else self.host

    # ------------------------------------------------------------ env + CLI

    @classmethod
    def from_env_and_args(
        cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
    ) -> ExecutorConfig:
        """Build the config from `env` (default `os.environ`) and `argv` (default
        `sys.argv[1:]`), through lemix.infra.settings. Bad flags exit via argparse
        (status 2); a bad environment value or an out-of-range setting raises
        `ValueError`."""
        return SPEC.parse(argv, env)


_OPTIONS: tuple[Option, ...] = (
    *common_options(EXECUTOR),
    Option("node_id", "--node-id", "LEMIX_NODE_ID", int, "this node's id", "N"),
    Option(
        "profile_path",
        "--profile",
        "LEMIX_PROFILE",
        Path,
        "profile JSON (default: the shipped A100 profile)",
        "FILE",
    ),
    Option(
        "backend",
        "--backend",
        "LEMIX_EXECUTOR_BACKEND",
        str,
        f"stage backend: {', '.join(BACKENDS)}",
        "NAME",
    ),
    Option(
        "time_scale",
        "--time-scale",
        "LEMIX_TIME_SCALE",
        float,
        "wall seconds per profile second (emulated)",
        "X",
    ),
    Option(
        "latency_noise_cv",
        "--latency-noise-cv",
        "LEMIX_LATENCY_NOISE_CV",
        float,
        "CV of the emulated latency noise (0 = exact profile)",
        "CV",
    ),
    Option("seed", "--seed", "LEMIX_SEED", int, "noise RNG seed (plus node id)", "N"),
    Option(
        "heartbeat_s",
        "--heartbeat-s",
        "LEMIX_HEARTBEAT_S",
        float,
        "node-state write period, s",
        "S",
    ),
    Option(
        "node_ttl_s",
        "--node-ttl-s",
        "LEMIX_NODE_TTL_S",
        float,
        "node-state TTL, s (default 3x heartbeat)",
        "S",
    ),
    Option(
        "max_batch_size",
        "--max-batch-size",
        "LEMIX_MAX_BATCH_SIZE",
        int,
        "C, the running-batch cap",
        "C",
    ),
    Option(
        "join_window_s",
        "--join-window-s",
        "LEMIX_JOIN_WINDOW_S",
        float,
        "T_w, profile s (default: join at any iteration)",
        "S",
    ),
    Option("kappa", "--kappa", "LEMIX_KAPPA", float, "usable fraction of GPU memory", "K"),
    Option(
        "max_wait_s",
        "--max-wait-s",
        "LEMIX_MAX_WAIT_S",
        float,
        "T_max, profile s a task may wait for memory (then a request fails)",
        "S",
    ),
    Option(
        "is_offload_enabled",
        "--offload",
        "LEMIX_OFFLOAD",
        boolean,
        "training past T_max offloads KV to host (--no-offload: it is re-queued)",
    ),
    Option(
        "advertise_host",
        "--advertise-host",
        "LEMIX_ADVERTISE_HOST",
        str,
        "host others dial (default: --host, or this machine's name for a wildcard)",
        "HOST",
    ),
    Option(
        "stage_timeout_s",
        "--stage-timeout-s",
        "LEMIX_STAGE_TIMEOUT_S",
        float,
        "a stage item running longer (wall s) marks the node unhealthy",
        "S",
    ),
    Option(
        "weight_sync_dir",
        "--weight-sync-dir",
        "LEMIX_WEIGHT_SYNC_DIR",
        str,
        "SyncWeights reads and writes only under this directory",
        "DIR",
    ),
    Option(
        "model",
        "--model",
        "LEMIX_MODEL",
        str,
        "torch: model preset or local checkpoint directory",
        "NAME|DIR",
    ),
    Option(
        "tokenizer",
        "--tokenizer",
        "LEMIX_TOKENIZER",
        str,
        "torch: tokenizer spec (bpe:N, tokenizer.json, model dir)",
        "SPEC",
    ),
    Option(
        "devices",
        "--devices",
        "LEMIX_DEVICES",
        str,
        "torch: per-stage devices, comma-separated (default cuda:0.. or cpu)",
        "LIST",
    ),
    Option(
        "dtype",
        "--dtype",
        "LEMIX_DTYPE",
        str,
        "torch: float32 | bfloat16 | float16 (default by device)",
        "DTYPE",
    ),
    Option(
        "model_seed", "--model-seed", "LEMIX_MODEL_SEED", int, "torch: preset weight-init seed", "N"
    ),
    Option(
        "learning_rate",
        "--learning-rate",
        "LEMIX_LEARNING_RATE",
        float,
        "torch: AdamW learning rate",
        "LR",
    ),
    Option(
        "max_grad_norm",
        "--max-grad-norm",
        "LEMIX_MAX_GRAD_NORM",
        float,
        "torch: per-stage gradient clipping (0 = off)",
        "N",
    ),
    Option(
        "memory_budget_bytes",
        "--memory-budget-bytes",
        "LEMIX_MEMORY_BUDGET_BYTES",
        int,
        "torch on CPU: memory per stage, bytes (0 = 4 GiB)",
        "B",
    ),
    Option(
        "torch_threads",
        "--torch-threads",
        "LEMIX_TORCH_THREADS",
        int,
        "torch: intra-op threads (0 = default)",
        "N",
    ),
    *ENGINE_OPTIONS,
)

# `python -m services.executor` serves metrics unless told not to.
_CLI_DEFAULTS: dict[str, Any] = dict(COMMON_CLI_DEFAULTS)


SPEC = settings.ConfigSpec(
    ExecutorConfig,
    _OPTIONS,
    prog="python -m services.executor",
    description="LeMix executor: one process per node (torch or emulated stage backend).",
    cli_defaults=_CLI_DEFAULTS,
)
build_parser = SPEC.build_parser
