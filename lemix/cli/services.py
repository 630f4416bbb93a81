"""`lemix up`, `lemix replay` and `lemix profile`: the commands that run, load or
measure the service stack.

Flag → typed-config mapping for these commands lives here, beside
`lemix/cli/main.py`'s for the simulator commands; `lemix/cli/main.py` dispatches.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lemix import __version__
from lemix.cli import workload_args
from lemix.harness.replay import ReplayConfig, format_lost, run_replay
from lemix.infra.engine_options import ENGINE_OPTIONS, EngineKnobs
from lemix.infra.rpc.auth import API_KEY_ENV
from lemix.infra.store.keys import DEFAULT_NAMESPACE, RedisKeys
from lemix.infra.store.server import APPENDFSYNC_POLICIES
from lemix.planner.registry import POLICIES
from lemix.profile import Profile, default_profile_path, load_profile, torch_cpu_profile_path
from lemix.report.metrics import LATENCY_TABLE_ROWS, OUTCOME_TABLE_ROWS, format_table
from lemix.slo import SloConfig, compute_slo
from lemix.stack.config import StackConfig
from lemix.stack.containers import ContainerConfig, run_containers_until_signalled
from lemix.stack.up import run_until_signalled
from lemix.workload import build_workload

if TYPE_CHECKING:  # the profiler is imported only when `lemix profile` runs
    from profiler.fit import FitConfig
    from profiler.runner import ProfileGrid, ProfileRun

REPLAY_TABLE_ROWS: tuple[tuple[str, str], ...] = (
    *OUTCOME_TABLE_ROWS,
    *LATENCY_TABLE_ROWS,
    ("slo_ttft_s", "SLO TTFT (s)"),
    ("slo_tbt_s", "SLO TBT (s)"),
)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each flag's default, unless its help already names one
    or it has none (None: the help says what happens then)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or "default" in text.lower():
            return text
        return super()._get_help_string(action)


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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
            help=f"{opt.help} (default: v1, {default})",
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
    _add_api_key_flag(up, "require this API key (comma-separated: several) on the gateway's API")
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

    _add_profile_parser(sub)

    rp = sub.add_parser("replay", help="open-loop load against a running gateway")
    rp.add_argument("--target", required=True, metavar="HOST:PORT")
    rp.add_argument(
        "--poisson",
        type=float,
        metavar="RATE",
        help="Poisson arrivals at RATE req/s (with --trace: time-scale it to RATE)",
    )
    rp.add_argument("--trace", metavar="FILE", help="Azure-format CSV to replay")
    rp.add_argument("--lengths-from", metavar="FILE", help="resample lengths from an Azure CSV")
    rp.add_argument("--train-data", metavar="FILE", help="hh-rlhf JSON lines: training lengths")
    workload_args.add_segment_args(rp)
    rp.add_argument("--train-rate", type=float, default=0.0)
    rp.add_argument("--duration", type=float, help="arrival window in s (default 60)")
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument(
        "--profile",
        metavar="FILE",
        help="profile for the SLO (5x unloaded latency, as `lemix sim` computes it)",
    )
    rp.add_argument("--drain-timeout", type=float, default=120.0)
    rp.add_argument("--json", metavar="OUT", help="write the metrics JSON (a list of one run)")
    rp.add_argument(
        "--tls-ca-file",
        default="",
        metavar="FILE",
        help="connect with TLS, trusting this CA (PEM) for the gateway's "
        "certificate (default: plaintext)",
    )
    _add_api_key_flag(rp, "the gateway's API key")


def _add_api_key_flag(parser: argparse.ArgumentParser, text: str) -> None:
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


def _add_profile_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from profiler.runner import (
        DEFAULT_BATCH_SIZES,
        DEFAULT_MEASURE_DEADLINE_S,
        DEFAULT_NUM_REPEATS,
        DEFAULT_NUM_TOKENS,
        DEFAULT_SUM_CONTEXT_TOKENS,
    )

    def csv(values: tuple[int, ...]) -> str:
        return ",".join(str(v) for v in values)

    pr = sub.add_parser("profile", help="measure one executor over a grid and fit the models")
    pr.add_argument("--target", required=True, metavar="HOST:PORT", help="the executor")
    pr.add_argument("--out", required=True, metavar="FILE", help="write the profile JSON here")
    pr.add_argument("--name", help="profile name (default: the --out file's stem)")
    pr.add_argument(
        "--batch-sizes",
        default=csv(DEFAULT_BATCH_SIZES),
        metavar="C,...",
        help="C of the forward/backward and decode grids",
    )
    pr.add_argument(
        "--tokens",
        default=csv(DEFAULT_NUM_TOKENS),
        metavar="L,...",
        help="tokens per sequence of the forward/backward grid",
    )
    pr.add_argument(
        "--contexts",
        default=csv(DEFAULT_SUM_CONTEXT_TOKENS),
        metavar="N,...",
        help="KV tokens summed over the batch, decode grid",
    )
    pr.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_NUM_REPEATS,
        help="runs per point; the point's latency is their median",
    )
    pr.add_argument(
        "--base-profile",
        metavar="FILE",
        help="profile the executor runs: memory, transfer and optimizer figures are "
        "copied from it (default: the shipped A100 one)",
    )
    pr.add_argument(
        "--holdout-fraction",
        type=float,
        default=0.25,
        help="share of points held out to score the fits",
    )
    pr.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    pr.add_argument(
        "--deadline",
        type=float,
        default=DEFAULT_MEASURE_DEADLINE_S,
        metavar="S",
        help="deadline of one Measure call, seconds",
    )
    pr.add_argument("--redis-url", metavar="URL", help="also store the profile in this Redis")
    pr.add_argument(
        "--namespace",
        help="Redis key namespace, with --redis-url [env LEMIX_NAMESPACE; default lemix]",
    )


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} needs comma-separated integers, got {text!r}") from None


@dataclass(frozen=True)
class ProfileCommandConfig:
    """`lemix profile`'s flags, typed and checked (built by `profile_command_config`)."""

    target: str  # executor host:port
    out: Path
    name: str
    grid: ProfileGrid
    num_repeats: int
    base_profile: Profile
    fit: FitConfig
    deadline_s: float  # one Measure call
    redis_url: str | None  # None: write the file only
    keys: RedisKeys


