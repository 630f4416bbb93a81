"""Continuous batching (Algorithm 3) as a pure admission rule.

At each iteration boundary a node forms its next iteration from the running
batch plus newly admitted prefills. New requests join while the batch has room
(`max_batch_size`, C), memory admits their KV, and — when a join window T_w is
set — while `T_start + T_w > now`, where T_start is when the current batch
began (reset whenever it empties). Training tasks are never mixed into an
inference batch: they are separate work items.

`join_window_s=None` admits at every iteration boundary (what vLLM and SGLang
do); a finite T_w reproduces the paper's Algorithm 3 exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchingConfig:
    max_batch_size: int = 64  # C
    join_window_s: float | None = None  # T_w; None = join at any iteration boundary

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.join_window_s is not None and self.join_window_s < 0:
            raise ValueError("join_window_s must be >= 0 or None")


@dataclass(frozen=True, slots=True)
class Admission:
    """The result of one admission round."""

    num_admitted: int  # how many from the head of the waiting queue join
    batch_start_s: float  # T_start after this round
    blocked_by: str  # "" | "batch-full" | "window" | "memory"


def admit(
    config: BatchingConfig,
    num_running: int,
    batch_start_s: float,
    waiting_kv_fits: Sequence[Callable[[], bool]] | int,
    now_s: float,
) -> Admission:
    """Decide how many waiting requests (FIFO) join the next iteration.

    `waiting_kv_fits` is either the number of waiting requests (no memory
    check) or one callable per waiting request, in order, that reserves its KV
    and returns True, or returns False without reserving when it does not fit.
    Admission stops at the first request that cannot join, keeping FIFO order.
    """
    if num_running == 0:
        batch_start_s = now_s  # an empty batch starts a new window
    checks = waiting_kv_fits if not isinstance(waiting_kv_fits, int) else None
    num_waiting = waiting_kv_fits if isinstance(waiting_kv_fits, int) else len(waiting_kv_fits)
    num_admitted = 0
    blocked_by = ""
    while num_admitted < num_waiting:
        if num_running + num_admitted >= config.max_batch_size:
            blocked_by = "batch-full"
            break
        window = config.join_window_s
        if (
            window is not None
            and num_running + num_admitted > 0
            and not (batch_start_s + window > now_s)
        ):
            blocked_by = "window"
            break
        if checks is not None and not checks[num_admitted]():
            blocked_by = "memory"
            break
        num_admitted += 1
    return Admission(num_admitted, batch_start_s, blocked_by)
