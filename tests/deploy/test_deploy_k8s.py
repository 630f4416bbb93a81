"""deploy/k8s/: every manifest against the Kubernetes API models (the `kubernetes`
client's generated pydantic models forbid unknown fields, check types and
required fields), the kustomization, and agreement with docker-compose.yml."""

from __future__ import annotations

import copy
import re
from typing import Any

import kubernetes.client as k8s
import pydantic
import pytest
import yaml
from deploy_support import (
    COMPOSE,
    K8S_DIR,
    PARSERS,
    compose_config,
    lemix_module,
    process_env,
    python_modules,
    service_ports,
)

MODELS: dict[tuple[str, str], type[pydantic.BaseModel]] = {
    ("v1", "ConfigMap"): k8s.V1ConfigMap,
    ("v1", "Service"): k8s.V1Service,
    ("apps/v1", "Deployment"): k8s.V1Deployment,
    ("apps/v1", "StatefulSet"): k8s.V1StatefulSet,
    ("v1", "PersistentVolumeClaim"): k8s.V1PersistentVolumeClaim,
    ("networking.k8s.io/v1", "NetworkPolicy"): k8s.V1NetworkPolicy,
}
KUSTOMIZATION_KEYS = {
    "apiVersion",
    "kind",
    "namespace",
    "labels",
    "commonLabels",
    "resources",
    "images",
    "configMapGenerator",
    "patches",
    "namePrefix",
}
MANIFESTS = sorted(p for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
DOCS = [(p.name, doc) for p in MANIFESTS for doc in yaml.safe_load_all(p.read_text()) if doc]
COMPOSE_MODEL = compose_config(COMPOSE)


def objects(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == kind}


WORKLOADS = {**objects("Deployment"), **objects("StatefulSet")}
SERVICES = objects("Service")
CONFIG = objects("ConfigMap")["lemix-config"]["data"]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, workload["metadata"]["name"]
    return containers[0]


def container_env(workload: dict[str, Any]) -> dict[str, str]:
    """Its LEMIX_* environment: the ConfigMap, then its own `env` (stand-ins for
    a fieldRef, status.podIP, and for a secretKeyRef, the operator's secret)."""
    c = container(workload)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        assert source["configMapRef"]["name"] == "lemix-config"
        env.update(CONFIG)
    for var in c.get("env", []):
        if "secretKeyRef" in var.get("valueFrom", {}):  # what compose's x-lemix-secrets gives
            env[var["name"]] = COMPOSE_MODEL["x-lemix-secrets"][var["name"]]
        else:
            env[var["name"]] = var.get("value", "10.0.0.2")  # status.podIP
    return env


def compose_name(k8s_name: str) -> str:
    """The compose service a workload corresponds to (compose has one per GPU executor)."""
    return "executor-0" if k8s_name == "executor" else k8s_name


# ------------------------------------------------------------------ API models


@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d.get('kind')}" for n, d in DOCS])
def test_manifest_matches_the_api_model(name: str, doc: dict[str, Any]) -> None:
    model = MODELS.get((doc.get("apiVersion"), doc.get("kind")))
    assert model is not None, f"{name}: unexpected {doc.get('apiVersion')} {doc.get('kind')}"
    parsed = model.model_validate(doc)  # raises on unknown fields, wrong types, missing ones
    assert parsed.metadata is not None and parsed.metadata.name, name


def test_the_model_check_catches_mistakes() -> None:
    deployment = copy.deepcopy(WORKLOADS["gateway"])
    container(deployment)["livenessProbe"]["grpc"]["prot"] = 1
    with pytest.raises(pydantic.ValidationError, match="prot"):
        k8s.V1Deployment.model_validate(deployment)
    deployment = copy.deepcopy(WORKLOADS["gateway"])
    del container(deployment)["name"]
    with pytest.raises(pydantic.ValidationError, match="name"):
        k8s.V1Deployment.model_validate(deployment)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert set(kustomization) <= KUSTOMIZATION_KEYS, set(kustomization) - KUSTOMIZATION_KEYS
    assert sorted(kustomization["resources"]) == [p.name for p in MANIFESTS]
    assert len(set(kustomization["resources"])) == len(kustomization["resources"])


