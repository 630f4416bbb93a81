"""`lemix up`, `lemix replay` and `lemix profile`: the commands that run, load or
measure the service stack, one module each (`lemix.cli.up`, `lemix.cli.replay`,
`lemix.cli.profiling`).

Flag → typed-config mapping for these commands lives in those modules, beside
`lemix/cli/main.py`'s for the simulator commands; `lemix/cli/main.py` dispatches.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from lemix.cli.profiling import add_profile_parser, cmd_profile
from lemix.cli.replay import add_replay_parser, cmd_replay
from lemix.cli.up import add_up_parser, cmd_up

# Each service command's handler, by subcommand name; it returns the exit status.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "up": cmd_up,
    "replay": cmd_replay,
    "profile": cmd_profile,
}


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The service commands' subparsers, in `lemix --help`'s order."""
    add_up_parser(sub)
    add_profile_parser(sub)
    add_replay_parser(sub)
