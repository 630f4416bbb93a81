"""Every Redis key name LeMix uses, in one place (arq's `constants.py` is the model).

All keys live under one namespace prefix (default ``"lemix"``) so that two
stacks can share a Redis server and a test can clean up by prefix. Nothing else
in the code base spells a key: services get a `RedisKeys` and call its methods.

Layout (``ns`` is the namespace; ids are task ids or integer node ids):

===========================  ======  ==============================================
key                          type    what it holds
===========================  ======  ==============================================
``ns:intake``                stream  durable task intake; consumer group below
``ns:dedupe:<task_id>``      string  idempotency marker (intake entry id), with TTL
``ns:task:<task_id>``        hash    task state: status, node_id, reason, times
``ns:out:<task_id>``         stream  per-request output (tokens, loss, final msg)
``ns:nodes``                 set     node ids that ever reported (for lookup)
``ns:node:<node_id>``        hash    the node's latest reported state
``ns:node:<node_id>:alive``  string  heartbeat; its TTL expiring = node is dead
``ns:node:<node_id>:claim``  string  owner of a container's claim on the id, with TTL
``ns:events``                stream  scheduler event log (replay / parity tests)
``ns:completions``           stream  task ends reported by executors
``ns:completions:cursor``    string  last completions entry the scheduler applied
``ns:cancelled:<task_id>``   string  cancelled before placement (with TTL)
``ns:lease:<gateway_id>``    string  a gateway's lease on every stream it reads (TTL)
``ns:wake:<gateway_id>``     stream  wakes that gateway's output reader (one entry, TTL)
``ns:scheduler:epoch``       string  wall-clock origin of the planner's time
``ns:scheduler:slo``         hash    the SLO the scheduler plans for (ttft_s, tbt_s)
``ns:profile:<name>``        string  a fitted profile as JSON text
``ns:stats``                 hash    integer counters
===========================  ======  ==============================================
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NAMESPACE = "lemix"
# Consumer group of the intake stream; every scheduler instance joins it.
INTAKE_GROUP = "scheduler"
# A node whose heartbeat is older than this is treated as gone. Executors
# heartbeat several times per TTL (e.g. every TTL / 3).
NODE_HEARTBEAT_TTL_S = 5.0
# The scheduler renews its liveness key every node poll; gateways refuse new
# work (UNAVAILABLE) once it lapses. Long enough to ride out a supervised
# restart of a few seconds, during which the intake keeps what arrives.
SCHEDULER_ALIVE_TTL_S = 10.0
# How long a task id stays known to the intake's dedupe check.
DEDUPE_TTL_S = 24 * 3600.0
# A gateway renews its lease (on every stream it reads) every
# STREAM_LEASE_TTL_S / 3; a lease that lapses means its gateway is gone.
STREAM_LEASE_TTL_S = 15.0
# Approximate cap on entries per output stream (XADD MAXLEN ~): far above any
# request's token count; only a runaway producer ever hits it.
OUTPUT_MAXLEN = 100_000


def _check_part(what: str, value: str) -> str:
    # `str.split()` splits on exactly what `str.isspace` calls whitespace, in
    # C: a part without any comes back whole. (A per-character check was a
    # visible cost: the gateway builds every stream's key on each read.)
    if value.split() != [value]:
        if not value:
            raise ValueError(f"{what} must be a non-empty string")
        raise ValueError(f"{what} must not contain whitespace: {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Builds key names under one namespace. Pure: no Redis access."""

    namespace: str = DEFAULT_NAMESPACE
    intake_group: str = INTAKE_GROUP

    def __post_init__(self) -> None:
        _check_part("namespace", self.namespace)
        _check_part("intake_group", self.intake_group)

    def _key(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    @property
    def pattern(self) -> str:
        """SCAN/KEYS pattern matching every key of this namespace."""
        return self._key("*")

    # ------------------------------------------------------------ intake
    @property
    def intake_stream(self) -> str:
        return self._key("intake")

    def dedupe(self, task_id: str) -> str:
        return self._key("dedupe", _check_part("task_id", task_id))

    # ------------------------------------------------------------ tasks
    def task(self, task_id: str) -> str:
        return self._key("task", _check_part("task_id", task_id))

    def output(self, task_id: str) -> str:
        return self._key("out", _check_part("task_id", task_id))

    # ------------------------------------------------------------ nodes
    @property
    def nodes(self) -> str:
        return self._key("nodes")

    def node_state(self, node_id: int) -> str:
        return self._key("node", str(int(node_id)))

    def node_heartbeat(self, node_id: int) -> str:
        return self._key("node", str(int(node_id)), "alive")

    def node_claim(self, node_id: int) -> str:
        """Owner of a replica's claim on `node_id` (`lemix.infra.store.node_identity`)."""
        return self._key("node", str(int(node_id)), "claim")

    # ------------------------------------------------------------ misc
    @property
    def events_stream(self) -> str:
        return self._key("events")

    def profile(self, name: str) -> str:
        return self._key("profile", _check_part("profile name", name))

    @property
    def completions_stream(self) -> str:
        """Executors append task ends here; the scheduler consumes them."""
        return self._key("completions")

    @property
    def completions_cursor(self) -> str:
        """The last completions entry the scheduler applied (restart resumes here)."""
        return self._key("completions", "cursor")

    def gateway_lease(self, gateway_id: str) -> str:
        """Gateway `gateway_id`'s lease on every stream it reads; renewed while
        it runs (one key per gateway, not per request: a task names its
        gateway in its hash, `task_hash.GATEWAY_ID_FIELD`).

        Its expiry means nobody reads those outputs any more (the gateway
        died): the scheduler cancels its tasks so the executors free their KV.
        """
        return self._key("lease", _check_part("gateway_id", gateway_id))

    def reader_wake(self, owner: str) -> str:
        """Wakes gateway `owner`'s output reader out of its blocking XREAD
        when it starts following another stream (one entry, MAXLEN 1; its
        TTL is renewed with the gateway's leases)."""
        return self._key("wake", _check_part("owner", owner))

    @property
    def scheduler_epoch(self) -> str:
        """Wall-clock epoch of the scheduler's planner time (set once)."""
        return self._key("scheduler", "epoch")

    @property
    def scheduler_alive(self) -> str:
        """Set with a TTL while a scheduler runs its loops (gateways check it)."""
        return self._key("scheduler", "alive")

    @property
    def scheduler_slo(self) -> str:
        """The SLO pair the scheduler plans for (the gateway judges requests by it)."""
        return self._key("scheduler", "slo")

    @property
    def stats(self) -> str:
        return self._key("stats")
