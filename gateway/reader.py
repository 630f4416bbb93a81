"""`OutputReader`: ONE blocking XREAD for every output stream a gateway serves.

A request's stream used to be read by its own blocking XREAD, so every open
stream held a pooled Redis connection and cost a round trip per wake. Here
one loop reads all of them at once (`Store.read_outputs`) and hands each
request's entries to its `Follower`; requests wait on the follower, not on
Redis.

Adding a stream while the read blocks: the read would not see it until it
returns. So whoever adds one while the loop is blocked (`is_waiting`) appends
to this gateway's wake stream (`RedisKeys.reader_wake`, sent in the round
trip that writes the task to the intake, `GatewayHold.is_wake`); the read includes that
stream from its last seen entry, so a wake written before the read arrives is
not missed either. The loop then reads again with the new set. One wake per
blocked read is enough (`claim_wake`): a burst of new streams costs one extra
read, not one each. A read blocks at most `block_s` (callers cap it near a
second), so even a wake lost with a failed round trip delays the
streams added meanwhile by at most that long.

A Redis error in the loop is logged and the read retried with backoff, from
each follower's last entry (nothing skipped or repeated); a follower waits
up to its idle timeout and then learns whether Redis was failing
(`last_error`).
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from redis.exceptions import RedisError

from lemix.infra.store.codec import Entry
from lemix.infra.store.store import Store
from lemix.infra.store.task_hash import IS_FINAL_FIELD

log = structlog.get_logger(__name__)

# After a Redis error the read is retried after this long, doubling up to the cap.
RETRY_BASE_S = 0.05
RETRY_CAP_S = 1.0
# `OutputReader.stop` cancels its loop again this often until it ends.
STOP_POLL_S = 0.1


def _entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("<ms>-<seq>") in the order Redis gives them."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Follower:
    """One reader of one task's stream; `next()` returns its newer entries."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.last_id = "0-0"  # the newest entry handed to this follower
        # The stream's final message (`IS_FINAL_FIELD`) was handed over:
        # nothing follows it, so the reader stops reading the stream for it.
        self.is_ended = False
        self._entries: list[Entry] = []
        self._ready = asyncio.Event()

    def deliver(self, entries: list[Entry]) -> None:
        """The reader's loop: entries after `last_id` arrived (no I/O)."""
        after = _entry_key(self.last_id)
        new = [entry for entry in entries if _entry_key(entry[0]) > after]
        if new:
            self._entries.extend(new)
            self.last_id = new[-1][0]
            self.is_ended = self.is_ended or any(f.get(IS_FINAL_FIELD) == "1" for _, f in new)
            self._ready.set()

    async def next(self, timeout_s: float) -> list[Entry]:
        """The entries that arrived since the last call, waiting up to
        `timeout_s` for one; raises `TimeoutError` when none came."""
        if not self._entries:
            async with asyncio.timeout(timeout_s):
                await self._ready.wait()
        entries, self._entries = self._entries, []
        self._ready.clear()
        return entries


class OutputReader:
    """Reads the streams of this gateway's (`owner`'s) followers, one XREAD
    blocking up to `block_s` at a time. `start()` runs its loop; `stop()`
    ends it."""

    def __init__(
        self,
        store: Store,
        owner: str,
        *,
        block_s: float,
    ) -> None:
        if block_s <= 0:
            raise ValueError(f"block_s must be > 0, got {block_s}")
        self._store = store
        self.owner = owner
        self.block_ms = max(1, round(block_s * 1000))
        self._followers: dict[str, list[Follower]] = {}
        self._changed = asyncio.Event()  # a follower was added while none were read
        self._is_waiting = False
        self._is_wake_claimed = False  # an adder is waking the read in flight
        self._wake_id = "0-0"  # the newest wake entry seen
        self._task: asyncio.Task[None] | None = None
        self._is_stopping = False
        self.last_error: str | None = None  # the failing read's error, until one succeeds
        self.num_reads = 0

    @property
    def is_waiting(self) -> bool:
        """The loop is blocked in a read that does not include streams added
        now: an adder must wake it (`Store.wake_reader`)."""
        return self._is_waiting

    def claim_wake(self) -> bool:
        """True when the caller, having just added a stream, must wake the
        read (`Store.wake_reader`, or with its task's intake write,
        `GatewayHold.is_wake`): the
        loop is blocked in a read without it and nobody has woken it yet."""
        if not self._is_waiting or self._is_wake_claimed:
            return False
        self._is_wake_claimed = True
        return True

    @property
    def num_streams(self) -> int:
        return len(self._followers)

    def follow(self, task_id: str) -> Follower:
        """Start reading `task_id`'s stream from its first entry (no I/O; see
        `is_waiting`)."""
        follower = Follower(task_id)
        self._followers.setdefault(task_id, []).append(follower)
        self._changed.set()
        return follower

    def unfollow(self, follower: Follower) -> None:
        """Stop reading for `follower` (no I/O; the stream leaves the next read)."""
        followers = self._followers.get(follower.task_id, [])
        if follower in followers:
            followers.remove(follower)
        if not followers:
            self._followers.pop(follower.task_id, None)

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("OutputReader is already started")
        self._is_stopping = False
        self._task = asyncio.create_task(self._run(), name="gateway-output-reader")

    async def stop(self) -> None:
        """End the loop (a read in flight is cancelled)."""
        task, self._task = self._task, None
        self._is_stopping = True
        self._changed.set()
        if task is None:
            return
        # A cancel can be lost while redis-py reads (see gateway.upkeep.Upkeep.stop).
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=STOP_POLL_S)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        retry_s = RETRY_BASE_S
        while not self._is_stopping:
            # One synchronous step from here to the read: a follower added
            # after it sees `is_waiting` and wakes the read. Ended followers
            # are left out before their requests unfollow: a read blocked on
            # finished streams alone would make the next request wake it
            # (a command and a read more per request).
            last_ids = {
                task_id: min((f.last_id for f in live), key=_entry_key)
                for task_id, followers in self._followers.items()
                if (live := [f for f in followers if not f.is_ended])
            }
            if not last_ids:
                self._changed.clear()
                await self._changed.wait()
                continue
            self._is_waiting = True
            self._is_wake_claimed = False
            try:
                found, woken = await self._store.read_outputs(
                    last_ids, block_ms=self.block_ms, wake=(self.owner, self._wake_id)
                )
            except (RedisError, OSError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                found, woken = {}, None
            else:
                self.last_error = None
            finally:
                self._is_waiting = False
            if self.last_error is not None:
                log.warning(
                    "gateway.stream_read_retry",
                    num_streams=len(last_ids),
                    retry_s=retry_s,
                    error=self.last_error,
                )
                await asyncio.sleep(retry_s)
                retry_s = min(2 * retry_s, RETRY_CAP_S)
                continue
            self.num_reads += 1
            retry_s = RETRY_BASE_S
            if woken is not None:
                self._wake_id = woken
            for task_id, entries in found.items():
                for follower in self._followers.get(task_id, ()):
                    follower.deliver(entries)
