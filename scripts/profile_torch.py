"""Measure a torch executor's stages and write its profile (the shipped CPU one).

Starts an embedded Redis and one real torch executor (gRPC on a free port),
runs the profiler over its grid through the Measure RPC, fits the paper's
model and ours, and writes a profile whose memory figures are the real
model's: weights, optimizer state and KV bytes per token from the model, and
activation bytes per token from the measured line through the saved-tensor
bytes of the backward grid.

    .venv/bin/python scripts/profile_torch.py --out profiles/cpu-tiny-llama-2stage.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lemix.infra.store.server import EmbeddedRedis  # noqa: E402
from lemix.profile import default_profile_path, load_profile, save_profile  # noqa: E402
from profiler.runner import ProfileGrid, run_profile  # noqa: E402
from services.executor.config import ExecutorConfig  # noqa: E402
from services.executor.service import ExecutorService  # noqa: E402


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


async def main(args: argparse.Namespace) -> int:
    redis = EmbeddedRedis().start()
    config = ExecutorConfig(
        backend="torch",
        model=args.model,
        tokenizer=args.tokenizer,
        devices=args.devices,
        redis_url=redis.url,
        namespace="profile",
        torch_threads=args.threads,
    )
    base = load_profile(default_profile_path())
    if args.stages != base.num_stages:
        base = load_profile(
            default_profile_path().with_name(f"a100-llama2-7b-{args.stages}stage.json")
        )
    service = ExecutorService(config, profile=base)
    try:
        await service.start()
        node = service.node
        assert node is not None
        real_profile = node.engine.profile  # memory figures of the real model
        grid = ProfileGrid(_ints(args.batch_sizes), _ints(args.tokens), _ints(args.contexts))
        run = await run_profile(
            f"127.0.0.1:{service.bound_port}",
            grid,
            args.repeats,
            real_profile,
            args.name or Path(args.out).stem,
            deadline_s=600.0,
        )
    finally:
        await service.stop(grace_s=1.0)
        redis.stop()
    profile = run.profile
    measured = [row["measured"]["activation_bytes_per_token"] for row in run.report["memory_check"]]
    activation = tuple(
        int(m) if m else real_profile.memory.activation_bytes_per_token[s]
        for s, m in enumerate(measured)
    )
    profile = dataclasses.replace(
        profile,
        memory=dataclasses.replace(real_profile.memory, activation_bytes_per_token=activation),
        model={**real_profile.model, "preset": args.model, "tokenizer": args.tokenizer},
        hardware={"device": args.devices or "cpu", "torch_threads": args.threads},
        provenance=(
            "measured by scripts/profile_torch.py: real torch executor over gRPC "
            "Measure, fitted by profiler.fit; memory from the model, activation "
            "bytes/token from saved-tensor bytes"
        ),
    )
    save_profile(profile, args.out)
    report_path = Path(args.out).with_suffix(".report.json")
    report_path.write_text(json.dumps(run.report, indent=2, default=str) + "\n")
    print(json.dumps(run.report.get("fit_quality", run.report), indent=2, default=str)[:4000])
    print(f"wrote {args.out} and {report_path}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", default="")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--tokenizer", default="bpe:8192")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--devices", default="")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", default="1,2,4,8")
    parser.add_argument("--tokens", default="16,32,64,128,256")
    parser.add_argument("--contexts", default="64,256,1024,4096")
    parser.add_argument("--repeats", type=int, default=5)
    sys.exit(asyncio.run(main(parser.parse_args())))
