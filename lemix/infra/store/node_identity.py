"""Give an executor a node id that is unique in its stack, then run it.

    python -m lemix.infra.store.node_identity [--from redis|hostname] -- python -m services.executor

The scheduler plans over node ids 0..N-1 (``LEMIX_NUM_NODES``) and ignores any
other, so every executor of a stack needs its own id in that range. Where the
replicas of a deployment are identical, something must hand the ids out:

- ``--from hostname`` (Kubernetes StatefulSet): pod ``executor-3`` is node 3.
  The command replaces this process (exec); nothing stays behind.
- ``--from redis`` (``docker compose up --scale executor=N``): Docker tells a
  container neither its replica number nor its name, so each replica claims the
  lowest free id in Redis (one Lua script: its own earlier claim first, e.g.
  after a container restart, else the first free one). The claim is a key with
  a TTL that this process renews while the command runs as its child, and
  deletes when the child exits. Replicas beyond N wait as hot spares until an
  id frees up. SIGTERM/SIGINT are passed on to the child, whose exit status
  becomes ours.

A numeric ``LEMIX_NODE_ID`` wins: the command then runs unchanged. Only
``auto`` or an unset variable asks for an id. ``LEMIX_ADVERTISE_HOST=auto`` is
replaced by this host's IP address (a scaled compose service's name resolves
to any of its replicas, so the scheduler must dial an address).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import sys
from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis

from lemix.infra.store.client import RedisClientConfig, connect
from lemix.infra.store.keys import DEFAULT_NAMESPACE, RedisKeys
from lemix.infra.store.redis_password import redact_url

AUTO = "auto"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_CLAIM_TTL_S = 15.0
DEFAULT_RETRY_S = 2.0
_ORDINAL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?-(?P<ordinal>\d+)$")

# KEYS: the claim keys of ids 0..N-1. ARGV: owner, ttl (ms). Returns the id or -1.
_CLAIM_LUA = """
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('SET', key, ARGV[1], 'PX', ARGV[2])
    return i - 1
  end
end
for i, key in ipairs(KEYS) do
  if redis.call('SET', key, ARGV[1], 'NX', 'PX', ARGV[2]) then return i - 1 end
end
return -1
"""
# KEYS[1] one claim key. ARGV: owner, ttl (ms); ttl 0 = release. 1 if still ours.
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '0' then redis.call('DEL', KEYS[1]) else redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""


def ordinal_from_hostname(hostname: str) -> int:
    """The StatefulSet ordinal in a pod name: ``executor-3`` → 3 (ValueError if none)."""
    match = _ORDINAL.match(hostname.split(".", 1)[0])
    if match is None:
        raise ValueError(f"hostname {hostname!r} has no StatefulSet ordinal (NAME-<digits>)")
    return int(match["ordinal"])


class NodeClaim:
    """Paired verbs over Redis: `claim` the lowest free id, `renew` it, `release` it."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: RedisKeys,
        num_nodes: int,
        owner: str,
        ttl_s: float = DEFAULT_CLAIM_TTL_S,
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if not ttl_s > 0:
            raise ValueError(f"claim ttl must be > 0 seconds, got {ttl_s}")
        self._client = client
        self._keys = [keys.node_claim(i) for i in range(num_nodes)]
        self._owner = owner
        self._ttl_ms = str(max(1, int(ttl_s * 1000)))

    async def claim(self) -> int | None:
        """Our earlier id, else the lowest free one; None when all are taken."""
        node_id = int(
            await self._client.eval(
                _CLAIM_LUA, len(self._keys), *self._keys, self._owner, self._ttl_ms
            )
        )
        return None if node_id < 0 else node_id

    async def renew(self, node_id: int) -> bool:
        """Extend the claim's TTL; False if it is no longer ours (it expired and was taken)."""
        return bool(
            await self._client.eval(_RENEW_LUA, 1, self._keys[node_id], self._owner, self._ttl_ms)
        )

    async def release(self, node_id: int) -> None:
        await self._client.eval(_RENEW_LUA, 1, self._keys[node_id], self._owner, "0")

    async def close(self) -> None:
        await self._client.aclose()


