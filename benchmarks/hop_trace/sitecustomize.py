"""Hop tracing for benchmarks/lone_request.py: measurement only, never shipped.

Put this directory first on PYTHONPATH of the stack's processes (the launcher
passes the environment on) with LEMIX_HOP_TRACE_DIR set: Python imports this
`sitecustomize` at start-up, and it wraps a few functions on the request path,
once their modules are imported, to append ``epoch_s pid label detail`` lines
to ``$LEMIX_HOP_TRACE_DIR/<pid>.log``. One host, so one clock for every process.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import time
from typing import Any

_DIR = os.environ.get("LEMIX_HOP_TRACE_DIR", "")


def _tid(obj: Any) -> str:
    for path in ("task_id", "task.task_id", "placement.task_id"):
        value: Any = obj
        for part in path.split("."):
            value = getattr(value, part, None)
        if isinstance(value, str):
            return value
    return ""


def _detail(label: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    if label == "settle":  # the replay client's own times, in epoch s
        record, t0 = args[0].record, kwargs["t0_epoch_s"]
        first = "" if record.first_token_s is None else f"{t0 + record.first_token_s:.6f}"
        return f"{record.task_id} {t0 + record.arrival_s:.6f} {first}"
    if label == "_generate":  # the replay client starts a request's call
        return str(args[2].record.task_id)
    if label == "GatewayServicer.Generate":
        return str(args[1].request_id)
    if label.startswith("StreamLeases.take"):
        return str(args[1])
    if label == "OutputStream.__init__":
        return str(args[1])
    if label == "OutputStream.on_message":
        return str(args[0].task_id)
    if label.endswith("_handle_intake"):
        return ",".join(f.get("task_id", "?") for _, f in args[1])
    if label.endswith("._run_stage"):
        start = args[1]
        return f"stage={start.stage} kind={start.kind} dur_s={start.duration_s:.6f}"
    if label.endswith(".write"):
        return ",".join(type(o).__name__ + ":" + _tid(o) for _, o in args[1])
    if label.endswith(".deliver"):
        return f"{args[0].task_id} n={len(args[1])}"
    if label.endswith(".Dispatch") or label == "ExecutorServicer._dispatch":
        return args[1].task.task_id
    if label == "GatewayCore._submit":  # its tasks: (task, payload) pairs
        return ",".join(task.task_id for task, _ in args[1])
    for arg in args[1:]:
        if _tid(arg):
            return _tid(arg)
    return ""


class _Log:
    file: Any = None

    @classmethod
    def line(cls, label: str, detail: str) -> None:
        if cls.file is None:
            cls.file = open(os.path.join(_DIR, f"{os.getpid()}.log"), "a", buffering=1)  # noqa: SIM115
        cls.file.write(f"{time.time():.6f} {os.getpid()} {label} {detail}\n")


def _wrap(label: str, fn: Any) -> Any:
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def traced_gen(*args: Any, **kwargs: Any) -> Any:
            _Log.line(label, _detail(label, args, kwargs))
            async with contextlib.aclosing(fn(*args, **kwargs)) as gen:
                async for item in gen:
                    yield item

        return traced_gen
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            detail = _detail(label, args, kwargs)
            _Log.line(label + ">", detail)
            try:
                return await fn(*args, **kwargs)
            finally:
                _Log.line(label + "<", detail)

        return traced_async

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        _Log.line(label, _detail(label, args, kwargs))
        return fn(*args, **kwargs)

    return traced


TARGETS: dict[str, list[tuple[str | None, str]]] = {
    "gateway.core": [("GatewayCore", "_require_live_stack"), ("GatewayCore", "_submit")],
    "gateway.reader": [("Follower", "deliver")],
    "gateway.convert": [("OutputStream", "__init__"), ("OutputStream", "on_message")],
    "lemix.harness.task_watch": [(None, "settle")],
    "lemix.harness.replay": [(None, "_generate")],
    "gateway.servicer": [("GatewayServicer", "Generate")],
    "gateway.upkeep": [("StreamLeases", "take")],
    "services.scheduler.service": [
        ("SchedulerService", "submit"),
        ("SchedulerService", "_handle_intake"),
    ],
    "services.scheduler.core": [("SchedulerCore", "on_tasks")],
    "services.scheduler.core_base": [("CoreBase", "_plan"), ("CoreBase", "_flush_writes")],
    "services.scheduler.placing": [("Placing", "_dispatch"), ("Placing", "_begin_attempts")],
    "services.scheduler.adapters": [("GrpcDispatcher", "dispatch"), ("RedisEventSink", "flush")],
    "lemix.infra.store.intake": [("IntakeOps", "accept_intake"), ("IntakeOps", "ack_intake")],
    "services.executor.servicer": [("ExecutorServicer", "_dispatch")],
    "services.executor.driver": [("NodeDriver", "add_task"), ("NodeDriver", "_run_stage")],
    "services.executor.sink": [("RedisOutcomeSink", "write")],
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, name: str) -> None:
        self.inner, self.name = inner, name

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        for cls_name, name in TARGETS[self.name]:
            if cls_name is None:  # a module-level function
                setattr(module, name, _wrap(name, getattr(module, name)))
                continue
            cls = getattr(module, cls_name)
            # getattr, not the class's own dict: a method a mixin defines
            # (`SchedulerService._handle_intake`) is wrapped on the class named.
            setattr(cls, name, _wrap(f"{cls_name}.{name}", getattr(cls, name)))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, name)
        return spec


if _DIR:
    sys.meta_path.insert(0, _Finder())
