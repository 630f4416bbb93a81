"""docker-compose.yml and docker-compose.cpu.yml, checked without a Docker engine:
the compose-spec schema (see deploy_support), then what the stack relies on."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from deploy_support import (
    COMPOSE,
    COMPOSE_CPU,
    GATEWAY_PORTS,
    PARSERS,
    REPO,
    REQUIRED_ENV,
    active_services,
    compose_config,
    duration_s,
    known_env,
    lemix_module,
    load_compose_file,
    python_modules,
    schema_errors,
    service_env,
    service_ports,
    strip_tags,
)

METRICS_PORT = 9090  # every LeMix container's Prometheus port, never published
BASE = compose_config(COMPOSE)
CPU = compose_config(COMPOSE, COMPOSE_CPU)
# (name, project model, the services `docker compose up` starts)
CONFIGS = [("gpu", BASE, active_services(BASE)), ("cpu", CPU, active_services(CPU))]
IDS = [c[0] for c in CONFIGS]


# ------------------------------------------------------------------ schema


@pytest.mark.parametrize(
    "paths",
    [(COMPOSE,), (COMPOSE_CPU,), (COMPOSE, COMPOSE_CPU)],
    ids=["base", "cpu-alone", "base+cpu"],
)
def test_compose_spec_schema(paths: tuple[Path, ...]) -> None:
    doc = compose_config(*paths) if len(paths) > 1 else strip_tags(load_compose_file(paths[0]))
    assert schema_errors(doc) == []


def test_schema_check_catches_mistakes() -> None:
    broken = json.loads(json.dumps(BASE))
    broken["services"]["gateway"]["restart"] = 3
    broken["services"]["scheduler"]["healthchek"] = {}
    errors = schema_errors(broken)
    assert any("restart" in e for e in errors) and any("healthchek" in e for e in errors)


def test_interpolation_reads_the_environment() -> None:
    model = compose_config(
        COMPOSE, env={**REQUIRED_ENV, "LEMIX_NUM_NODES": "4", "LEMIX_PUBLISH_HTTP_PORT": "9000"}
    )
    assert model["services"]["scheduler"]["environment"]["LEMIX_NUM_NODES"] == "4"
    assert "9000:8000" in model["services"]["gateway"]["ports"]


# ------------------------------------------------------------------ every service


@pytest.mark.parametrize("name,model,services", CONFIGS, ids=IDS)
def test_every_service_has_healthcheck_and_restart_policy(
    name: str, model: Any, services: dict[str, Any]
) -> None:
    for svc_name, svc in model["services"].items():
        assert svc.get("healthcheck", {}).get("test"), f"{svc_name}: no healthcheck"
        assert not svc["healthcheck"].get("disable"), svc_name
        assert svc.get("restart") in ("always", "unless-stopped", "on-failure"), svc_name


@pytest.mark.parametrize("name,model,services", CONFIGS, ids=IDS)
def test_only_the_gateway_publishes_ports(name: str, model: Any, services: dict[str, Any]) -> None:
    publishing = {n for n, svc in model["services"].items() if svc.get("ports")}
    assert publishing == {"gateway"}
    targets = {int(str(p).rsplit(":", 1)[-1]) for p in model["services"]["gateway"]["ports"]}
    assert targets == GATEWAY_PORTS


@pytest.mark.parametrize("name,model,services", CONFIGS, ids=IDS)
def test_commands_are_modules_of_this_repo(name: str, model: Any, services: dict[str, Any]) -> None:
    for svc_name, svc in services.items():
        argvs = [svc.get("command", []), svc["healthcheck"]["test"][1:]]
        for module in (m for argv in argvs for m in python_modules(argv)):
            spec = importlib.util.find_spec(module)
            assert spec is not None and spec.origin, f"{svc_name}: no module {module}"
            assert Path(spec.origin).resolve().is_relative_to(REPO), (svc_name, spec.origin)
        if svc_name != "redis":
            assert lemix_module(svc), f"{svc_name} runs no LeMix service: {svc.get('command')}"


@pytest.mark.parametrize("name,model,services", CONFIGS, ids=IDS)
def test_settings_parse_and_stop_outlasts_the_drain(
    name: str, model: Any, services: dict[str, Any]
) -> None:
    for svc_name, svc in services.items():
        module = lemix_module(svc)
        stop_s = duration_s(svc.get("stop_grace_period", "10s"))  # Docker's default is 10 s
        if module is None:
            assert stop_s >= 10, svc_name  # Redis: time to fsync its AOF
            continue
        parse, grace_field = PARSERS[module]
        config = parse(service_env(svc))  # ValueError names a bad LEMIX_* value
        grace_s = getattr(config, grace_field)
        assert stop_s >= grace_s + 10, f"{svc_name}: stop {stop_s} s vs drain {grace_s} s"
        assert Path(service_env(svc)["LEMIX_PROFILE"]).is_file(), svc_name


@pytest.mark.parametrize("name,model,services", CONFIGS, ids=IDS)
def test_dependencies_wait_for_health(name: str, model: Any, services: dict[str, Any]) -> None:
    for svc_name, svc in services.items():
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services, f"{svc_name} depends on {dep}, which does not start"
            assert cond == {"condition": "service_healthy"}, (svc_name, dep)
    assert set(services["gateway"]["depends_on"]) == {"redis", "scheduler"}


@pytest.mark.parametrize("name,model,services", CONFIGS, ids=IDS)
def test_services_agree_on_stack_wiring(name: str, model: Any, services: dict[str, Any]) -> None:
    shared = model["x-lemix-env"]
    for svc_name, svc in services.items():
        if svc_name == "redis":
            continue
        env = svc["environment"]
        assert {k: env[k] for k in shared} == shared, svc_name
        health_port = svc["healthcheck"]["test"][-2].rsplit(":", 1)[1]
        port_vars = [k for k in env if re.fullmatch(r"LEMIX_[A-Z]+_PORT", k)]
        assert [env[k] for k in port_vars] == [health_port], (svc_name, port_vars)
    assert "LEMIX_REDIS_URL" not in shared  # it carries the password: x-lemix-secrets
    password = REQUIRED_ENV["LEMIX_REDIS_PASSWORD"]
    for svc_name, svc in services.items():
        if svc_name != "redis":
            assert svc["environment"]["LEMIX_REDIS_URL"] == (f"redis://:{password}@redis:6379/0"), (
                svc_name
            )
    assert services["gateway"]["environment"]["LEMIX_SCHEDULER_ADDRESS"] == (
        f"scheduler:{services['scheduler']['environment']['LEMIX_SCHEDULER_PORT']}"
    )


@pytest.mark.parametrize("name,model,services", CONFIGS, ids=IDS)
def test_every_variable_is_read_by_its_service(
    name: str, model: Any, services: dict[str, Any]
) -> None:
    """A renamed or misspelt LEMIX_* variable would be ignored silently."""
    read_by_any = set().union(*(known_env(m) for m in PARSERS))
    for svc_name, svc in services.items():
        module = lemix_module(svc)
        if module is None:
            continue
        own = set(svc["environment"]) - set(model["x-lemix-env"])
        if "lemix.infra.store.node_identity" in python_modules(svc["command"]):
            own -= {"LEMIX_NUM_NODES"}  # the wrapper reads it too
        assert own <= known_env(module), (svc_name, own - known_env(module))
        assert service_ports(service_env(svc)) <= known_ports(svc), svc_name
    assert set(model["x-lemix-env"]) <= read_by_any, set(model["x-lemix-env"]) - read_by_any


def known_ports(svc: Any) -> set[int]:
    health = svc["healthcheck"]["test"]
    published = {int(str(p).rsplit(":", 1)[-1]) for p in svc.get("ports", [])}
    return {int(health[-2].rsplit(":", 1)[1]), METRICS_PORT} | published


@pytest.mark.parametrize("name,model,services", CONFIGS, ids=IDS)
def test_gateway_and_executors_tokenize_alike(
    name: str, model: Any, services: dict[str, Any]
) -> None:
    tokenizers = {
        svc["environment"]["LEMIX_TOKENIZER"]
        for svc in services.values()
        if lemix_module(svc) in ("gateway", "services.executor")
    }
    assert len(tokenizers) == 1, tokenizers


@pytest.mark.parametrize("name,model,services", CONFIGS, ids=IDS)
def test_executors_share_the_weight_sync_dir(
    name: str, model: Any, services: dict[str, Any]
) -> None:
    """SEPARATE's weight sync: the scheduler names files under its dir, one
    executor saves them, the others load them, so each mounts one shared
    named volume at the scheduler's path."""
    sync_dir = services["scheduler"]["environment"]["LEMIX_WEIGHT_SYNC_DIR"]
    executors = {n: s for n, s in services.items() if lemix_module(s) == "services.executor"}
    assert executors and sync_dir.startswith("/")
    volumes = set()
    for svc_name, svc in executors.items():
        assert svc["environment"]["LEMIX_WEIGHT_SYNC_DIR"] == sync_dir, svc_name
        mounts = {
            target: source
            for source, target, *_ in (str(v).split(":") for v in svc.get("volumes", []))
        }  # short syntax
        assert sync_dir in mounts, f"{svc_name} does not mount {sync_dir}"
        volumes.add(mounts[sync_dir])
    (volume,) = volumes  # one volume for all of them
    assert volume in model["volumes"] and not volume.startswith(("/", "."))
    dockerfile = (REPO / "Dockerfile").read_text()  # a fresh volume copies its ownership
    assert f"install -d -o 10001 -g 10001 {sync_dir}" in dockerfile


