"""The executor's real-time driver around the node engine (emulated backend)."""

from __future__ import annotations

import asyncio

from factories import make_profile, make_request, make_training

from lemix.engine import EngineConfig, Failed, Finished, FirstToken, NodeEngine, TokensEmitted
from services.executor.backends import EmulatedBackend
from services.executor.driver import PLACED_WRITE_DELAY_S, NodeDriver, Placed

TIME_SCALE = 0.01  # 100x faster than the profile: the test stays short


class ListSink:
    def __init__(self) -> None:
        self.batches: list[list] = []
        self.done = asyncio.Event()
        self.expect: set[str] = set()

    async def write(self, batch: list) -> None:
        self.batches.append(batch)
        for _, outcome in batch:
            if isinstance(outcome, Finished | Failed):
                self.expect.discard(outcome.task_id)
        if not self.expect:
            self.done.set()

    def outcomes(self) -> list:
        return [o for batch in self.batches for _, o in batch]


def make_driver(sink: ListSink) -> NodeDriver:
    profile = make_profile()
    engine = NodeEngine(0, profile, profile.ours, EngineConfig(emit_tokens=True))
    return NodeDriver(engine, EmulatedBackend(), sink, time_scale=TIME_SCALE)


async def test_request_streams_every_token_then_finishes() -> None:
    sink = ListSink()
    sink.expect = {"r", "t"}
    driver = make_driver(sink)
    await driver.start()
    driver.add_task(make_request("r", 0.0, 50, 5))
    driver.add_task(make_training("t", 0.0, 40))
    await asyncio.wait_for(sink.done.wait(), timeout=10)
    await driver.stop()
    outcomes = sink.outcomes()
    first = [o for o in outcomes if isinstance(o, FirstToken)]
    tokens = [
        n
        for o in outcomes
        if isinstance(o, TokensEmitted)
        for tid, n in zip(o.task_ids, o.num_generated, strict=True)
        if tid == "r"
    ]
    finished = {o.task_id: o for o in outcomes if isinstance(o, Finished)}
    assert [o.task_id for o in first] == ["r"]
    assert tokens == [2, 3, 4, 5]  # the first token came with the prefill
    assert finished["r"].num_output_tokens == 5
    assert "t" in finished and driver.engine.num_training_updates == 1
    assert driver.engine.is_idle
    assert all(
        driver.engine.memory.used_bytes(s) == driver.engine.memory._static[s] for s in range(2)
    )


async def test_cancel_frees_the_request_and_reports_it() -> None:
    sink = ListSink()
    sink.expect = {"long"}
    driver = make_driver(sink)
    await driver.start()
    driver.add_task(make_request("long", 0.0, 50, 10_000))
    # Its KV could never fit make_profile()'s memory: it waits until cancelled.
    assert [r.task.task_id for r in driver.engine.waiting] == ["long"]
    assert driver.cancel("long")
    await asyncio.wait_for(sink.done.wait(), timeout=10)
    await driver.stop()
    failed = [o for o in sink.outcomes() if isinstance(o, Failed)]
    assert [o.task_id for o in failed] == ["long"]
    assert failed[0].reason.startswith("CANCELLED")
    assert not driver.engine.memory.holds("long")
    assert not driver.cancel("long")  # unknown now


async def test_a_placement_rides_on_the_tasks_first_write_or_goes_alone_after_a_delay() -> None:
    sink = ListSink()
    sink.expect = {"r"}
    driver = make_driver(sink)
    await driver.start()
    driver.note_placed("r", 1.5)
    driver.add_task(make_request("r", 0.0, 50, 2))
    await asyncio.wait_for(sink.done.wait(), timeout=10)
    first = sink.batches[0]
    # The placement went with the task's first outcomes, ahead of them.
    assert first[0][1] == Placed("r", 1.5) and isinstance(first[1][1], FirstToken)
    # A node with nothing else to write writes a placement on its own, once
    # PLACED_WRITE_DELAY_S passed: never held until some later outcome.
    num_batches = len(sink.batches)
    driver.note_placed("stuck", 2.5)
    await asyncio.sleep(PLACED_WRITE_DELAY_S / 2)
    assert len(sink.batches) == num_batches
    for _ in range(100):
        if len(sink.batches) > num_batches:
            break
        await asyncio.sleep(PLACED_WRITE_DELAY_S / 5)
    assert [item for _, item in sink.batches[num_batches]] == [Placed("stuck", 2.5)]
    await driver.stop()
