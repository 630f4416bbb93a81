"""`lemix audit`: every task of a running stack that is not final and older
than a bound, read from the gateway (AuditTasks).

    lemix audit --target HOST:PORT [--older-than S] [--limit N] [--json OUT]

Prints one line per task (id, state, age, node, reason), oldest first. Exit
status: 0 when there is none, 1 when there is any (a task the stack holds
with no final state past the bound: stuck or lost work), 2 on a usage error
or when the gateway cannot be asked (the message says why).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc
from lemix.infra.address import is_host_port
from lemix.infra.rpc.auth import API_KEY_ENV
from lemix.infra.rpc.client import channel
from lemix.infra.rpc.errors import InvalidArgument, Unavailable
from lemix.infra.rpc.tls import client_tls
from lemix.infra.task_states import task_info_to_dict
from lemix.report.metrics import format_table

DEFAULT_OLDER_THAN_S = 60.0
DEFAULT_LIMIT = 1_000
DEFAULT_DEADLINE_S = 60.0  # the scan visits every task hash of the namespace
MAX_REASON_CHARS = 80  # in the printed table; the JSON has the whole reason

EXIT_NONE, EXIT_FOUND = 0, 1

AUDIT_COLUMNS = [
    ("task_id", "task id"),
    ("state", "state"),
    ("age_s", "age (s)"),
    ("node_id", "node"),
    ("reason", "reason"),
]


@dataclass(frozen=True)
class AuditConfig:
    target: str  # the gateway's gRPC host:port
    older_than_s: float = DEFAULT_OLDER_THAN_S
    limit: int = DEFAULT_LIMIT
    deadline_s: float = DEFAULT_DEADLINE_S
    json_path: Path | None = None
    tls_ca_file: str = ""  # the CA of a gateway that serves TLS (PEM); "" = plaintext
    api_key: str = field(default="", repr=False)  # a gateway with --api-key; "" = none

    def __post_init__(self) -> None:
        if not is_host_port(self.target):
            raise ValueError(f"--target must be HOST:PORT, got {self.target!r}")
        if not math.isfinite(self.older_than_s) or self.older_than_s < 0:
            raise ValueError(
                f"--older-than must be a number of seconds >= 0, got {self.older_than_s}"
            )
        if self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if self.deadline_s <= 0:
            raise ValueError(f"--deadline must be > 0, got {self.deadline_s}")


@dataclass(frozen=True)
class AuditResult:
    tasks: list[dict[str, Any]]  # `task_info_to_dict` plus `age_s`, oldest first
    num_scanned: int
    is_truncated: bool


def add_audit_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    audit = sub.add_parser("audit", help="list non-final tasks older than a bound (exit 1 if any)")
    audit.add_argument(
        "--target", required=True, metavar="HOST:PORT", help="the gateway's gRPC address"
    )
    audit.add_argument(
        "--older-than",
        type=float,
        default=DEFAULT_OLDER_THAN_S,
        metavar="S",
        help=f"only tasks submitted at least S s ago (default {DEFAULT_OLDER_THAN_S:g})",
    )
    audit.add_argument(
        "--limit",
        type=int,
        default=DEFAULT_LIMIT,
        metavar="N",
        help=f"list at most N tasks, oldest first (default {DEFAULT_LIMIT})",
    )
    audit.add_argument(
        "--deadline",
        type=float,
        default=DEFAULT_DEADLINE_S,
        metavar="S",
        help=f"deadline of the scan call (default {DEFAULT_DEADLINE_S:g})",
    )
    audit.add_argument("--json", metavar="OUT", help="also write the tasks as JSON here")
    audit.add_argument(
        "--tls-ca-file",
        default="",
        metavar="FILE",
        help="connect with TLS, trusting this CA (PEM) for the gateway's "
        "certificate (default: plaintext)",
    )
    audit.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"the gateway's API key [env {API_KEY_ENV}; default: none]; the env var "
        "keeps it out of `ps`",
    )


def audit_config(args: argparse.Namespace) -> AuditConfig:
    return AuditConfig(
        target=args.target,
        older_than_s=args.older_than,
        limit=args.limit,
        deadline_s=args.deadline,
        json_path=Path(args.json) if args.json else None,
        tls_ca_file=args.tls_ca_file,
        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV, ""),
    )


async def run_audit(config: AuditConfig, *, now_s: float | None = None) -> AuditResult:
    """Ask the gateway; raises `Unavailable` (cannot reach it, or it failed) or
    `InvalidArgument` (it refused the request)."""
    request = gateway_pb2.AuditRequest(min_age_s=config.older_than_s, limit=config.limit)
    credentials = client_tls(config.tls_ca_file) if config.tls_ca_file else None
    async with channel(config.target, credentials=credentials, api_key=config.api_key) as chan:
        try:
            reply = await gateway_pb2_grpc.GatewayStub(chan).AuditTasks(
                request, timeout=config.deadline_s
            )
        except grpc.aio.AioRpcError as err:
            details = f"{err.code().name}: {err.details()}"
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(f"the gateway refused the audit: {details}") from None
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise InvalidArgument(
                    f"the gateway refused the audit: {details} (pass --api-key or set "
                    f"{API_KEY_ENV})"
                ) from None
            raise Unavailable(f"cannot audit the gateway at {config.target}: {details}") from None
    now_s = time.time() if now_s is None else now_s
    tasks = []
    for info in reply.tasks:
        row = task_info_to_dict(info)
        submitted = row["submitted_at_s"] or row["queued_at_s"] or row["placed_at_s"]
        row["age_s"] = round(now_s - submitted, 3) if submitted else None
        tasks.append(row)
    return AuditResult(tasks, reply.num_scanned, reply.is_truncated)


def format_audit(result: AuditResult, config: AuditConfig) -> str:
    bound = f"older than {config.older_than_s:g} s"
    if not result.tasks:
        return (
            f"no non-final task {bound} ({result.num_scanned} task records and intake "
            "entries scanned)"
        )
    rows = [{**row, "reason": _short(row["reason"])} for row in result.tasks]
    more = f" (the oldest {len(rows)}; more exist)" if result.is_truncated else ""
    return format_table(rows, AUDIT_COLUMNS) + f"\n{len(rows)} non-final task(s) {bound}{more}"


def cmd_audit(args: argparse.Namespace) -> int:
    """`lemix audit`: 0 none, 1 some; usage and connection errors raise
    (ValueError / ServiceError: `lemix.cli.main.main` prints them and exits 2)."""
    config = audit_config(args)
    result = asyncio.run(run_audit(config))
    print(format_audit(result, config))
    if config.json_path is not None:
        config.json_path.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "target": config.target,
            "older_than_s": config.older_than_s,
            "num_scanned": result.num_scanned,
            "is_truncated": result.is_truncated,
            "tasks": result.tasks,
        }
        config.json_path.write_text(json.dumps(body, indent=2) + "\n")
        print(f"audit JSON: {config.json_path}")
    return EXIT_FOUND if result.tasks else EXIT_NONE


def _short(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."