async def run_with_claim(
    command: Sequence[str],
    env: Mapping[str, str],
    claim: NodeClaim,
    *,
    ttl_s: float = DEFAULT_CLAIM_TTL_S,
    retry_s: float = DEFAULT_RETRY_S,
) -> int:
    """Claim an id, run `command` with ``LEMIX_NODE_ID`` set, keep the claim alive,
    release it when the command ends. Returns the command's exit status."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    child: asyncio.subprocess.Process | None = None

    def on_signal(sig: signal.Signals) -> None:
        stop.set()
        if child is not None and child.returncode is None:
            child.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        while (node_id := await claim.claim()) is None:
            _say(f"all node ids are taken; retrying in {retry_s:g} s (a hot spare)")
            try:
                await asyncio.wait_for(stop.wait(), retry_s)
                return 0  # stopped before it ever ran
            except TimeoutError:
                pass
        _say(f"claimed node id {node_id}")
        child = await asyncio.create_subprocess_exec(
            *command, env={**env, "LEMIX_NODE_ID": str(node_id)}
        )
        renewer = asyncio.create_task(_keep_claim(claim, node_id, child, ttl_s / 3))
        try:
            status = await child.wait()
        finally:
            renewer.cancel()
            await claim.release(node_id)
        return status if status >= 0 else 128 - status  # killed by signal N: 128 + N
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _keep_claim(
    claim: NodeClaim, node_id: int, child: asyncio.subprocess.Process, period_s: float
) -> None:
    while True:
        await asyncio.sleep(period_s)
        try:
            is_ours = await claim.renew(node_id)
        except (aioredis.ConnectionError, aioredis.TimeoutError) as exc:
            _say(f"could not renew the claim on node id {node_id}: {exc}")
            continue  # the TTL covers a few missed renewals
        if not is_ours:  # two live executors with one id would corrupt node state
            _say(f"lost the claim on node id {node_id}; stopping the executor")
            child.terminate()
            return


def _say(message: str) -> None:
    print(f"node_identity: {message}", file=sys.stderr, flush=True)


def _resolve_advertise_host(env: dict[str, str]) -> None:
    if env.get("LEMIX_ADVERTISE_HOST") == AUTO:
        env["LEMIX_ADVERTISE_HOST"] = socket.gethostbyname(socket.gethostname())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lemix.infra.store.node_identity",
        description="Run COMMAND with a LEMIX_NODE_ID unique in the stack (see module doc). "
        "Reads LEMIX_NODE_ID, LEMIX_NUM_NODES, LEMIX_REDIS_URL, LEMIX_NAMESPACE, "
        "LEMIX_ADVERTISE_HOST.",
    )
    parser.add_argument(
        "--from",
        dest="source",
        choices=("redis", "hostname"),
        default="redis",
        help="where the id comes from [redis]",
    )
    parser.add_argument(
        "--claim-ttl-s",
        type=float,
        default=DEFAULT_CLAIM_TTL_S,
        help=f"TTL of a Redis claim, renewed every third of it [{DEFAULT_CLAIM_TTL_S:g}]",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return parser


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("error: no command given (… -- python -m services.executor)", file=sys.stderr)
        return 2
    env = dict(os.environ if environ is None else environ)
    try:
        _resolve_advertise_host(env)
        num_nodes = int(env.get("LEMIX_NUM_NODES") or 1)
        given = env.get("LEMIX_NODE_ID", "")
        if given not in ("", AUTO):
            os.execvpe(command[0], command, env)  # an explicit id wins
        if args.source == "hostname":
            node_id = ordinal_from_hostname(socket.gethostname())
            if node_id >= num_nodes:
                raise ValueError(
                    f"node id {node_id} (from the hostname) is outside 0.."
                    f"{num_nodes - 1}: raise LEMIX_NUM_NODES to the replica count"
                )
            os.execvpe(command[0], command, {**env, "LEMIX_NODE_ID": str(node_id)})
        claim = NodeClaim(
            # Claim and renew, one at a time: two connections are plenty.
            connect(
                RedisClientConfig(
                    env.get("LEMIX_REDIS_URL") or DEFAULT_REDIS_URL,
                    max_connections=2,
                    socket_timeout_s=10.0,
                    decode_responses=False,
                )
            ),
            RedisKeys(env.get("LEMIX_NAMESPACE") or DEFAULT_NAMESPACE),
            num_nodes,
            owner=socket.gethostname(),
            ttl_s=args.claim_ttl_s,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run_and_close(command, env, claim, args.claim_ttl_s))
    except aioredis.ConnectionError as exc:  # exit 1: the restart policy tries again
        print(
            f"error: Redis at {redact_url(env.get('LEMIX_REDIS_URL') or DEFAULT_REDIS_URL)} is "
            f"unreachable: {exc}",
            file=sys.stderr,
        )
        return 1


async def _run_and_close(
    command: Sequence[str], env: Mapping[str, str], claim: NodeClaim, ttl_s: float
) -> int:
    try:
        return await run_with_claim(command, env, claim, ttl_s=ttl_s)
    finally:
        await claim.close()


if __name__ == "__main__":
    sys.exit(main())
