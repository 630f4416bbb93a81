"""`lemix.stack.containers`' settings, without an engine (tests/compose runs it)."""

from __future__ import annotations

import pytest

from lemix.stack.config import SERVICE_ENV, StackConfig, stack_env
from lemix.stack.containers import ContainerConfig


@pytest.mark.parametrize("project", ["", "x", "has space", "semi;colon"])
def test_project_names_docker_refuses_are_refused_up_front(project: str) -> None:
    with pytest.raises(ValueError, match="--project"):
        ContainerConfig(project=project)


def test_negative_gpus_per_node_is_refused() -> None:
    with pytest.raises(ValueError, match="--gpus-per-node"):
        ContainerConfig(gpus_per_node=-1)


def test_containers_get_the_process_stacks_variables_with_their_own_profile_path() -> None:
    config = StackConfig(num_nodes=3, policy="mix-luf", backend="torch", tokenizer="bpe:2048")
    env = stack_env(
        config, redis_url="redis://r:6379/0", service_token="t", profile_path="/etc/p.json"
    )
    assert env[SERVICE_ENV["profile_path"]] == "/etc/p.json"
    assert env[SERVICE_ENV["num_nodes"]] == "3" and env[SERVICE_ENV["policy"]] == "mix-luf"
    assert env[SERVICE_ENV["tokenizer"]] == "bpe:2048"
    assert env["LEMIX_REDIS_URL"] == "redis://r:6379/0"
