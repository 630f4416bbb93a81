"""Factories for tests: small profiles, tasks and planners with round numbers.

The default profile is deliberately simple so expected values can be computed
by hand: per stage, forward = a + 0.001·C·ℓ s (a = 0 unless asked), backward =
0.002·C·ℓ s, a decode step = d0 + d1·C + d2·Σctx with d0 = 0.01 s, and memory
of 10 000 B per GPU with 1 000 B of weights (κ = 0.9 → 9 000 B threshold,
8 000 B per stage for dynamic owners), 4 B of KV and 4 B of activations per
token and stage. `make_tiny_memory_profile` shrinks memory (800 B per stage for
dynamic owners, 1 B per token) so a handful of requests fills a node.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from lemix.latency import AffineQuadraticLatencyModel, DecodeCoeffs, PaperLatencyModel, QuadCoeffs
from lemix.memory import MemoryConfig
from lemix.planner.base import PlannerConfig
from lemix.planner.planner import Planner
from lemix.planner.registry import build_planner
from lemix.profile import MemoryProfile, Profile, TransferProfile
from lemix.types import Placement, Task, TaskKind

PerStage = float | Sequence[float]


def per_stage(value: PerStage, num_stages: int) -> tuple[float, ...]:
    """A scalar repeated on every stage, or the given per-stage sequence."""
    if isinstance(value, int | float):
        return (value,) * num_stages
    values = tuple(value)
    if len(values) != num_stages:
        raise ValueError(f"need {num_stages} per-stage values, got {len(values)}")
    return values


def make_profile(
    num_stages: int = 2,
    *,
    forward_a_s: PerStage = 0.0,
    forward_s_per_token: PerStage = 0.001,
    backward_s_per_token: PerStage = 0.002,
    decode_d0_s: PerStage = 0.01,
    decode_d1_s: PerStage = 0.0,
    decode_d2_s: PerStage = 0.0,
    optimizer_step_s: PerStage = 0.0,
    eta_forward: PerStage = 1e-5,
    eta_backward: PerStage = 2e-5,
    capacity_bytes: int = 10_000,
    weight_bytes: PerStage = 1_000,
    training_state_bytes: PerStage = 0,
    kv_bytes_per_token: PerStage = 4,
    activation_bytes_per_token: PerStage = 4,
    host_capacity_bytes: int = 10**9,
    host_link_bytes_s: float = 1e6,
    weight_sync_bytes_s: float = 1e6,
    name: str = "test-profile",
) -> Profile:
    n = num_stages

    def ints(value: PerStage) -> tuple[int, ...]:
        return tuple(int(x) for x in per_stage(value, n))

    ours = AffineQuadraticLatencyModel(
        forward=tuple(
            QuadCoeffs(a, b, 0.0)
            for a, b in zip(
                per_stage(forward_a_s, n), per_stage(forward_s_per_token, n), strict=True
            )
        ),
        backward=tuple(QuadCoeffs(0.0, b, 0.0) for b in per_stage(backward_s_per_token, n)),
        decode=tuple(
            DecodeCoeffs(d0, d1, d2)
            for d0, d1, d2 in zip(
                per_stage(decode_d0_s, n),
                per_stage(decode_d1_s, n),
                per_stage(decode_d2_s, n),
                strict=True,
            )
        ),
    )
    return Profile(
        name=name,
        num_stages=n,
        paper=PaperLatencyModel(per_stage(eta_forward, n), per_stage(eta_backward, n)),
        ours=ours,
        optimizer_step_s=per_stage(optimizer_step_s, n),
        memory=MemoryProfile(
            capacity_bytes=capacity_bytes,
            weight_bytes=ints(weight_bytes),
            training_state_bytes=ints(training_state_bytes),
            kv_bytes_per_token=ints(kv_bytes_per_token),
            activation_bytes_per_token=ints(activation_bytes_per_token),
            host_capacity_bytes=host_capacity_bytes,
        ),
        transfer=TransferProfile(
            host_link_bytes_s=host_link_bytes_s, weight_sync_bytes_s=weight_sync_bytes_s
        ),
    )


def make_tiny_memory_profile(num_stages: int = 2, **overrides: object) -> Profile:
    """1 000 B GPUs, 100 B of weights, 1 B of KV and activations per token.

    With κ = 0.9 the threshold is 900 B, so 800 B per stage remain for KV and
    activations: four requests of 200 tokens, or two of them plus a 400-token
    training task, fill a node.
    """
    kwargs: dict[str, object] = {
        "capacity_bytes": 1_000,
        "weight_bytes": 100,
        "kv_bytes_per_token": 1,
        "activation_bytes_per_token": 1,
        "name": "tiny-memory",
    }
    kwargs.update(overrides)
    return make_profile(num_stages, **kwargs)  # type: ignore[arg-type]


def make_request(
    task_id: str,
    arrival_s: float = 0.0,
    num_prompt_tokens: int = 100,
    max_output_tokens: int = 10,
    seq: int = 0,
) -> Task:
    return Task(
        task_id,
        TaskKind.INFERENCE,
        arrival_s,
        num_prompt_tokens,
        max_output_tokens,
        batch_size=1,
        seq=seq,
    )


def make_training(
    task_id: str, arrival_s: float = 0.0, num_tokens: int = 100, batch_size: int = 1, seq: int = 0
) -> Task:
    return Task(
        task_id, TaskKind.TRAINING, arrival_s, num_tokens, 0, batch_size=batch_size, seq=seq
    )


def make_planner_config(
    num_nodes: int = 4, num_stages: int = 2, **overrides: object
) -> PlannerConfig:
    kwargs: dict[str, object] = {
        "num_nodes": num_nodes,
        "num_stages": num_stages,
        "slo_ttft_s": 1.0,
        "slo_tbt_s": 0.5,
        # No periodic recheck unless a test asks: aging tests see one deadline.
        "defer_recheck_s": 1000.0,
        # Requests seen long ago still count as load (the probe stays active).
        "request_rate_window_s": 1000.0,
    }
    kwargs.update(overrides)
    return PlannerConfig(**kwargs)  # type: ignore[arg-type]


def make_planner(
    policy: str = "lemix",
    num_nodes: int = 4,
    profile: Profile | None = None,
    memory: MemoryConfig | None = None,
    **config_overrides: object,
) -> Planner:
    profile = profile or make_profile()
    config = make_planner_config(num_nodes, profile.num_stages, **config_overrides)
    return build_planner(policy, config, profile, memory or MemoryConfig())


def drive_planner(
    planner: Planner,
    seed: int,
    num_tasks: int = 200,
    *,
    rate_rps: float = 60.0,
    training_share: float = 0.4,
    finish_share: float = 0.3,
) -> tuple[list[str], float]:
    """Feed `planner` a seeded stream of requests and training, finishing a
    random held task after some; returns every decision's `repr` and the
    last time."""
    rng = random.Random(seed)
    now_s, held, out = 0.0, [], []
    for i in range(num_tasks):
        now_s += rng.expovariate(rate_rps)
        if rng.random() < training_share:
            task = make_training(f"t{i}", now_s, rng.randint(50, 300), rng.randint(1, 4))
        else:
            task = make_request(f"r{i}", now_s, rng.randint(10, 400), rng.randint(5, 80))
        planner.submit(task, now_s)
        decisions = planner.plan(now_s)
        while planner.is_release_pending:  # as the scheduler and the simulator do
            decisions += planner.plan(now_s)
        out += [repr(d) for d in decisions]
        held += [d.task_id for d in decisions if isinstance(d, Placement)]
        if held and rng.random() < finish_share:
            planner.on_task_finished(held.pop(rng.randrange(len(held))), now_s)
    return out, now_s
