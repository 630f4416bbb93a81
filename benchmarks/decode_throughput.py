"""Decode throughput of the staged runner against plain Hugging Face `generate`.

One model is built once; the baseline is a deepcopy of it (same weights), so
both sides compute the same function. Per batch size B:

* ours: B requests of `--prompt-tokens` random ids are admitted to an
  `InferenceRunner` over a 2-stage `StagedModel` (both stages on `--device`),
  prefilled together in one iteration, then decoded together in packed
  iterations through both stages, exactly as the executor runs a continuous
  batch (stage 0 then stage 1 per iteration, on one thread).
* generate: `model.generate` on the same B prompts as one left-padded batch
  with an attention mask, greedy (`do_sample=False`), `max_new_tokens` =
  `min_new_tokens` = `--new-tokens`.

End-of-sequence is disabled on both sides (the runner's `eos_id=None`, and no
`eos_token_id` in the generation config), so every request produces exactly
`--new-tokens` tokens and the greedy tokens are comparable. Prompts have equal
length, so the left padding is a no-op and both sides do the same work.

Two rates per side, medians over `--repeats` timed runs after one warm-up:
decode tok/s = B·(new_tokens − 1) / (time from the first token to the last),
end-to-end tok/s = B·new_tokens / (time from start, prefill included, to the
last token). For generate the first-token time is taken by a no-op logits
processor, which HF calls once per step right after that step's forward.

Then, unless `--staggered-requests 0`, continuous batching against static
`generate` batches on one staggered request mix (`staggered_batching`).

Targets: (A) ours ≥ 0.8× generate at batch 1; (B) ours at batch 8 ≥ 2× ours
at batch 1 (aggregate tokens/s from batching); issue 9, on small-llama, one
CPU thread, tokens equal: (C) ours ≥ 1.0× generate at batch 8, (D) ≥ 1.2× at
batch 32, (E) continuous batching ≥ 1.5× static `generate` on the staggered mix.

    .venv/bin/python benchmarks/decode_throughput.py --model tiny-llama
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode_throughput.py \\
        --model small-llama --threads 1 --batch-sizes 1,8,32
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode_throughput.py \\
        --model small-llama --threads 1 --batch-sizes 8,32 --clock cpu  # a shared machine
    .venv/bin/python benchmarks/decode_throughput.py --model llama-1b --device cuda \\
        --json runs/gpu/decode_throughput_llama-1b.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.host_load import describe, host_load  # noqa: E402
from benchmarks.staggered_batching import bench_staggered, print_staggered  # noqa: E402
from lemix.model.presets import ModelSpec, build_model  # noqa: E402
from lemix.model.runner import GenRequest, InferenceRunner  # noqa: E402
from lemix.model.staged import StagedModel  # noqa: E402
from lemix.report.metrics import format_table  # noqa: E402

NUM_STAGES = 2
TARGET_BATCH1_RATIO = 0.8  # (A) ours / generate at batch 1
TARGET_BATCH = 8
TARGET_AGGREGATE_SPEEDUP = 2.0  # (B) ours at TARGET_BATCH / ours at batch 1
WARMUP_NEW_TOKENS = 4
TARGET_VS_GENERATE = {8: 1.0, 32: 1.2}  # (C), (D): ours / generate decode tok/s at batch B
TARGET_STAGGERED_RATIO = 1.5  # (E): continuous / static generate tok/s
# --clock: the staggered mix always runs on the wall clock (its arrivals are real time).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(frozen=True)
class Timing:
    """One timed run of one side."""

    total_s: float  # start -> last token (prefill + decode)
    decode_s: float  # first token -> last token
    tokens: list[list[int]]  # [B][new_tokens] generated ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompts(
    batch_size: int, num_tokens: int, vocab_size: int, seed: int
) -> list[tuple[int, ...]]:
    """Random prompt ids in [3, vocab) (clear of pad/bos/eos), one list per request."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (batch_size, num_tokens), generator=generator)
    return [tuple(int(t) for t in row) for row in ids]


