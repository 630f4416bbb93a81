"""Serving on a staged model: prefill + decode iterations with per-request KV.

The node engine decides *what* an iteration holds (which requests prefill,
which decode; `lemix.batching`'s Algorithm 3); `InferenceRunner` runs it one
stage at a time. Stage 0 packs the iteration's tokens (a prefill's prompt, a
decode's last token) with their positions, each stage appends to the
requests' caches, and the last stage samples each request's next token.

A prefill with a reference answer also scores it (the paper's inference
loss): the prompt and reference go through the stages together, causally, so
the logits at prompt positions are unchanged; only the prompt's K/V is kept.
One forward pass gives the first token and the teacher-forced cross-entropy
of the weights serving the request.

Chunked prefill (engine v2): a prefill carries a span (start, num_tokens) of
its prompt; the chunk's tokens run at positions start.. and append to the
request's cache after the earlier chunks' K/V (`Stage.forward`'s offset causal
mask). Only the chunk that ends the prompt samples the first token and carries
the reference ids; prompt logprobs are collected chunk by chunk.

Several iterations may be in flight at once (micro-batches), each on another
stage's thread: the stage-to-stage carry is keyed by iteration, KV lives per
request per stage, and a request belongs to one iteration at a time (the
engine's contract), so iterations share no mutable state but the `requests`
dict (changed under a lock) and `failures`, which only the last stage writes
and only its thread (or a single-threaded caller) takes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lemix.model.sampling import SamplingState, check_sampling, choose_token
from lemix.model.staged import Segment, StagedModel
from lemix.outputs import FINISH_LENGTH, FINISH_STOP, TokenLogprob


@dataclass
class GenRequest:
    """One inference request's model-side state."""

    key: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    reference_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    top_logprobs: int = -1  # -1: none; k: each token's logprob and the top k's
    prompt_logprobs: int = -1  # the same for the prompt's tokens, from the prefill
    # vLLM's filters and penalties (`lemix.model.sampling`; 0 / 1.0 = off).
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # end the sequence as EOS does (after min_tokens)
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token
    # prompt[1:], appended chunk by chunk; complete once the first token is made
    prompt_logprob_entries: list[TokenLogprob] = field(default_factory=list)
    num_prefilled: int = 0  # prompt tokens stage 0 has packed (chunked prefill)
    inference_loss: float | None = None
    # Teacher-forced top-1 accuracy on the reference (`reference_accuracy`).
    reference_accuracy: float | None = None
    finish_reason: str | None = None
    generator: torch.Generator | None = None


# (start, num_tokens): the prompt tokens one iteration prefills for a request,
# as `lemix.engine_groups.Iteration.prefill_spans`.
PrefillSpan = tuple[int, int]


@dataclass
class _Carry:
    hidden: torch.Tensor
    positions: torch.Tensor
    segments: list[Segment]


