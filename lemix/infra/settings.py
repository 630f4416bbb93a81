"""Flags and `LEMIX_*` environment variables → a service's frozen config.

One mechanism for the services whose settings are a flat table: each `Option`
names a config field, its flag, its variable and a parser. A flag beats its
variable, which beats the dataclass default (or a CLI-only default).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Option:
    field: str
    flag: str
    env: str
    parse: Callable[[str], Any]  # `boolean` makes a --flag/--no-flag pair
    help: str
    metavar: str | None = None


def boolean(text: str) -> bool:
    """A boolean variable: 1/true/yes/on or 0/false/no/off."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 1/0/true/false, got {text!r}")


def port_or_off(text: str) -> int:
    """A port that may be switched off: "off"/"none" (or any negative number) = -1.
    (-1, not None: a flag whose value is None counts as not given.)"""
    if text.strip().lower() in ("off", "none", "disabled"):
        return -1
    return max(int(text), -1)


def build_parser(
    config_cls: type,
    options: Sequence[Option],
    *,
    prog: str,
    description: str,
    cli_defaults: Mapping[str, Any] | None = None,
) -> argparse.ArgumentParser:
    """Every flag defaults to None, so variables and defaults can apply."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"{description} Flags override LEMIX_* environment variables, which "
        "override the defaults.",
    )
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    defaults.update(cli_defaults or {})
    for opt in options:
        text = f"{opt.help} [env {opt.env}; default {defaults[opt.field]!r}]"
        if opt.parse is boolean:
            parser.add_argument(
                opt.flag,
                dest=opt.field,
                default=None,
                help=text,
                action=argparse.BooleanOptionalAction,
            )
        else:
            parser.add_argument(
                opt.flag,
                dest=opt.field,
                type=opt.parse,
                default=None,
                metavar=opt.metavar,
                help=text,
            )
    return parser


def parse_settings(
    config_cls: Callable[..., T],
    parser: argparse.ArgumentParser,
    options: Sequence[Option],
    argv: Sequence[str] | None,
    env: Mapping[str, str] | None,
    cli_defaults: Mapping[str, Any] | None = None,
) -> T:
    """The config from `argv` (default `sys.argv[1:]`) and `env` (default
    `os.environ`). ValueError on a bad variable or config; `--help` and bad flags
    exit through argparse."""
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    environ = os.environ if env is None else env
    values: dict[str, Any] = dict(cli_defaults or {})
    for opt in options:
        flag_value = getattr(args, opt.field)
        if flag_value is not None:
            values[opt.field] = flag_value
        elif environ.get(opt.env, "") != "":
            text = environ[opt.env]
            try:
                values[opt.field] = opt.parse(text)
            except ValueError:
                kind = getattr(opt.parse, "__name__", "value")
                raise ValueError(
                    f"{opt.env}={text!r} is not a valid {kind} (for {opt.flag})"
                ) from None
    return config_cls(**values)


def check_port_or_off(name: str, port: int) -> None:
    """ValueError unless `port` is -1 (off), 0 (any free port) or a port number."""
    if not -1 <= port <= 65535:
        raise ValueError(
            f"{name} must be in [0, 65535] (0 = any free port) or -1 (off), got {port}"
        )