def test_both_files_share_the_same_settings() -> None:
    for block in ("x-lemix-env", "x-lemix-secrets"):
        base, cpu = (strip_tags(load_compose_file(p))[block] for p in (COMPOSE, COMPOSE_CPU))
        assert base == cpu, block


# ------------------------------------------------------------------ security


@pytest.mark.parametrize("paths", [(COMPOSE,), (COMPOSE, COMPOSE_CPU)], ids=["gpu", "cpu"])
def test_compose_refuses_to_run_without_a_service_token(paths: tuple[Path, ...]) -> None:
    with pytest.raises(ValueError, match="LEMIX_SERVICE_TOKEN is missing: set LEMIX_SERVICE"):
        compose_config(*paths, env={})
    with pytest.raises(ValueError, match="LEMIX_SERVICE_TOKEN is missing"):
        compose_config(*paths, env={"LEMIX_SERVICE_TOKEN": ""})  # `:?` refuses empty too


@pytest.mark.parametrize("name,model,services", CONFIGS, ids=IDS)
def test_every_lemix_service_gets_the_same_token(
    name: str, model: Any, services: dict[str, Any]
) -> None:
    """The scheduler, executors and profiler require it; the gateway sends it."""
    assert "LEMIX_SERVICE_TOKEN" not in model["x-lemix-env"]  # that block is the ConfigMap
    for svc_name, svc in services.items():
        module = lemix_module(svc)
        if module is None:
            assert "LEMIX_SERVICE_TOKEN" not in svc.get("environment", {}), svc_name
            continue
        parse, _ = PARSERS[module]
        config = parse(service_env(svc))
        assert config.service_token == REQUIRED_ENV["LEMIX_SERVICE_TOKEN"], svc_name


