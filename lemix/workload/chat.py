"""The chat workload (issue 10, item 4): ShareGPT-shaped lengths, Poisson
arrivals.

Lengths are lognormal fits (`LognormalLengths.from_median_mean`) to the
ShareGPT request statistics Sarathi-Serve publishes (Agrawal et al., OSDI
2024; file `data/processed_traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv`
of microsoft/sarathi-serve, commit 72339db): 30,731 requests, Llama-2
tokenizer, at most 8,149 tokens in all (the file's 8k filter). Prompt tokens
median 1,730 /
mean 2,340 (p90 5,696); output tokens median 415 / mean 438.7 (p90 834).
Fitted sigmas: prompt 0.78, output 0.33. The fit matches medians and means,
not tails: its prompt p90 is ~4,690 against the data's 5,696.

Prompt + output is clipped to 4,096 tokens, Llama-2's context length (the
shipped profiles' model), by cutting the prompt (`clip_to_context`), as a
server keeps the latest turns; about a quarter of the data's requests are
longer than that. Nothing of the data set is copied here: only the four
published statistics above.
"""

from __future__ import annotations

from lemix.workload.base import LognormalLengths

SHAREGPT_PROMPT_MEDIAN = 1730.0
SHAREGPT_PROMPT_MEAN = 2340.0
SHAREGPT_OUTPUT_MEDIAN = 415.0
SHAREGPT_OUTPUT_MEAN = 438.7
# Llama-2's context length: the chat workload's prompt + output limit.
CHAT_MAX_TOTAL_TOKENS = 4096


def chat_lengths() -> LognormalLengths:
    """The chat workload's (prompt, output) sampler: the ShareGPT fit."""
    return LognormalLengths.from_median_mean(
        SHAREGPT_PROMPT_MEDIAN,
        SHAREGPT_PROMPT_MEAN,
        SHAREGPT_OUTPUT_MEDIAN,
        SHAREGPT_OUTPUT_MEAN,
    )
