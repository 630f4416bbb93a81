"""Workloads: deterministic, arrival-ordered task lists for sims and load tests.

Typical use::

    from lemix.workload import WorkloadConfig, build_workload
    wl = build_workload(WorkloadConfig(request_rate=8, train_rate=0.3, duration_s=60, seed=1))
    wl.tasks  # tuple[Task, ...] sorted by (arrival_s, seq)
"""

from lemix.workload.azure_csv import AzureTrace, read_azure_csv, time_scale
from lemix.workload.base import (
    EmpiricalLengths,
    LengthSampler,
    LognormalLengths,
    Workload,
    WorkloadConfig,
    clip_to_context,
    estimate_num_tokens,
)
from lemix.workload.chat import CHAT_MAX_TOTAL_TOKENS, chat_lengths
from lemix.workload.hh_jsonl import iter_hh_pairs, read_hh_pairs, split_pairs
from lemix.workload.long_output import LONG_OUTPUT_MAX_TOTAL_TOKENS, long_output_lengths
from lemix.workload.long_prompt import LONG_PROMPT_MAX_TOTAL_TOKENS, UniformLengths, gamma_arrivals
from lemix.workload.poisson import (
    WorkloadData,
    build_workload,
    load_workload_data,
    poisson_arrivals,
)
from lemix.workload.sharegpt import iter_sharegpt_conversations, read_sharegpt_pairs

__all__ = [
    "CHAT_MAX_TOTAL_TOKENS",
    "LONG_OUTPUT_MAX_TOTAL_TOKENS",
    "LONG_PROMPT_MAX_TOTAL_TOKENS",
    "AzureTrace",
    "EmpiricalLengths",
    "LengthSampler",
    "LognormalLengths",
    "UniformLengths",
    "Workload",
    "WorkloadConfig",
    "WorkloadData",
    "build_workload",
    "chat_lengths",
    "clip_to_context",
    "estimate_num_tokens",
    "gamma_arrivals",
    "iter_hh_pairs",
    "iter_sharegpt_conversations",
    "load_workload_data",
    "long_output_lengths",
    "poisson_arrivals",
    "read_azure_csv",
    "read_hh_pairs",
    "read_sharegpt_pairs",
    "split_pairs",
    "time_scale",
]
