"""What a `lemix up` stack runs (`StackConfig`) and the `LEMIX_*` environment its
services get (`stack_env`).

Both ways to run the stack use it: local processes (`lemix.stack.launcher`)
and containers (`lemix.stack.containers`). Each service reads the variables
it has an option for, through its own config module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lemix.infra.config import SHARED_ENV
from lemix.infra.engine_options import ENGINE_OPTIONS, EngineKnobs
from lemix.infra.rpc.auth import parse_api_keys
from lemix.infra.store.redis_password import check_password
from lemix.infra.store.server import APPENDFSYNC_POLICIES
from lemix.stack.supervisor import RestartPolicy

# The service-specific variables `lemix up` sets, by the config field that
# reads them (the readers in the comments). The shared ones (Redis, namespace,
# logging, token, each service's host and ports) come from lemix.infra.config;
# these are spelled here because lemix.stack may not import the services.
# tests/test_launcher.py checks each against its service's option table.
SERVICE_ENV = {
    "policy": "LEMIX_POLICY",  # scheduler
    "num_nodes": "LEMIX_NUM_NODES",  # scheduler
    "train_rate": "LEMIX_TRAIN_RATE",  # scheduler
    "profile_path": "LEMIX_PROFILE",  # scheduler, executor (the profiler's base_profile_path)
    "max_batch_size": "LEMIX_MAX_BATCH_SIZE",  # scheduler, executor
    "node_id": "LEMIX_NODE_ID",  # executor
    "time_scale": "LEMIX_TIME_SCALE",  # executor
    "latency_noise_cv": "LEMIX_LATENCY_NOISE_CV",  # executor
    "backend": "LEMIX_EXECUTOR_BACKEND",  # executor
    "model": "LEMIX_MODEL",  # executor
    "torch_threads": "LEMIX_TORCH_THREADS",  # executor
    "tokenizer": "LEMIX_TOKENIZER",  # executor, gateway
    "scheduler_address": "LEMIX_SCHEDULER_ADDRESS",  # gateway
    "http_port": "LEMIX_GATEWAY_HTTP_PORT",  # gateway
    "served_model_name": "LEMIX_SERVED_MODEL_NAME",  # gateway
    "max_context_tokens": "LEMIX_MAX_CONTEXT_TOKENS",  # gateway (`lemix up --max-model-len`)
    "max_in_flight": "LEMIX_MAX_IN_FLIGHT",  # gateway
    # scheduler, executor: the engine v2 knobs (one table for both)
    **{opt.field: opt.env for opt in ENGINE_OPTIONS},
}


@dataclass(frozen=True)
class StackConfig:
    """One stack: its services' settings, ports and log and Redis dirs (ValueError
    for a bad one; the messages name `lemix up`'s flags)."""

    num_nodes: int = 2
    profile_path: Path | None = None  # None: the shipped A100 profile
    backend: str = "emulated"
    policy: str = "lemix"
    host: str = "127.0.0.1"
    gateway_port: int = 50051  # 0 = a free port, picked once at start
    # The gateway's OpenAI-compatible HTTP API; 0 = a free port (`lemix up`'s
    # --http-port defaults to 8000), so programmatic stacks never collide on it.
    http_port: int = 0
    redis_url: str | None = None  # None: start an embedded Redis
    # The embedded Redis's data dir (its AOF); None = a temporary one, kept
    # across Redis restarts and removed when the stack stops.
    redis_dir: Path | None = None
    redis_fsync: str = "always"  # the embedded Redis's appendfsync: always | everysec
    # The embedded Redis's password; None = a random one per start.
    redis_password: str | None = field(default=None, repr=False)
    restart_policy: RestartPolicy = RestartPolicy()
    namespace: str = "lemix"
    time_scale: float = 1.0
    latency_noise_cv: float = 0.05
    max_batch_size: int = 64
    # The executors' engine (and the scheduler's model of it): engine v2 by
    # default. Both get the same LEMIX_* values and resolve the auto ones from
    # the same profile (`EngineKnobs.resolve`), so they agree.
    engine: EngineKnobs = EngineKnobs()
    train_rate: float = 0.0  # SEPARATE's split
    log_dir: Path = Path("runs/stack-logs")
    extra_env: dict[str, str] = field(default_factory=dict)
    # torch backend: the model every executor builds and the tokenizer the
    # gateway and the executors share (trained once here before they start).
    model: str = "tiny-llama"
    tokenizer: str = "bpe:8192"
    torch_threads: int = 1  # per executor process; several share the cores
    # The gateway's API keys (`--api-key`, comma-separated); "" = the
    # LEMIX_API_KEY the launcher was given, if any, else an open API. Given to
    # the gateway alone, in its environment (flags show in `ps`).
    api_key: str = field(default="", repr=False)
    # The gateway's served model name (the OpenAI `model`, the metrics'
    # model_name), context limit (0 = the model's) and in-flight streams.
    served_model_name: str = "lemix"
    max_model_len: int = 0
    max_in_flight: int = 1024
    # Gateways against the one scheduler and Redis: "gateway" on `gateway_port`
    # (and `http_port`), "gateway-1".. on free ports (`Stack.gateway_addresses`).
    num_gateways: int = 1

    def __post_init__(self) -> None:
        parse_api_keys(self.api_key)  # ValueError for a malformed key
        if not self.served_model_name or any(ch.isspace() for ch in self.served_model_name):
            raise ValueError(
                f"--served-model-name must be a non-empty name without spaces, "
                f"got {self.served_model_name!r}"
            )
        if self.max_model_len < 0:
            raise ValueError(
                f"--max-model-len must be >= 0 (0 = the model's), got {self.max_model_len}"
            )
        if self.max_in_flight < 1:
            raise ValueError(f"--max-in-flight must be >= 1, got {self.max_in_flight}")
        if self.num_nodes < 1:
            raise ValueError("--nodes must be >= 1")
        if self.num_gateways < 1:
            raise ValueError(f"num_gateways must be >= 1, got {self.num_gateways}")
        if self.backend not in ("emulated", "torch"):
            raise ValueError(f"backend must be 'emulated' or 'torch', got {self.backend!r}")
        if self.time_scale <= 0:
            raise ValueError("--time-scale must be > 0")
        if self.backend == "torch" and self.time_scale != 1.0:
            raise ValueError("--time-scale is for the emulated backend; torch runs in real time")
        if self.redis_fsync not in APPENDFSYNC_POLICIES:
            raise ValueError(
                f"--redis-fsync must be one of {', '.join(APPENDFSYNC_POLICIES)}, "
                f"got {self.redis_fsync!r}"
            )
        if self.redis_password is not None:
            check_password(self.redis_password)
        for name in ("gateway_port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {getattr(self, name)}")


