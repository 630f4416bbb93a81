"""What the whole stack shares: node heartbeats, counters, the SLO, fitted
profiles, the planner's time origin and the Redis server's run id.

A node is alive while its heartbeat key lives (TTL); its state hash holds
the fields of `heartbeat`. The scheduler is alive while its key lives.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lemix.infra.store.base import StoreBase, as_fields, to_ms
from lemix.infra.store.codec import Fields, FieldValue, encode_fields, get_float
from lemix.infra.store.keys import NODE_HEARTBEAT_TTL_S, SCHEDULER_ALIVE_TTL_S


class ClusterOps(StoreBase):
    """Node heartbeats; stack-wide counters, SLO, profiles, epoch, server identity."""

    async def mark_scheduler_alive(self, ttl_s: float = SCHEDULER_ALIVE_TTL_S) -> None:
        """A scheduler runs: (re)set its liveness key for `ttl_s`."""
        await self.client.set(self.keys.scheduler_alive, "1", px=to_ms(ttl_s, "ttl_s"))

    async def drop_scheduler_alive(self) -> None:
        """The scheduler stops: gateways refuse new work from their next check."""
        await self.client.delete(self.keys.scheduler_alive)

    async def get_liveness(self) -> tuple[dict[int, Fields], bool]:
        """The live nodes' states (`get_node_states`) and whether a scheduler
        is live; the node set and the scheduler's key in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.smembers(self.keys.nodes)
        pipe.exists(self.keys.scheduler_alive)
        members, is_scheduler_alive = await pipe.execute()
        return await self._states_of(members), bool(is_scheduler_alive)

    async def put_node_state(
        self,
        node_id: int,
        fields: Mapping[str, FieldValue],
        ttl_s: float = NODE_HEARTBEAT_TTL_S,
    ) -> None:
        """Replace the node's state hash and renew its heartbeat (TTL `ttl_s`).

        One MULTI/EXEC: the hash is replaced whole (no stale fields survive) and
        the node id is added to the node set.
        """
        ttl_ms = to_ms(ttl_s, "ttl_s")
        encoded = encode_fields(fields)
        state_key = self.keys.node_state(node_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(state_key)
            if encoded:
                pipe.hset(state_key, mapping=encoded)  # type: ignore[arg-type]
            pipe.set(self.keys.node_heartbeat(node_id), "1", px=ttl_ms)
            pipe.sadd(self.keys.nodes, str(int(node_id)))
            await pipe.execute()

    async def get_node_states(self) -> dict[int, Fields]:
        """State of every live node (heartbeat not expired), by node id."""
        return await self._states_of(await self.client.smembers(self.keys.nodes))

    async def _states_of(self, members: Iterable[str | bytes]) -> dict[int, Fields]:
        """`get_node_states` for the node set's `members` (one MULTI/EXEC)."""
        node_ids = sorted(int(n) for n in members)
        if not node_ids:
            return {}
        async with self.client.pipeline(transaction=True) as pipe:
            for node_id in node_ids:
                pipe.exists(self.keys.node_heartbeat(node_id))
                pipe.hgetall(self.keys.node_state(node_id))
            replies = await pipe.execute()
        states: dict[int, Fields] = {}
        for i, node_id in enumerate(node_ids):
            is_alive, fields = replies[2 * i], replies[2 * i + 1]
            if is_alive:
                states[node_id] = as_fields(fields)
        return states

    async def incr_stat(self, name: str, by: int = 1) -> int:
        """Add `by` to counter `name`; returns the new value."""
        return int(await self.client.hincrby(self.keys.stats, name, by))

    async def incr_stats(self, deltas: Mapping[str, int]) -> None:
        """Add each `deltas[name]` to counter `name`, one pipelined round trip."""
        if not deltas:
            return
        pipe = self.client.pipeline(transaction=False)
        for name, by in deltas.items():
            pipe.hincrby(self.keys.stats, name, by)
        await pipe.execute()

    async def get_stats(self) -> dict[str, int]:
        """All counters."""
        raw = as_fields(await self.client.hgetall(self.keys.stats))
        return {name: int(value) for name, value in raw.items()}

    async def put_slo(self, ttft_s: float, tbt_s: float) -> None:
        """Publish the SLO pair the scheduler plans for."""
        fields = encode_fields({"ttft_s": ttft_s, "tbt_s": tbt_s})
        await self.client.hset(self.keys.scheduler_slo, mapping=fields)  # type: ignore[arg-type]

    async def get_slo(self) -> tuple[float, float] | None:
        """(ttft_s, tbt_s) as the scheduler published it, or None."""
        fields = as_fields(await self.client.hgetall(self.keys.scheduler_slo))
        if not fields.get("ttft_s") or not fields.get("tbt_s"):
            return None
        return get_float(fields, "ttft_s"), get_float(fields, "tbt_s")

    async def put_profile(self, name: str, json_text: str) -> None:
        """Store a fitted profile (JSON text) under `name`."""
        await self.client.set(self.keys.profile(name), json_text)

    async def get_profile(self, name: str) -> str | None:
        """The profile JSON text stored under `name`, or None."""
        text = await self.client.get(self.keys.profile(name))
        return None if text is None else str(text)

    async def scheduler_epoch(self, now_epoch_s: float) -> float:
        """The planner's time origin: set once (NX), then read back forever."""
        await self.client.set(self.keys.scheduler_epoch, repr(now_epoch_s), nx=True)
        value = await self.client.get(self.keys.scheduler_epoch)
        return float(str(value))

    async def server_run_id(self) -> str:
        """The Redis server's run id: it changes when the server restarts."""
        info = await self.client.info("server")
        return str(info.get("run_id", ""))
