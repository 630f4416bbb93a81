"""`Store`: the typed Redis operations of the LeMix services (async, `redis.asyncio`).

One `Store` wraps a client created with ``decode_responses=True`` and a
`RedisKeys`. Services call its methods and never spell a key or a command.
Its methods live by concern, one mixin module each: `intake`, `tasks`,
`fencing`, `outputs`, `events`, `cluster` (the Lua sources in `scripts`; what
the fields hold in `codec`, `task_hash`, `messages` and `heartbeat`).

Rules it keeps (STYLE.md, "Redis hygiene", arq as the model):

- Every task is keyed by id. `submit_task` is idempotent (a dedupe key set in
  the same Lua script as the XADD); `finish_task` happens once per task (a
  second call is a no-op), and `set_task_state` cannot overwrite a final state,
  so a redelivered task cannot publish two results.
- A result and the state that records it are written in one Lua script
  (`finish_task`); a task's dedupe marker, its hash and its intake entry too
  (`submit_tasks`). Readers never see one half.
- Hot paths take one round trip: `append_outputs_batch` pipelines a whole
  executor iteration's tokens (`append_outputs_fenced`, the executor's, does
  it in one script call, fenced by attempt).
- Every public operation counts its Redis failures in
  ``lemix_redis_errors_total{op=<method>}``.

The store assumes one Redis instance (no cluster): scripts touch several keys.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import RedisError

from lemix.infra import telemetry
from lemix.infra.store.cluster import ClusterOps
from lemix.infra.store.events import EventOps
from lemix.infra.store.fencing import FencingOps
from lemix.infra.store.intake import IntakeOps
from lemix.infra.store.outputs import OutputOps
from lemix.infra.store.tasks import TaskOps

_C = TypeVar("_C", bound=type)


def _counted(op: str, method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(method)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await method(*args, **kwargs)
        except (RedisError, OSError):
            telemetry.observe_redis_error(op)
            raise

    return wrapper


def _count_redis_errors(cls: _C) -> _C:
    """Every public async method, its mixins' included, counts its Redis
    failures in `lemix_redis_errors_total{op=<method>}`: the store's one
    error path."""
    for name, member in inspect.getmembers(cls, inspect.iscoroutinefunction):
        if not name.startswith("_"):
            setattr(cls, name, _counted(name, member))
    return cls


@_count_redis_errors
class Store(IntakeOps, TaskOps, FencingOps, OutputOps, EventOps, ClusterOps):
    """The services' Redis operations, over a ``decode_responses=True`` client.

    ``Store(client, keys=None, *, output_maxlen=OUTPUT_MAXLEN,
    dedupe_ttl_s=DEDUPE_TTL_S)`` (`base.StoreBase`): `output_maxlen`
    approximately caps each output stream; `dedupe_ttl_s` is how long a
    submitted task id is remembered by `submit_task`.
    """
