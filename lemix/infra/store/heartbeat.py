"""A node's heartbeat hash (``ns:node:<node_id>``), both ways.

An executor writes it every heartbeat (`heartbeat_fields`, then
`Store.put_node_state`): `NodeSnapshot`'s fields under their names (the
`NodeState` proto's), plus `ADDRESS_FIELD`, ``num_stages`` and ``t`` (epoch s
of the beat). The scheduler's GetState and the gateway's Stats turn it into a
`NodeState` message (`node_states_from_heartbeats`).

Bad fields, one policy for both readers: a value that does not parse, or does
not fit `NodeState` (negative or too large for its unsigned field, a
non-finite time, a negative busy fraction), makes the whole hash unreadable
(`ValueError` naming the node and the field), and that node is left out of
the answer while the others are kept. One odd executor cannot break the
answer for the cluster, and no made-up number (a 0 standing for "many")
is reported as a node's state. A missing field reads as its default (0;
``is_healthy`` true): an older executor may not write it.

The scheduler's node supervision reads `ADDRESS_FIELD`, `IS_HEALTHY_FIELD`
and `NOW_S_FIELD` from the same hash on its own, leniently: whether a node
is alive must not hinge on an unrelated malformed counter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TypeVar

from lemix._proto.lemix.v1 import common_pb2
from lemix.infra.rpc.convert import node_state_to_proto
from lemix.infra.store.codec import Fields, FieldValue, get_bool
from lemix.types import NodeSnapshot

ADDRESS_FIELD = "address"  # host:port the node's executor serves on
IS_HEALTHY_FIELD = "is_healthy"
NOW_S_FIELD = "now_s"  # the node engine's clock (goes back when the node restarts)
NUM_STAGES_FIELD = "num_stages"
T_FIELD = "t"  # epoch s of the beat

_N = TypeVar("_N", int, float)


def heartbeat_fields(
    snapshot: NodeSnapshot, *, address: str, num_stages: int, t: float
) -> dict[str, FieldValue]:
    """One heartbeat's fields: the snapshot, where to reach the node, and when."""
    fields: dict[str, FieldValue] = dict(dataclasses.asdict(snapshot))
    fields.update({ADDRESS_FIELD: address, NUM_STAGES_FIELD: num_stages, T_FIELD: t})
    return fields


def node_state_from_heartbeat(node_id: int, fields: Mapping[str, str]) -> common_pb2.NodeState:
    """A heartbeat hash (`Store.get_node_states`) as a `NodeState` message.

    Raises ValueError naming the node and the field for a bad value (the
    module's policy); missing fields read as defaults.
    """

    def read(name: str, parse: Callable[[str], _N], default: _N) -> _N:
        text = fields.get(name, "")
        if not text:
            return default
        try:
            return parse(text)
        except ValueError:
            raise ValueError(
                f"node {node_id}: field {name!r} is not a number: {text!r:.40}"
            ) from None

    snapshot = NodeSnapshot(
        node_id=node_id,
        now_s=read(NOW_S_FIELD, float, 0.0),
        num_running=read("num_running", int, 0),
        num_waiting=read("num_waiting", int, 0),
        sum_context_tokens=read("sum_context_tokens", int, 0),
        max_remaining_decode_tokens=read("max_remaining_decode_tokens", int, 0),
        kv_used_bytes=read("kv_used_bytes", int, 0),
        memory_capacity_bytes=read("memory_capacity_bytes", int, 0),
        busy_fraction=read("busy_fraction", float, 0.0),
        num_training_updates=read("num_training_updates", int, 0),
        is_healthy=get_bool(fields, IS_HEALTHY_FIELD, default=True),
    )
    # Checks the ranges (an unsigned field, a finite time): InvalidArgument, a ValueError.
    return node_state_to_proto(
        snapshot,
        address=fields.get(ADDRESS_FIELD, ""),
        num_stages=read(NUM_STAGES_FIELD, int, 0),
    )


def node_states_from_heartbeats(
    states: Mapping[int, Fields],
) -> tuple[list[common_pb2.NodeState], dict[int, str]]:
    """Every readable heartbeat of `states` (by node id, `Store.get_node_states`)
    as a `NodeState`, in node id order, and why each other one is not (by node
    id): the caller logs those."""
    nodes: list[common_pb2.NodeState] = []
    bad: dict[int, str] = {}
    for node_id, fields in sorted(states.items()):
        try:
            nodes.append(node_state_from_heartbeat(node_id, fields))
        except ValueError as exc:
            bad[node_id] = str(exc)
    return nodes, bad
