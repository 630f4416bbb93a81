"""Read the deployment files the way Docker Compose and Kubernetes would, with neither.

Compose: YAML with compose's `!reset`/`!override` tags, `${VAR:-default}`
interpolation, then the override file merged onto the base file (the part of
compose's merge rules these files use), then the compose-spec JSON schema.
That schema is not copied into this repository: it ships inside the
`check-jsonschema` wheel (a dev dependency), which vendors the compose-spec
project's schema and keeps it current.
"""

from __future__ import annotations

import importlib.resources
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from gateway import config as gateway_config
from profiler import config as profiler_config
from services.executor import config as executor_config
from services.scheduler import config as scheduler_config

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
COMPOSE_CPU = REPO / "docker-compose.cpu.yml"
K8S_DIR = REPO / "deploy" / "k8s"
# The Dockerfile copies profiles/ here; LEMIX_PROFILE values point into it.
IMAGE_PROFILES_DIR = "/app/profiles/"


class _Reset:
    def __repr__(self) -> str:
        return "!reset"


RESET = _Reset()


class Override:
    """`!override VALUE`: replaces the base value instead of merging with it."""

    def __init__(self, value: Any) -> None:
        self.value = value


class _ComposeLoader(yaml.SafeLoader):
    pass


def _construct_any(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)  # type: ignore[arg-type]


_ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)
_ComposeLoader.add_constructor(
    "!override", lambda loader, node: Override(_construct_any(loader, node))
)


def load_compose_file(path: Path) -> dict[str, Any]:
    with path.open() as f:
        doc = yaml.load(f, Loader=_ComposeLoader)  # a SafeLoader subclass
    assert isinstance(doc, dict), f"{path.name}: not a mapping"
    return doc


