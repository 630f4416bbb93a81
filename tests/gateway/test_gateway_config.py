"""gateway.config: defaults, validation, and the env/flag mapping."""

from __future__ import annotations

import pytest

from gateway.config import CLI_DEFAULT_PORT, GatewayConfig, from_env_and_args


def test_defaults_are_valid_and_port_zero_means_free() -> None:
    config = GatewayConfig()
    assert config.port == 0 and config.max_context_tokens == 0  # the model's
    assert config.tokenizer == "approx" and config.max_in_flight > 0


def test_cli_defaults_to_the_public_port() -> None:
    config = from_env_and_args([], env={})
    assert config.port == CLI_DEFAULT_PORT == 50051


def test_flags_override_env_which_overrides_defaults() -> None:
    env = {
        "LEMIX_GATEWAY_PORT": "6000",
        "LEMIX_MAX_IN_FLIGHT": "8",
        "LEMIX_NAMESPACE": "from-env",
        "LEMIX_REDIS_URL": "redis://redis:6379/1",
        "LEMIX_STREAM_IDLE_TIMEOUT_S": "2.5",
        "LEMIX_SCHEDULER_ADDRESS": "scheduler:7000",
        "LEMIX_NODE_CHECK_S": "",  # empty = unset
    }
    config = from_env_and_args(["--port", "7001", "--namespace", "from-flag"], env=env)
    assert config.port == 7001 and config.namespace == "from-flag"
    assert config.max_in_flight == 8 and config.redis_url == "redis://redis:6379/1"
    assert config.stream_idle_timeout_s == 2.5 and config.scheduler_address == "scheduler:7000"
    assert config.node_check_s == GatewayConfig().node_check_s


def test_isolation_limits_come_from_env() -> None:
    env = {
        "LEMIX_MAX_TRAIN_SAMPLES": "64",
        "LEMIX_MAX_TRAIN_BATCH_SIZE": "8",
        "LEMIX_STREAM_LEASE_TTL_S": "3",
        "LEMIX_STATS_FLUSH_S": "0.5",
    }
    config = from_env_and_args([], env=env)
    assert (config.max_train_samples, config.max_train_batch_size) == (64, 8)
    assert (config.stream_lease_ttl_s, config.stats_flush_s) == (3.0, 0.5)
    assert GatewayConfig().max_train_samples == 1024


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="LEMIX_MAX_IN_FLIGHT='lots' is not a valid int"):
        from_env_and_args([], env={"LEMIX_MAX_IN_FLIGHT": "lots"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"port": 70000}, "port must be in"),
        ({"scheduler_address": "nohost"}, "scheduler_address must be host:port"),
        ({"redis_url": "localhost:6379"}, "redis_url must start with"),
        ({"namespace": "has space"}, "namespace must not contain whitespace"),
        ({"max_context_tokens": -1}, "max_context_tokens must be >= 0"),
        ({"max_in_flight": 0}, "max_in_flight must be > 0"),
        ({"max_train_samples": 0}, "max_train_samples must be > 0"),
        ({"max_train_batch_size": -1}, "max_train_batch_size must be > 0"),
        ({"stream_lease_ttl_s": 0.0}, "stream_lease_ttl_s must be"),
        ({"stats_flush_s": float("inf")}, "stats_flush_s must be"),
        ({"submit_deadline_s": 0.0}, "submit_deadline_s must be"),
        ({"stream_idle_timeout_s": float("nan")}, "stream_idle_timeout_s must be"),
        ({"node_check_s": -1.0}, "node_check_s must be"),
        ({"cors_allowed_origins": "app.example"}, "is not an origin"),
        ({"log_level": "loud"}, "log_level must be one of"),
        ({"log_format": "xml"}, "log_format must be one of"),
    ],
)
def test_invalid_values_raise_value_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatewayConfig(**kwargs)  # type: ignore[arg-type]


def test_config_is_frozen() -> None:
    config = GatewayConfig()
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]


def test_idempotency_window_comes_from_env_and_must_be_positive() -> None:
    config = from_env_and_args([], env={"LEMIX_IDEMPOTENCY_WINDOW_S": "600"})
    assert config.idempotency_window_s == 600.0
    assert GatewayConfig().idempotency_window_s == 24 * 3600.0
    with pytest.raises(ValueError, match="idempotency_window_s"):
        GatewayConfig(idempotency_window_s=0.0)