def stack_env(
    config: StackConfig,
    *,
    redis_url: str,
    service_token: str,
    profile_path: str | None = None,
) -> dict[str, str]:
    """The LEMIX_* variables every service of `config`'s stack is given (each
    reads those it has an option for): Redis, namespace, the internal token,
    the policy and the backend. `profile_path` overrides the config's (a
    container sees the file elsewhere). No listener and no API key: those
    are per service."""
    c = config
    shared = {
        "redis_url": redis_url,
        "namespace": c.namespace,
        "log_format": "json",
        "service_token": service_token,
    }
    specific = {
        "policy": c.policy,
        "num_nodes": str(c.num_nodes),
        "time_scale": repr(c.time_scale),
        "latency_noise_cv": repr(c.latency_noise_cv),
        "max_batch_size": str(c.max_batch_size),
        "train_rate": repr(c.train_rate),
        "served_model_name": c.served_model_name,
        "max_context_tokens": str(c.max_model_len),
        "max_in_flight": str(c.max_in_flight),
        "num_micro_batches": str(c.engine.num_micro_batches),
        "prefill_token_budget": str(c.engine.prefill_token_budget),
        "train_slice_s": repr(c.engine.train_slice_s),
        "batch_cap": c.engine.batch_cap,
        "gather_decodes": c.engine.gather_decodes,
        "decode_pace_s": repr(c.engine.decode_pace_s),
        "training_order": c.engine.training_order,
        "spare_training": str(c.engine.spare_training),
    }
    profile = profile_path or (str(c.profile_path) if c.profile_path is not None else None)
    if profile is not None:
        specific["profile_path"] = profile
    if c.backend == "torch":
        specific.update(
            backend="torch",
            model=c.model,
            tokenizer=c.tokenizer,
            torch_threads=str(c.torch_threads),
        )
    return {
        **{SHARED_ENV[name]: value for name, value in shared.items()},
        **{SERVICE_ENV[name]: value for name, value in specific.items()},
    }
