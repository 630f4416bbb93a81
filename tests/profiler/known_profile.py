"""The known profile the profiler tests recover, and the grid they measure it on."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from factories import make_profile

from lemix.latency import AffineQuadraticLatencyModel, DecodeCoeffs, QuadCoeffs
from lemix.profile import Profile
from profiler.runner import ProfileGrid
from services.executor.service import ExecutorService

NOISE_CV = 0.02  # the emulated executor's latency noise (lognormal, mean 1)

# Every term matters on the grid below: at C = 8, ℓ = 1,024 forward on stage 0
# is 2 ms (a) + 328 ms (b·Cℓ) + 210 ms (c·Cℓ²); decode at C = 8, Σctx = 16,384
# is 5 ms (d0) + 0.8 ms (d1·C) + 3.3 ms (d2·Σctx); 13 ms at Σctx = 65,536.
TRUE_OURS = AffineQuadraticLatencyModel(
    forward=(QuadCoeffs(2.0e-3, 4.0e-5, 2.5e-8), QuadCoeffs(2.2e-3, 4.2e-5, 2.6e-8)),
    backward=(QuadCoeffs(4.0e-3, 8.0e-5, 5.0e-8), QuadCoeffs(4.4e-3, 8.4e-5, 5.2e-8)),
    decode=(DecodeCoeffs(5.0e-3, 1.0e-4, 2.0e-7), DecodeCoeffs(5.5e-3, 1.2e-4, 1.8e-7)),
)
STATIC_BYTES = 10**6
KV_BYTES_PER_TOKEN = 8
ACTIVATION_BYTES_PER_TOKEN = 16

# Small enough to be quick, large enough to identify every coefficient.
GRID = ProfileGrid(
    batch_sizes=(1, 2, 4, 8),
    num_tokens=(64, 128, 256, 512, 1024),
    sum_context_tokens=(256, 1024, 4096, 16384, 65536),
)


def true_profile(name: str = "truth") -> Profile:
    """The profile the emulated executor is given (and profiling must recover)."""
    base = make_profile(
        capacity_bytes=10**9,
        weight_bytes=STATIC_BYTES,
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        activation_bytes_per_token=ACTIVATION_BYTES_PER_TOKEN,
        optimizer_step_s=(0.03, 0.04),
        name=name,
    )
    return dataclasses.replace(base, ours=TRUE_OURS)


# `await start_executor(noise_cv=..., seed=...)` (the fixture in conftest.py).
StartExecutor = Callable[..., Awaitable[ExecutorService]]
