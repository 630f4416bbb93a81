"""lemix.stack.supervisor: the backoff and give-up bookkeeping (pure, explicit times),
and `supervise` driving a stand-in child (real processes: tests/test_launcher.py)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from lemix.stack.supervisor import CrashHistory, RestartPolicy, describe_exit, supervise

POLICY = RestartPolicy(
    initial_backoff_s=0.5, max_backoff_s=4.0, reset_after_s=30.0, max_crashes=5, crash_window_s=60.0
)


def test_backoff_doubles_per_crash_in_a_row_up_to_the_cap() -> None:
    history = CrashHistory(POLICY)
    history.on_start(0.0)
    delays = []
    now_s = 0.0
    for _ in range(4):
        now_s += 10.0  # up 10 s each time: less than reset_after_s
        delays.append(history.on_crash(now_s))
        history.on_start(now_s)
    assert delays == [0.5, 1.0, 2.0, 4.0]
    now_s += 10.0
    assert history.on_crash(now_s) is None  # the 5th within 60 s (crashes at 10..50 s)


def test_a_long_uptime_starts_a_new_series() -> None:
    history = CrashHistory(POLICY)
    history.on_start(0.0)
    assert history.on_crash(1.0) == 0.5
    history.on_start(1.5)
    assert history.on_crash(2.0) == 1.0
    history.on_start(3.0)
    assert history.on_crash(3.0 + POLICY.reset_after_s) == 0.5  # up 30 s: back to the start


def test_crashes_outside_the_window_do_not_count_toward_giving_up() -> None:
    policy = RestartPolicy(
        initial_backoff_s=0.1, max_backoff_s=0.1, max_crashes=3, crash_window_s=60.0
    )
    history = CrashHistory(policy)
    for at_s in (0.0, 50.0, 100.0, 150.0, 200.0):  # never 3 within 60 s
        assert history.on_crash(at_s) == 0.1
    assert history.num_recent_crashes == 2
    assert history.on_crash(201.0) is None  # 150, 200, 201


def test_a_failed_restart_is_not_uptime() -> None:
    history = CrashHistory(POLICY)
    history.on_start(0.0)
    assert history.on_crash(100.0) == 0.5  # a long uptime, then a crash
    assert history.on_crash(200.0) == 1.0  # the restart never came up: still in a row


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_backoff_s": 0.0},
        {"initial_backoff_s": 2.0, "max_backoff_s": 1.0},
        {"max_crashes": 0},
        {"crash_window_s": 0.0},
        {"reset_after_s": -1.0},
    ],
)
def test_policy_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]


def test_exit_statuses_read_as_a_person_would() -> None:
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(3) == "exit code 3"


class _Child:
    """Stands in for a process: exits at once with `codes` in turn; a restart
    fails when its number is in `failing_restarts`."""

    name = "worker"
    log_path = Path("/logs/worker.log")

    def __init__(self, codes: list[int], failing_restarts: frozenset[int] = frozenset()) -> None:
        self.codes = codes
        self.failing_restarts = failing_restarts
        self.num_restart_calls = 0
        self.running = asyncio.Event()

    async def wait_exit(self) -> int:
        if not self.codes:
            await asyncio.Event().wait()  # runs until cancelled
        return self.codes.pop(0)

    async def restart(self) -> None:
        self.num_restart_calls += 1
        if self.num_restart_calls in self.failing_restarts:
            raise RuntimeError("port taken")


async def test_supervise_restarts_until_the_crash_loop_then_gives_up() -> None:
    policy = RestartPolicy(
        initial_backoff_s=0.001, max_backoff_s=0.002, max_crashes=3, crash_window_s=60.0
    )
    child = _Child([1, -signal.SIGKILL, 2, 0], failing_restarts=frozenset({2}))
    reports: list[str] = []
    message = await asyncio.wait_for(supervise(child, policy, reports.append), 10)
    assert message == (
        "worker crashed 3 times within 60 s (last: exit code 2); giving up; "
        "see its log /logs/worker.log"
    )
    assert child.num_restart_calls == 2 and child.codes == [0]
    assert reports[0] == (
        "worker exited (exit code 1); restarting in 0.001 s; log: /logs/worker.log"
    )
    assert "worker did not restart: port taken" in reports
    assert reports[-1] == message


async def test_a_cancelled_supervisor_restarts_nothing() -> None:
    child = _Child([])
    task = asyncio.create_task(supervise(child, POLICY, lambda _: None))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert child.num_restart_calls == 0