# ------------------------------------------------------------------ interpolation

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_]\w*)"
    r"(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}|(?P<bare>[A-Za-z_]\w*))"
)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?err}`,
    `${VAR:+alt}` and `$$`, applied to every string in `value`."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, Override):
        return Override(interpolate(value.value, env))
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["name"] or match["bare"]
        op, arg = match["op"] or "", match["arg"] or ""
        is_set = name in env and (env[name] != "" or not op.startswith(":"))
        if op.endswith("-"):
            return env[name] if is_set else arg
        if op.endswith("?"):
            if not is_set:
                raise ValueError(f"required variable {name} is missing: {arg}")
            return env[name]
        if op.endswith("+"):
            return arg if is_set else ""
        return env.get(name, "")

    return _VAR.sub(one, value)


# ------------------------------------------------------------------ merging

# Compose replaces these sequences; it merges the others (appending new items).
_REPLACED_SEQUENCES = {"command", "entrypoint", "test"}


def merge(base: Any, override: Any, key: str = "") -> Any:
    """`override` merged onto `base` as `docker compose -f base -f override` does."""
    if isinstance(override, Override):
        return override.value
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for k, v in override.items():
            if v is RESET:
                merged.pop(k, None)
            else:
                merged[k] = merge(base[k], v, k) if k in base else strip_tags(v)
        return merged
    if isinstance(base, list) and isinstance(override, list) and key not in _REPLACED_SEQUENCES:
        return base + [item for item in override if item not in base]
    return strip_tags(override)


def strip_tags(value: Any) -> Any:
    """The document a lone file means: `!reset` keys dropped, `!override` unwrapped."""
    if isinstance(value, Override):
        return strip_tags(value.value)
    if isinstance(value, dict):
        return {k: strip_tags(v) for k, v in value.items() if v is not RESET}
    if isinstance(value, list):
        return [strip_tags(v) for v in value if v is not RESET]
    return value


# What an operator must set before `docker compose up` (the files refuse to
# interpolate without it); a stand-in for the tests.
REQUIRED_ENV = {
    "LEMIX_SERVICE_TOKEN": "stand-in-service-token-for-deploy-tests",
    "LEMIX_REDIS_PASSWORD": "stand-in-redis-password-for-deploy-tests",
}


def compose_config(*paths: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The project model of `docker compose -f p1 -f p2 ... config` (interpolated
    with `env`, by default just the required variables)."""
    env = REQUIRED_ENV if env is None else env
    docs = [interpolate(load_compose_file(p), env) for p in paths]
    model = strip_tags(docs[0])
    for doc in docs[1:]:
        model = merge(model, doc)
    return model


def active_services(model: Mapping[str, Any], profiles: tuple[str, ...] = ()) -> dict[str, Any]:
    """Services `up` starts: those without profiles, or with one of `profiles` enabled."""
    return {
        name: svc
        for name, svc in model["services"].items()
        if not svc.get("profiles") or set(svc["profiles"]) & set(profiles)
    }


# ------------------------------------------------------------------ schema


def compose_schema_validator() -> jsonschema.protocols.Validator:
    """The compose-spec schema as vendored by the installed check-jsonschema."""
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads((vendor / "compose-spec.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def schema_errors(doc: Mapping[str, Any]) -> list[str]:
    validator = compose_schema_validator()
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
        for e in validator.iter_errors(doc)
    ]


# ------------------------------------------------------------------ LeMix services

GATEWAY_PORTS = {50051, 8000}  # DESIGN.md: gRPC and HTTP
# LeMix service module → (its own env/flag parser, the config field of its drain grace)
PARSERS: dict[str, tuple[Callable[[Mapping[str, str]], Any], str]] = {
    "gateway": (lambda env: gateway_config.from_env_and_args([], env), "shutdown_grace_s"),
    "services.scheduler": (
        lambda env: scheduler_config.from_env_and_args([], env),
        "shutdown_grace_s",
    ),
    "services.executor": (
        lambda env: executor_config.ExecutorConfig.from_env_and_args([], env),
        "shutdown_grace_s",
    ),
    "profiler": (lambda env: profiler_config.from_env_and_args([], env), "shutdown_grace_s"),
}


def known_env(module: str) -> set[str]:
    """The LEMIX_* variables a LeMix service reads (as its --help lists them)."""
    configs = {
        "gateway": gateway_config,
        "services.scheduler": scheduler_config,
        "services.executor": executor_config,
        "profiler": profiler_config,
    }
    parser = configs[module].build_parser()
    return {
        name
        for action in parser._actions
        for name in re.findall(r"LEMIX_[A-Z0-9_]+", action.help or "")
    }


def service_ports(env: Mapping[str, str]) -> set[int]:
    """The ports a LeMix process listens on: its LEMIX_*_PORT values that are set (> 0)."""
    return {int(v) for k, v in env.items() if re.fullmatch(r"LEMIX_\w+_PORT", k) and int(v) > 0}


def lemix_module(service: Mapping[str, Any]) -> str | None:
    """The LeMix service a compose service or container runs (its command's last `-m`)."""
    modules = [m for m in python_modules(service.get("command") or []) if m in PARSERS]
    return modules[-1] if modules else None


def service_env(service: Mapping[str, Any]) -> dict[str, str]:
    """A compose service's environment as its LeMix process sees it in the image."""
    return process_env(service.get("environment", {}), service.get("command", []))


def process_env(environment: Mapping[str, Any], command: list[str]) -> dict[str, str]:
    """`environment` as the LeMix process that `command` starts sees it: profile
    paths in the image mapped to the repo, wrapper-resolved values filled in."""
    env = {k: "" if v is None else str(v) for k, v in environment.items()}
    if env.get("LEMIX_PROFILE", "").startswith(IMAGE_PROFILES_DIR):
        env["LEMIX_PROFILE"] = str(
            REPO / "profiles" / env["LEMIX_PROFILE"].removeprefix(IMAGE_PROFILES_DIR)
        )
    if "lemix.infra.store.node_identity" in python_modules(command):
        # What the wrapper hands the executor in place of "auto".
        stand_ins = {"LEMIX_NODE_ID": "0", "LEMIX_ADVERTISE_HOST": "10.0.0.2"}
        env.update({k: v for k, v in stand_ins.items() if env.get(k) == "auto"})
    backend = env.get("LEMIX_EXECUTOR_BACKEND")
    if backend is not None and backend not in executor_config.BACKENDS:
        # The GPU executors default to the torch backend. Until it is registered in
        # services/executor/config.py (its own issue), the rest of their settings are
        # checked with the emulated one; test_gpu_executors_run_torch checks the name.
        assert backend == "torch", backend
        env["LEMIX_EXECUTOR_BACKEND"] = "emulated"
    return env


# ------------------------------------------------------------------ small parsers

_DURATION = re.compile(r"(?P<value>\d+(?:\.\d+)?)(?P<unit>us|ms|s|m|h)")
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration_s(text: str | int | float) -> float:
    """A compose duration (`30s`, `1m30s`, `1500ms`) in seconds."""
    if isinstance(text, int | float):
        return float(text)
    parts = _DURATION.findall(text)
    if not parts or "".join(v + u for v, u in parts) != text:
        raise ValueError(f"not a compose duration: {text!r}")
    return sum(float(v) * _UNIT_S[u] for v, u in parts)


def python_modules(command: list[str]) -> list[str]:
    """Every `-m MODULE` in an argv (a wrapper's and the command it runs)."""
    return [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == "-m"]
