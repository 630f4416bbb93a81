"""Co-located LeMix vs SEPARATE on a real model: the torch half of `make demo`.

Each policy gets the same live stack (embedded Redis, scheduler, gateway,
2 torch executors of 2 stages each running a tiny Llama on the CPU) and the
same workload: Poisson inference requests whose prompt and reference answer
come from held-out (query, reference) pairs, and Poisson training samples
from a disjoint training split. Every request reports its inference loss
(teacher-forced cross-entropy of the reference under the weights that served
it) and its reference accuracy (the fraction of reference tokens that are
the model's top-1 choice, teacher-forced). Executors start from the preset's
seeded random weights, or from a pretrained checkpoint (`from_checkpoint`,
`make pretrain`). Co-located, every node trains and serves its own replica
(they start equal; without replica sync they are never synchronised, so each
learns only from the samples placed on it; with `replica_sync_every_tasks` M
they are averaged every M training tasks); SEPARATE trains on half the nodes and
ships weights to the serving half every K training tasks. The run prints both
side by side and plots inference loss over time.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lemix.engine_config import AUTO_DECODE_PACE_TBT_FRACTION, AUTO_TRAIN_SLICE_TBT_FRACTION
from lemix.harness.replay import ReplayConfig, run_replay
from lemix.infra.engine_options import EngineKnobs
from lemix.profile import torch_cpu_profile_path
from lemix.stack.launcher import Stack, StackConfig
from lemix.types import Task, TaskKind, TaskRecord

Pair = tuple[str, str]


@dataclass(frozen=True)
class TorchDemoConfig:
    policies: tuple[str, ...] = ("lemix", "separate")
    num_nodes: int = 2
    model: str = "tiny-llama"
    tokenizer: str = "bpe:8192"
    request_rate: float = 2.0  # inference requests/s
    training_rate: float = 4.0  # training samples/s
    duration_s: float = 60.0
    max_tokens: int = 16
    max_chars: int = 600  # query + reference, so a CPU prefill stays short
    sync_every_tasks: int = 100  # SEPARATE's K (the paper caps it at 100)
    # M: average the training replicas every M training tasks (0 = off;
    # `lemix.planner.replica_sync`)
    replica_sync_every_tasks: int = 0
    seed: int = 0
    slo_ttft_s: float = 2.0  # a CPU tiny model's SLO; one for every policy
    slo_tbt_s: float = 0.5

    def __post_init__(self) -> None:
        if self.request_rate <= 0 or self.training_rate < 0 or self.duration_s <= 0:
            raise ValueError("rates and duration must be positive")
        if self.replica_sync_every_tasks < 0:
            raise ValueError("replica_sync_every_tasks must be >= 0 (0 = off)")


def poisson_tasks(config: TorchDemoConfig) -> list[Task]:
    """Inference and training arrivals over `duration_s`, seeded."""
    rng = np.random.default_rng(config.seed)
    tasks: list[Task] = []
    for kind, rate in (
        (TaskKind.INFERENCE, config.request_rate),
        (TaskKind.TRAINING, config.training_rate),
    ):
        if rate <= 0:
            continue
        t = 0.0
        while True:
            t += float(rng.exponential(1.0 / rate))
            if t >= config.duration_s:
                break
            is_inf = kind is TaskKind.INFERENCE
            tasks.append(
                Task(
                    f"{kind.value[:3]}-{len(tasks)}",
                    kind,
                    t,
                    64,
                    config.max_tokens if is_inf else 0,
                )
            )
    tasks.sort(key=lambda task: task.arrival_s)
    return [dataclasses.replace(task, seq=i) for i, task in enumerate(tasks)]


def assign_texts(
    tasks: Sequence[Task], eval_pairs: Sequence[Pair], train_pairs: Sequence[Pair]
) -> dict[str, Pair]:
    """Task id -> (query, reference): inference from the eval split, training
    from the training split, cycling in order (the same for every policy)."""
    texts: dict[str, Pair] = {}
    num_inf = num_train = 0
    for task in tasks:
        if task.is_training:
            texts[task.task_id] = train_pairs[num_train % len(train_pairs)]
            num_train += 1
        else:
            texts[task.task_id] = eval_pairs[num_inf % len(eval_pairs)]
            num_inf += 1
    return texts


async def run_policy(
    config: TorchDemoConfig,
    policy: str,
    tasks: Sequence[Task],
    texts: dict[str, Pair],
    out_dir: Path,
    profile_path: Path | None = None,
) -> tuple[dict[str, Any], list[TaskRecord]]:
    """One live run of `policy`; its metrics object and per-task records."""
    stack_config = StackConfig(
        num_nodes=config.num_nodes,
        profile_path=profile_path or torch_cpu_profile_path(),
        backend="torch",
        policy=policy,
        gateway_port=0,
        latency_noise_cv=0.0,
        train_rate=0.5 if policy.startswith("separate") else 0.0,
        # Engine v2 with auto training slices and decode pace taken from this
        # run's own TBT SLO, the one it is judged by (the services would
        # otherwise derive one from the profile, 0.024 s on the CPU tiny profile).
        engine=EngineKnobs(
            train_slice_s=AUTO_TRAIN_SLICE_TBT_FRACTION * config.slo_tbt_s,
            decode_pace_s=AUTO_DECODE_PACE_TBT_FRACTION * config.slo_tbt_s,
        ),
        log_dir=out_dir / f"stack-logs-{policy}",
        namespace=f"demo-{policy}",
        model=config.model,
        tokenizer=config.tokenizer,
        extra_env={
            "LEMIX_SYNC_EVERY_TASKS": str(config.sync_every_tasks),
            "LEMIX_REPLICA_SYNC_EVERY_TASKS": str(config.replica_sync_every_tasks),
            "LEMIX_WEIGHT_SYNC_DIR": str((out_dir / f"weights-{policy}").resolve()),
            "LEMIX_MODEL_SEED": str(config.seed),
        },
    )
    records: list[TaskRecord] = []
    async with Stack(stack_config) as stack:
        print(
            f"[{policy}] stack up: gateway {stack.gateway_address}, {config.num_nodes} torch "
            f"nodes ({config.model}); replaying {len(tasks)} tasks over "
            f"{config.duration_s:g} s ...",
            flush=True,
        )
        metrics = await run_replay(
            ReplayConfig(
                target=stack.gateway_address,
                slo_ttft_s=config.slo_ttft_s,
                slo_tbt_s=config.slo_tbt_s,
                drain_timeout_s=120.0,
                text_for=lambda task: texts.get(task.task_id),
            ),
            tasks,
            request_rate=config.request_rate,
            train_rate=config.training_rate / config.request_rate,
            duration_s=config.duration_s,
            seed=config.seed,
            label=f"{policy} (torch, live)",
            records_out=records,
        )
    return metrics, records


def from_checkpoint(config: TorchDemoConfig, checkpoint: Path) -> TorchDemoConfig:
    """`config` with its executors starting from the pretrained `checkpoint`
    (`lemix.model.pretrain`): the directory as ``--model`` (absolute, as the
    executors run elsewhere) and the tokenizer it was trained with."""
    from lemix.model.pretrain import read_meta

    tokenizer = str(read_meta(checkpoint)["tokenizer"])
    return dataclasses.replace(config, model=str(checkpoint.resolve()), tokenizer=tokenizer)


def pretrained_checkpoint() -> Path:
    """The default pretrained checkpoint (`make pretrain`), trained first when
    it is not cached yet (minutes on two cores)."""
    from lemix.model.pretrain import PretrainConfig, ensure_pretrained

    return ensure_pretrained(PretrainConfig(), log=lambda line: print(line, flush=True))


def loss_series(records: Sequence[TaskRecord]) -> list[tuple[float, float]]:
    """(finish time s, inference loss) of every completed request with a loss."""
    return sorted(
        (r.finish_s, r.inference_loss)
        for r in records
        if r.finish_s is not None and r.inference_loss is not None
    )


def accuracy_series(records: Sequence[TaskRecord]) -> list[tuple[float, float]]:
    """(finish time s, reference accuracy) of every completed request with one."""
    return sorted(
        (r.finish_s, r.reference_accuracy)
        for r in records
        if r.finish_s is not None and r.reference_accuracy is not None
    )


def plot_loss(series: dict[str, list[tuple[float, float]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in series.items():
        if not points:
            continue
        t = np.array([p[0] for p in points])
        loss = np.array([p[1] for p in points])
        ax.scatter(t, loss, s=8, alpha=0.35)
        window = max(1, len(loss) // 10)
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        ax.plot(t[window - 1 :], smooth, label=f"{label} (moving mean of {window})")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("inference loss (reference cross-entropy, nats)")
    ax.set_title("Inference loss of served requests: co-located LeMix vs SEPARATE")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load_pairs(config: TorchDemoConfig, hh_path: Path | None) -> tuple[list[Pair], list[Pair]]:
    """(eval, train) splits: HH-RLHF pairs from `hh_path`, else the packaged ShareGPT."""
    if hh_path is not None:
        from lemix.workload.hh_jsonl import read_hh_pairs

        pool = [(q, r) for q, r in read_hh_pairs(hh_path) if len(q) + len(r) <= config.max_chars]
        order = np.random.default_rng(config.seed).permutation(len(pool))
        pairs = [pool[i] for i in order]
    else:
        from lemix.workload.corpus import default_pairs

        pairs = default_pairs(4000, config.seed, max_chars=config.max_chars)
    if len(pairs) < 20:
        raise ValueError("too few (query, reference) pairs under max_chars")
    num_eval = max(10, len(pairs) // 5)
    return pairs[:num_eval], pairs[num_eval:]


def run_demo(
    config: TorchDemoConfig, out_dir: Path, hh_path: Path | None = None
) -> tuple[list[dict[str, Any]], Path]:
    """Every policy live on one workload; returns the metrics and the PNG path."""
    eval_pairs, train_pairs = load_pairs(config, hh_path)
    tasks = poisson_tasks(config)
    texts = assign_texts(tasks, eval_pairs, train_pairs)
    runs: list[dict[str, Any]] = []
    series: dict[str, list[tuple[float, float]]] = {}
    for policy in config.policies:
        metrics, records = asyncio.run(run_policy(config, policy, tasks, texts, out_dir))
        metrics["backend"] = "torch"
        metrics["model"] = config.model
        metrics["sync_every_tasks"] = config.sync_every_tasks
        runs.append(metrics)
        series[policy] = loss_series(records)
    png = plot_loss(series, out_dir / "inference_loss.png")
    return runs, png


TABLE_ROWS = (
    ("inference_loss", "inference loss (nats)"),
    ("slo_attainment", "SLO attainment"),
    ("ttft_s.p50", "TTFT p50 (s)"),
    ("ttft_s.p99", "TTFT p99 (s)"),
    ("e2e_s.p50", "E2E p50 (s)"),
    ("e2e_s.p99", "E2E p99 (s)"),
    ("throughput_tokens_s", "throughput (tokens/s)"),
    ("num_completed_inference", "inference completed"),
    ("num_completed_training", "training completed"),
    ("num_lost", "lost"),
)


def side_by_side(runs: Sequence[dict[str, Any]]) -> str:
    """The runs as columns, one row per metric."""
    from lemix.report.metrics import format_table

    def lookup(row: dict[str, Any], key: str) -> Any:
        value: Any = row
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    rows = [
        {"metric": label, **{f"run{i}": lookup(run, key) for i, run in enumerate(runs)}}
        for key, label in TABLE_ROWS
    ]
    columns = [("metric", "metric")] + [
        (f"run{i}", str(run["policy"])) for i, run in enumerate(runs)
    ]
    return format_table(rows, columns)
