"""The gateway's typed config, and the ONE place env vars and flags map onto it.

Precedence: command-line flag, then ``LEMIX_*`` environment variable, then the
default (lemix.infra.settings is the mechanism). Nothing is read at import time:
`from_env_and_args` reads `argv` and the environment when called (tests pass
both in). The fields every service shares (host, ports, Redis, logging, the
service token, the drain grace) come from `lemix.infra.config`;
`scripts/config_table.py` prints the docs/configuration.md table from `_OPTIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.http_cors import parse_origins
from gateway.validate import DEFAULT_MAX_TRAIN_BATCH_SIZE, DEFAULT_MAX_TRAIN_SAMPLES
from lemix.infra import settings
from lemix.infra.address import is_host_port
from lemix.infra.config import COMMON_CLI_DEFAULTS, GATEWAY, CommonServiceConfig, common_options
from lemix.infra.rpc.auth import API_KEY_ENV, parse_api_keys
from lemix.infra.settings import Option, boolean, check_finite
from lemix.infra.store.keys import DEDUPE_TTL_S, STREAM_LEASE_TTL_S

# The public port in DESIGN.md; `GatewayConfig()` itself defaults to 0 (a free
# port), which is what tests and `lemix up` with many stacks want.
CLI_DEFAULT_PORT = 50051
CLI_DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible HTTP API (gateway.http_api)
# Where the scheduler listens unless told otherwise (gateway is 50051).
DEFAULT_SCHEDULER_ADDRESS = "127.0.0.1:50052"


@dataclass(frozen=True)
class GatewayConfig(CommonServiceConfig):
    """Everything the gateway process needs; validated on construction (ValueError).

    `service_token` (from CommonServiceConfig) is sent to the scheduler; the
    gateway's own API is public unless `api_key` names keys.
    """

    http_port: int = 0  # the OpenAI-compatible HTTP API; 0 = any free port, as `port`
    served_model_name: str = "lemix"  # the `model` the HTTP API lists and accepts
    # Also GET /metrics on the public HTTP API port. A deployment that publishes
    # that port turns it off and scrapes `metrics_port` inside its network.
    is_http_metrics_enabled: bool = True
    scheduler_address: str = DEFAULT_SCHEDULER_ADDRESS  # host:port
    # prompt + max_tokens must fit in this and in the model's max_model_len (as
    # executors publish it); 0 = the model's alone (4096 when none publishes one).
    max_context_tokens: int = 0
    max_in_flight: int = 1024  # concurrent Generate streams; more get RESOURCE_EXHAUSTED
    # One Train call carries at most this many samples (each becomes Submit work
    # and intake state before the call answers); more is INVALID_ARGUMENT.
    max_train_samples: int = DEFAULT_MAX_TRAIN_SAMPLES
    # Samples per training task (a Train call's batch_size).
    max_train_batch_size: int = DEFAULT_MAX_TRAIN_BATCH_SIZE
    submit_deadline_s: float = 5.0  # the task's write to the intake (Redis)
    cancel_deadline_s: float = 2.0  # Scheduler.Cancel after a client went away
    # A stream with no new output message for this long is ended UNAVAILABLE
    # (its executor probably died) and its task cancelled.
    stream_idle_timeout_s: float = 60.0
    # This gateway's lease on the streams it reads (one key) lives this long
    # and is renewed every third of it; if the gateway dies, it lapses and the
    # scheduler cancels the orphaned tasks (`RedisKeys.gateway_lease`).
    stream_lease_ttl_s: float = STREAM_LEASE_TTL_S
    # Request counters are summed in memory and written to Redis this often (one
    # round trip), never once per request on the admission path.
    stats_flush_s: float = 1.0
    # How long a request_id is remembered (its dedupe marker's TTL): a resubmit
    # within it gets the first task (409 for another payload). Keep it at least
    # the scheduler's finished_task_ttl_s, so GetTask can always find the task.
    idempotency_window_s: float = DEDUPE_TTL_S
    tokenizer: str = "approx"  # "approx" (emulated); "bpe:<vocab>", tokenizer.json, model dir
    node_check_s: float = 0.5  # how long "is any executor live?" is cached; 0 = never
    # TLS on the public gRPC and HTTP ports: a PEM certificate (chain) and its
    # key, both or neither; "" = plaintext. Read and checked at start
    # (`lemix.infra.rpc.tls`). The metrics port stays plain HTTP: Prometheus scrapes
    # it inside the deployment's network (compose/k8s never publish it), it
    # carries no request data, and scrapers then need no CA.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # mTLS: both ports then require a client certificate signed by this CA.
    tls_client_ca_file: str = ""
    # Keys the public API requires (`Authorization: Bearer <key>` over HTTP,
    # the same metadata over gRPC); several comma-separated; "" = open.
    # Health, /ping, /version, reflection and metrics stay open. Never logged.
    api_key: str = field(default="", repr=False)
    # Origins whose browser pages may call the HTTP API (CORS, `gateway.http_cors`):
    # comma-separated scheme://host[:port], or * for any; "" = CORS off.
    cors_allowed_origins: str = ""

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted keys; () = the API is open."""
        return parse_api_keys(self.api_key)

    @property
    def is_tls_enabled(self) -> bool:
        return bool(self.tls_cert_file)

    def __post_init__(self) -> None:
        super().__post_init__()
        settings.check_port("http_port", self.http_port)
        if not self.served_model_name or any(ch.isspace() for ch in self.served_model_name):
            raise ValueError(
                f"served_model_name must be a non-empty name without spaces, "
                f"got {self.served_model_name!r}"
            )
        _check_address("scheduler_address", self.scheduler_address)
        if self.max_context_tokens < 0:
            raise ValueError(
                f"max_context_tokens must be >= 0 (0 = the model's), got {self.max_context_tokens}"
            )
        for name in (
            "max_in_flight",
            "max_train_samples",
            "max_train_batch_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "submit_deadline_s",
            "cancel_deadline_s",
            "stream_idle_timeout_s",
            "stream_lease_ttl_s",
            "stats_flush_s",
            "idempotency_window_s",
        ):
            check_finite(name, getattr(self, name), allow_zero=False)
        check_finite("node_check_s", self.node_check_s, allow_zero=True)
        if not self.tokenizer:
            raise ValueError("tokenizer must be non-empty ('approx' for the emulated backend)")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            given, missing = (
                ("tls_cert_file", "tls_key_file")
                if self.tls_cert_file
                else ("tls_key_file", "tls_cert_file")
            )
            raise ValueError(
                f"TLS needs both a certificate and its key: {given} is set but "
                f"{missing} is not (--tls-cert-file and --tls-key-file, both or "
                f"neither)"
            )
        parse_api_keys(self.api_key)  # ValueError for a malformed key
        parse_origins(self.cors_allowed_origins)  # ValueError for one that is not an origin
        if self.tls_client_ca_file and not self.is_tls_enabled:
            raise ValueError(
                "tls_client_ca_file (mTLS) needs TLS: set --tls-cert-file and --tls-key-file too"
            )


