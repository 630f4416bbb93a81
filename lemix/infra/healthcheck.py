"""``python -m lemix.infra.healthcheck HOST:PORT [SERVICE]``: one gRPC health check.

The probe docker-compose runs inside each LeMix container. It calls the
standard ``grpc.health.v1.Health/Check`` (every LeMix server serves it, see
`lemix.infra.rpc.server`) with a deadline and exits

- 0 when the server reports SERVICE (default "": the whole server) SERVING;
- 1 otherwise: NOT_SERVING (a server draining on stop), an unknown service,
  nothing listening, the deadline passing, or a malformed argument.

Docker reserves exit status 2 for healthchecks, so bad usage exits 1 too.
One line says what was seen: on stdout when healthy, on stderr when not; Docker
keeps it in `docker inspect`'s health log.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lemix.infra.address import is_host_port

DEFAULT_DEADLINE_S = 3.0
_SERVING = health_pb2.HealthCheckResponse.SERVING


def check(
    address: str, service: str = "", deadline_s: float = DEFAULT_DEADLINE_S
) -> tuple[bool, str]:
    """Ask `address` for `service`'s health once; return (is_serving, what was seen)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=deadline_s)
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            details = err.details() if isinstance(err, grpc.Call) else str(err)
            name = code.name if code is not None else "ERROR"
            return False, f"{name}: {details}"
    return reply.status == _SERVING, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _address(text: str) -> str:
    if not is_host_port(text):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


def _deadline(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"deadline must be > 0 seconds, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lemix.infra.healthcheck",
        description="One gRPC health check: exit 0 when SERVING, 1 otherwise.",
    )
    parser.add_argument("address", type=_address, help="HOST:PORT of the gRPC server")
    parser.add_argument(
        "service",
        nargs="?",
        default="",
        help="full service name, e.g. lemix.v1.Scheduler (default: the server)",
    )
    parser.add_argument(
        "--deadline-s",
        type=_deadline,
        default=DEFAULT_DEADLINE_S,
        help=f"deadline of the Check call, seconds [{DEFAULT_DEADLINE_S}]",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: 0 for --help, 2 for bad usage (reserved by Docker)
        return 0 if exc.code == 0 else 1
    target = f"{args.address} {args.service or '(server)'}"
    is_serving, seen = check(args.address, args.service, args.deadline_s)
    if is_serving:
        print(f"healthy: {target} is SERVING")
        return 0
    print(f"unhealthy: {target}: {seen}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
