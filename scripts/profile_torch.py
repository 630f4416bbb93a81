"""Measure a torch executor's stages and write its profile (the shipped CPU one).

Starts an embedded Redis and one real torch executor (gRPC on a free port),
runs the profiler over its grid through the Measure RPC, fits the paper's
model and ours, and writes a profile whose memory figures are the real
model's: weights, optimizer state and KV bytes per token from the model, and
activation bytes per token from the measured line through the saved-tensor
bytes of the backward grid.

Engine v2 shapes, measured in process on the executor's own loaded model
(the Measure RPC has no phase for them): prefill chunks of n new tokens after
p cached ones (`--chunk-new-tokens` × `--chunk-past-tokens`, n + p within the
model's positions), fitted as `ChunkCoeffs` and scored on held-out points next
to the derived default; and each stage's training pass run whole and as one
slice per layer group (`--slice-shape`), whose difference per extra slice is
the slice overhead the report records. The fit quality (held-out R², MAPE) of
every phase is printed and written to the report.

    .venv/bin/python scripts/profile_torch.py --out profiles/cpu-tiny-llama-2stage.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lemix.infra.store.server import EmbeddedRedis  # noqa: E402
from lemix.latency import ChunkCoeffs, ChunkPoint  # noqa: E402
from lemix.latency_fit import fit_chunk_points  # noqa: E402
from lemix.model.staged import StagedModel  # noqa: E402
from lemix.profile import Profile, default_profile_path, load_profile, save_profile  # noqa: E402
from profiler.fit import PHASES  # noqa: E402
from profiler.runner import STATISTICS, ProfileGrid, run_profile  # noqa: E402
from services.executor.backends.torch import TorchBackend, set_torch_threads  # noqa: E402
from services.executor.config import ExecutorConfig  # noqa: E402
from services.executor.service import ExecutorService  # noqa: E402
from services.executor.torch_measure import measure_chunk, measure_training_slices  # noqa: E402


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def measure_v2(
    staged: StagedModel, args: argparse.Namespace
) -> tuple[list[list[ChunkPoint]], list[dict[str, Any]]]:
    """Per stage: chunk points (medians) and one slice timing (see the docstring)."""
    set_torch_threads(args.threads)  # OpenMP threads are per calling thread
    limit = staged.family.max_positions
    pairs = [
        (n, p)
        for n in _ints(args.chunk_new_tokens)
        for p in _ints(args.chunk_past_tokens)
        if n + p <= limit
    ]
    batch_size, num_tokens = (int(v) for v in args.slice_shape.split("x"))
    aggregate = STATISTICS[args.statistic]
    chunks: list[list[ChunkPoint]] = []
    slices: list[dict[str, Any]] = []
    for s, stage in enumerate(staged.stages):
        chunks.append(
            [
                ChunkPoint(n, p, aggregate(measure_chunk(staged, s, n, p, args.repeats)))
                for n, p in pairs
            ]
        )
        num_slices = len(stage.layers)  # one layer group per layer: the finest slicing
        if num_slices < 2:
            continue
        timing = measure_training_slices(
            staged, s, batch_size, num_tokens, num_slices, args.repeats, aggregate
        )
        slices.append(
            {
                "stage": s,
                **dataclasses.asdict(timing),
                "forward_overhead_s": timing.forward_overhead_s,
                "backward_overhead_s": timing.backward_overhead_s,
            }
        )
    return chunks, slices


def with_chunk_model(
    profile: Profile, chunks: list[list[ChunkPoint]], holdout_fraction: float, seed: int
) -> Profile:
    """`profile` with a fitted chunk model per stage and its held-out quality."""
    ours, fits = profile.ours, []
    for s, points in enumerate(chunks):
        derived = ChunkCoeffs.derived(ours.forward[s], ours.decode[s])
        fits.append(
            fit_chunk_points(points, profile.paper.eta_forward[s], derived, holdout_fraction, seed)
        )
    quality = {k: [q[k] for _, q in fits] for k in fits[0][1]}
    return dataclasses.replace(
        profile,
        ours=dataclasses.replace(ours, chunk=tuple(c for c, _ in fits)),
        fit_quality={**profile.fit_quality, "chunk": quality},
    )


def quality_table(profile: Profile) -> str:
    """Held-out R² / MAPE per phase, model and stage, as printed text."""
    lines = [
        f"{'phase':9s} {'model':8s} "
        + "  ".join(f"stage {s} R² / MAPE" for s in range(profile.num_stages))
    ]
    for phase in PHASES:
        for model, per_stage in profile.fit_quality.get(phase, {}).items():
            cells = [f"{q['r2']:8.3f} / {100 * q['mape']:5.1f}%" for q in per_stage]
            lines.append(f"{phase:9s} {model:8s} " + "  ".join(cells))
    return "\n".join(lines)


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
            statistic=args.statistic,
        )
        backend = node.backend
        assert isinstance(backend, TorchBackend)  # config.backend is "torch"
        chunks, slices = await asyncio.to_thread(measure_v2, backend.staged, args)
    finally:
        await service.stop(grace_s=1.0)
        redis.stop()
    fit = run.report.get("fit_quality", {})
    profile = with_chunk_model(run.profile, chunks, fit["holdout_fraction"], fit["seed"])
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
            "bytes/token from saved-tensor bytes; prefill chunks and training "
            f"slices measured in process: {' '.join(sys.argv[1:])}"
        ),
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, args.out)
    report = {
        **run.report,
        "fit_quality": profile.fit_quality,
        "chunk_grid": {
            "num_new_tokens": list(_ints(args.chunk_new_tokens)),
            "num_past_tokens": list(_ints(args.chunk_past_tokens)),
        },
        "chunk_points": [[dataclasses.asdict(p) for p in points] for points in chunks],
        "training_slices": {"shape": args.slice_shape, "stages": slices},
    }
    report_path = Path(args.out).with_suffix(".report.json")
    report_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(quality_table(profile))
    for row in slices:
        print(
            f"stage {row['stage']}: {row['num_slices']} slices of {args.slice_shape}: forward "
            f"{1e3 * row['forward_whole_s']:.2f} -> {1e3 * row['forward_sliced_s']:.2f} ms, "
            f"backward {1e3 * row['backward_whole_s']:.2f} -> "
            f"{1e3 * row['backward_sliced_s']:.2f} ms"
        )
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
    parser.add_argument(
        "--statistic",
        choices=sorted(STATISTICS),
        default="median",
        help="a point's latency from its repeats; min on a shared, loaded machine",
    )
    parser.add_argument("--chunk-new-tokens", default="16,32,64,128,256,512")
    parser.add_argument("--chunk-past-tokens", default="0,128,512,1024,1536")
    parser.add_argument("--slice-shape", default="1x256", help="CxL of the slice timing")
    sys.exit(asyncio.run(main(parser.parse_args())))
