"""`python -m lemix.cli.pretrain` (`make pretrain`): pretrain the small model once.

Trains a preset on the packaged ShareGPT text (`lemix.model.pretrain`) and
caches the checkpoint under ``runs/cache/pretrain-<hash>/``; a second run with
the same flags finds it and only prints its path and loss curve. The path is
what `benchmarks/inference_loss.py --init pretrained` and the executors'
``--model`` load.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from lemix.model.pretrain import PretrainConfig, ensure_pretrained, read_meta


def add_pretrain_args(parser: argparse.ArgumentParser) -> None:
    """One ``--<field>`` flag per `PretrainConfig` field, its default as default."""
    for field in dataclasses.fields(PretrainConfig):
        default = field.default
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=type(default),
            default=default,
            help=f"default {default}",
        )


def pretrain_config(args: argparse.Namespace) -> PretrainConfig:
    """The config the parsed flags name (ValueError for an invalid one)."""
    return PretrainConfig(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(PretrainConfig)}
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_pretrain_args(parser)
    parser.add_argument("--cache-root", type=Path, default=None, help="default runs/cache")
    args = parser.parse_args(argv)
    try:
        config = pretrain_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = ensure_pretrained(
        config, cache_root=args.cache_root, log=lambda line: print(line, flush=True)
    )
    meta = read_meta(path)
    curve = ", ".join(f"{step}: {loss:.3f}" for step, loss in meta["eval_losses"])
    print(f"held-out loss by step (nats/token): {curve}")
    print(f"trained on {meta['num_train_tokens']} tokens in {meta['train_s']:.0f} s")
    print(f"checkpoint: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
