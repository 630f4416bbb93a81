"""``python -m profiler [flags]``: run the profiler until SIGINT/SIGTERM.

Prints one line ``SERVING profiler address=HOST:PORT`` on stdout once it serves
(logs go to stderr). Exit status: 0 after a clean stop, 2 for a bad flag or
env value, 1 when it cannot start (Redis unreachable, port busy, bad profile).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lemix.infra.service_main import run_service
from profiler.config import from_env_and_args
from profiler.service import ProfilerService


def main(argv: Sequence[str] | None = None) -> int:
    return run_service(argv, from_env_and_args, ProfilerService, lambda c: "profiler")


if __name__ == "__main__":
    sys.exit(main())
