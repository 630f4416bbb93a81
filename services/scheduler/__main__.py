"""`python -m services.scheduler [flags]`: run the scheduler until SIGINT/SIGTERM.

Prints ``SERVING scheduler address=HOST:PORT`` on stdout once it accepts
calls (scripts and tests wait for that line); logs go to stderr. Exit status:
0 after a clean stop, 2 for a bad configuration, 1 if it could not start.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lemix.infra.service_main import run_service
from services.scheduler.config import from_env_and_args
from services.scheduler.service import SchedulerService


def main(argv: Sequence[str] | None = None) -> int:
    return run_service(argv, from_env_and_args, SchedulerService, lambda c: "scheduler")


if __name__ == "__main__":
    sys.exit(main())