def token_logprob(logits: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    """logits [vocab] -> `token`'s log-probability under the model's own
    distribution (log_softmax of the raw logits, in float32: before
    temperature and top_p, as OpenAI's and vLLM's) and the `num_top` best."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if num_top > 0:
        values, ids = torch.topk(logprobs, num_top)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(float(logprobs[token]), top)


def sampling_state(req: GenRequest) -> SamplingState:
    """`req`'s sampling parameters and generator as `lemix.model.sampling` takes them."""
    return SamplingState(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        min_tokens=req.min_tokens,
        stop_token_ids=req.stop_token_ids,
        seed=req.seed,
        generator=req.generator,
    )


def sample_next(logits: torch.Tensor, req: GenRequest, eos_id: int | None = None) -> int:
    """`req`'s next token (`lemix.model.sampling.choose_token`: penalties,
    min_tokens, greedy or filtered sampling), drawn from the request's own
    seeded generator (reproducible per request)."""
    state = sampling_state(req)
    token = choose_token(
        logits, state, prompt_ids=req.prompt_ids, output_ids=req.generated, eos_id=eos_id
    )
    req.generator = state.generator
    return token


def is_plain_greedy(req: GenRequest) -> bool:
    """Whether `choose_token` reduces to the argmax for `req` now: temperature
    0, no penalty, min_tokens reached (so no end token is masked)."""
    return (
        req.temperature == 0.0
        and req.repetition_penalty == 1.0
        and req.presence_penalty == 0.0
        and req.frequency_penalty == 0.0
        and len(req.generated) >= req.min_tokens
    )


def reference_accuracy(logits: torch.Tensor, target: torch.Tensor) -> float:
    """Teacher-forced top-1 accuracy: the fraction of reference positions whose
    argmax token (logits [N, vocab], row i predicting target[i]) is the
    reference token. Ties go to the lowest id, as greedy sampling's argmax."""
    return float((logits.argmax(dim=-1) == target).float().mean())


def needs_all_rows(req: GenRequest) -> bool:
    """Whether sampling `req` reads logits at every prompt position (its
    inference loss or prompt logprobs), not just at the last one."""
    return not req.generated and (bool(req.reference_ids) or req.prompt_logprobs >= 0)


class InferenceRunner:
    """Runs inference iterations of one node's staged model."""

    def __init__(self, staged: StagedModel, eos_id: int | None) -> None:
        self.staged = staged
        self.eos_id = eos_id
        self.requests: dict[str, GenRequest] = {}
        # Requests whose sampling failed in the last stage's latest iteration,
        # with the reason; the backend takes them right after `run_stage`.
        self.failures: dict[str, str] = {}
        self._carry: dict[int, _Carry] = {}
        self._lock = threading.Lock()

    def admit(self, req: GenRequest) -> None:
        """Allocate the request's KV on every stage (prompt + max_tokens)."""
        if not req.prompt_ids:
            raise ValueError(f"request {req.key!r} has no prompt token ids")
        total = len(req.prompt_ids) + req.max_tokens
        if total > self.staged.family.max_positions:
            raise ValueError(
                f"request {req.key!r}: {total} tokens exceed the model's "
                f"{self.staged.family.max_positions} positions"
            )
        for stage in self.staged.stages:
            stage.kv.allocate(req.key, total)
        with self._lock:
            self.requests[req.key] = req

    def take_failures(self) -> dict[str, str]:
        """The requests that failed since the last call (key -> reason)."""
        failures, self.failures = self.failures, {}
        return failures

    def release(self, key: str) -> None:
        for stage in self.staged.stages:
            stage.kv.free(key)
        with self._lock:
            self.requests.pop(key, None)

    def offload(self, key: str) -> int:
        return sum(stage.kv.offload(key) for stage in self.staged.stages)

    def reload(self, key: str) -> int:
        return sum(stage.kv.reload(key) for stage in self.staged.stages)

    @torch.inference_mode()
    def run_stage(
        self,
        stage_index: int,
        iteration: int,
        prefill: Sequence[str],
        decode: Sequence[str],
        prefill_spans: Sequence[PrefillSpan] | None = None,
    ) -> list[str]:
        """Run one iteration's work on one stage.

        `iteration` identifies the iteration across its stages (unique among
        those in flight). `prefill_spans[i]` is the chunk of `prefill[i]`'s
        prompt this iteration prefills; None or empty: whole prompts. Every
        stage of an iteration gets the same arguments. Returns, on the last
        stage, the keys that stopped at an end-of-sequence token.
        """
        spans = self._spans(prefill, prefill_spans)
        stage = self.staged.stages[stage_index]
        for key in (*prefill, *decode):
            stage.kv.reload(key)  # no-op unless it was offloaded
        if stage.is_first:
            inputs, positions, segments = self._pack(prefill, spans, decode)
        else:
            with self._lock:
                carry = self._carry.pop(iteration)
            inputs, positions, segments = carry.hidden, carry.positions, carry.segments
        if not stage.is_last:
            out = stage.forward(inputs, positions, segments)
            with self._lock:
                self._carry[iteration] = _Carry(out, positions, segments)
            return []
        rows, starts = self._logit_rows(prefill, spans, segments)
        logit_rows = torch.tensor(rows, dtype=torch.long)  # may be empty: no chunk ends
        out = stage.forward(inputs, positions, segments, logit_rows=logit_rows)
        return self._sample(out[0], prefill, spans, decode, starts)

    def _spans(
        self, prefill: Sequence[str], prefill_spans: Sequence[PrefillSpan] | None
    ) -> list[PrefillSpan]:
        """Each prefill's chunk, checked against its prompt (whole if not given)."""
        if not prefill_spans:
            return [(0, len(self.requests[key].prompt_ids)) for key in prefill]
        if len(prefill_spans) != len(prefill):
            raise ValueError(f"{len(prefill)} prefills but {len(prefill_spans)} prefill spans")
        for key, (start, num_tokens) in zip(prefill, prefill_spans, strict=True):
            num_prompt = len(self.requests[key].prompt_ids)
            if start < 0 or num_tokens < 1 or start + num_tokens > num_prompt:
                raise ValueError(
                    f"request {key!r}: prefill span ({start}, {num_tokens}) is not within "
                    f"its {num_prompt} prompt tokens"
                )
        return list(prefill_spans)

    def _logit_rows(
        self,
        prefill: Sequence[str],
        spans: Sequence[PrefillSpan],
        segments: Sequence[Segment],
    ) -> tuple[list[int], list[int]]:
        """The packed rows the last stage's head computes, and per request the
        place of its first one among them: all of a prefill chunk's rows when
        `needs_all_rows` (prompt logprobs, reference scoring), else only the
        row its next token is sampled from (none for a chunk that does not
        end its prompt)."""
        rows: list[int] = []
        starts: list[int] = []
        for i, seg in enumerate(segments):
            starts.append(len(rows))
            if i >= len(prefill):  # a decode: its one token
                rows.append(seg.start)
                continue
            req = self.requests[prefill[i]]
            start, num_tokens = spans[i]
            if needs_all_rows(req):
                rows.extend(range(seg.start, seg.end))
            elif start + num_tokens == len(req.prompt_ids):
                rows.append(seg.start + num_tokens - 1)
        return rows, starts

    def _pack(
        self, prefill: Sequence[str], spans: Sequence[PrefillSpan], decode: Sequence[str]
    ) -> tuple[torch.Tensor, torch.Tensor, list[Segment]]:
        """Stage 0's packed ids [N], positions [N] and one segment per request."""
        ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        for key, (start, num_tokens) in zip(prefill, spans, strict=True):
            req = self.requests[key]
            # Chunks must come in order: each appends to the KV of the last.
            if start != req.num_prefilled:
                raise ValueError(
                    f"request {key!r}: prefill chunk starts at {start} but "
                    f"{req.num_prefilled} prompt tokens were prefilled"
                )
            end = start + num_tokens
            req.num_prefilled = end
            # The reference rides with the chunk that ends the prompt: its rows
            # follow the last prompt position's, and only the chunk is cached.
            reference = req.reference_ids if end == len(req.prompt_ids) else ()
            tokens = req.prompt_ids[start:end] + reference
            first_row = len(ids)
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            segments.append(Segment(first_row, len(ids), key, num_tokens))
        for key in decode:
            req = self.requests[key]
            first_row = len(ids)
            ids.append(req.generated[-1])
            positions.append(len(req.prompt_ids) + len(req.generated) - 1)
            segments.append(Segment(first_row, first_row + 1, key, 1))
        return torch.tensor(ids), torch.tensor(positions), segments

    def _sample(
        self,
        logits: torch.Tensor,
        prefill: Sequence[str],
        spans: Sequence[PrefillSpan],
        decode: Sequence[str],
        starts: Sequence[int],
    ) -> list[str]:
        """logits [R, vocab] (`_logit_rows`; request i's from row starts[i]):
        next token per request; the inference loss of prefills.

        A prefill chunk that does not end its prompt only adds prompt logprobs.
        A request whose sampling fails is recorded in `failures` (key -> reason)
        and skipped; the others in the batch go on.
        """
        keys = (*prefill, *decode)
        reqs = [self.requests[key] for key in keys]
        # Each request's sampling row among `logits`: the last of its chunk's
        # rows when it has them all, else its one row. A chunk that does not
        # end its prompt samples nothing (its row, if any, is unused).
        num_spans = [n for _, n in spans] + [1] * len(decode)
        rows = [
            start + (num_tokens - 1 if needs_all_rows(req) and i < len(prefill) else 0)
            for i, (req, start, num_tokens) in enumerate(zip(reqs, starts, num_spans, strict=True))
        ]
        # Plain greedy requests take the argmax of their rows in one op rather
        # than one `choose_token` each (same token: it checks finiteness, then
        # takes the argmax); the per-request calls cost more than a decode
        # step's attention at batch 32 on a small model.
        is_sampling = [
            i >= len(prefill) or sum(spans[i]) == len(req.prompt_ids) for i, req in enumerate(reqs)
        ]
        greedy = [i for i, req in enumerate(reqs) if is_sampling[i] and is_plain_greedy(req)]
        greedy_tokens: dict[int, int | None] = {}
        if greedy:
            picked_rows = [rows[i] for i in greedy]
            picked = (
                logits  # a decode batch: every row, in order (no [B, vocab] copy)
                if picked_rows == list(range(logits.shape[0]))
                else logits.index_select(0, torch.tensor(picked_rows))
            )
            # max and min of each row tell whether it holds a NaN (max is NaN)
            # or an infinity: two reductions instead of a [B, vocab] isfinite.
            highs, tokens_t = picked.max(dim=1)  # the first maximum, as argmax
            is_finite = (torch.isfinite(highs) & torch.isfinite(picked.amin(dim=1))).tolist()
            tokens = tokens_t.tolist()
            for i, ok, token in zip(greedy, is_finite, tokens, strict=True):
                greedy_tokens[i] = int(token) if ok else None
        stopped = []
        one_row = [(0, 1)] * len(decode)  # a decode's span: its one new token
        for i, (key, req, (start, num_tokens)) in enumerate(
            zip(keys, reqs, (*spans, *one_row), strict=True)
        ):
            is_prefill = i < len(prefill)
            row = rows[i]
            try:
                if is_prefill and req.prompt_logprobs >= 0:
                    self._add_prompt_logprobs(req, logits, starts[i], start, num_tokens)
                if is_prefill and start + num_tokens < len(req.prompt_ids):
                    continue  # more chunks to come: no token yet
                if req.reference_ids and is_prefill:
                    ref_rows = logits[row : row + len(req.reference_ids)]
                    target = torch.tensor(req.reference_ids, device=ref_rows.device)
                    req.inference_loss = float(F.cross_entropy(ref_rows, target))
                    req.reference_accuracy = reference_accuracy(ref_rows, target)
                if i in greedy_tokens:
                    check_sampling(sampling_state(req))
                    greedy_token = greedy_tokens[i]
                    if greedy_token is None:
                        raise ValueError("the model produced non-finite logits for this request")
                    token = greedy_token
                else:
                    token = sample_next(logits[row], req, self.eos_id)
                if req.top_logprobs >= 0:
                    req.logprobs.append(token_logprob(logits[row], token, req.top_logprobs))
            except (ValueError, RuntimeError) as exc:
                self.failures[key] = f"INTERNAL: sampling failed: {type(exc).__name__}: {exc}"
                continue
            req.generated.append(token)
            if (token == self.eos_id and not req.ignore_eos) or token in req.stop_token_ids:
                req.finish_reason = FINISH_STOP
                stopped.append(key)
            elif len(req.generated) >= req.max_tokens:
                req.finish_reason = FINISH_LENGTH
        return stopped

    @staticmethod
    def _add_prompt_logprobs(
        req: GenRequest, logits: torch.Tensor, first_row: int, start: int, num_tokens: int
    ) -> None:
        """Append the prompt logprobs of one chunk: the row at prompt position i
        predicts prompt[i + 1], so the prompt's last position gives none."""
        num_rows = min(num_tokens, len(req.prompt_ids) - 1 - start)
        rows = logits[first_row : first_row + num_rows]  # [num_rows, vocab]
        targets = req.prompt_ids[start + 1 : start + 1 + num_rows]
        req.prompt_logprob_entries.extend(
            token_logprob(r, t, req.prompt_logprobs) for r, t in zip(rows, targets, strict=True)
        )

    def generate_alone(self, req: GenRequest) -> list[int]:
        """Prefill then decode `req` by itself to completion (tests, benchmarks)."""
        self.admit(req)
        try:
            keys = [req.key]
            for s in range(self.staged.num_stages):
                stopped = self.run_stage(s, -1, keys, [])
            while not stopped and len(req.generated) < req.max_tokens:
                for s in range(self.staged.num_stages):
                    stopped = self.run_stage(s, -1, [], keys)
            return list(req.generated)
        finally:
            self.release(req.key)
