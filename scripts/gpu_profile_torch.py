"""Profile a staged preset model with the executor's own measurement code and fit a profile.

What the profiler service does over gRPC (`profiler.runner`), in one process:
build the model as the torch backend does (`StagedModel`, S stages on
`--device`), time every stage with `services.executor.torch_measure.
measure_stage` — forward and backward at each (C, ℓ), a decode step at each
(C, Σctx) — take the median of `--repeats` runs per point, and fit the
paper's latency model and ours with `profiler.fit.fit_profile`. Memory,
transfer and optimizer figures come from `--base-profile` with the memory
replaced by the real model's (`services.executor.torch_setup.model_profile`,
as the executor reports them), so only latency is measured here.

With all stages on one GPU (a one-GPU node), each stage's peak memory
includes the other stages' weights: the fit report's memory check then
disagrees with the base by that much, by construction.

    # on the H200 (scripts/gpu_check.sh), ~1B model, 2 stages on cuda:0:
    python scripts/gpu_profile_torch.py --model llama-1b --device cuda:0 \\
        --out profiles/measured/h200-llama-1b-2stage.json
    # plumbing check on a CPU:
    .venv/bin/python scripts/gpu_profile_torch.py --model tiny-llama --device cpu \\
        --batch-sizes 1,2 --num-tokens 16,32 --sum-context 16,64 --repeats 2 \\
        --out /tmp/tiny.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lemix.latency import DecodePoint, PhasePoint  # noqa: E402
from lemix.model.presets import ModelSpec, build_model  # noqa: E402
from lemix.model.staged import StagedModel  # noqa: E402
from lemix.profile import load_profile, save_profile  # noqa: E402
from lemix.report.metrics import format_table  # noqa: E402
from profiler.fit import (  # noqa: E402
    FIT_TABLE_COLUMNS,
    FitConfig,
    MemoryPoint,
    StageMeasurements,
    fit_profile,
    fit_quality_rows,
)
from services.executor.convert import MeasurePhase, MeasureSpec  # noqa: E402
from services.executor.torch_measure import measure_stage  # noqa: E402
from services.executor.torch_setup import model_profile  # noqa: E402

DEFAULT_BASE_PROFILE = "profiles/h100-llama2-7b-2stage.json"
# Sized for llama-1b on one H200 with both stages on cuda:0: 2 stages x (2 x 20
# forward/backward + 14 decode points) x (repeats + 1 warm-up) runs, well
# under the 5 minutes gpu_check.sh allows (the largest backward, 8 x 2,048
# tokens through 11 layers, is tens of ms there).
DEFAULT_BATCH_SIZES = "1,2,4,8"
DEFAULT_NUM_TOKENS = "128,256,512,1024,2048"
DEFAULT_SUM_CONTEXT = "256,1024,4096,16384,65536"
DEFAULT_DECODE_BATCH_SIZES = "1,4,16,64"


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need integers >= 1, got {text!r}")
    return values


def decode_grid(
    batch_sizes: tuple[int, ...], sum_context: tuple[int, ...], max_positions: int
) -> list[tuple[int, int]]:
    """(C, Σctx) with each sequence holding between 1 and `max_positions` tokens."""
    return [(c, s) for c in batch_sizes for s in sum_context if c <= s <= c * max_positions]


def _point(
    staged: StagedModel,
    phase: MeasurePhase,
    stage: int,
    batch_size: int,
    num_tokens: int,
    sum_context: int,
    repeats: int,
) -> tuple[float, int]:
    """(median latency s, peak bytes) of one grid point."""
    result = measure_stage(
        staged, MeasureSpec(phase, stage, batch_size, num_tokens, sum_context, repeats)
    )
    return statistics.median(result.latency_s), result.peak_memory_bytes


def measure_stages(staged: StagedModel, args: argparse.Namespace) -> list[StageMeasurements]:
    """Every grid point of every stage, one at a time (concurrent runs would time each other)."""
    decode_points = decode_grid(
        args.decode_batch_sizes, args.sum_context, staged.family.max_positions
    )
    measurements = []
    for stage in range(staged.num_stages):
        forward: list[PhasePoint] = []
        backward: list[PhasePoint] = []
        training_memory: list[MemoryPoint] = []
        for phase, points in ((MeasurePhase.FORWARD, forward), (MeasurePhase.BACKWARD, backward)):
            for c in args.batch_sizes:
                for n in args.num_tokens:
                    latency_s, peak = _point(staged, phase, stage, c, n, 0, args.repeats)
                    points.append(PhasePoint(c, n, latency_s))
                    training_memory.append(MemoryPoint(c * n, peak))
                    print(
                        f"stage {stage} {phase:8s} C={c:3d} l={n:5d} "
                        f"{latency_s * 1e3:9.3f} ms  peak {peak / 2**30:7.2f} GiB",
                        flush=True,
                    )
        decode: list[DecodePoint] = []
        decode_memory: list[MemoryPoint] = []
        for c, s in decode_points:
            latency_s, peak = _point(staged, MeasurePhase.DECODE, stage, c, 0, s, args.repeats)
            decode.append(DecodePoint(c, s, latency_s))
            decode_memory.append(MemoryPoint(s, peak))
            print(
                f"stage {stage} decode   C={c:3d} ctx={s:6d} "
                f"{latency_s * 1e3:9.3f} ms  peak {peak / 2**30:7.2f} GiB",
                flush=True,
            )
        measurements.append(
            StageMeasurements(
                tuple(forward),
                tuple(backward),
                tuple(decode),
                tuple(training_memory),
                tuple(decode_memory),
            )
        )
    return measurements


def _hardware(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            memory_bytes=int(props.total_memory),
            num_sms=props.multi_processor_count,
        )
    else:
        info.update(name="cpu", num_threads=torch.get_num_threads())
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b", help="a preset or checkpoint directory")
    parser.add_argument(
        "--device",
        default="cuda:0" if torch.cuda.is_available() else "cpu",
        help="every stage on this device (a one-GPU node)",
    )
    parser.add_argument("--dtype", default="", help="'' = bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument(
        "--batch-sizes",
        type=_ints,
        default=_ints(DEFAULT_BATCH_SIZES),
        help="C for forward/backward",
    )
    parser.add_argument(
        "--num-tokens", type=_ints, default=_ints(DEFAULT_NUM_TOKENS), help="ℓ for forward/backward"
    )
    parser.add_argument(
        "--decode-batch-sizes",
        type=_ints,
        default=_ints(DEFAULT_DECODE_BATCH_SIZES),
        help="C for decode",
    )
    parser.add_argument(
        "--sum-context",
        type=_ints,
        default=_ints(DEFAULT_SUM_CONTEXT),
        help="Σctx for decode (KV tokens over the batch)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--base-profile",
        default=DEFAULT_BASE_PROFILE,
        help="memory/transfer/optimizer figures (memory replaced by the model's)",
    )
    parser.add_argument("--name", default="", help="profile name ('' = the --out file's stem)")
    parser.add_argument("--out", default="profiles/measured/h200-llama-1b-2stage.json")
    parser.add_argument("--report", default="", help="fit report JSON ('' = <out>.report.json)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    staged = StagedModel(
        build_model(ModelSpec(args.model, dtype=dtype)), args.num_stages, [device] * args.num_stages
    )
    devices = [str(device)] * args.num_stages
    base = model_profile(load_profile(args.base_profile), staged, devices, 0)
    if base.num_stages != args.num_stages:
        parser.error(f"--base-profile has {base.num_stages} stages, not {args.num_stages}")
    print(
        f"{args.model} ({dtype}) in {args.num_stages} stages on {device}; built in "
        f"{time.perf_counter() - started:.1f} s",
        flush=True,
    )

    measurements = measure_stages(staged, args)
    out = Path(args.out)
    name = args.name or out.stem
    provenance = (
        f"scripts/gpu_profile_torch.py --model {args.model} --device {device} ({dtype}), "
        f"{args.num_stages} stages on one device: services.executor.torch_measure at C in "
        f"{list(args.batch_sizes)} x l in {list(args.num_tokens)}, decode at C in "
        f"{list(args.decode_batch_sizes)} x sum_context in {list(args.sum_context)}, median "
        f"of {args.repeats}; memory from the model, transfer and optimizer_step_s from "
        f"{args.base_profile}"
    )
    result = fit_profile(
        measurements, base, name, FitConfig(), provenance=provenance, hardware=_hardware(device)
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(result.profile, out)
    report = {
        **result.report,
        "model": args.model,
        "dtype": dtype,
        "hardware": _hardware(device),
        "points": [
            {
                "forward": [vars(p) for p in m.forward],
                "backward": [vars(p) for p in m.backward],
                "decode": [vars(p) for p in m.decode],
            }
            for m in measurements
        ],
        "wall_s": time.perf_counter() - started,
    }
    report_path = Path(args.report) if args.report else out.with_suffix(".report.json")
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(fit_quality_rows(result.profile), FIT_TABLE_COLUMNS))
    print(f"wrote {out} and {report_path} in {report['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