@pytest.mark.parametrize("name,model,services", CONFIGS, ids=IDS)
def test_metrics_are_not_published_with_the_gateway(
    name: str, model: Any, services: dict[str, Any]
) -> None:
    """Prometheus scrapes each container's 9090 inside the compose network; the
    gateway's published HTTP port serves the API without /metrics."""
    gateway = services["gateway"]
    parse, _ = PARSERS["gateway"]
    config = parse(service_env(gateway))
    published = {int(str(p).rsplit(":", 1)[-1]) for p in gateway["ports"]}
    assert config.is_http_metrics_enabled is False
    assert config.metrics_port == METRICS_PORT and METRICS_PORT not in published
    assert config.http_port in published


# ------------------------------------------------------------------ Redis


def test_redis_persists_with_aof_and_requires_the_password() -> None:
    redis = BASE["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    # Written and fsynced before each reply (lemix/infra/store/server.py says why).
    assert command[command.index("--appendfsync") + 1] == "always"
    assert any(v.endswith(":/data") and not v.startswith(("/", ".")) for v in redis["volumes"])
    password = REQUIRED_ENV["LEMIX_REDIS_PASSWORD"]
    assert command[command.index("--requirepass") + 1] == password
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert redis["environment"] == {"REDISCLI_AUTH": password}  # the healthcheck's AUTH


@pytest.mark.parametrize("paths", [(COMPOSE,), (COMPOSE, COMPOSE_CPU)], ids=["gpu", "cpu"])
def test_compose_refuses_to_run_without_a_redis_password(paths: tuple[Path, ...]) -> None:
    token = {"LEMIX_SERVICE_TOKEN": REQUIRED_ENV["LEMIX_SERVICE_TOKEN"]}
    with pytest.raises(ValueError, match="LEMIX_REDIS_PASSWORD is missing: set LEMIX_REDIS"):
        compose_config(*paths, env=token)
    with pytest.raises(ValueError, match="LEMIX_REDIS_PASSWORD is missing"):
        compose_config(*paths, env={**token, "LEMIX_REDIS_PASSWORD": ""})


# ------------------------------------------------------------------ GPUs


def _gpu_devices(svc: Mapping[str, Any]) -> list[dict[str, Any]]:
    return svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def gpu_executors() -> dict[str, Any]:
    return {n: s for n, s in BASE["services"].items() if lemix_module(s) == "services.executor"}


def test_gpu_executors_reserve_distinct_explicit_gpus() -> None:
    executors = gpu_executors()
    assert len(executors) >= 2
    seen: dict[str, str] = {}
    for svc_name, svc in executors.items():
        devices = _gpu_devices(svc)
        assert len(devices) == 1, svc_name
        device = devices[0]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], svc_name
        assert "count" not in device, f"{svc_name}: reserve GPUs by device_ids, not count"
        ids = device["device_ids"]
        assert ids and len(set(ids)) == len(ids), svc_name
        for gpu in ids:
            assert gpu not in seen, f"GPU {gpu} reserved by {seen.get(gpu)} and {svc_name}"
            seen[gpu] = svc_name
        profile = json.loads(Path(service_env(svc)["LEMIX_PROFILE"]).read_text())
        assert len(ids) == profile["num_stages"], f"{svc_name}: one GPU per pipeline stage"


