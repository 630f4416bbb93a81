"""A private Redis server's password: checked, generated, kept out of logs.

`EmbeddedRedis` (`lemix.infra.store.server`) hands a password to
``requirepass`` on stdin and puts it in its ``redis://`` URL, so a password
must pass through redis.conf syntax and a URL unchanged (`check_password`).
Any URL that may carry one is printed through `redact_url`.
"""

from __future__ import annotations

import secrets
from urllib.parse import urlsplit, urlunsplit

# Characters a password may use: printable ASCII minus whitespace, quotes and
# backslash, so it passes through redis.conf syntax and a URL unchanged.
_PASSWORD_CHARS = frozenset(chr(c) for c in range(33, 127)) - set("\"'\\")
_MAX_PASSWORD_CHARS = 512


def check_password(password: str) -> str:
    """`password` if Redis and a redis:// URL can carry it; ValueError otherwise."""
    if not password:
        raise ValueError("the Redis password is empty")
    if len(password) > _MAX_PASSWORD_CHARS:
        raise ValueError(f"the Redis password is longer than {_MAX_PASSWORD_CHARS} characters")
    if not set(password) <= _PASSWORD_CHARS:
        raise ValueError(
            "the Redis password may only use printable ASCII without spaces, quotes or backslashes"
        )
    return password


def redact_url(url: str) -> str:
    """`url` with its password (if any) replaced by ``***``: for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def generate_password() -> str:
    """A random password (192 bits, hex) for a private server."""
    return secrets.token_hex(24)
