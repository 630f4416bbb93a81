"""``host:port`` strings: the form services bind and advertise, clients dial,
and flags and requests take. An IPv6 host is written in brackets
(``[::1]:50051``), as gRPC and aiohttp expect."""

from __future__ import annotations


def join_host_port(host: str, port: int) -> str:
    """``host:port``, a bare IPv6 literal put in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def is_host_port(text: str) -> bool:
    """Whether `text` is ``HOST:PORT`` with a non-empty host and a port in 1..65535."""
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) <= 65535)
