"""Drive one executor's `Measure` RPC over a grid and fit a `Profile` from it.

    profile = await profile_executor("127.0.0.1:50060", ProfileGrid(), 3, base, "a100-measured")

Per stage, forward and backward are measured at every (C, ℓ) of the grid and a
decode step at every (C, Σctx) with Σctx ≥ C (each sequence holds at least one
token). Each point is one `Measure` call asking for `num_repeats` runs; the
point's latency is their median (robust to a stray slow run), or their minimum
with `statistic="min"` (for a shared machine, where most runs are slowed by
other work and the fastest is the best estimate of the hardware's time).
Calls go one at a time, never concurrently: on a real GPU two measurements at
once would time each other. Every call carries a deadline.

Errors are the domain errors of `lemix.infra.rpc.errors`: `InvalidArgument` for a
bad grid (or one the executor refuses), `Unavailable` when the executor cannot
be reached, fails a call, or answers with no usable samples.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import grpc.aio

from lemix._proto.lemix.v1 import executor_pb2, executor_pb2_grpc
from lemix.infra.rpc.client import DEFAULT_DEADLINE_S, channel
from lemix.infra.rpc.errors import InvalidArgument, ServiceError, Unavailable, error_from_rpc
from lemix.latency import DecodePoint, PhasePoint
from lemix.profile import Profile
from profiler.fit import FitConfig, MemoryPoint, StageMeasurements, fit_profile

DEFAULT_BATCH_SIZES = (1, 2, 4, 8)
DEFAULT_NUM_TOKENS = (64, 128, 256, 512, 1024)
DEFAULT_SUM_CONTEXT_TOKENS = (256, 1024, 4096, 16384, 65536)
DEFAULT_NUM_REPEATS = 3
# One Measure call: num_repeats runs of one point. Generous, because a real
# backward of 8 x 1,024 tokens repeated many times takes seconds.
DEFAULT_MEASURE_DEADLINE_S = 60.0
MAX_NUM_REPEATS = 10_000  # the executor's own cap per Measure call
# How one point's repeats become its latency.
STATISTICS: dict[str, Callable[[Sequence[float]], float]] = {
    "median": statistics.median,
    "min": min,
}

_Phase = executor_pb2.MeasureRequest.Phase
T = TypeVar("T")


@dataclass(frozen=True)
class ProfileGrid:
    """The points to measure: (C, ℓ) for forward/backward, (C, Σctx) for decode."""

    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES  # C, sequences
    num_tokens: tuple[int, ...] = DEFAULT_NUM_TOKENS  # ℓ, tokens per sequence
    sum_context_tokens: tuple[int, ...] = DEFAULT_SUM_CONTEXT_TOKENS  # Σctx over the batch

    def __post_init__(self) -> None:
        for what, values in asdict(self).items():
            if not values or any(int(v) != v or v < 1 for v in values):
                raise ValueError(f"{what} needs one or more integers >= 1, got {list(values)}")
            if len(set(values)) != len(values):
                raise ValueError(f"{what} has repeated values: {list(values)}")
        # a + b·Cℓ + c·Cℓ² is only identifiable with two lengths (one ℓ makes
        # Cℓ² proportional to Cℓ); d0 + d1·C + d2·Σctx needs two of each.
        if len(self.num_tokens) < 2:
            raise ValueError("num_tokens needs at least two lengths to fit a + b·Cℓ + c·Cℓ²")
        decode = self.decode_points()
        if len({c for c, _ in decode}) < 2 or len({s for _, s in decode}) < 2:
            raise ValueError(
                "the decode grid needs at least two batch sizes and two sum_context_tokens "
                "values with sum_context_tokens >= batch size"
            )
        if min(len(self.phase_points()), len(decode)) < 4:
            raise ValueError("the grid needs at least 4 points per phase (3 fitted + 1 held out)")

    def phase_points(self) -> list[tuple[int, int]]:
        """(C, ℓ) pairs of the forward and backward grid."""
        return [(c, n) for c in self.batch_sizes for n in self.num_tokens]

    def decode_points(self) -> list[tuple[int, int]]:
        """(C, Σctx) pairs of the decode grid, where each sequence holds a token or more."""
        return [(c, s) for c in self.batch_sizes for s in self.sum_context_tokens if s >= c]

    @property
    def num_calls_per_stage(self) -> int:
        return 2 * len(self.phase_points()) + len(self.decode_points())


@dataclass(frozen=True)
class ProfileRun:
    """One profiling run: the fitted profile and its JSON-ready report."""

    profile: Profile
    report: dict[str, Any]  # profiler.fit.fit_report's keys plus the run's settings


async def profile_executor(
    address: str,
    grid: ProfileGrid,
    num_repeats: int,
    base_profile: Profile,
    name: str,
    *,
    fit_config: FitConfig | None = None,
    deadline_s: float = DEFAULT_MEASURE_DEADLINE_S,
) -> Profile:
    """Measure the executor at `address` and return the fitted profile named `name`.

    Memory, transfer and optimizer figures come from `base_profile` (see
    `profiler.fit`); it must have the executor's number of stages.
    """
    run = await run_profile(
        address, grid, num_repeats, base_profile, name, fit_config=fit_config, deadline_s=deadline_s
    )
    return run.profile


async def run_profile(
    address: str,
    grid: ProfileGrid,
    num_repeats: int,
    base_profile: Profile,
    name: str,
    *,
    fit_config: FitConfig | None = None,
    deadline_s: float = DEFAULT_MEASURE_DEADLINE_S,
    service_token: str = "",
    statistic: str = "median",
) -> ProfileRun:
    """`profile_executor`, also returning the fit report (quality, memory check, run info).

    `service_token`: the stack's token, when its executors require one.
    `statistic`: how a point's repeats become its latency, "median" or "min"."""
    if statistic not in STATISTICS:
        raise InvalidArgument(f"statistic must be one of {sorted(STATISTICS)}, got {statistic!r}")
    if not 1 <= num_repeats <= MAX_NUM_REPEATS:
        raise InvalidArgument(f"num_repeats must be in [1, {MAX_NUM_REPEATS}], got {num_repeats}")
    if not (math.isfinite(deadline_s) and deadline_s > 0):
        raise InvalidArgument(f"deadline_s must be a finite number > 0, got {deadline_s}")
    if not name:
        raise InvalidArgument("name the profile (it is stored and looked up by name)")
    async with channel(address, service_token=service_token) as ch:
        stub = executor_pb2_grpc.ExecutorStub(ch)
        state = await _call(
            address,
            "GetNodeState",
            stub.GetNodeState(executor_pb2.GetNodeStateRequest(), timeout=DEFAULT_DEADLINE_S),
        )
        num_stages = state.num_stages or base_profile.num_stages
        if num_stages != base_profile.num_stages:
            raise InvalidArgument(
                f"executor {address} has {num_stages} stage(s) but base profile "
                f"{base_profile.name!r} has {base_profile.num_stages}; pass its own profile"
            )
        measurements = [
            await measure_stage(stub, address, stage, grid, num_repeats, deadline_s, statistic)
            for stage in range(num_stages)
        ]
    provenance = (
        f"measured by the LeMix profiler on executor {address}: forward/backward at "
        f"C in {list(grid.batch_sizes)} x l in {list(grid.num_tokens)}, decode at C x "
        f"sum_context in {list(grid.sum_context_tokens)}, {statistic} of {num_repeats} repeat(s); "
        f"memory, transfer and optimizer_step_s copied from base profile {base_profile.name!r}"
    )
    result = fit_profile(
        measurements,
        base_profile,
        name,
        fit_config,
        provenance=provenance,
        hardware={"executor_address": address},
    )
    report: dict[str, Any] = {
        **result.report,
        "executor_address": address,
        "grid": asdict(grid),
        "num_repeats": num_repeats,
        "statistic": statistic,
        "num_measure_calls": num_stages * grid.num_calls_per_stage,
        # Work running during the measurement perturbs it on a real GPU.
        "executor_load_at_start": {
            "num_running": state.num_running,
            "num_waiting": state.num_waiting,
        },
    }
    return ProfileRun(result.profile, report)


