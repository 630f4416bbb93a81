"""Command packing in C for redis-py's asyncio connections.

redis-py's synchronous client packs commands with `hiredis.pack_command` when
hiredis is installed, but its asyncio connection always packs in Python: a
call per argument (encode, length, concatenation). LeMix's scripts carry many
arguments (the executor's node script ~130, the gateway's intake script and
its multi-stream XREAD dozens), and at 200 req/s the Python packer was the
largest single cost in the gateway's and the executor's own code
(docs/control-plane.md, tenth round). Packed by hiredis the same command is
the same bytes, ~8x faster.

`with_hiredis_packing(cls)` returns a subclass of a connection class that
packs with hiredis and falls back to redis-py's own packer for anything
hiredis refuses (`bytearray`, `None`, `bool`, ...), so the bytes sent and the
errors raised (`DataError`, `UnicodeEncodeError`) are redis-py's in every case
hiredis does not handle. Connections whose encoder is not strict UTF-8 keep
redis-py's packer, since hiredis encodes `str` as strict UTF-8 only.
"""

from __future__ import annotations

from typing import Any

import hiredis  # a declared dependency (pyproject.toml)
import redis.asyncio.connection as aioconn


def _is_strict_utf8(connection: aioconn.AbstractConnection) -> bool:
    encoder = connection.encoder
    return encoder.encoding.lower().replace("-", "").replace("_", "") == "utf8" and (
        encoder.encoding_errors == "strict"
    )


class _HiredisPacking(aioconn.AbstractConnection):
    """Mixin: `pack_command` by hiredis when it can (module doc)."""

    _is_hiredis_packing: bool | None = None

    def pack_command(self, *args: Any) -> list[bytes]:
        if self._is_hiredis_packing is None:
            self._is_hiredis_packing = _is_strict_utf8(self)
        if not self._is_hiredis_packing:
            return super().pack_command(*args)
        # The command name may hold several words ("CONFIG GET"): the server
        # wants them as separate arguments (as redis-py's own packers split).
        first = args[0]
        if isinstance(first, str):
            args = (*first.encode().split(), *args[1:])
        elif isinstance(first, bytes) and b" " in first:
            args = (*first.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]  # type: ignore[arg-type]
        except (TypeError, ValueError):
            # An argument hiredis does not take: redis-py's packer either
            # handles it (bytearray) or raises its own DataError.
            return super().pack_command(*args)


_PACKING_CLASSES: dict[type[aioconn.AbstractConnection], type[aioconn.AbstractConnection]] = {}


def with_hiredis_packing(
    connection_class: type[aioconn.AbstractConnection],
) -> type[aioconn.AbstractConnection]:
    """`connection_class` packing its commands with hiredis (module doc)."""
    if issubclass(connection_class, _HiredisPacking):
        return connection_class
    packing = _PACKING_CLASSES.get(connection_class)
    if packing is None:
        packing = type(
            f"HiredisPacking{connection_class.__name__}", (_HiredisPacking, connection_class), {}
        )
        _PACKING_CLASSES[connection_class] = packing
    return packing