# ------------------------------------------------------------------ workloads


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workload_is_wired(name: str) -> None:
    workload = WORKLOADS[name]
    spec, c = workload["spec"], container(workload)
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    service = SERVICES[name]  # every workload has a Service of its name
    assert service["spec"]["selector"].items() <= labels.items()
    port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in port_names, (name, port)
        assert port["port"] == port_names[port["targetPort"]], (name, port)
    if workload["kind"] == "StatefulSet":
        assert SERVICES[spec["serviceName"]]["spec"].get("clusterIP") == "None", name
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind]), (name, kind)
    if name == "redis":
        return
    pod_security = spec["template"]["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] and pod_security["runAsUser"] != 0
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] in port_names.values(), (name, probe)


def test_redis_persists_on_a_volume_claim() -> None:
    redis = WORKLOADS["redis"]
    args = container(redis)["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "always"
    claims = {t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]}
    mounts = {m["name"]: m["mountPath"] for m in container(redis)["volumeMounts"]}
    assert mounts == {name: "/data" for name in claims}


def test_executors_one_pod_per_node_with_its_gpus() -> None:
    executor = WORKLOADS["executor"]
    assert executor["kind"] == "StatefulSet"
    pod = executor["spec"]["template"]["spec"]
    rules = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert [r["topologyKey"] for r in rules] == ["kubernetes.io/hostname"]
    compose_gpus = COMPOSE_MODEL["services"]["executor-0"]["deploy"]["resources"]["reservations"][
        "devices"
    ][0]["device_ids"]
    assert container(executor)["resources"]["limits"]["nvidia.com/gpu"] == str(len(compose_gpus))
    assert executor["spec"]["replicas"] == int(CONFIG["LEMIX_NUM_NODES"])
    command = container(executor)["command"]
    assert command[:5] == ["python", "-m", "lemix.infra.store.node_identity", "--from", "hostname"]
    env = {v["name"]: v for v in container(executor)["env"]}
    assert env["LEMIX_NODE_ID"]["value"] == "auto"
    assert env["LEMIX_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_executors_share_the_weight_sync_dir() -> None:
    """Every executor pod mounts one ReadWriteMany claim at the scheduler's
    LEMIX_WEIGHT_SYNC_DIR (one pod saves synced weights, the others load them)."""
    sync_dir = container_env(WORKLOADS["scheduler"])["LEMIX_WEIGHT_SYNC_DIR"]
    executor = WORKLOADS["executor"]
    assert container_env(executor)["LEMIX_WEIGHT_SYNC_DIR"] == sync_dir
    mounts = {m["mountPath"]: m["name"] for m in container(executor)["volumeMounts"]}
    volumes = {v["name"]: v for v in executor["spec"]["template"]["spec"]["volumes"]}
    claim_name = volumes[mounts[sync_dir]]["persistentVolumeClaim"]["claimName"]
    assert "ReadWriteMany" in objects("PersistentVolumeClaim")[claim_name]["spec"]["accessModes"]
    assert not executor["spec"].get("volumeClaimTemplates")  # per pod: not shared
    assert executor["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001


def test_the_scheduler_is_a_singleton() -> None:
    scheduler = WORKLOADS["scheduler"]["spec"]
    assert scheduler["replicas"] == 1 and scheduler["strategy"]["type"] == "Recreate"


# ------------------------------------------------------------------ agreement with compose


def test_same_services_as_compose() -> None:
    compose_names = {re.sub(r"-\d+$", "", n) for n in COMPOSE_MODEL["services"]}
    assert set(WORKLOADS) == compose_names


def test_configmap_is_composes_shared_env() -> None:
    assert COMPOSE_MODEL["x-lemix-env"] == CONFIG


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_command_ports_env_and_grace_as_compose(name: str) -> None:
    workload, svc = WORKLOADS[name], COMPOSE_MODEL["services"][compose_name(name)]
    c = container(workload)
    ports = {p["containerPort"] for p in c["ports"]}
    if name == "redis":
        assert ports == {6379} and svc["image"] == c["image"]
        return
    assert python_modules(c["command"])[-1] == lemix_module(svc)
    assert c["image"] == svc["image"], name  # lemix:cpu / lemix:gpu (kustomize may rename)
    health = svc["healthcheck"]["test"]
    assert ports == service_ports(svc["environment"]), name
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"].get("service") == health[-1], (name, probe)
    env = container_env(workload)
    assert set(env) == set(svc["environment"]), set(env) ^ set(svc["environment"])
    parse, grace_field = PARSERS[lemix_module(svc) or ""]
    grace_s = getattr(parse(process_env(env, c["command"])), grace_field)
    assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= grace_s + 10


# ------------------------------------------------------------------ security

LEMIX_WORKLOADS = sorted(n for n in WORKLOADS if n != "redis")
PROMETHEUS = {
    "namespaceSelector": {},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


def _selected_names(selector: dict[str, Any]) -> set[str]:
    """The app.kubernetes.io/name values a pod selector matches (the only key used)."""
    names = set()
    if "app.kubernetes.io/name" in selector.get("matchLabels", {}):
        names.add(selector["matchLabels"]["app.kubernetes.io/name"])
    for expr in selector.get("matchExpressions", []):
        assert expr["key"] == "app.kubernetes.io/name" and expr["operator"] == "In", expr
        names |= set(expr["values"])
    assert set(selector) <= {"matchLabels", "matchExpressions"}, selector
    return names


def _ingress_by_workload() -> dict[str, list[dict[str, Any]]]:
    rules: dict[str, list[dict[str, Any]]] = {}
    for policy in objects("NetworkPolicy").values():
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"], policy["metadata"]["name"]
        for name in _selected_names(spec["podSelector"]):
            rules.setdefault(name, []).extend(spec["ingress"])
    return rules


def test_network_policy_opens_only_the_gateway_api_to_the_outside() -> None:
    """Every workload is selected by a policy (so isolated); a rule with no
    `from` (anyone) exists only for the gateway's gRPC and HTTP ports; every
    other rule admits only the stack's own pods, or Prometheus on metrics."""
    rules = _ingress_by_workload()
    assert set(rules) == set(WORKLOADS)
    for name, ingress in rules.items():
        port_names = {p["name"] for p in container(WORKLOADS[name])["ports"]}
        for rule in ingress:
            ports = {p["port"] for p in rule["ports"]}
            assert ports <= port_names, (name, ports)  # named ports that exist
            if "from" not in rule:
                assert name == "gateway" and ports == {"grpc", "http"}, (name, rule)
                continue
            for peer in rule["from"]:
                if peer == PROMETHEUS:
                    assert ports == {"metrics"}, (name, rule)
                else:
                    assert set(peer) == {"podSelector"}, (name, peer)  # this namespace only
                    assert _selected_names(peer["podSelector"]) <= set(LEMIX_WORKLOADS)


def test_network_policy_lets_each_caller_reach_what_it_calls() -> None:
    """The calls the stack makes: gateway -> scheduler, scheduler and profiler
    -> executors, every service -> Redis."""
    rules = _ingress_by_workload()

    def admitted(name: str, port: str) -> set[str]:
        return {
            caller
            for rule in rules[name]
            if "from" in rule and port in {p["port"] for p in rule["ports"]}
            for peer in rule["from"]
            if "podSelector" in peer and peer != PROMETHEUS
            for caller in _selected_names(peer["podSelector"])
        }

    assert "gateway" in admitted("scheduler", "grpc")
    assert {"scheduler", "profiler"} <= admitted("executor", "grpc")
    assert set(LEMIX_WORKLOADS) <= admitted("redis", "redis")
    assert "executor" not in admitted("scheduler", "grpc")


def test_redis_runs_unprivileged_on_a_read_only_root() -> None:
    redis = WORKLOADS["redis"]
    pod = redis["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] and pod["runAsUser"] != 0 and pod["fsGroup"]
    assert pod["seccompProfile"]["type"] == "RuntimeDefault"
    c = container(redis)["securityContext"]
    assert c["readOnlyRootFilesystem"] and c["allowPrivilegeEscalation"] is False
    assert c["capabilities"]["drop"] == ["ALL"]
    # Read-only root: everything Redis writes (AOF, RDB) goes under its data mount.
    assert {m["mountPath"] for m in container(redis)["volumeMounts"]} == {"/data"}


@pytest.mark.parametrize("name", LEMIX_WORKLOADS)
def test_lemix_pods_drop_capabilities_and_read_the_token_from_a_secret(name: str) -> None:
    c = container(WORKLOADS[name])
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    env = {v["name"]: v for v in c["env"]}
    ref = env["LEMIX_SERVICE_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "lemix-service-token", "key": "token"}  # not optional
    assert "LEMIX_SERVICE_TOKEN" not in CONFIG  # never in the ConfigMap


@pytest.mark.parametrize("name", LEMIX_WORKLOADS)
def test_services_name_the_metrics_port(name: str) -> None:
    ports = {p["name"]: p for p in SERVICES[name]["spec"]["ports"]}
    assert ports["metrics"]["port"] == 9090 and ports["metrics"]["targetPort"] == "metrics"


@pytest.mark.parametrize("name", LEMIX_WORKLOADS)
def test_services_carry_prometheus_scrape_annotations(name: str) -> None:
    """Prometheus' usual `kubernetes-service-endpoints` job scrapes each pod of
    a Service annotated so: on the port the service really serves metrics on."""
    annotations = SERVICES[name]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true"
    assert annotations.get("prometheus.io/path") == "/metrics"
    port = int(annotations["prometheus.io/port"])
    ports = {p["name"]: p["containerPort"] for p in container(WORKLOADS[name])["ports"]}
    assert ports["metrics"] == port
    env = container_env(WORKLOADS[name])
    [metrics_port] = [v for k, v in env.items() if k.endswith("_METRICS_PORT")]
    assert int(metrics_port) == port


def test_redis_is_not_scraped() -> None:
    """Redis serves no /metrics: no scrape annotation (a scrape would only fail)."""
    annotations = SERVICES["redis"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") != "true"


def test_gateway_serves_metrics_only_off_its_public_ports() -> None:
    gateway = WORKLOADS["gateway"]
    parse, _ = PARSERS["gateway"]
    config = parse(process_env(container_env(gateway), container(gateway)["command"]))
    assert config.is_http_metrics_enabled is False
    assert config.metrics_port not in (config.port, config.http_port)


def _secret_ref(var: dict[str, Any]) -> dict[str, str]:
    return var["valueFrom"]["secretKeyRef"]


def test_redis_requires_the_password_from_a_secret() -> None:
    c = container(WORKLOADS["redis"])
    args = c["args"]
    env = {v["name"]: v for v in c["env"]}
    assert args[args.index("--requirepass") + 1] == "$(LEMIX_REDIS_PASSWORD)"  # k8s expands it
    assert _secret_ref(env["LEMIX_REDIS_PASSWORD"]) == {"name": "lemix-redis", "key": "password"}
    assert _secret_ref(env["REDISCLI_AUTH"]) == {"name": "lemix-redis", "key": "password"}
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"] == ["redis-cli", "ping"]  # AUTH via REDISCLI_AUTH


@pytest.mark.parametrize("name", LEMIX_WORKLOADS)
def test_lemix_pods_read_the_redis_url_from_the_secret(name: str) -> None:
    env = {v["name"]: v for v in container(WORKLOADS[name])["env"]}
    assert _secret_ref(env["LEMIX_REDIS_URL"]) == {"name": "lemix-redis", "key": "url"}
    assert "LEMIX_REDIS_URL" not in CONFIG  # it carries the password


# ------------------------------------------------------------------ checkpoint overlay

OVERLAY = K8S_DIR / "overlays" / "checkpoint"
_MERGE_KEYS = {"containers": "name", "env": "name", "volumeMounts": "name", "volumes": "name"}


def _merge(base: Any, patch: Any, key: str = "") -> Any:
    """A strategic merge as kubectl does it for the lists used here (merged by
    name), maps recursively, anything else replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and key in _MERGE_KEYS:
        name = _MERGE_KEYS[key]
        out_list = [copy.deepcopy(item) for item in base]
        for item in patch:
            match = [i for i, b in enumerate(out_list) if b[name] == item[name]]
            if match:
                out_list[match[0]] = _merge(out_list[match[0]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def test_the_checkpoint_overlay_mounts_one_checkpoint_as_model_and_tokenizer() -> None:
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert set(kustomization) <= KUSTOMIZATION_KEYS
    assert kustomization["resources"][0] == "../.."
    listed = {*kustomization["resources"][1:], *(p["path"] for p in kustomization["patches"])}
    assert listed == {p.name for p in OVERLAY.glob("*.yaml")} - {"kustomization.yaml"}
    (claim,) = yaml.safe_load_all((OVERLAY / "checkpoint-pvc.yaml").read_text())
    k8s.V1PersistentVolumeClaim.model_validate(claim)
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    for entry in kustomization["patches"]:
        patch = yaml.safe_load((OVERLAY / entry["path"]).read_text())
        base = WORKLOADS[patch["metadata"]["name"]]
        assert base["kind"] == patch["kind"]
        merged = _merge(base, patch)
        MODELS[(merged["apiVersion"], merged["kind"])].model_validate(merged)
        pod = merged["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "checkpoint"]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        env = {e["name"]: e.get("value") for e in container(merged)["env"]}
        (mount,) = [m for m in container(merged)["volumeMounts"] if m["name"] == "checkpoint"]
        assert mount["readOnly"] is True
        assert env["LEMIX_TOKENIZER"] == mount["mountPath"]  # the gateway's and the executors'
        if base["kind"] == "StatefulSet":
            assert env["LEMIX_MODEL"] == mount["mountPath"]