def profile_command_config(args: argparse.Namespace) -> ProfileCommandConfig:
    from profiler.fit import FitConfig
    from profiler.runner import ProfileGrid

    out = Path(args.out)
    keys = RedisKeys(args.namespace or os.environ.get("LEMIX_NAMESPACE") or DEFAULT_NAMESPACE)
    name = args.name or out.stem
    keys.profile(name)  # a bad name fails now, not after the measurements
    return ProfileCommandConfig(
        target=args.target,
        out=out,
        name=name,
        grid=ProfileGrid(
            _ints("--batch-sizes", args.batch_sizes),
            _ints("--tokens", args.tokens),
            _ints("--contexts", args.contexts),
        ),
        num_repeats=args.repeats,
        base_profile=load_profile(args.base_profile or default_profile_path()),
        fit=FitConfig(args.holdout_fraction, args.seed),
        deadline_s=args.deadline,
        redis_url=args.redis_url,
        keys=keys,
    )


def cmd_profile(args: argparse.Namespace) -> int:
    """Profile one executor, write the profile file (and store it in Redis if asked)."""
    from profiler.fit import FIT_TABLE_COLUMNS, fit_quality_rows

    config = profile_command_config(args)
    run = asyncio.run(_profile_and_store(config))
    print(format_table(fit_quality_rows(run.profile), FIT_TABLE_COLUMNS))
    for check in run.report["memory_check"]:
        if check["is_consistent"] is False:
            print(
                f"warning: stage {check['stage']}: peak memory measured {check['measured']} "
                f"differs from base profile {config.base_profile.name!r}'s {check['base']}"
            )
    print(f"wrote {config.out}")
    if config.redis_url:
        print(f"stored in Redis as {config.keys.profile(config.name)}")
    return 0


