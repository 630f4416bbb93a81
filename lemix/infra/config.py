"""The settings every LeMix service shares, declared and validated once.

Each service config (gateway, scheduler, executor, profiler) extends
`CommonServiceConfig` with its own fields and lists `common_options(<SERVICE>)`
first in its option table, so the shared fields keep one name, one flag, one
`LEMIX_*` variable, one help text and one check across the stack. `lemix up`
(`lemix.stack.launcher`) takes the variables it sets for the shared fields
from here too: it may not import the services.

The listening fields (host, port, metrics_port) are per process, so their
variables carry the service's name (`LEMIX_GATEWAY_PORT`,
`LEMIX_SCHEDULER_PORT`, ...); the others are read under the same name by every
service (`LEMIX_REDIS_URL`, `LEMIX_NAMESPACE`, ...), so one environment
configures the whole stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lemix.infra.rpc.auth import SERVICE_TOKEN_OPTION, check_service_token
from lemix.infra.settings import Option, check_finite, check_port, check_port_or_off, port_or_off
from lemix.infra.store.keys import DEFAULT_NAMESPACE, RedisKeys

# The `<SERVICE>` in each service's LEMIX_<SERVICE>_HOST/_PORT/_METRICS_PORT.
GATEWAY, SCHEDULER, EXECUTOR, PROFILER = "GATEWAY", "SCHEDULER", "EXECUTOR", "PROFILER"
SERVICE_PREFIXES = (GATEWAY, SCHEDULER, EXECUTOR, PROFILER)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_SHUTDOWN_GRACE_S = 5.0
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("console", "json")  # json: one object per line
# The asyncio event loop a service runs on: uvloop's (libuv, a dependency;
# 6-13% less CPU per request on the control-plane benchmark,
# docs/control-plane.md) or the standard one.
EVENT_LOOPS = ("asyncio", "uvloop")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")  # what redis-py's from_url accepts
# `python -m <service>` serves /metrics on a free port; the dataclass default
# (-1, off) is what tests and embedded services want.
COMMON_CLI_DEFAULTS: dict[str, Any] = {"metrics_port": 0}


@dataclass(frozen=True)
class CommonServiceConfig:
    """The fields every service process has; validated on construction (ValueError).

    Extended, not embedded, by each service's config, so `config.redis_url`
    reads the same everywhere; a subclass's `__post_init__` calls this one's.
    """

    host: str = DEFAULT_HOST  # gRPC (and metrics) bind address
    port: int = 0  # gRPC port; 0 = any free port (the bound one is printed at start)
    metrics_port: int = -1  # Prometheus /metrics: 0 = any free port, -1 = off
    redis_url: str = DEFAULT_REDIS_URL
    namespace: str = DEFAULT_NAMESPACE  # Redis key prefix shared by one stack's services
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S  # in-flight work gets this long on stop
    log_level: str = "info"
    log_format: str = "console"
    event_loop: str = "uvloop"  # one of EVENT_LOOPS
    # Internal RPCs carry it (lemix.infra.rpc.auth); "" = unauthenticated.
    service_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not self.host or any(ch.isspace() for ch in self.host):
            raise ValueError(
                f"host must be a non-empty host name or address (e.g. 127.0.0.1 or 0.0.0.0), "
                f"got {self.host!r}"
            )
        check_port("port", self.port)
        check_port_or_off("metrics_port", self.metrics_port)
        if not self.redis_url.startswith(REDIS_SCHEMES):
            raise ValueError(
                f"redis_url must start with one of {', '.join(REDIS_SCHEMES)}, "
                f"got {self.redis_url!r}"
            )
        RedisKeys(self.namespace)  # raises ValueError naming the problem
        check_finite("shutdown_grace_s", self.shutdown_grace_s, allow_zero=True)
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.log_format not in LOG_FORMATS:
            raise ValueError(
                f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}"
            )
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(
                f"event_loop must be one of {', '.join(EVENT_LOOPS)}, got {self.event_loop!r}"
            )
        check_service_token(self.service_token)


def listener_options(service: str) -> tuple[Option, ...]:
    """host, port and metrics_port, read from LEMIX_<service>_HOST/_PORT/_METRICS_PORT."""
    if service not in SERVICE_PREFIXES:
        raise ValueError(f"service must be one of {', '.join(SERVICE_PREFIXES)}, got {service!r}")
    return (
        Option("host", "--host", f"LEMIX_{service}_HOST", str, "address to bind", "HOST"),
        Option(
            "port", "--port", f"LEMIX_{service}_PORT", int, "gRPC port (0 = any free port)", "PORT"
        ),
        Option(
            "metrics_port",
            "--metrics-port",
            f"LEMIX_{service}_METRICS_PORT",
            port_or_off,
            "Prometheus /metrics port (0 = any free port, -1 = off)",
            "PORT",
        ),
    )


# The shared fields every service reads under the same variable.
SHARED_OPTIONS: tuple[Option, ...] = (
    Option(
        "redis_url",
        "--redis-url",
        "LEMIX_REDIS_URL",
        str,
        "Redis holding the stack's queues and state, e.g. redis://host:6379/0",
        "URL",
    ),
    Option(
        "namespace",
        "--namespace",
        "LEMIX_NAMESPACE",
        str,
        "Redis key prefix shared by the stack's services",
        "NAME",
    ),
    Option(
        "shutdown_grace_s",
        "--shutdown-grace-s",
        "LEMIX_SHUTDOWN_GRACE_S",
        float,
        "on stop, in-flight calls and work get this long to finish, seconds",
        "S",
    ),
    Option("log_level", "--log-level", "LEMIX_LOG_LEVEL", str, "/".join(LOG_LEVELS), "LEVEL"),
    Option("log_format", "--log-format", "LEMIX_LOG_FORMAT", str, "/".join(LOG_FORMATS), "FORMAT"),
    Option(
        "event_loop",
        "--event-loop",
        "LEMIX_EVENT_LOOP",
        str,
        "/".join(EVENT_LOOPS) + " (the services' event loop)",
        "LOOP",
    ),
    SERVICE_TOKEN_OPTION,
)
SHARED_ENV: dict[str, str] = {opt.field: opt.env for opt in SHARED_OPTIONS}


def common_options(service: str) -> tuple[Option, ...]:
    """Every `CommonServiceConfig` field's option, for the service LEMIX_<service>_*
    names (one of `SERVICE_PREFIXES`); a service's table starts with these."""
    return (*listener_options(service), *SHARED_OPTIONS)
