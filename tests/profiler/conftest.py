"""Shared setup of the profiler tests: a real emulated executor (real gRPC on a
free port, real Redis) running the known profile of `known_profile`."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from known_profile import NOISE_CV, StartExecutor, true_profile

from lemix.infra.store.server import EmbeddedRedis
from services.executor.config import ExecutorConfig
from services.executor.service import ExecutorService


@pytest.fixture
def namespace() -> str:
    return f"prof-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def start_executor(
    redis_server: EmbeddedRedis, namespace: str
) -> AsyncIterator[StartExecutor]:
    """`await start_executor(noise_cv=..., seed=...)`: a started emulated
    executor running `true_profile()`; all are stopped after the test."""
    started: list[ExecutorService] = []

    async def start(noise_cv: float = NOISE_CV, seed: int = 7) -> ExecutorService:
        config = ExecutorConfig(
            node_id=0,
            redis_url=redis_server.url,
            namespace=namespace,
            latency_noise_cv=noise_cv,
            seed=seed,
            heartbeat_s=0.2,
            shutdown_grace_s=0.1,
        )
        service = ExecutorService(config, profile=true_profile())
        started.append(service)
        await service.start()
        return service

    try:
        yield start
    finally:
        for service in started:
            await service.stop(grace_s=0.1)


@pytest.fixture
async def executor(start_executor: StartExecutor) -> ExecutorService:
    """An emulated executor with latency noise of CV `NOISE_CV`."""
    return await start_executor()
