"""An `OutcomeSink` for executor tests: records each task's end and, given a
backend, what the Redis sink would read from it at write time."""

from __future__ import annotations

import asyncio
from typing import Any

from lemix.engine import Failed, Finished
from lemix.outputs import TokenLogprob


class RecordingSink:
    """Records outcomes; with `backend`, also each ended task's output ids,
    prompt logprobs and end fields, read when the end is written (as the Redis
    sink does, before the node forgets the task)."""

    def __init__(self, backend: Any = None) -> None:
        self.backend = backend
        self.ended: dict[str, Finished | Failed] = {}
        self.ids: dict[str, list[int]] = {}
        self.prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        self.end_fields: dict[str, dict] = {}
        self.changed = asyncio.Event()

    async def write(self, batch: list) -> None:
        for _, outcome in batch:
            if not isinstance(outcome, Finished | Failed):
                continue
            key = outcome.task_id
            self.ended[key] = outcome
            if self.backend is not None:
                self.ids[key] = list(self.backend.output_ids(key))
                self.prompt_logprobs[key] = list(self.backend.prompt_logprobs(key))
                self.end_fields[key] = self.backend.end_fields(key)
        self.changed.set()

    async def wait_for(self, ids: set[str], timeout_s: float = 60.0) -> None:
        """Until every task in `ids` has ended (TimeoutError after `timeout_s`)."""

        async def loop() -> None:
            while not ids <= set(self.ended):
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(loop(), timeout_s)
