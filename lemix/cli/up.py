"""`lemix up`: its flags, their mapping to a `StackConfig`, and the command that
runs the stack in the foreground (local processes, or containers with
`--runtime docker`)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
from pathlib import Path

from lemix import __version__
from lemix.cli.service_args import DefaultsHelpFormatter, add_api_key_flag, api_key_arg
from lemix.infra.engine_options import ENGINE_OPTIONS, EngineKnobs, knob_text
from lemix.infra.store.server import APPENDFSYNC_POLICIES
from lemix.planner.registry import POLICIES
from lemix.profile import default_profile_path, torch_cpu_profile_path
from lemix.stack.config import StackConfig
from lemix.stack.containers import ContainerConfig, run_containers_until_signalled
from lemix.stack.up import run_until_signalled


def add_up_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`lemix up`'s subparser and flags."""
    up = sub.add_parser(
        "up",
        help="run the service stack in the foreground (Ctrl-C stops it)",
        formatter_class=DefaultsHelpFormatter,
    )
    up.add_argument("--version", action="version", version=f"lemix {__version__}")
    up.add_argument("--nodes", type=int, default=2, help="executor nodes (default 2)")
    up.add_argument("--stages", type=int, help="stages per node: picks the shipped profile")
    up.add_argument(
        "--backend", default="emulated", choices=("emulated", "torch"), help="executor backend"
    )
    up.add_argument("--profile", metavar="FILE", help="profile JSON (default: shipped A100 one)")
    up.add_argument("--policy", default="lemix", help=f"one of: {', '.join(POLICIES)}")
    up.add_argument("--gateway-port", type=int, default=50051, help="the gateway's gRPC port")
    up.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="the gateway's OpenAI-compatible HTTP API (default 8000; 0 = free)",
    )
    up.add_argument("--host", default="127.0.0.1", help="the gateway's listen host")
    up.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="emulated stage time multiplier (<1 runs faster than the profile)",
    )
    up.add_argument("--train-rate", type=float, default=0.0, help="SEPARATE's training share")
    up.add_argument(
        "--log-dir",
        help="each service's log file (default: a new runs/stack-logs/<UTC time>-<pid>/ per "
        "start, runs/stack-logs/latest pointing at it)",
    )
    up.add_argument(
        "--served-model-name",
        default="lemix",
        help="the model name the OpenAI API lists and accepts (`model`), also the "
        "metrics' model_name label",
    )
    up.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="prompt + max_tokens limit in tokens (0 = the served model's max_model_len; "
        "4096 when no executor publishes one)",
    )
    up.add_argument(
        "--max-in-flight",
        type=int,
        default=1024,
        help="concurrent Generate streams the gateway holds; more get 429 / RESOURCE_EXHAUSTED",
    )
    for opt in ENGINE_OPTIONS:  # the executors' engine, declared once (lemix.infra)
        default = getattr(EngineKnobs(), opt.field)
        up.add_argument(
            opt.flag,
            dest=opt.field,
            type=opt.parse,
            default=default,
            metavar=opt.metavar,
            help=f"{opt.help} (default: {knob_text(opt.field, default)}, engine v2; "
            "v1: --micro-batches 1 --prefill-token-budget off --train-slice-s off "
            "--gather-decodes off)",
        )
    up.add_argument(
        "--model", default="tiny-llama", help="torch: model preset or local checkpoint directory"
    )
    up.add_argument(
        "--tokenizer",
        default="bpe:8192",
        help="torch: tokenizer spec shared by the gateway and the executors",
    )
    up.add_argument(
        "--redis-dir",
        metavar="DIR",
        help="the embedded Redis's data dir, its AOF kept across restarts "
        "(default: redis/ beside --log-dir, e.g. runs/redis)",
    )
    up.add_argument(
        "--redis-fsync",
        default="always",
        choices=APPENDFSYNC_POLICIES,
        help="the embedded Redis's appendfsync: always (default: fsync before every "
        "reply, so no acknowledged write is lost to a Redis or machine crash) or "
        "everysec (faster; a crash may lose up to ~2 s of acknowledged writes when "
        "the disk is slow, see lemix/infra/store/server.py)",
    )
    up.add_argument(
        "--redis-password",
        metavar="PASS",
        help="the embedded Redis's password [env LEMIX_REDIS_PASSWORD; default: "
        "random per start]; the env var keeps it out of `ps`",
    )
    add_api_key_flag(up, "require this API key (comma-separated: several) on the gateway's API")
    up.add_argument(
        "--runtime",
        default="process",
        choices=("process", "docker"),
        help="process: each service a supervised local process (default); docker: each "
        "service a container of --image through the Docker SDK (needs a Docker engine)",
    )
    up.add_argument("--image", default="lemix:cpu", help="docker: the LeMix image")
    up.add_argument("--redis-image", default="redis:7.4-alpine", help="docker: the Redis image")
    up.add_argument(
        "--project", default="lemix", help="docker: prefix of the containers' names and label"
    )
    up.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        help="docker: GPUs each executor reserves (node i: GPUs i*k..i*k+k-1; default 0)",
    )


