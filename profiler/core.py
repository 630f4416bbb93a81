"""What RunProfile does, apart from protobuf: profile one executor, store the result.

Runs against the same executor are serialized: two profiling runs at once would
time each other on a real GPU (and interleave one executor's measurements).
Runs against different executors proceed concurrently.
"""

from __future__ import annotations

import asyncio

import structlog
from redis.exceptions import RedisError

from lemix.infra.rpc.errors import Unavailable
from lemix.infra.store.store import Store
from lemix.profile import Profile
from profiler.convert import ProfileJob, profile_json
from profiler.fit import FitConfig
from profiler.runner import ProfileRun, run_profile

log = structlog.get_logger(__name__)


class ProfilerCore:
    """Profiles executors with one base profile and stores fitted profiles in Redis."""

    def __init__(
        self,
        store: Store,
        base_profile: Profile,
        fit_config: FitConfig,
        measure_deadline_s: float,
        *,
        service_token: str = "",
    ) -> None:
        self._store = store
        self._service_token = service_token  # what the executors require
        self._base = base_profile
        self._fit_config = fit_config
        self._measure_deadline_s = measure_deadline_s
        self._locks: dict[str, asyncio.Lock] = {}  # one per executor address

    async def run(self, job: ProfileJob) -> ProfileRun:
        """Measure, fit, then store the profile under `job.name` (overwriting it).

        Raises the runner's domain errors, or `Unavailable` when Redis fails.
        """
        lock = self._locks.setdefault(job.executor_address, asyncio.Lock())
        async with lock:
            log.info(
                "profiler.run_started",
                executor=job.executor_address,
                name=job.name,
                num_repeats=job.num_repeats,
            )
            run = await run_profile(
                job.executor_address,
                job.grid,
                job.num_repeats,
                self._base,
                job.name,
                fit_config=self._fit_config,
                deadline_s=self._measure_deadline_s,
                service_token=self._service_token,
            )
        try:
            await self._store.put_profile(job.name, profile_json(run))
        except RedisError as exc:
            raise Unavailable(
                f"fitted profile {job.name!r} but could not store it in Redis: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        log.info("profiler.run_stored", executor=job.executor_address, name=job.name)
        return run
