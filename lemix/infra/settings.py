"""Flags and `LEMIX_*` environment variables → a service's frozen config.

One mechanism for the services whose settings are a flat table: each `Option`
names a config field, its flag, its variable and a parser. A flag beats its
variable, which beats the dataclass default (or a CLI-only default). The
options every service shares are declared once, in `lemix.infra.config`.

A renamed flag or variable stays accepted as a deprecated alias
(`Option.deprecated_flags` / `deprecated_envs`): it still sets the field, below
the new name in precedence, and using it prints a warning naming the new one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Option:
    """One config field's flag and `LEMIX_*` variable."""

    field: str
    flag: str
    env: str
    parse: Callable[[str], Any]  # `boolean` makes a --flag/--no-flag pair
    help: str
    metavar: str | None = None
    # Old names still accepted (with a warning naming `flag` / `env`).
    deprecated_flags: tuple[str, ...] = ()
    deprecated_envs: tuple[str, ...] = ()


def option(
    field: str, env: str, parse: Callable[[str], Any], help: str, metavar: str | None = None
) -> Option:
    """An `Option` whose flag is its field name, dashed (`max_defer_s` → `--max-defer-s`)."""
    return Option(field, f"--{field.replace('_', '-')}", env, parse, help, metavar)


def _print_warning(message: str) -> None:
    # Settings are parsed before logging is configured (the log level is one
    # of them), so the warning goes straight to stderr, like the errors.
    print(f"warning: {message}", file=sys.stderr, flush=True)


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
        deprecated = ", ".join((*opt.deprecated_flags, *opt.deprecated_envs))
        text = f"{opt.help} [env {opt.env}; default {defaults[opt.field]!r}"
        text += f"; deprecated aliases: {deprecated}]" if deprecated else "]"
        _add_flag(parser, opt, opt.flag, opt.field, text)
        for flag in opt.deprecated_flags:  # hidden: the new flag's help names them
            _add_flag(parser, opt, flag, _deprecated_dest(opt, flag), argparse.SUPPRESS)
    return parser


def _add_flag(
    parser: argparse.ArgumentParser, opt: Option, flag: str, dest: str, help: str
) -> None:
    if opt.parse is boolean:
        parser.add_argument(
            flag, dest=dest, default=None, help=help, action=argparse.BooleanOptionalAction
        )
    else:
        parser.add_argument(
            flag, dest=dest, type=opt.parse, default=None, metavar=opt.metavar, help=help
        )


def _deprecated_dest(opt: Option, flag: str) -> str:
    return f"{opt.field}:{flag}"


def parse_settings(
    config_cls: Callable[..., T],
    parser: argparse.ArgumentParser,
    options: Sequence[Option],
    argv: Sequence[str] | None,
    env: Mapping[str, str] | None,
    cli_defaults: Mapping[str, Any] | None = None,
    warn: Callable[[str], None] = _print_warning,
) -> T:
    """The config from `argv` (default `sys.argv[1:]`) and `env` (default
    `os.environ`). ValueError on a bad variable or config; `--help` and bad flags
    exit through argparse. Each deprecated alias in use is reported to `warn`.

    Per field, the first given wins: the flag, its deprecated flags, the
    variable, its deprecated variables, then the default."""
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    environ = os.environ if env is None else env
    values: dict[str, Any] = dict(cli_defaults or {})
    for opt in options:
        given = _given(opt, args, environ)  # (name, value), first = the one that wins
        for name, _ in given:
            if name in opt.deprecated_flags or name in opt.deprecated_envs:
                new = opt.flag if name.startswith("-") else opt.env
                ignored = "" if name == given[0][0] else f" (ignored: {given[0][0]} is set)"
                warn(f"{name} is deprecated, use {new}{ignored}")
        if not given:
            continue
        name, value = given[0]
        if name.startswith("-"):  # a flag: argparse has parsed it
            values[opt.field] = value
            continue
        try:
            values[opt.field] = opt.parse(value)
        except ValueError:
            kind = getattr(opt.parse, "__name__", "value")
            raise ValueError(f"{name}={value!r} is not a valid {kind} (for {opt.flag})") from None
    return config_cls(**values)


def _given(
    opt: Option, args: argparse.Namespace, environ: Mapping[str, str]
) -> list[tuple[str, Any]]:
    """The flags and variables of `opt` that are set, in order of precedence."""
    flags = [(opt.flag, getattr(args, opt.field))]
    flags += [(f, getattr(args, _deprecated_dest(opt, f))) for f in opt.deprecated_flags]
    envs = [(name, environ.get(name, "")) for name in (opt.env, *opt.deprecated_envs)]
    return [(f, v) for f, v in flags if v is not None] + [(n, t) for n, t in envs if t != ""]


def check_finite(name: str, value: float, *, allow_zero: bool) -> None:
    """ValueError unless `value` is a finite number > 0 (or >= 0 with `allow_zero`)."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value}")


def check_port(name: str, port: int) -> None:
    """ValueError unless `port` is 0 (any free port) or a port number."""
    if not 0 <= port <= 65535:
        raise ValueError(f"{name} must be in [0, 65535] (0 = any free port), got {port}")


def check_port_or_off(name: str, port: int) -> None:
    """ValueError unless `port` is -1 (off), 0 (any free port) or a port number."""
    if not -1 <= port <= 65535:
        raise ValueError(
            f"{name} must be in [0, 65535] (0 = any free port) or -1 (off), got {port}"
        )


@dataclass(frozen=True)
class ConfigSpec(Generic[T]):
    """How one service reads its config: its dataclass, its options, its program
    name and description, and the defaults that apply on the command line only."""

    config_cls: Callable[..., T]
    options: Sequence[Option]
    prog: str
    description: str
    cli_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def build_parser(self, prog: str | None = None) -> argparse.ArgumentParser:
        """The flags; every default is None so variables and defaults can apply."""
        return build_parser(
            self.config_cls,  # type: ignore[arg-type]
            self.options,
            prog=prog or self.prog,
            description=self.description,
            cli_defaults=self.cli_defaults,
        )

    def parse(self, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> T:
        """Flags (`argv`, default sys.argv[1:]) over variables (`env`, default
        os.environ) over defaults; see `parse_settings`."""
        return parse_settings(
            self.config_cls, self.build_parser(), self.options, argv, env, self.cli_defaults
        )
