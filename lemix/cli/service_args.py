"""Flags shared by the service commands (`lemix up`, `lemix replay`): `--help`
with defaults, and the API key, whose default comes from the environment."""

from __future__ import annotations

import argparse
import os

from lemix.infra.rpc.auth import API_KEY_ENV


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each flag's default, unless its help already names one
    or it has none (None: the help says what happens then)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or "default" in text.lower():
            return text
        return super()._get_help_string(action)


def add_api_key_flag(parser: argparse.ArgumentParser, text: str) -> None:
    """--api-key, whose default (LEMIX_API_KEY) is read when used, never shown."""
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"{text} [env {API_KEY_ENV}; default: none]; the env var keeps it out of `ps`",
    )


def api_key_arg(args: argparse.Namespace) -> str:
    """--api-key, else LEMIX_API_KEY, else "" (none)."""
    given: str | None = getattr(args, "api_key", None)
    return given if given is not None else os.environ.get(API_KEY_ENV, "")