async def _profile_and_store(config: ProfileCommandConfig) -> ProfileRun:
    from redis.exceptions import RedisError

    from lemix.infra.rpc.errors import Unavailable
    from lemix.infra.store.client import RedisClientConfig, connect
    from lemix.infra.store.server import redact_url
    from lemix.infra.store.store import Store
    from lemix.profile import save_profile
    from profiler.convert import profile_json
    from profiler.runner import run_profile

    client = None
    if config.redis_url:
        client = connect(
            RedisClientConfig(config.redis_url, max_connections=2, socket_timeout_s=30.0)
        )
    try:
        if client is not None:  # fail before the measurements, not after
            await client.ping()
        run = await run_profile(
            config.target,
            config.grid,
            config.num_repeats,
            config.base_profile,
            config.name,
            fit_config=config.fit,
            deadline_s=config.deadline_s,
            # The stack's internal token, when its executors require one.
            service_token=os.environ.get("LEMIX_SERVICE_TOKEN", ""),
        )
        config.out.parent.mkdir(parents=True, exist_ok=True)
        save_profile(run.profile, config.out)
        if client is not None:
            await Store(client, config.keys).put_profile(config.name, profile_json(run))
        return run
    except RedisError as exc:
        raise Unavailable(
            f"Redis at {redact_url(config.redis_url or '')}: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        if client is not None:
            await client.aclose()


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
        engine=EngineKnobs(
            args.num_micro_batches, args.prefill_token_budget, args.train_slice_s, args.batch_cap
        ),
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


def cmd_replay(args: argparse.Namespace) -> int:
    workload_config = workload_args.workload_config(args, args.poisson, args.train_rate, args.seed)
    workload = build_workload(workload_config)
    tasks = list(workload.tasks)
    profile = load_profile(args.profile or default_profile_path())
    slo = compute_slo(profile, tasks, SloConfig())
    config = ReplayConfig(
        target=args.target,
        drain_timeout_s=args.drain_timeout,
        slo_ttft_s=slo.ttft_s,
        slo_tbt_s=slo.tbt_s,
        tls_ca_file=args.tls_ca_file,
        api_key=api_key_arg(args),
    )
    metrics = asyncio.run(
        run_replay(
            config,
            tasks,
            request_rate=workload_config.request_rate,
            train_rate=args.train_rate,
            duration_s=workload.duration_s,
            seed=args.seed,
        )
    )
    rows = [{"metric": label, "value": _lookup(metrics, key)} for key, label in REPLAY_TABLE_ROWS]
    print(format_table(rows, [("metric", "metric"), ("value", "value")]))
    print(format_lost(metrics))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([metrics], indent=2) + "\n")
        print(f"metrics JSON: {args.json}")
    return 0 if metrics["num_lost"] == 0 else 1


# `make demo`'s live part: small enough for a 2-core laptop, real enough to
# exercise every service (2 emulated nodes x 2 stages, timing from the profile).
DEMO_LIVE_NODES = 2
DEMO_LIVE_RATE = 3.0
DEMO_LIVE_TRAIN_RATE = 0.3
DEMO_LIVE_DURATION_S = 20.0


async def _live_demo(out_dir: Path) -> dict:
    from lemix.workload import WorkloadConfig

    workload = build_workload(
        WorkloadConfig(
            request_rate=DEMO_LIVE_RATE,
            train_rate=DEMO_LIVE_TRAIN_RATE,
            duration_s=DEMO_LIVE_DURATION_S,
            seed=0,
        )
    )
    tasks = list(workload.tasks)
    slo = compute_slo(load_profile(default_profile_path()), tasks, SloConfig())
    config = StackConfig(
        num_nodes=DEMO_LIVE_NODES, gateway_port=0, log_dir=out_dir / "stack-logs", namespace="demo"
    )
    from lemix.stack.launcher import Stack

    async with Stack(config) as stack:
        print(
            f"stack up: gateway {stack.gateway_address}, {DEMO_LIVE_NODES} emulated nodes; "
            f"replaying {len(tasks)} tasks over {DEMO_LIVE_DURATION_S:g} s ...",
            flush=True,
        )
        return await run_replay(
            ReplayConfig(
                target=stack.gateway_address,
                slo_ttft_s=slo.ttft_s,
                slo_tbt_s=slo.tbt_s,
                drain_timeout_s=120.0,
            ),
            tasks,
            request_rate=DEMO_LIVE_RATE,
            train_rate=DEMO_LIVE_TRAIN_RATE,
            duration_s=workload.duration_s,
            seed=0,
            label="lemix (live stack)",
        )


def run_live_demo(out_dir: Path) -> dict:
    """The live half of `lemix demo`: `lemix up` + `lemix replay`, in-process."""
    metrics = asyncio.run(_live_demo(out_dir))
    rows = [{"metric": label, "value": _lookup(metrics, key)} for key, label in REPLAY_TABLE_ROWS]
    print(format_table(rows, [("metric", "live stack (emulated)"), ("value", "value")]))
    return metrics


def _lookup(row: dict, key: str) -> object:
    value: object = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value
