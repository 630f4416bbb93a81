"""Algorithm 3 admission (`lemix.batching.admit`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lemix.batching import Admission, BatchingConfig, admit


def test_config_validates() -> None:
    with pytest.raises(ValueError):
        BatchingConfig(max_batch_size=0)
    with pytest.raises(ValueError):
        BatchingConfig(join_window_s=-0.1)
    assert BatchingConfig(max_batch_size=1, join_window_s=0.0).join_window_s == 0.0


def test_cap_c_limits_the_running_batch() -> None:
    config = BatchingConfig(max_batch_size=4)
    assert admit(config, 1, 0.0, 5, 1.0) == Admission(3, 0.0, "batch-full")
    assert admit(config, 4, 0.0, 2, 1.0) == Admission(0, 0.0, "batch-full")
    assert admit(config, 0, 0.0, 4, 1.0) == Admission(4, 1.0, "")


def test_nothing_waiting_admits_nothing() -> None:
    assert admit(BatchingConfig(max_batch_size=4), 2, 0.5, 0, 1.0) == Admission(0, 0.5, "")


def test_join_window_allows_joins_while_start_plus_window_is_after_now() -> None:
    config = BatchingConfig(max_batch_size=8, join_window_s=0.5)
    # T_start = 10.0: joins allowed while 10.5 > now.
    assert admit(config, 2, 10.0, 3, 10.4) == Admission(3, 10.0, "")
    assert admit(config, 2, 10.0, 3, 10.5) == Admission(0, 10.0, "window")
    assert admit(config, 2, 10.0, 3, 11.0) == Admission(0, 10.0, "window")


def test_empty_batch_resets_the_window_start() -> None:
    config = BatchingConfig(max_batch_size=8, join_window_s=0.5)
    # The batch emptied: T_start = now = 20.0 even though the old start was 10.0.
    assert admit(config, 0, 10.0, 3, 20.0) == Admission(3, 20.0, "")
    # The reset happens also when nobody waits.
    assert admit(config, 0, 10.0, 0, 20.0) == Admission(0, 20.0, "")


def test_zero_window_still_starts_an_empty_batch_with_one_request() -> None:
    # T_w = 0: T_start + 0 > now never holds, but an empty batch must make progress.
    config = BatchingConfig(max_batch_size=8, join_window_s=0.0)
    assert admit(config, 0, 0.0, 3, 5.0) == Admission(1, 5.0, "window")


def test_no_window_admits_at_any_iteration_boundary() -> None:
    config = BatchingConfig(max_batch_size=8, join_window_s=None)
    assert admit(config, 3, 0.0, 2, 1_000.0) == Admission(2, 0.0, "")


def _checks(answers: list[bool], calls: list[int]) -> list[Callable[[], bool]]:
    def make(i: int) -> Callable[[], bool]:
        def check() -> bool:
            calls.append(i)
            return answers[i]

        return check

    return [make(i) for i in range(len(answers))]


def test_memory_check_stops_at_the_first_request_that_does_not_fit() -> None:
    calls: list[int] = []
    checks = _checks([True, True, False, True], calls)
    result = admit(BatchingConfig(max_batch_size=8), 0, 0.0, checks, 1.0)
    assert result == Admission(2, 1.0, "memory")
    # FIFO: the fourth request (which would fit) is never even asked.
    assert calls == [0, 1, 2]


def test_memory_checks_are_not_called_past_the_cap_or_the_window() -> None:
    calls: list[int] = []
    result = admit(BatchingConfig(max_batch_size=3), 1, 0.0, _checks([True] * 4, calls), 1.0)
    assert result == Admission(2, 0.0, "batch-full")
    assert calls == [0, 1]
    calls.clear()
    config = BatchingConfig(max_batch_size=8, join_window_s=0.5)
    result = admit(config, 1, 0.0, _checks([True] * 4, calls), 1.0)
    assert result == Admission(0, 0.0, "window")
    assert calls == []


def test_all_memory_checks_pass() -> None:
    calls: list[int] = []
    result = admit(BatchingConfig(max_batch_size=8), 2, 0.0, _checks([True] * 3, calls), 1.0)
    assert result == Admission(3, 0.0, "")
    assert calls == [0, 1, 2]