def _profile_path(profile: str | None, num_stages: int | None, backend: str = "emulated") -> Path:
    if profile:
        return Path(profile)
    if backend == "torch":
        # The latency model of the shipped CPU measurement; memory figures are
        # replaced by the real model's at executor start.
        return torch_cpu_profile_path()
    if num_stages is None:
        return default_profile_path()
    path = default_profile_path().with_name(f"a100-llama2-7b-{num_stages}stage.json")
    if not path.exists():
        raise ValueError(f"no shipped profile with {num_stages} stages; pass --profile FILE")
    return path


LOG_ROOT = Path("runs/stack-logs")


def run_log_dir(root: Path = LOG_ROOT) -> Path:
    """A new directory name under `root` for one start's logs (UTC time, pid)."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return root / f"{stamp}-{os.getpid()}"


def point_latest(log_dir: Path) -> None:
    """`<root>/latest` -> this start's log directory (replaced atomically)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    link = log_dir.parent / "latest"
    tmp = log_dir.parent / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(log_dir.name)
    tmp.replace(link)


def stack_config(args: argparse.Namespace) -> StackConfig:
    """`lemix up`'s flags as a `StackConfig` (ValueError for a bad one)."""
    if args.policy not in POLICIES:
        raise ValueError(f"unknown policy {args.policy!r}; choose from {', '.join(POLICIES)}")
    # --log-dir as given; else one new directory per start (runs/redis stays
    # the Redis default either way: beside the log root).
    log_root = Path(args.log_dir) if args.log_dir else LOG_ROOT
    log_dir = Path(args.log_dir) if args.log_dir else run_log_dir()
    return StackConfig(
        num_nodes=args.nodes,
        profile_path=_profile_path(args.profile, args.stages, args.backend),
        backend=args.backend,
        policy=args.policy,
        host=args.host,
        gateway_port=args.gateway_port,
        http_port=args.http_port,
        time_scale=args.time_scale,
        train_rate=args.train_rate,
        log_dir=log_dir,
        redis_url=os.environ.get("LEMIX_REDIS_URL") or None,  # else an embedded one
        redis_dir=Path(args.redis_dir) if args.redis_dir else log_root.parent / "redis",
        redis_fsync=args.redis_fsync,
        redis_password=args.redis_password or os.environ.get("LEMIX_REDIS_PASSWORD") or None,
        model=args.model,
        tokenizer=args.tokenizer,
        api_key=api_key_arg(args),
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        max_in_flight=args.max_in_flight,
        engine=EngineKnobs.of(args),
    )


def startup_error_line(exc: BaseException, log_dir: Path) -> str:
    """One line for a stack that did not start: the error's first line (a
    service's names its log), its log's last line, and where the logs are."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    head = lines[0].removesuffix(" ends:") if lines else type(exc).__name__
    last = ""
    if len(lines) > 1:
        try:  # a service logs JSON lines: its "error" field says it all
            record = json.loads(lines[-1])
            last = str(record.get("error") or record.get("event") or lines[-1])
        except (ValueError, AttributeError):
            last = lines[-1]
        last = f"; last log line: {last}"
    return f"error: lemix up did not start: {head}{last} (logs: {log_dir})"


def cmd_up(args: argparse.Namespace) -> int:
    """Run the stack until a signal; 1 when it did not start or supervision gave up."""
    config = stack_config(args)
    if args.runtime == "docker":
        containers = ContainerConfig(
            image=args.image,
            redis_image=args.redis_image,
            project=args.project,
            gpus_per_node=args.gpus_per_node,
        )
        return run_containers_until_signalled(config, containers)
    if args.log_dir is None:
        point_latest(config.log_dir)
    try:
        return asyncio.run(run_until_signalled(config))
    except (RuntimeError, OSError) as exc:  # a service or Redis did not come up
        print(startup_error_line(exc, config.log_dir), file=sys.stderr)
        return 1
