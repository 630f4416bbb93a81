"""`python -m services.executor [flags]`: run one executor until SIGINT/SIGTERM.

Prints exactly one line to stdout once it serves (logs go to stderr):

    SERVING executor node=N address=HOST:PORT

Exit status: 0 after a clean shutdown, 1 when it could not start (Redis
unreachable, port busy, bad profile), 2 for bad flags or settings.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lemix.infra.service_main import run_service
from services.executor.config import ExecutorConfig
from services.executor.service import ExecutorService


def main(argv: Sequence[str] | None = None) -> int:
    return run_service(
        argv,
        ExecutorConfig.from_env_and_args,
        ExecutorService,
        lambda c: f"executor node={c.node_id}",
    )


if __name__ == "__main__":
    sys.exit(main())
