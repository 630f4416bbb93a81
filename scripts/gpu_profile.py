"""Measure one pipeline stage of a Llama-2-7B-shaped model on a GPU and fit both
latency forms (the paper's η·C·ℓ² and ours), with held-out R²/MAPE.

One stage = 16 of the model's 32 decoder layers plus the embedding and the LM
head (a slight overestimate of either real stage). Weights are random (bf16):
latency depends on shapes, not values. Forward = prefill under no_grad;
backward = (forward+backward with grad) − forward with grad; decode = one step
of a batch holding a KV cache. CUDA events, warm-ups, median of repeats.

    python3 scripts/gpu_profile.py --out runs/gpu/h200_stage.json          # on the GPU
    python3 scripts/gpu_profile.py --tiny --device cpu --out /tmp/x.json   # plumbing check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lemix.latency import (  # noqa: E402
    DecodePoint,
    PhasePoint,
    fit_decode,
    fit_paper_eta,
    fit_quad,
    fit_quality,
    split_holdout,
)

LLAMA2_7B_STAGE = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
    max_position_embeddings=4096,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=256,
    max_position_embeddings=1024,
)


def timer(device: str, fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _forward_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids).loss


def _forward_backward(model: torch.nn.Module, ids: torch.Tensor) -> None:
    _forward_loss(model, ids).backward()
    model.zero_grad(set_to_none=True)


def measure(args: argparse.Namespace) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = TINY if args.tiny else LLAMA2_7B_STAGE
    config = LlamaConfig(**shape, attn_implementation="sdpa")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = LlamaForCausalLM(config).to(device=args.device, dtype=dtype)
    vocab = config.vocab_size
    batches = [1, 2, 4, 8]
    lengths = [64, 128, 256] if args.tiny else [128, 256, 512, 1024, 2048]
    forward, backward, decode = [], [], []
    for c in batches:
        for n in lengths:
            ids = torch.randint(0, vocab, (c, n), device=args.device)
            model.eval()
            with torch.no_grad():
                latency_s = timer(args.device, partial(model, ids), args.repeats)
                forward.append(PhasePoint(c, n, latency_s))
            if c * n > args.max_train_tokens:
                continue
            model.train()

            t_fwd = timer(args.device, partial(_forward_loss, model, ids), args.repeats)
            t_both = timer(args.device, partial(_forward_backward, model, ids), args.repeats)
            backward.append(PhasePoint(c, n, max(t_both - t_fwd, 1e-6)))
            print(
                f"C={c} l={n} fwd={forward[-1].latency_s * 1e3:.2f}ms "
                f"bwd={backward[-1].latency_s * 1e3:.2f}ms",
                flush=True,
            )
    model.eval()
    contexts = [64, 256] if args.tiny else [256, 1024, 2048]
    for c in [1, 8, 32, 64]:
        for ctx in contexts:
            ids = torch.randint(0, vocab, (c, ctx), device=args.device)
            with torch.no_grad():
                cache = model(ids, use_cache=True).past_key_values
                step = torch.randint(0, vocab, (c, 1), device=args.device)
                step_fn = partial(model, step, past_key_values=cache, use_cache=True)
                latency = timer(args.device, step_fn, args.repeats)
            decode.append(DecodePoint(c, c * ctx, latency))
            print(f"decode C={c} ctx={ctx} step={latency * 1e3:.2f}ms", flush=True)
            del cache
    return {"forward": forward, "backward": backward, "decode": decode}


def fit_report(points: dict) -> dict:
    report = {}
    for phase in ("forward", "backward"):
        fit_pts, hold = split_holdout(points[phase], 0.25, seed=0)
        eta = fit_paper_eta(fit_pts)
        quad = fit_quad(fit_pts)
        measured = [p.latency_s for p in hold]
        report[phase] = {
            "paper": {
                "eta": eta,
                **vars(
                    fit_quality(
                        [eta * p.batch_size * p.num_tokens**2 for p in hold], measured, len(fit_pts)
                    )
                ),
            },
            "ours": {
                **vars(quad),
                **vars(
                    fit_quality(
                        [quad(p.batch_size, p.num_tokens) for p in hold], measured, len(fit_pts)
                    )
                ),
            },
        }
    fit_pts, hold = split_holdout(points["decode"], 0.25, seed=0)
    dec = fit_decode(fit_pts)
    eta_f = report["forward"]["paper"]["eta"]
    measured = [p.latency_s for p in hold]
    report["decode"] = {
        "paper": vars(fit_quality([eta_f * p.batch_size for p in hold], measured, len(fit_pts))),
        "ours": {
            **vars(dec),
            **vars(
                fit_quality(
                    [dec(p.batch_size, p.sum_context_tokens) for p in hold], measured, len(fit_pts)
                )
            ),
        },
    }
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny config (plumbing check)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-train-tokens", type=int, default=8192)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    started = time.time()
    points = measure(args)
    report = {
        "what": "one 16-layer Llama-2-7B-shaped stage (+embedding, +LM head), random bf16 weights",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "points": {k: [vars(p) for p in v] for k, v in points.items()},
        "fits": fit_report(points),
        "wall_s": time.time() - started,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for phase, fits in report["fits"].items():
        print(
            f"{phase:8s} paper R2={fits['paper']['r2']:.3f} MAPE={fits['paper']['mape']:.3f} | "
            f"ours R2={fits['ours']['r2']:.3f} MAPE={fits['ours']['mape']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
