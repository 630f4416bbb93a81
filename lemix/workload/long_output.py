"""The long-output workload (issue 10, item 3): moderate prompts, long answers,
so many long-lived sequences hold KV at once and a node's KV room, not its
compute or its batch cap, is what binds.

Shape (lengths fixed before any run, not fitted to make a policy win):
- prompts uniform in [256, 1024] tokens, outputs uniform in [1024, 3072]
  tokens (independent draws, both ends inclusive), Poisson arrivals at
  `request_rate`: long generations (drafting, code, step-by-step answers)
  whose prompt + output ends at most at 4,096 tokens, Llama-2's context
  length (Touvron et al. 2023, "Llama 2", §2.2; `max_position_embeddings`
  4096 in `meta-llama/Llama-2-7b-hf` config.json), so nothing is clipped.
- Why it binds (A100 80 GB, Llama-2-7B, 2 stages, the shipped profile): KV is
  2 (K, V) × 32 layers × 4,096 hidden × 2 B = 512 KiB per token (model dims
  from the same config.json), and beside the weights and training state a
  node keeps 89,271 KV tokens at κ = 0.9 (profiles/README.md). The engine
  reserves a request's whole prompt + output at admission: 2,688 tokens on
  average here, so about 33 requests fill a node, half the default batch cap
  C = 64. The Azure conversation shape (1,155 + 211 tokens on average) fills
  it only at 65 running requests, above the cap, which is why memory never
  bound on it.

Pure and seeded like every workload: arrivals and lengths come from their own
RNG streams (`lemix.workload.base.stream_rng`), drawn in fixed chunks, so a
longer window only appends tasks. Select it with
`WorkloadConfig(source="long-output", ...)` (`--workload long-output`).
"""

from __future__ import annotations

from lemix.workload.long_prompt import UniformLengths

LONG_OUTPUT_PROMPT_MIN_TOKENS = 256
LONG_OUTPUT_PROMPT_MAX_TOKENS = 1024
LONG_OUTPUT_MIN_TOKENS = 1024
LONG_OUTPUT_MAX_TOKENS = 3072
# Llama-2's context length; every prompt + output fits it unclipped.
LONG_OUTPUT_MAX_TOTAL_TOKENS = 4096


def long_output_lengths() -> UniformLengths:
    """The long-output workload's (prompt, output) length sampler."""
    return UniformLengths(
        prompt_min=LONG_OUTPUT_PROMPT_MIN_TOKENS,
        prompt_max=LONG_OUTPUT_PROMPT_MAX_TOKENS,
        output_min=LONG_OUTPUT_MIN_TOKENS,
        output_max=LONG_OUTPUT_MAX_TOKENS,
    )