async def measure_stage(
    stub: executor_pb2_grpc.ExecutorStub,
    address: str,
    stage: int,
    grid: ProfileGrid,
    num_repeats: int,
    deadline_s: float,
    statistic: str = "median",
) -> StageMeasurements:
    """Every grid point of one stage, one `Measure` call each, in order."""

    async def point(
        phase: _Phase, batch_size: int, num_tokens: int, sum_context_tokens: int
    ) -> tuple[float, int]:
        request = executor_pb2.MeasureRequest(
            phase=phase,
            stage=stage,
            batch_size=batch_size,
            num_tokens=num_tokens,
            sum_context_tokens=sum_context_tokens,
            num_repeats=num_repeats,
        )
        what = (
            f"Measure {_Phase.Name(phase)} stage {stage} C={batch_size} "
            f"l={num_tokens} sum_context={sum_context_tokens}"
        )
        reply = await _call(address, what, stub.Measure(request, timeout=deadline_s))
        return _aggregate_s(address, what, reply.latency_s, statistic), reply.peak_memory_bytes

    forward: list[PhasePoint] = []
    backward: list[PhasePoint] = []
    training_memory: list[MemoryPoint] = []
    for points, phase in ((forward, _Phase.PHASE_FORWARD), (backward, _Phase.PHASE_BACKWARD)):
        for c, n in grid.phase_points():
            latency_s, peak_bytes = await point(phase, c, n, 0)
            points.append(PhasePoint(c, n, latency_s))
            training_memory.append(MemoryPoint(c * n, peak_bytes))
    decode: list[DecodePoint] = []
    decode_memory: list[MemoryPoint] = []
    for c, s in grid.decode_points():
        latency_s, peak_bytes = await point(_Phase.PHASE_DECODE, c, 0, s)
        decode.append(DecodePoint(c, s, latency_s))
        decode_memory.append(MemoryPoint(s, peak_bytes))
    return StageMeasurements(
        tuple(forward), tuple(backward), tuple(decode), tuple(training_memory), tuple(decode_memory)
    )


def _aggregate_s(address: str, what: str, samples: Sequence[float], statistic: str) -> float:
    if not samples or not all(math.isfinite(x) and x > 0 for x in samples):
        raise Unavailable(
            f"executor {address}: {what} returned no usable samples "
            f"(need positive latencies, got {list(samples)[:5]})"
        )
    return float(STATISTICS[statistic](samples))


async def _call(address: str, what: str, call: Awaitable[T]) -> T:
    """Await one RPC; a failure becomes the matching domain error naming the call."""
    try:
        return await call
    except grpc.aio.AioRpcError as err:
        mapped = error_from_rpc(err)
        if isinstance(mapped, ServiceError):
            raise type(mapped)(f"executor {address}: {what}: {mapped}") from err
        raise Unavailable(
            f"executor {address}: {what} failed: {err.code().name}: {err.details()}"
        ) from err
