"""Fixtures of the compose suite: an engine, the image, per-module projects.

Without a Docker engine (and the compose plugin) every test here is skipped
with the reason; `make test-compose` runs scripts/docker_engine.sh first, so
on a machine where an engine can be started the suite runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from compose_support import REPO, build_image, engine_or_reason

# Per fault case: what the client caused and how each id ended; written to
# runs/compose/results.json for the table in docs/deploy.md.
RESULTS: dict[str, dict[str, object]] = {}


@pytest.fixture(scope="session")
def docker_client() -> docker.DockerClient:
    client, reason = engine_or_reason()
    if client is None:
        pytest.skip(reason)
    return client


@pytest.fixture(scope="session")
def lemix_image(docker_client: docker.DockerClient) -> str:
    tag, took_s = build_image(docker_client)
    RESULTS["image_build"] = {"tag": tag, "seconds": round(took_s, 1)}
    return tag


@pytest.fixture(scope="session", autouse=True)
def _write_results() -> Iterator[None]:
    yield
    if RESULTS:
        default = REPO / "runs" / "compose" / "results.json"
        out = Path(os.environ.get("LEMIX_COMPOSE_RESULTS", default))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(RESULTS, indent=2, sort_keys=True) + "\n")
