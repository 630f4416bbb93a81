"""``python -m gateway [flags]``: run the gateway until SIGINT/SIGTERM.

Prints one line ``SERVING gateway address=HOST:PORT`` on stdout once it serves
(logs go to stderr). Exit status: 0 after a clean stop, 2 for a bad flag or
env value, 1 when it cannot start (Redis unreachable, port busy).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gateway.config import from_env_and_args
from gateway.service import GatewayService
from lemix.infra.service_main import run_service


def main(argv: Sequence[str] | None = None) -> int:
    return run_service(argv, from_env_and_args, GatewayService, lambda c: "gateway")


if __name__ == "__main__":
    sys.exit(main())
