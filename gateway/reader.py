"""`OutputReader`: a few blocking XREADs for every output stream a gateway serves.

A request's stream used to be read by its own blocking XREAD, so every open
stream held a pooled Redis connection and cost a round trip per wake. Here
at most `MAX_LANES` loops ("lanes") read them, each with one XREAD over many
streams at once (`Store.read_outputs`), and hand each request's entries to
its `Follower`; requests wait on the follower, not on Redis.

Adding a stream while every lane blocks: a blocked read would not see it until
it returns. A new lane reads it (one command) while there are fewer than
`MAX_LANES`; past that the stream joins lane 0, and whoever adds it appends to
this gateway's wake stream (`RedisKeys.reader_wake`, sent in the round trip
that writes the task to the intake, `GatewayHold.is_wake`). Lane 0's read
includes that stream from its last seen entry, so a wake written before the
read arrives is not missed either; the lane then reads again with the new
set. One wake per blocked read is enough (`claim_wake`): a burst of new
streams costs one extra read, not one each. A read blocks at most `block_s`
(callers cap it near a second), so even a wake lost with a failed round trip
delays the streams added meanwhile by at most that long. A stream leaves the
reads once its final message was handed over.

A Redis error in a lane is logged and its read retried with backoff, from
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
# `OutputReader.stop` cancels its loops again this often until they end.
STOP_POLL_S = 0.1
# Reads in flight at once (pooled connections held by blocking XREADs).
MAX_LANES = 4


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


class _Lane:
    """One blocking XREAD at a time over its followers' streams (lane 0 with
    the wake stream too)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.followers: list[Follower] = []
        self.is_waiting = False  # blocked in a read
        self.changed = asyncio.Event()  # a follower was added while it did not read
        self.task: asyncio.Task[None] | None = None

    def last_ids(self) -> dict[str, str]:
        """{task id: the oldest last entry id among its live followers here}.
        Ended followers are left out before their requests unfollow: a read
        blocked on finished streams alone would make the next request wake it
        (a command and a read more per request)."""
        last_ids: dict[str, str] = {}
        for follower in self.followers:
            if follower.is_ended:
                continue
            seen = last_ids.get(follower.task_id)
            if seen is None or _entry_key(follower.last_id) < _entry_key(seen):
                last_ids[follower.task_id] = follower.last_id
        return last_ids


