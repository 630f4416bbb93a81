"""Protobuf <-> domain for the profiler (the only module that touches its messages).

A proto3 empty list or zero can only mean "unset" here, so it reads as the
default: no batch sizes -> `runner.DEFAULT_BATCH_SIZES`, `num_repeats` 0 ->
`runner.DEFAULT_NUM_REPEATS`. Bad values raise `InvalidArgument`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from lemix._proto.lemix.v1 import profiler_pb2
from lemix.infra.address import is_host_port
from lemix.infra.rpc.errors import InvalidArgument
from lemix.infra.store.keys import RedisKeys
from profiler.runner import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_NUM_REPEATS,
    DEFAULT_NUM_TOKENS,
    DEFAULT_SUM_CONTEXT_TOKENS,
    MAX_NUM_REPEATS,
    ProfileGrid,
    ProfileRun,
)


@dataclass(frozen=True)
class ProfileJob:
    """One RunProfile request, validated."""

    executor_address: str  # host:port
    grid: ProfileGrid
    num_repeats: int
    name: str  # the profile's name, and its Redis key


def job_from_proto(msg: profiler_pb2.RunProfileRequest) -> ProfileJob:
    address = msg.executor_address
    if not is_host_port(address):
        raise InvalidArgument(f"executor_address must be host:port, got {address!r}")
    if not msg.name:
        raise InvalidArgument("name is empty; name the profile (it is stored under that name)")
    try:
        RedisKeys().profile(msg.name)  # the name must make a valid key part
        grid = ProfileGrid(
            batch_sizes=tuple(msg.batch_sizes) or DEFAULT_BATCH_SIZES,
            num_tokens=tuple(msg.num_tokens) or DEFAULT_NUM_TOKENS,
            sum_context_tokens=tuple(msg.sum_context_tokens) or DEFAULT_SUM_CONTEXT_TOKENS,
        )
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    num_repeats = msg.num_repeats or DEFAULT_NUM_REPEATS
    if num_repeats > MAX_NUM_REPEATS:
        raise InvalidArgument(f"num_repeats must be <= {MAX_NUM_REPEATS}, got {num_repeats}")
    return ProfileJob(address, grid, num_repeats, msg.name)


def profile_json(run: ProfileRun) -> str:
    """The profile as `lemix.profile.save_profile` writes it (schema in profiles/README.md)."""
    return json.dumps(run.profile.to_json_dict(), indent=2) + "\n"


def run_to_proto(run: ProfileRun) -> profiler_pb2.RunProfileResponse:
    return profiler_pb2.RunProfileResponse(
        profile_json=profile_json(run), fit_report_json=json.dumps(run.report)
    )
