"""`lemix replay`: an open-loop load generator against a running gateway.

Tasks come from the same workload builders as the simulator (Poisson or an
Azure-format trace, time-scaled; training at a training rate), so a live run
and `lemix sim` can be compared on one workload. Each task is fired at its
arrival time whether or not earlier ones finished (open loop); latencies are
measured here, on this process's monotonic clock: TTFT at the first streamed
message, TBT between later ones, E2E at the last.

Every task is tracked by its id, never by a counter. Ids are unique per run:
each carries the run's id (`run_id`, 8 hex characters unless given), so
reruns and other seeds never collide with earlier tasks in the same stack.
An inference task ends with its stream: completed, rejected (refused before
it ran, with its status) or failed (with the reason). A training task is
acknowledged with its task ids by Train; once the arrival window has passed
and the inference streams ended, `lemix.harness.task_watch` reads every id's final
state from the gateway (WatchTasks) for up to the drain timeout. A task is
*lost* when it has no final state then: acknowledged but still queued,
placed or running, unknown to a stack that acknowledged it, never answered,
or impossible to look up (the gateway is gone). `num_lost` counts them and
`lost_task_ids` lists them; a gateway that dies mid-run makes its calls fail
with a reason, never this command.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from lemix._proto.lemix.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from lemix.harness.task_watch import TaskWatch, Tracked, settle
from lemix.infra.rpc.client import channel
from lemix.infra.rpc.tls import client_tls
from lemix.reasons import reason_code
from lemix.report.metrics import summarize
from lemix.types import Task, TaskKind, TaskRecord, TaskStatus

# Refusals decided before any work ran count as rejections, not failures.
_REJECT_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
}
_DUMMY_TOKEN_ID = 100  # the emulated backend only needs the prompt's length
RUN_ID_BYTES = 4  # 8 hex characters
MAX_RUN_ID_CHARS = 32
NUM_LOST_SHOWN = 20  # lost ids printed (the JSON lists them all)

# (query, reference) text of a task, for a stack that runs a real model; None:
# send dummy token ids of the task's length (all the emulated backend needs).
TextFor = Callable[[Task], tuple[str, str] | None]


def new_run_id() -> str:
    """A fresh run id: 8 random hex characters."""
    return os.urandom(RUN_ID_BYTES).hex()


@dataclass(frozen=True)
class ReplayConfig:
    target: str
    request_deadline_s: float = 600.0
    # After the last arrival and the last stream, how long to wait for every
    # acknowledged task to reach a final state.
    drain_timeout_s: float = 120.0
    slo_ttft_s: float = 1.0
    slo_tbt_s: float = 0.1
    show_progress: bool = True
    text_for: TextFor | None = None
    run_id: str | None = None  # prefix of every task id; None: `new_run_id()`
    lookup_deadline_s: float = 10.0  # one snapshot call of the final accounting
    tls_ca_file: str = ""  # the CA of a gateway that serves TLS (PEM); "" = plaintext
    api_key: str = field(default="", repr=False)  # a gateway with --api-key; "" = none

    def __post_init__(self) -> None:
        if ":" not in self.target:
            raise ValueError(f"--target must be HOST:PORT, got {self.target!r}")
        if self.request_deadline_s <= 0 or self.drain_timeout_s < 0 or self.lookup_deadline_s <= 0:
            raise ValueError("deadlines must be positive")
        if self.run_id is not None and (
            not self.run_id
            or len(self.run_id) > MAX_RUN_ID_CHARS
            or any(ch.isspace() or not ch.isprintable() for ch in self.run_id)
        ):
            raise ValueError(
                f"run_id must be 1..{MAX_RUN_ID_CHARS} printable characters "
                f"without whitespace, got {self.run_id!r}"
            )


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


def _rpc_reason(err: grpc.aio.AioRpcError) -> str:
    return f"{err.code().name}: {err.details()}"


async def _generate(
    stub: gateway_pb2_grpc.GatewayStub,
    task: Task,
    tracked: Tracked,
    t0: float,
    config: ReplayConfig,
) -> None:
    record = tracked.record
    request = gateway_pb2.GenerateRequest(
        request_id=record.task_id,
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
            if message.request_id and message.request_id != tracked.stack_ids[0]:
                tracked.stack_ids = [message.request_id]  # the id the stack knows it by
            if record.first_token_s is None:
                record.first_token_s = now
                record.node_id = message.node_id
            record.num_output_tokens = max(record.num_output_tokens, message.num_output_tokens)
            if message.is_finished:
                record.finish_s = now
                record.status = TaskStatus.COMPLETED
                if text is not None and text[1]:
                    record.inference_loss = message.inference_loss
                    record.reference_accuracy = message.reference_accuracy
    except grpc.aio.AioRpcError as err:
        record.finish_s = time.monotonic() - t0
        is_refused = err.code() in _REJECT_CODES and record.first_token_s is None
        record.status = TaskStatus.REJECTED if is_refused else TaskStatus.FAILED
        record.reason = _rpc_reason(err)
        return
    if record.status is None:
        record.status = TaskStatus.FAILED
        record.reason = "stream ended without a final message"
        record.finish_s = time.monotonic() - t0


async def _train(
    stub: gateway_pb2_grpc.GatewayStub,
    task: Task,
    tracked: Tracked,
    t0: float,
    config: ReplayConfig,
) -> None:
    record = tracked.record
    text = config.text_for(task) if config.text_for is not None else None
    if text is None:
        samples = [
            gateway_pb2.TrainSample(
                sample_id=f"{record.task_id}-{i}",
                token_ids=[_DUMMY_TOKEN_ID] * task.num_prompt_tokens,
            )
            for i in range(task.batch_size)
        ]
    else:  # a real model trains on one text sample per task
        samples = [
            gateway_pb2.TrainSample(
                sample_id=f"{record.task_id}-0", query=text[0], reference=text[1]
            )
        ]
    request = gateway_pb2.TrainRequest(samples=samples, batch_size=len(samples))
    try:
        reply = await stub.Train(request, timeout=config.request_deadline_s)
    except grpc.aio.AioRpcError as err:
        is_refused = err.code() in _REJECT_CODES
        record.status = TaskStatus.REJECTED if is_refused else TaskStatus.FAILED
        record.reason = _rpc_reason(err)
        record.finish_s = time.monotonic() - t0
        return
    # Durable: the final state comes from the stack, by these ids.
    tracked.stack_ids = list(reply.task_ids)
    tracked.is_acknowledged = True


async def _fire(
    stub: gateway_pb2_grpc.GatewayStub,
    task: Task,
    tracked: Tracked,
    t0: float,
    config: ReplayConfig,
) -> None:
    """One task's call; an unexpected client-side error is recorded, not raised,
    so one broken call never stops the run (the accounting then looks it up)."""
    call = _train if task.is_training else _generate
    try:
        await call(stub, task, tracked, t0, config)
    except Exception as exc:
        tracked.client_error = f"{type(exc).__name__}: {exc}"


async def _fire_all(
    stub: gateway_pb2_grpc.GatewayStub,
    tasks: Sequence[Task],
    tracked: dict[str, Tracked],
    config: ReplayConfig,
    t0: float,
) -> None:
    """Fire every task at `t0` (monotonic) + its arrival time; wait for the
    calls up to the request deadline."""
    progress = _Progress(len(tasks), config.show_progress)
    running: set[asyncio.Task[None]] = set()
    for task in tasks:
        delay = task.arrival_s - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        job = asyncio.create_task(_fire(stub, task, tracked[task.task_id], t0, config))
        running.add(job)
        job.add_done_callback(running.discard)
        job.add_done_callback(lambda _: progress.tick())
    if running:
        await asyncio.wait(running, timeout=config.request_deadline_s)
    for job in list(running):  # never answered: the accounting looks them up
        job.cancel()


def _tracked(task: Task, run_id: str) -> Tracked:
    task_id = f"{run_id}-{task.task_id}"
    record = TaskRecord(
        task_id,
        task.kind,
        task.arrival_s,
        task.num_prompt_tokens,
        task.max_output_tokens,
        task.batch_size,
    )
    # Inference is known by its request id; training by the ids Train returns.
    stack_ids = [task_id] if task.kind is TaskKind.INFERENCE else []
    return Tracked(record, stack_ids)


async def run_replay(
    config: ReplayConfig,
    tasks: Sequence[Task],
    *,
    request_rate: float,
    train_rate: float,
    duration_s: float,
    seed: int,
    label: str = "live",
    records_out: list[TaskRecord] | None = None,
) -> dict[str, Any]:
    """Replay `tasks` against the gateway; return the DESIGN.md metrics object,
    plus `run_id` and `lost_task_ids` (every lost task's id)."""
    run_id = config.run_id or new_run_id()
    tracked = {task.task_id: _tracked(task, run_id) for task in tasks}
    credentials = client_tls(config.tls_ca_file) if config.tls_ca_file else None
    async with channel(config.target, credentials=credentials, api_key=config.api_key) as chan:
        stub = gateway_pb2_grpc.GatewayStub(chan)
        # One time origin on both clocks: the stack stamps task times in epoch s.
        t0, t0_epoch_s = time.monotonic(), time.time()
        await _fire_all(stub, tasks, tracked, config, t0)
        watch = TaskWatch(stub, lookup_deadline_s=config.lookup_deadline_s)
        await watch.run(
            list(tracked.values()), deadline_s=time.monotonic() + config.drain_timeout_s
        )
    end_s = time.monotonic() - t0
    lost_ids: list[str] = []
    for item in tracked.values():
        lost_ids.extend(settle(item, watch, t0_epoch_s=t0_epoch_s, end_s=end_s))
    records = [item.record for item in tracked.values()]
    finished = [r.finish_s for r in records if r.finish_s is not None]
    if records_out is not None:
        records_out.extend(records)
    metrics = summarize(
        records,
        policy=label,
        seed=seed,
        request_rate=request_rate,
        train_rate=train_rate,
        duration_s=duration_s,
        makespan_s=max(finished, default=0.0),
        slo_ttft_s=config.slo_ttft_s,
        slo_tbt_s=config.slo_tbt_s,
        utilization=0.0,
        decision_latency_us=[],
        node_active_spans_s=[],
    )
    metrics["run_id"] = run_id
    metrics["lost_task_ids"] = lost_ids
    metrics["end_reasons"] = end_reasons(records)
    return metrics


def end_reasons(records: Sequence[TaskRecord]) -> dict[str, dict[str, Any]]:
    """Tasks that did not complete, by "<status> <CODE>" (the reason's status
    code): how many, and the first one's reason as an example."""
    out: dict[str, dict[str, Any]] = {}
    for record in records:
        if record.status is None or record.status is TaskStatus.COMPLETED:
            continue  # completed; or lost, which `lost_task_ids` lists by id
        code = reason_code(record.reason)
        key = f"{record.status.value} {code.value if code is not None else 'UNKNOWN'}"
        entry = out.setdefault(key, {"count": 0, "example": record.reason})
        entry["count"] += 1
    return dict(sorted(out.items()))


def format_lost(metrics: dict[str, Any], limit: int = NUM_LOST_SHOWN) -> str:
    """The run id line, why tasks did not complete (count and an example per
    status and code), and the lost task ids (the first `limit`), for the console."""
    lines = [f"run id: {metrics.get('run_id', '?')}"]
    reasons = metrics.get("end_reasons") or {}
    if reasons:
        lines.append("not completed, by reason:")
        lines.extend(
            f"  {key}: {entry['count']} (e.g. {entry['example']!r})"
            for key, entry in reasons.items()
        )
    lost = list(metrics.get("lost_task_ids") or [])
    if lost:
        more = f" (first {limit}; all in the JSON)" if len(lost) > limit else ""
        lines.append(f"lost tasks: {len(lost)}{more}")
        lines.extend(f"  {task_id}" for task_id in lost[:limit])
    return "\n".join(lines)