def test_gpu_executors_have_node_ids_0_to_n_minus_1() -> None:
    executors = gpu_executors()
    node_ids = sorted(int(s["environment"]["LEMIX_NODE_ID"]) for s in executors.values())
    assert node_ids == list(range(int(BASE["x-lemix-env"]["LEMIX_NUM_NODES"])))
    for svc_name, svc in executors.items():  # compose's DNS name: one container each
        assert svc["environment"]["LEMIX_ADVERTISE_HOST"] == svc_name


def test_gpu_executors_run_torch() -> None:
    for svc in gpu_executors().values():
        assert svc["environment"]["LEMIX_EXECUTOR_BACKEND"] == "torch"
        assert svc["image"].endswith(":gpu") and svc["build"]["args"]["VARIANT"] == "gpu"


def test_cpu_override_has_no_gpus_and_scales() -> None:
    services = active_services(CPU)
    assert all(not _gpu_devices(s) for s in CPU["services"].values())
    assert set(active_services(CPU, ("gpu",))) - set(services) == {"executor-0", "executor-1"}
    executor = services["executor"]
    assert executor["image"].endswith(":cpu") and executor["build"]["args"]["VARIANT"] == "cpu"
    assert executor["environment"]["LEMIX_EXECUTOR_BACKEND"] == "emulated"
    # `--scale executor=N` needs replicas that differ in nothing fixed per container.
    for key in ("container_name", "hostname", "ports"):
        assert key not in executor, key
    assert executor["command"][:4] == ["python", "-m", "lemix.infra.store.node_identity", "--from"]
    assert executor["environment"]["LEMIX_NODE_ID"] == "auto"
    assert executor["deploy"]["replicas"] == CPU["x-lemix-env"]["LEMIX_NUM_NODES"]


# ------------------------------------------------------------------ Dockerfile


def test_dockerfile_variants_match_compose() -> None:
    text = (REPO / "Dockerfile").read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, flags=re.M))
    assert stages == {"os", "build", "runtime"}
    variants = {s["build"]["args"]["VARIANT"] for s in CPU["services"].values() if "build" in s}
    assert variants == {"cpu", "gpu"}
    for variant in variants:  # the torch stage's `case "${VARIANT}"` knows each one
        assert re.search(rf"^\s+(case .*)?\b{variant}\) flavour=", text, flags=re.M), variant
    assert re.search(r"^USER 10001", text, flags=re.M), "the runtime must not run as root"
    assert "pip install --no-cache-dir --no-deps ." in text
    ignored = (REPO / ".dockerignore").read_text().split()
    for needed in (
        "lemix",
        "services",
        "gateway",
        "profiler",
        "profiles",
        "pyproject.toml",
        "docker-wheels",
    ):
        assert needed not in ignored, needed


def test_dockerfile_builds_on_the_classic_builder() -> None:
    """CI's engine has no BuildKit frontend to pull and no buildx (issue 13)."""
    text = (REPO / "Dockerfile").read_text()
    # A parser directive would make the build pull a frontend image.
    assert not re.search(r"^#\s*syntax=", text, flags=re.M | re.I)
    run_lines = [line for line in text.splitlines() if line.startswith("RUN")]
    assert not any("--mount" in line or "<<" in line for line in run_lines)  # BuildKit-only
    assert re.search(r"^ARG BASE_IMAGE=\S+", text, flags=re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS os$", text, flags=re.M)
