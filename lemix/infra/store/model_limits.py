"""The served model's limits, as executors publish them in their heartbeat hash.

A torch executor adds `VOCAB_SIZE_FIELD` and `MAX_MODEL_LEN_FIELD` to every
heartbeat (`model_limit_fields`); the emulated backend runs no model and adds
none. The gateway reads them from the live nodes' hashes
(`model_limits_from_states`) to refuse, before anything is submitted, a
prompt token id outside the vocabulary or a prompt + ``max_tokens`` over the
model's positions: caught only on the executor, such a request ended as a
refused task instead of a 400.

Nodes that disagree (a rolling upgrade) are read strictly: the smallest
vocabulary and the shortest context, so a request the gateway accepts runs
on any node. A field that does not parse is left out, with the node named
in the reason the caller logs; missing fields mean "not published".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lemix.infra.store.codec import FieldValue

VOCAB_SIZE_FIELD = "model_vocab_size"  # token ids are in [0, vocab_size)
MAX_MODEL_LEN_FIELD = "model_max_len"  # prompt + output tokens, at most (positions)


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts; 0 = unknown (no node published it)."""

    vocab_size: int = 0
    max_model_len: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < 0 or self.max_model_len < 0:
            raise ValueError(f"model limits must be >= 0 (0 = unknown), got {self}")

    @property
    def is_known(self) -> bool:
        return bool(self.vocab_size or self.max_model_len)


def model_limit_fields(limits: ModelLimits | None) -> dict[str, FieldValue]:
    """The heartbeat fields that publish `limits` (none for None: no model)."""
    if limits is None:
        return {}
    return {VOCAB_SIZE_FIELD: limits.vocab_size, MAX_MODEL_LEN_FIELD: limits.max_model_len}


def _read(node_id: int, fields: Mapping[str, str], name: str) -> int:
    text = fields.get(name, "")
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        reason = f"node {node_id}: field {name!r} is not an integer: {text!r:.40}"
        raise ValueError(reason) from None
    if value <= 0:
        raise ValueError(f"node {node_id}: field {name!r} must be > 0, got {value}")
    return value


def _strictest(a: int, b: int) -> int:
    """The smaller of two limits, where 0 is "unknown" (not "none allowed")."""
    return min(a, b) if a and b else a or b


def model_limits_from_states(
    states: Mapping[int, Mapping[str, str]],
) -> tuple[ModelLimits, dict[int, str]]:
    """The strictest limits the live nodes (`Store.get_node_states`) publish,
    and why each unreadable node was left out (by node id), for the caller
    to log. `ModelLimits()` (unknown) when no node publishes any."""
    vocab_size = max_model_len = 0
    bad: dict[int, str] = {}
    for node_id, fields in sorted(states.items()):
        try:
            vocab = _read(node_id, fields, VOCAB_SIZE_FIELD)
            length = _read(node_id, fields, MAX_MODEL_LEN_FIELD)
        except ValueError as exc:
            bad[node_id] = str(exc)
            continue
        vocab_size = _strictest(vocab_size, vocab)
        max_model_len = _strictest(max_model_len, length)
    return ModelLimits(vocab_size, max_model_len), bad
