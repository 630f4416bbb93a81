"""`lemix profile`: measure one executor over a grid, fit the latency models,
write the profile file (and store it in Redis if asked).

The profiler is imported only when this command's parser is built or it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lemix.infra.store.keys import DEFAULT_NAMESPACE, RedisKeys
from lemix.profile import Profile, default_profile_path, load_profile
from lemix.report.metrics import format_table

if TYPE_CHECKING:
    from profiler.fit import FitConfig
    from profiler.runner import ProfileGrid, ProfileRun


def add_profile_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`lemix profile`'s subparser and flags (their defaults are the profiler's)."""
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
    from lemix.infra.store.redis_password import redact_url
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
