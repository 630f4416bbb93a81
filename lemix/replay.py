"""`lemix replay`: an open-loop load generator against a running gateway.

Tasks come from the same workload builders as the simulator (Poisson or an
Azure-format trace, time-scaled; training at a training rate), so a live run
and `lemix sim` can be compared on one workload. Each task is fired at its
arrival time whether or not earlier ones finished (open loop); latencies are
measured here, on this process's monotonic clock: TTFT at the first streamed
message, TBT between later ones, E2E at the last. Every task ends with a
status: completed, rejected (the gateway refused it, with its status code) or
failed (anything else, with the reason). Training tasks count as completed
when the gateway's stats say the cluster finished them.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from lemix._proto.lemix.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from lemix.metrics import summarize
from lemix.rpc.client import channel
from lemix.types import Task, TaskRecord, TaskStatus

# Refusals decided before any work ran count as rejections, not failures.
_REJECT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.UNAVAILABLE}
_DUMMY_TOKEN_ID = 100  # the emulated backend only needs the prompt's length

# (query, reference) text of a task, for a stack that runs a real model; None:
# send dummy token ids of the task's length (all the emulated backend needs).
TextFor = Callable[[Task], tuple[str, str] | None]


@dataclass(frozen=True)
class ReplayConfig:
    target: str
    request_deadline_s: float = 600.0
    drain_timeout_s: float = 120.0  # after the last arrival, wait this long for stragglers
    slo_ttft_s: float = 1.0
    slo_tbt_s: float = 0.1
    show_progress: bool = True
    text_for: TextFor | None = None

    def __post_init__(self) -> None:
        if ":" not in self.target:
            raise ValueError(f"--target must be HOST:PORT, got {self.target!r}")
        if self.request_deadline_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("deadlines must be positive")


class _Progress:
    def __init__(self, total: int, is_enabled: bool) -> None:
        self.total = total
        self.done = 0
        self.is_enabled = is_enabled and sys.stderr.isatty()
        self._last = 0.0

    def tick(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.is_enabled and (now - self._last > 0.2 or self.done == self.total):
            self._last = now
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def _generate(stub: gateway_pb2_grpc.GatewayStub, task: Task, record: TaskRecord,
                    t0: float, config: ReplayConfig) -> None:
    request = gateway_pb2.GenerateRequest(
        request_id=task.task_id,
        max_tokens=task.max_output_tokens,
        # Fixed output lengths, so runs under different policies do equal work.
        sampling=common_pb2.SamplingParams(ignore_eos=True),
    )
    text = config.text_for(task) if config.text_for is not None else None
    if text is None:
        request.prompt_token_ids.extend([_DUMMY_TOKEN_ID] * task.num_prompt_tokens)
    else:
        request.prompt, request.reference = text
    try:
        async for message in stub.Generate(request, timeout=config.request_deadline_s):
            now = time.monotonic() - t0
            if record.first_token_s is None:
                record.first_token_s = now
                record.node_id = message.node_id
            record.num_output_tokens = max(record.num_output_tokens, message.num_output_tokens)
            if message.is_finished:
                record.finish_s = now
                record.status = TaskStatus.COMPLETED
                if text is not None and text[1]:
                    record.inference_loss = message.inference_loss
    except grpc.aio.AioRpcError as err:
        record.finish_s = time.monotonic() - t0
        is_refused = err.code() in _REJECT_CODES and record.first_token_s is None
        record.status = TaskStatus.REJECTED if is_refused else TaskStatus.FAILED
        record.reason = f"{err.code().name}: {err.details()}"
        return
    if record.status is None:
        record.status = TaskStatus.FAILED
        record.reason = "stream ended without a final message"
        record.finish_s = time.monotonic() - t0


async def _train(stub: gateway_pb2_grpc.GatewayStub, task: Task, record: TaskRecord,
                 t0: float, config: ReplayConfig) -> None:
    text = config.text_for(task) if config.text_for is not None else None
    if text is None:
        samples = [gateway_pb2.TrainSample(sample_id=f"{task.task_id}-{i}",
                                           token_ids=[_DUMMY_TOKEN_ID] * task.num_prompt_tokens)
                   for i in range(task.batch_size)]
    else:  # a real model trains on one text sample per task
        samples = [gateway_pb2.TrainSample(sample_id=f"{task.task_id}-0", query=text[0],
                                           reference=text[1])]
    request = gateway_pb2.TrainRequest(samples=samples, batch_size=len(samples))
    try:
        await stub.Train(request, timeout=config.request_deadline_s)
        record.placed_s = time.monotonic() - t0  # durable; completion comes from stats
    except grpc.aio.AioRpcError as err:
        is_refused = err.code() in _REJECT_CODES
        record.status = TaskStatus.REJECTED if is_refused else TaskStatus.FAILED
        record.reason = f"{err.code().name}: {err.details()}"
        record.finish_s = time.monotonic() - t0


async def _fire_all(stub: gateway_pb2_grpc.GatewayStub, tasks: Sequence[Task],
                    records: dict[str, TaskRecord], config: ReplayConfig) -> float:
    progress = _Progress(len(tasks), config.show_progress)
    t0 = time.monotonic()
    running: set[asyncio.Task[None]] = set()
    for task in tasks:
        delay = task.arrival_s - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        record = records[task.task_id]
        call = _train if task.is_training else _generate
        job = asyncio.create_task(call(stub, task, record, t0, config))
        running.add(job)
        job.add_done_callback(running.discard)
        job.add_done_callback(lambda _: progress.tick())
    if running:
        await asyncio.wait(running, timeout=config.request_deadline_s)
    for job in running:
        job.cancel()
    return t0


async def _training_done(stub: gateway_pb2_grpc.GatewayStub) -> int:
    stats = await stub.GetStats(gateway_pb2.GetStatsRequest(), timeout=10.0)
    return int(stats.num_completed_training)


async def run_replay(config: ReplayConfig, tasks: Sequence[Task], *, request_rate: float,
                     train_rate: float, duration_s: float, seed: int,
                     label: str = "live",
                     records_out: list[TaskRecord] | None = None) -> dict[str, Any]:
    """Replay `tasks` against the gateway; return the DESIGN.md metrics object."""
    records = {t.task_id: TaskRecord(t.task_id, t.kind, t.arrival_s, t.num_prompt_tokens,
                                     t.max_output_tokens, t.batch_size) for t in tasks}
    async with channel(config.target) as chan:
        stub = gateway_pb2_grpc.GatewayStub(chan)
        base_training = await _training_done(stub)
        t0 = await _fire_all(stub, tasks, records, config)
        training = [r for r in records.values() if r.kind.value == "training" and r.status is None]
        deadline = time.monotonic() + config.drain_timeout_s
        num_done = 0
        while training and time.monotonic() < deadline:
            num_done = await _training_done(stub) - base_training
            if num_done >= len(training):
                break
            await asyncio.sleep(0.2)
        # The cluster reports counts, not ids: mark that many training tasks done.
        for i, record in enumerate(sorted(training, key=lambda r: r.arrival_s)):
            if i < num_done:
                record.status = TaskStatus.COMPLETED
            else:
                record.status = TaskStatus.FAILED
                record.reason = f"not finished within the {config.drain_timeout_s:g} s drain"
            record.finish_s = time.monotonic() - t0
    finished = [r.finish_s for r in records.values() if r.finish_s is not None]
    if records_out is not None:
        records_out.extend(records.values())
    return summarize(
        list(records.values()), policy=label, seed=seed, request_rate=request_rate,
        train_rate=train_rate, duration_s=duration_s, makespan_s=max(finished, default=0.0),
        slo_ttft_s=config.slo_ttft_s, slo_tbt_s=config.slo_tbt_s, utilization=0.0,
        decision_latency_us=[], node_active_spans_s=[],
    )
