"""Field values on the wire: every Redis hash field and stream field is a string.

`encode_value`/`encode_fields` write numbers, booleans and ``None``;
the ``get_*`` helpers read them back. Every wire format (`task_hash`,
`messages`, `heartbeat`) and every `Store` method goes through them, so a
float or a bool is spelled the same in every hash and stream.
"""

from __future__ import annotations

from collections.abc import Mapping

FieldValue = str | int | float | bool | None
Fields = dict[str, str]
Entry = tuple[str, Fields]  # (stream entry id, fields)


def encode_value(value: FieldValue) -> str:
    """One field value as a string: bools as "1"/"0", floats exactly, None as ""."""
    if type(value) is str:  # most values: no further checks
        return value
    if value is None:
        return ""
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "1" if value else "0"
    if isinstance(value, str):
        return str(value)  # plain str, also for StrEnum members
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # shortest text that round-trips exactly
    raise TypeError(f"cannot store {type(value).__name__} in a Redis field: {value!r}")


def encode_fields(fields: Mapping[str, FieldValue]) -> Fields:
    """A mapping as str -> str, ready for HSET/XADD."""
    return {str(name): encode_value(value) for name, value in fields.items()}


def get_int(fields: Mapping[str, str], name: str, default: int = 0) -> int:
    """`fields[name]` as an int; `default` when missing or empty."""
    text = fields.get(name, "")
    return int(text) if text else default


def get_float(fields: Mapping[str, str], name: str, default: float = 0.0) -> float:
    """`fields[name]` as a float; `default` when missing or empty."""
    text = fields.get(name, "")
    return float(text) if text else default


def get_optional_float(fields: Mapping[str, str], name: str) -> float | None:
    """`fields[name]` as a float, or None when missing or empty (encoded None)."""
    text = fields.get(name, "")
    return float(text) if text else None


def get_optional_int(fields: Mapping[str, str], name: str) -> int | None:
    """`fields[name]` as an int, or None when missing or empty (encoded None)."""
    text = fields.get(name, "")
    return int(text) if text else None


def get_bool(fields: Mapping[str, str], name: str, default: bool = False) -> bool:
    """`fields[name]` as a bool ("1"/"0"); `default` when missing or empty."""
    text = fields.get(name, "")
    return text == "1" if text else default