def _check_address(name: str, address: str) -> None:
    if not is_host_port(address):
        raise ValueError(f"{name} must be host:port, got {address!r}")


# ------------------------------------------------------------------ mapping


_OPTIONS: tuple[Option, ...] = (
    *common_options(GATEWAY),
    Option(
        "http_port",
        "--http-port",
        "LEMIX_GATEWAY_HTTP_PORT",
        int,
        "OpenAI-compatible HTTP API port (0 = any free port)",
    ),
    Option(
        "served_model_name",
        "--served-model-name",
        "LEMIX_SERVED_MODEL_NAME",
        str,
        "model name the HTTP API serves (GET /v1/models)",
    ),
    Option(
        "is_http_metrics_enabled",
        "--http-metrics",
        "LEMIX_GATEWAY_HTTP_METRICS",
        boolean,
        "also serve GET /metrics on the HTTP API port (--no-http-metrics: only on --metrics-port)",
    ),
    Option(
        "scheduler_address",
        "--scheduler",
        "LEMIX_SCHEDULER_ADDRESS",
        str,
        "the scheduler's host:port",
    ),
    Option(
        "max_context_tokens",
        "--max-context-tokens",
        "LEMIX_MAX_CONTEXT_TOKENS",
        int,
        "prompt + max_tokens must fit in this many tokens, and in the served model's "
        "max_model_len (0 = the model's; 4096 when no executor publishes one)",
    ),
    Option(
        "max_in_flight",
        "--max-in-flight",
        "LEMIX_MAX_IN_FLIGHT",
        int,
        "concurrent Generate streams before RESOURCE_EXHAUSTED",
    ),
    Option(
        "max_train_samples",
        "--max-train-samples",
        "LEMIX_MAX_TRAIN_SAMPLES",
        int,
        "samples one Train call may carry (split larger sets)",
    ),
    Option(
        "max_train_batch_size",
        "--max-train-batch-size",
        "LEMIX_MAX_TRAIN_BATCH_SIZE",
        int,
        "samples per training task (Train's batch_size)",
    ),
    Option(
        "submit_deadline_s",
        "--submit-deadline-s",
        "LEMIX_SUBMIT_DEADLINE_S",
        float,
        "deadline of a request's write to the intake (Redis), seconds",
    ),
    Option(
        "cancel_deadline_s",
        "--cancel-deadline-s",
        "LEMIX_CANCEL_DEADLINE_S",
        float,
        "deadline of Scheduler.Cancel, seconds",
    ),
    Option(
        "stream_idle_timeout_s",
        "--stream-idle-timeout-s",
        "LEMIX_STREAM_IDLE_TIMEOUT_S",
        float,
        "end a stream UNAVAILABLE after this long without output, seconds",
    ),
    Option(
        "stream_lease_ttl_s",
        "--stream-lease-ttl-s",
        "LEMIX_STREAM_LEASE_TTL_S",
        float,
        "this gateway's lease on the streams it reads (renewed every third), seconds",
    ),
    Option(
        "stats_flush_s",
        "--stats-flush-s",
        "LEMIX_STATS_FLUSH_S",
        float,
        "write the request counters to Redis this often, seconds",
    ),
    Option(
        "idempotency_window_s",
        "--idempotency-window-s",
        "LEMIX_IDEMPOTENCY_WINDOW_S",
        float,
        "how long a request_id is remembered (a resubmit gets the first task), seconds",
    ),
    Option(
        "tokenizer",
        "--tokenizer",
        "LEMIX_TOKENIZER",
        str,
        "'approx' (emulated backend), 'bpe:<vocab_size>' (trained on the default "
        "corpus, cached), a tokenizer.json file or a model directory",
    ),
    Option(
        "node_check_s",
        "--node-check-s",
        "LEMIX_NODE_CHECK_S",
        float,
        "cache the live-executor check this long, seconds (0 = every request)",
    ),
    Option(
        "tls_cert_file",
        "--tls-cert-file",
        "LEMIX_GATEWAY_TLS_CERT_FILE",
        str,
        "PEM certificate (chain) for TLS on the gRPC and HTTP ports, with "
        '--tls-key-file ("" = plaintext; /metrics stays plain HTTP)',
        "FILE",
    ),
    Option(
        "tls_key_file",
        "--tls-key-file",
        "LEMIX_GATEWAY_TLS_KEY_FILE",
        str,
        "PEM private key of --tls-cert-file (unencrypted)",
        "FILE",
    ),
    Option(
        "tls_client_ca_file",
        "--tls-client-ca-file",
        "LEMIX_GATEWAY_TLS_CLIENT_CA_FILE",
        str,
        'mTLS: require client certificates signed by this PEM CA ("" = none)',
        "FILE",
    ),
    Option(
        "api_key",
        "--api-key",
        API_KEY_ENV,
        str,
        "require `Authorization: Bearer KEY` on the HTTP API and `authorization: "
        'Bearer KEY` metadata on gRPC (several: comma-separated; "" = open; health, '
        "/ping, /version, reflection and metrics stay open; prefer the variable: "
        "flags show in `ps`)",
        "KEY",
    ),
    Option(
        "cors_allowed_origins",
        "--cors-allowed-origins",
        "LEMIX_CORS_ALLOWED_ORIGINS",
        str,
        "origins whose browser pages may call the HTTP API (CORS): comma-separated "
        'scheme://host[:port], or * for any ("" = off)',
        "ORIGINS",
    ),
)

_CLI_DEFAULTS: dict[str, Any] = {
    **COMMON_CLI_DEFAULTS,
    "port": CLI_DEFAULT_PORT,
    "http_port": CLI_DEFAULT_HTTP_PORT,
}


SPEC = settings.ConfigSpec(
    GatewayConfig,
    _OPTIONS,
    prog="python -m gateway",
    description="LeMix gateway: the public gRPC API (Generate, Train, GetStats) and "
    "the OpenAI-compatible HTTP API.",
    cli_defaults=_CLI_DEFAULTS,
)
build_parser = SPEC.build_parser
from_env_and_args = SPEC.parse