class OutputReader:
    """Reads the streams of this gateway's (`owner`'s) followers. `start()`
    runs its loops; `stop()` ends them.

    Each follower is read by one of at most `max_lanes` lanes, each one
    blocking XREAD (up to `block_s`) at a time. A follower added while every
    lane blocks goes to a new lane (a read of its own, one command) rather than
    waking a blocked one (a wake and a read again, two); a lane other than the
    first ends when its streams have ended. With `max_lanes` lanes blocked the
    follower joins lane 0, which an adder wakes (`claim_wake`). So a gateway's
    reads hold at most `max_lanes` pooled connections.
    """

    def __init__(
        self,
        store: Store,
        owner: str,
        *,
        block_s: float,
        max_lanes: int = MAX_LANES,
    ) -> None:
        if block_s <= 0:
            raise ValueError(f"block_s must be > 0, got {block_s}")
        if max_lanes < 1:
            raise ValueError(f"max_lanes must be >= 1, got {max_lanes}")
        self._store = store
        self.owner = owner
        self.block_ms = max(1, round(block_s * 1000))
        self.max_lanes = max_lanes
        self._followers: dict[str, list[Follower]] = {}
        self._lanes: list[_Lane] = []  # lane 0 first; the others while they read
        self._next_lane_index = 1
        self._is_wake_needed = False  # a follower joined lane 0 while it blocked
        self._is_wake_claimed = False  # an adder is waking lane 0's read in flight
        self._wake_id = "0-0"  # the newest wake entry seen
        self._is_started = False
        self._is_stopping = False
        self.last_error: str | None = None  # the failing read's error, until one succeeds
        self.num_reads = 0

    @property
    def is_waiting(self) -> bool:
        """Lane 0 is blocked in a read."""
        return bool(self._lanes) and self._lanes[0].is_waiting

    @property
    def num_reading(self) -> int:
        """Lanes blocked in a read now."""
        return sum(lane.is_waiting for lane in self._lanes)

    @property
    def num_lanes(self) -> int:
        """Lanes running now (lane 0 included once started)."""
        return len(self._lanes)

    def claim_wake(self) -> bool:
        """True when the caller, having just added a stream, must wake the
        read (`Store.wake_reader`, or with its task's intake write,
        `GatewayHold.is_wake`): the stream joined lane 0 while it blocked in a
        read without it (every lane was reading), and nobody has woken it yet."""
        if not (self.is_waiting and self._is_wake_needed) or self._is_wake_claimed:
            return False
        self._is_wake_claimed = True
        return True

    @property
    def num_streams(self) -> int:
        return len(self._followers)

    def follow(self, task_id: str) -> Follower:
        """Start reading `task_id`'s stream from its first entry (no I/O; see
        `claim_wake`)."""
        follower = Follower(task_id)
        self._followers.setdefault(task_id, []).append(follower)
        lane = self._pick_lane()
        lane.followers.append(follower)
        if lane.is_waiting:
            self._is_wake_needed = True  # only lane 0 is ever picked while reading
        lane.changed.set()
        return follower

    def unfollow(self, follower: Follower) -> None:
        """Stop reading for `follower` (no I/O; the stream leaves the next read)."""
        followers = self._followers.get(follower.task_id, [])
        if follower in followers:
            followers.remove(follower)
        if not followers:
            self._followers.pop(follower.task_id, None)
        # (A lane that ended has left `_lanes`: its list goes with it.)
        for lane in self._lanes:
            if follower in lane.followers:
                lane.followers.remove(follower)
                break

    def _pick_lane(self) -> _Lane:
        if not self._lanes:  # not started (or stopped): lane 0 reads once started
            self._lanes.append(_Lane(0))
        for lane in self._lanes:
            if not lane.is_waiting:  # it reads again (or goes idle) with the follower
                return lane
        if len(self._lanes) < self.max_lanes and self._is_started and not self._is_stopping:
            lane = _Lane(self._next_lane_index)
            self._next_lane_index += 1
            self._lanes.append(lane)
            lane.task = asyncio.create_task(
                self._run(lane), name=f"gateway-output-reader-{lane.index}"
            )
            return lane
        return self._lanes[0]

    def start(self) -> None:
        if self._is_started:
            raise RuntimeError("OutputReader is already started")
        self._is_started = True
        self._is_stopping = False
        if not self._lanes:
            self._lanes.append(_Lane(0))
        lane = self._lanes[0]
        lane.task = asyncio.create_task(self._run(lane), name="gateway-output-reader")

    async def stop(self) -> None:
        """End the loops (reads in flight are cancelled)."""
        self._is_stopping = True
        tasks = [lane.task for lane in self._lanes if lane.task is not None]
        for lane in self._lanes:
            lane.task = None
            lane.changed.set()
        self._is_started = False
        # A later start reads every stream on lane 0.
        for lane in self._lanes[1:]:
            self._lanes[0].followers += lane.followers
        del self._lanes[1:]
        # A cancel can be lost while redis-py reads (see gateway.upkeep.Upkeep.stop).
        while not all(task.done() for task in tasks):
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=STOP_POLL_S)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, lane: _Lane) -> None:
        retry_s = RETRY_BASE_S
        while not self._is_stopping:
            # One synchronous step from here to the read: a follower added
            # after it sees the lane reading and goes elsewhere (or wakes it).
            last_ids = lane.last_ids()
            if not last_ids:
                if lane.index:  # an extra lane ends with its streams
                    self._lanes.remove(lane)
                    return
                lane.changed.clear()
                await lane.changed.wait()
                continue
            lane.is_waiting = True
            if not lane.index:
                self._is_wake_needed = self._is_wake_claimed = False
            wake = None if lane.index else (self.owner, self._wake_id)
            try:
                found, woken = await self._store.read_outputs(
                    last_ids, block_ms=self.block_ms, wake=wake
                )
            except (RedisError, OSError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                found, woken = {}, None
            else:
                self.last_error = None
            finally:
                lane.is_waiting = False
            if self.last_error is not None:
                log.warning(
                    "gateway.stream_read_retry",
                    lane=lane.index,
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
            # Every follower of a stream, on any lane (each keeps its own
            # last entry, so none gets an entry twice).
            for task_id, entries in found.items():
                for follower in self._followers.get(task_id, ()):
                    follower.deliver(entries)
