"""Next-token choice from one request's logits, with vLLM's semantics.

In order, on float32 logits:

1. penalties (also for greedy decoding): `repetition_penalty` over the
   prompt's and the output's tokens (a positive logit divided by it, a
   negative one multiplied), then `frequency_penalty` x each token's count in
   the output and `presence_penalty` once per token the output holds,
   subtracted;
2. `min_tokens`: EOS and `stop_token_ids` get -inf until that many tokens
   are out;
3. temperature 0: the argmax; else divide by the temperature, keep the
   `top_k` best, the `top_p` nucleus, the tokens of at least `min_p` x the
   best one's probability, and draw from the request's seeded generator.

Log-probabilities (`lemix.model.runner.token_logprob`) stay those of the raw
logits, before any of this, as OpenAI's and vLLM's.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingState:
    """A request's sampling parameters (`lemix.types.TaskPayload` has their
    ranges) and its generator, made on the first draw from `seed`."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    generator: torch.Generator | None = field(default=None, repr=False)


def check_sampling(s: SamplingState) -> None:
    """ValueError naming the first value out of range."""
    if not 0.0 <= s.temperature < math.inf or not 0.0 < s.top_p <= 1.0:
        raise ValueError(f"invalid sampling values: temperature={s.temperature}, top_p={s.top_p}")
    if s.top_k < 0 or not 0.0 <= s.min_p <= 1.0:
        raise ValueError(f"invalid sampling values: top_k={s.top_k}, min_p={s.min_p}")
    if not 0.0 < s.repetition_penalty < math.inf:
        raise ValueError(f"invalid repetition_penalty {s.repetition_penalty}: must be > 0")
    if not (math.isfinite(s.presence_penalty) and math.isfinite(s.frequency_penalty)):
        raise ValueError("presence_penalty and frequency_penalty must be finite")


def apply_penalties(
    logits: torch.Tensor,
    s: SamplingState,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
) -> torch.Tensor:
    """float32 logits [vocab] with the repetition, frequency and presence
    penalties applied (the input is never changed; without penalties the
    result may be the input itself)."""
    out = logits.float()
    vocab = out.shape[-1]
    if s.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.zeros(vocab, dtype=torch.bool, device=out.device)
        seen[torch.tensor([*prompt_ids, *output_ids], device=out.device)] = True
        penalised = torch.where(out > 0, out / s.repetition_penalty, out * s.repetition_penalty)
        out = torch.where(seen, penalised, out)
    if output_ids and (s.frequency_penalty or s.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=out.device), minlength=vocab)
        counts = counts[:vocab].to(out.dtype)
        out = out - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).to(out.dtype)
    return out


def mask_ends(logits: torch.Tensor, end_ids: Collection[int]) -> torch.Tensor:
    """A copy of `logits` with -inf at `end_ids` (ids past the vocabulary skipped)."""
    ids = [i for i in end_ids if 0 <= i < logits.shape[-1]]
    if not ids:
        return logits
    masked = logits.clone()
    masked[torch.tensor(ids, device=logits.device)] = -math.inf
    return masked


def filter_probs(probs: torch.Tensor, s: SamplingState) -> torch.Tensor:
    """probs [vocab] (a distribution) with top_k, top_p and min_p applied
    (zeros where dropped; not renormalised: `torch.multinomial` needs no sum 1).
    The most likely token always stays."""
    if 0 < s.top_k < probs.shape[-1]:
        kth = torch.topk(probs, s.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    if s.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always >= 1 token).
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < s.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    if s.min_p > 0.0:
        probs = torch.where(probs >= s.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs


def choose_token(
    logits: torch.Tensor,
    s: SamplingState,
    *,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
    eos_id: int | None = None,
) -> int:
    """The next token for logits [vocab] (module doc for the order)."""
    if not bool(torch.isfinite(logits).all()):
        raise ValueError("the model produced non-finite logits for this request")
    check_sampling(s)
    scores = apply_penalties(logits, s, prompt_ids, output_ids)
    if len(output_ids) < s.min_tokens:
        ends = {*s.stop_token_ids, *(() if eos_id is None else (eos_id,))}
        scores = mask_ends(scores, ends)
        if not bool(torch.isfinite(scores).any()):
            raise ValueError("min_tokens masked every token of the vocabulary")
    if s.temperature == 0.0:
        return int(torch.argmax(scores))
    scaled = scores / s.temperature
    if bool(torch.isposinf(scaled).any()) or bool(torch.isnan(scaled).any()):
        # A temperature so small that logits/T overflows is greedy in the
        # limit; softmax of inf - inf would be NaN and fail the draw.
        return int(torch.argmax(scores))
    probs = filter_probs(torch.softmax(scaled, dim=-1), s)
    if s.generator is None:
        s.generator = torch.Generator().manual_seed(s.seed)
    return int(torch.multinomial(probs.cpu(), 1, generator=s.generator))
