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
    parse: Callable[[str], Any]
    help: str


def build_parser(config_cls: type, options: Sequence[Option], *, prog: str, description: str,
                 cli_defaults: Mapping[str, Any] | None = None) -> argparse.ArgumentParser:
    """Every flag defaults to None, so variables and defaults can apply."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"{description} Flags override LEMIX_* environment variables, which "
        "override the defaults.")
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    defaults.update(cli_defaults or {})
    for opt in options:
        parser.add_argument(opt.flag, dest=opt.field, type=opt.parse, default=None,
                            help=f"{opt.help} [env {opt.env}; default {defaults[opt.field]!r}]")
    return parser


def parse_settings(config_cls: Callable[..., T], parser: argparse.ArgumentParser,
                   options: Sequence[Option], argv: Sequence[str] | None,
                   env: Mapping[str, str] | None,
                   cli_defaults: Mapping[str, Any] | None = None) -> T:
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
                raise ValueError(f"{opt.env}={text!r} is not a valid {kind} "
                                 f"(for {opt.flag})") from None
    return config_cls(**values)