def run_ours(
    runner: InferenceRunner,
    prompts: list[tuple[int, ...]],
    new_tokens: int,
    tag: str,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Admit all, prefill in one iteration, decode the batch together."""
    device = runner.staged.stages[-1].device
    keys = [f"{tag}-{i}" for i in range(len(prompts))]
    reqs = [
        GenRequest(key, prompt, new_tokens, ignore_eos=True)
        for key, prompt in zip(keys, prompts, strict=True)
    ]
    _sync(device)
    t0 = clock()
    try:
        for req in reqs:
            runner.admit(req)
        iteration = 0
        for s in range(runner.staged.num_stages):
            runner.run_stage(s, iteration, keys, [])
        _sync(device)
        t_first = clock()
        while len(reqs[0].generated) < new_tokens:
            iteration += 1
            for s in range(runner.staged.num_stages):
                runner.run_stage(s, iteration, [], keys)
        _sync(device)
        t_end = clock()
    finally:
        for key in keys:
            runner.release(key)
    return Timing(t_end - t0, t_end - t_first, [list(r.generated) for r in reqs])


class _FirstStepClock:
    """A no-op logits processor that notes when generate's first step finished."""

    def __init__(self, device: torch.device, clock: Callable[[], float]) -> None:
        self.device = device
        self.clock = clock
        self.first_s: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first_s is None:
            _sync(self.device)
            self.first_s = self.clock()
        return scores


def run_generate(
    model: nn.Module,
    prompts: list[tuple[int, ...]],
    new_tokens: int,
    pad_id: int,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Plain HF greedy generate of the batch, left-padded, eos disabled."""
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):  # left padding
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    first_step = _FirstStepClock(device, clock)
    _sync(device)
    t0 = clock()
    hf_model: Any = model  # an HF causal LM; `nn.Module` does not declare generate
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=pad_id,
            logits_processor=LogitsProcessorList([first_step]),
        )
    _sync(device)
    t_end = clock()
    first_s = first_step.first_s if first_step.first_s is not None else t0
    return Timing(t_end - t0, t_end - first_s, out[:, width:].tolist())


def _rates(timings: list[Timing], batch_size: int, new_tokens: int) -> dict[str, Any]:
    total_s = statistics.median(t.total_s for t in timings)
    decode_s = statistics.median(t.decode_s for t in timings)
    return {
        "e2e_s": total_s,
        "decode_s": decode_s,
        "e2e_tok_s": batch_size * new_tokens / total_s,
        "decode_tok_s": batch_size * (new_tokens - 1) / decode_s if new_tokens > 1 else 0.0,
        "e2e_s_samples": [t.total_s for t in timings],
        "decode_s_samples": [t.decode_s for t in timings],
    }


def _first_mismatch(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, int] | None:
    """(request, position) of the first differing greedy token, or None."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for j, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return i, j
    return None


def bench_batch(
    runner: InferenceRunner,
    baseline: nn.Module,
    args: argparse.Namespace,
    batch_size: int,
    vocab_size: int,
    pad_id: int,
) -> dict[str, Any]:
    prompts = make_prompts(batch_size, args.prompt_tokens, vocab_size, seed=batch_size)
    run_ours(runner, prompts, WARMUP_NEW_TOKENS, "warm")
    run_generate(baseline, prompts, WARMUP_NEW_TOKENS, pad_id)
    ours: list[Timing] = []
    theirs: list[Timing] = []
    clock = CLOCKS[args.clock]
    for r in range(args.repeats):  # interleaved, so drift hits both sides alike
        ours.append(run_ours(runner, prompts, args.new_tokens, f"r{r}", clock))
        theirs.append(run_generate(baseline, prompts, args.new_tokens, pad_id, clock))
    mismatch = _first_mismatch(ours[0].tokens, theirs[0].tokens)
    row: dict[str, Any] = {
        "batch": batch_size,
        "ours": _rates(ours, batch_size, args.new_tokens),
        "generate": _rates(theirs, batch_size, args.new_tokens),
        "tokens_equal": mismatch is None,
        "first_mismatch": list(mismatch) if mismatch else None,
    }
    row["decode_ratio"] = row["ours"]["decode_tok_s"] / row["generate"]["decode_tok_s"]
    row["e2e_ratio"] = row["ours"]["e2e_tok_s"] / row["generate"]["e2e_tok_s"]
    return row


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_batch = {row["batch"]: row for row in rows}
    targets: dict[str, Any] = {}
    if 1 in by_batch:
        ratio = by_batch[1]["decode_ratio"]
        targets["A_batch1_vs_generate"] = {
            "what": f"ours / generate decode tok/s at batch 1 >= {TARGET_BATCH1_RATIO}",
            "value": ratio,
            "is_met": ratio >= TARGET_BATCH1_RATIO,
        }
    if 1 in by_batch and TARGET_BATCH in by_batch:
        speedup = (
            by_batch[TARGET_BATCH]["ours"]["decode_tok_s"] / by_batch[1]["ours"]["decode_tok_s"]
        )
        targets["B_aggregate_batch8_vs_batch1"] = {
            "what": (
                f"ours decode tok/s at batch {TARGET_BATCH} / ours at batch 1 >= "
                f"{TARGET_AGGREGATE_SPEEDUP}"
            ),
            "value": speedup,
            "is_met": speedup >= TARGET_AGGREGATE_SPEEDUP,
        }
        targets["batch8_vs_generate"] = {
            "what": f"ours / generate decode tok/s at batch {TARGET_BATCH} (reported, no target)",
            "value": by_batch[TARGET_BATCH]["decode_ratio"],
            "is_met": None,
        }
    for (batch, floor), name in zip(TARGET_VS_GENERATE.items(), "CD", strict=True):
        if batch in by_batch:
            ratio = by_batch[batch]["decode_ratio"]
            targets[f"{name}_batch{batch}_vs_generate"] = {
                "what": f"ours / generate decode tok/s at batch {batch} >= {floor}, tokens equal",
                "value": ratio,
                "is_met": ratio >= floor and by_batch[batch]["tokens_equal"],
            }
    return targets


def _addresses(batch_size: int) -> str:
    if batch_size == 1:
        return "A (>=0.8x generate)"
    if batch_size == TARGET_BATCH:
        return "B (>=2x ours@1); C (>=1.0x generate)"
    if batch_size in TARGET_VS_GENERATE:
        return f"D (>={TARGET_VS_GENERATE[batch_size]}x generate)"
    return ""


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - the baseline needs it anyway
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def hbm_floor(
    runner: InferenceRunner, rows: list[dict[str, Any]], hbm_gbps: float
) -> dict[str, Any]:
    """Each batch's measured decode step (both stages) against the memory-bound
    floor: every weight byte read once per step at `hbm_gbps` (KV reads, small
    at these contexts, are left out, so the floor is a lower bound)."""
    weight_bytes = sum(runner.staged.weight_bytes())
    floor_s = weight_bytes / (hbm_gbps * 1e9)
    per_batch = []
    for row in rows:
        step_s = row["batch"] / row["ours"]["decode_tok_s"]
        per_batch.append({"batch": row["batch"], "step_s": step_s, "floor_ratio": step_s / floor_s})
        print(
            f"batch {row['batch']:3d}: decode step {step_s * 1e3:.3f} ms vs the HBM floor "
            f"{floor_s * 1e3:.3f} ms ({weight_bytes / 1e9:.2f} GB of weights at "
            f"{hbm_gbps:g} GB/s): {step_s / floor_s:.2f}x"
        )
    return {
        "weight_bytes": weight_bytes,
        "hbm_gbps": hbm_gbps,
        "floor_s": floor_s,
        "rows": per_batch,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="tiny-llama", help="a preset (tiny-llama, small-llama, llama-1b, ...)"
    )
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (both stages on it)")
    parser.add_argument("--dtype", default="", help="float32/bfloat16 ('' = bf16 on cuda)")
    parser.add_argument("--json", default="runs/bench/decode_throughput.json")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="time the batch runs by the wall clock, or by this process's CPU time: on a "
        "shared machine other jobs' time slices inflate wall time at random, not CPU time "
        "(their cache and memory traffic still slow both sides); one thread only, on a CPU",
    )
    parser.add_argument(
        "--staggered-requests", type=int, default=48, help="requests in the mix (0 = skip)"
    )
    parser.add_argument("--staggered-gap-s", type=float, default=0.05, help="mean arrival gap")
    parser.add_argument("--staggered-batch", type=int, default=16, help="max requests at once")
    parser.add_argument(
        "--hbm-gbps",
        type=float,
        default=0.0,
        help="device memory bandwidth, GB/s (e.g. 4800 for an H200): reports each decode "
        "step against the floor of reading every weight once (0 = skip)",
    )
    args = parser.parse_args(argv)
    host = host_load()
    print(describe(host))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if not batch_sizes or min(batch_sizes) < 1:
        parser.error("--batch-sizes needs integers >= 1")
    if args.prompt_tokens < 1 or args.new_tokens < 2 or args.repeats < 1:
        parser.error("--prompt-tokens >= 1, --new-tokens >= 2 and --repeats >= 1")
    if args.clock == "cpu" and (args.threads != 1 or args.device != "cpu"):
        # CPU time sums the threads' time, and does not see a GPU's.
        parser.error("--clock cpu needs --threads 1 and --device cpu")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")

    spec = ModelSpec(args.model, seed=0, dtype=dtype)
    model = build_model(spec)
    baseline = copy.deepcopy(model).to(device)  # same weights, before staging moves them
    baseline.generation_config.eos_token_id = None
    runner = InferenceRunner(StagedModel(model, NUM_STAGES, [device] * NUM_STAGES), eos_id=None)
    vocab_size = runner.staged.vocab_size

    rows = []
    for batch_size in batch_sizes:
        row = bench_batch(runner, baseline, args, batch_size, vocab_size, spec.pad_id)
        rows.append(row)
        print(
            f"batch {batch_size:3d}: ours {row['ours']['decode_tok_s']:9.1f} tok/s, "
            f"generate {row['generate']['decode_tok_s']:9.1f} tok/s",
            flush=True,
        )
        if not row["tokens_equal"]:
            i, j = row["first_mismatch"]
            severity = "WARNING" if batch_size == 1 else "note"
            print(
                f"{severity}: greedy tokens differ at batch {batch_size} (request {i}, "
                f"token {j}); batch 1 must match, batch > 1 may differ by float "
                "reduction order in batched matmuls",
                flush=True,
            )

    table_rows = [
        {
            "batch": row["batch"],
            "ours": row["ours"]["decode_tok_s"],
            "generate": row["generate"]["decode_tok_s"],
            "ratio": row["decode_ratio"],
            "ours_e2e": row["ours"]["e2e_tok_s"],
            "generate_e2e": row["generate"]["e2e_tok_s"],
            "e2e_ratio": row["e2e_ratio"],
            "equal": "yes" if row["tokens_equal"] else "NO",
            "target": _addresses(row["batch"]),
        }
        for row in rows
    ]
    print(
        f"\n{args.model} on {device} ({dtype}), {NUM_STAGES} stages, prompt "
        f"{args.prompt_tokens}, new {args.new_tokens}, median of {args.repeats}, "
        f"{torch.get_num_threads()} thread(s), {args.clock} clock"
    )
    print(
        format_table(
            table_rows,
            [
                ("batch", "batch"),
                ("ours", "ours decode tok/s"),
                ("generate", "generate decode tok/s"),
                ("ratio", "ratio"),
                ("ours_e2e", "ours e2e tok/s"),
                ("generate_e2e", "generate e2e tok/s"),
                ("e2e_ratio", "e2e ratio"),
                ("equal", "tokens equal"),
                ("target", "addresses target"),
            ],
        )
    )
    targets = _targets(rows)
    floor = hbm_floor(runner, rows, args.hbm_gbps) if args.hbm_gbps > 0 else None
    staggered = None
    if args.staggered_requests > 0:
        staggered = bench_staggered(
            runner,
            baseline,
            num_requests=args.staggered_requests,
            mean_gap_s=args.staggered_gap_s,
            max_batch=args.staggered_batch,
            repeats=args.repeats,
            vocab_size=vocab_size,
            pad_id=spec.pad_id,
            generate=run_generate,
        )
        print_staggered(staggered)
        targets["E_staggered_continuous_vs_static"] = {
            "what": (
                f"continuous / static generate tok/s on the staggered mix >= "
                f"{TARGET_STAGGERED_RATIO}, tokens equal"
            ),
            "value": staggered["ratio"],
            "is_met": staggered["ratio"] >= TARGET_STAGGERED_RATIO and staggered["tokens_equal"],
        }
    for name, target in targets.items():
        verdict = {True: "MET", False: "NOT MET", None: "info"}[target["is_met"]]
        print(f"{name}: {target['what']}: {target['value']:.2f} -> {verdict}")

    report = {
        "model": args.model,
        "dtype": dtype,
        "num_stages": NUM_STAGES,
        "clock": args.clock,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "hbm_floor": floor,
        "machine": machine_info(device),
        "host_at_start": host,
        "rows": rows,
        "staggered": staggered,
        "targets": targets,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
