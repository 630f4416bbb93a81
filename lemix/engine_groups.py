"""The pure rules `lemix.engine.NodeEngine` applies for engine v2 (issue 9).

Pipelined micro-batches
    With M micro-batches (`EngineConfig.num_micro_batches`; None = one per
    stage, 1 = v1) the running requests are split into M groups. Each group is an
    independent continuous batch: its own running list, its own join window
    (T_start) and at most one iteration in flight, which advances one stage at
    a time. With M = S every stage can be busy with a different group, and a
    request's next decode step waits only for its own group. A request stays in
    the group it joined (a swapped-out request comes back into the group that
    is forming when its KV returns); only its prefill chunks may ride another
    group's iterations (below).

Admission (which group a waiting request joins)
    New requests join at a group's iteration boundary, from the head of the one
    FIFO waiting queue, under the v1 rules (the node-wide cap C =
    `max_batch_size` on running requests, memory, the group's join window)
    plus three:

    - *even share of the cap*: a group holds at most ceil(C / M) requests, so
      no group can take the batch slots the others need;
    - *balance by tokens held* (context tokens, or the prompt for a request not
      yet prefilled): the forming group takes the head while it is the lightest
      of the groups that could take it now (below their share of the cap, join
      window open), or while taking it brings the group nearer an even share
      of everything held or admissible now, (Σ held + Σ admissible) / M, where
      the admissible requests are the head of the queue that the node's free
      batch slots and free KV memory could take at once. The first clause
      makes requests join the lightest group; the second lets a burst that
      arrives while every group is in flight spread over the next boundaries
      instead of trickling in one request per boundary;
    - *no starvation*: balance may turn the head of the queue away at most M
      times; at the next boundary any group with room takes it. Cap, memory
      and window waits are the v1 ones (finite: requests finish).

    With M = 1 all three are void and admission is exactly v1's.

    Throughput: M = S lets every stage work at once, but the cap C is
    node-wide, so the same requests are split into M smaller batches, each
    paying a decode step's fixed cost (the weights are read once per batch
    step). Where that fixed cost dominates (d0 on the A100 profiles) the gain
    is much less than S× (measured on the A100 7B profile, one node saturated
    with 200-2000-token prompts, KV memory bounding the batch to ~50
    requests: 1.30× tokens/s, 1.38× with a 512-token budget). With memory to
    spare, setting `max_batch_size` to S × the per-batch size serves like
    vLLM's pipeline-parallel virtual engines (a cap per micro-batch). Groups
    whose iterations differ in length (one carries a long prefill) leave
    pipeline bubbles; chunked prefill evens them out.

Gathered decodes (`EngineConfig.is_decode_gathered`)
    While the node has training (in flight or waiting) and M > 1, requests
    decode in one group, `DECODE_GROUP`: a request moves there once its prompt
    is prefilled (when that group has room under its cap), and new requests
    join the other groups only, by the balance rule among them. Their prompts'
    chunks still ride every group (pipelined chunks, below). Why: a decode
    step's cost is mostly the fixed cost of reading the stage's weights (A100
    Llama-2-7B: 5.6 ms per stage at batch 1, 9.6 ms at batch 32), so M groups
    decoding pay it M times per token where one group pays it once, and on a
    node that trains, the stage time saved goes to training. The price: the
    decode group's iterations are longer, and a group's requests wait behind
    it once per round, so the planner's TBT estimate models it
    (`DecodeAwareCostEstimator.is_decode_gathered`). A request moves between
    groups only when no chunk of it is in flight, so it is in exactly one
    group's iterations at a time. Without training on the node, joins balance
    over all groups again; requests already gathered stay where they are.
    Off in `EngineConfig` (the mechanism's plain default); on in the
    simulator's and the services' defaults (`--gather-decodes`), measured in
    docs/results.md (2026-12-03).

Paced decodes (`EngineConfig.decode_pace_s`)
    While decodes are gathered, the decode group's next iteration starts no
    sooner than `decode_pace_s` after its previous one started; until then
    the group is held (the engine's timer, `NodeEngine.next_timer_s`, wakes
    it) and the stages run other work. Why: a request's TBT SLO is a mean
    between tokens; a round that comes sooner than needed pays the decode
    step's fixed cost once more per token for no SLO the request has, and on
    a node that trains that stage time is the training's. A pace below the
    SLO leaves the rest for the round's own waits behind slices. Only the
    decode group is paced, and only while the node trains: prompts (their
    chunks ride the other groups) and a node that only serves run as soon as
    they can. The planner predicts no TBT below the pace on such a node
    (`DecodeAwareCostEstimator.paced_tbt_s`). Off in `EngineConfig`; the
    simulator's and the services' defaults pace at 0.7 × the TBT SLO
    (`--decode-pace-s`, since 2026-12-04).

KV offload (memory-aware training admission)
    Only requests of micro-batches between iterations are offloaded (their KV
    is not in use), so with M > 1 it happens at any group's boundary while the
    others run. Training that offloading every request could not fit is handed
    back at T_max even while groups are in flight.

Chunked prefill
    With a per-iteration token budget B (`EngineConfig.prefill_token_budget`),
    every decode request costs one token; what remains goes to prefill chunks,
    first to requests whose prefill is partly done (in the order they joined),
    then to newly admitted ones. A later chunk attends over the KV of the
    earlier ones, so it costs more per token: the budget is time, counted in
    tokens with nothing cached. A later chunk takes the most tokens whose time
    (the profile's `chunk_forward_s`) fits in what is left and uses up the
    tokens that time is worth, so a long prompt's last chunks do not stretch
    the iteration (and its decodes' time between tokens).

    Pipelined chunks (since 2026-12-03): a prompt's next chunk need not wait
    for the iteration carrying its previous chunk to come back through every
    stage. A group forming an iteration takes, after its own requests' chunks
    and joins, the next chunks of other groups' prompts, within the budget
    left and only while its iteration stays no longer than the longest one in
    flight: the groups' iterations follow each other on every stage, so the
    pipeline turns at the pace of the longest, and up to that length the
    extra chunk fills time the stages would otherwise idle (a group with only
    decodes behind one carrying a long chunk) without making any running
    request wait longer between tokens. Chunk k+1 then runs on stage 0 while
    chunk k runs on stage 1. This is sound because each stage runs iterations
    in the order they were formed: when chunk k+1 reaches a stage, chunk k's
    KV for that stage's layers is there. A 4k-token prompt at a 512-token
    budget on two stages gets its first token after ~9 chunk-stage times
    instead of ~16 (docs/results.md, 2026-12-03). The request ends only in its
    own group, once no chunk of it is in flight. A new
    request joins only if it gets at least one token this iteration, so
    nothing holds KV without making progress. If
    the decodes alone use the budget, they all still run and prefill waits. It
    cannot wait forever: a request starts decoding only when its last chunk
    ran, which took budget, so decodes exceed the budget only when swapped-out
    requests come back, and they finish. A request's KV is reserved whole at
    admission (as in v1) and its first token comes when its last chunk
    completes.

Training slices
    A training forward, backward or optimizer step that would occupy a stage
    for d seconds, longer than `EngineConfig.max_training_slice_s` = T, runs
    as k = ceil(d / T) slices of d / k (layer groups of that stage), one after
    another on that stage; between slices the stage picks its next item by
    priority again, so an inference iteration waits at most one slice. The
    optimizer step is its own item after the backward (`lemix.engine`), so
    the previous stage's backward starts as soon as this stage's backward
    ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lemix.latency import LatencyModel
from lemix.types import Task

# The group requests decode in when decodes are gathered (`is_decode_gathered`).
DECODE_GROUP = 0


@dataclass(slots=True)
class Request:
    """One inference request's state inside a node's engine."""

    task: Task
    since_s: float
    num_generated: int = 0
    context_tokens: int = (
        0  # KV the request holds the content of (its prefill so far, then +1 a step)
    )
    num_prefilled: int = 0  # prompt tokens prefilled so far (chunked prefill)
    # Prompt tokens whose chunks are in iterations formed so far: ahead of
    # `num_prefilled` while a chunk is in flight (`has_chunk_in_flight`).
    num_issued: int = 0
    micro_batch: int = 0  # the group it runs in
    num_passed_over: int = 0  # times balance turned it away at the head of the queue
    is_cancelled: bool = False
    cancel_reason: str = ""  # why, when is_cancelled (docs/protocol.md reason)
    is_stopped: bool = False  # the model emitted end-of-sequence
    failure: str = ""  # the backend could not run it: ends Failed with this reason

    @property
    def is_prefilled(self) -> bool:
        return self.num_generated > 0

    @property
    def has_chunk_in_flight(self) -> bool:
        """A prefill chunk of it is in an iteration that has not ended (possibly
        another group's): its KV is in use, and it cannot end before that chunk."""
        return self.num_issued > self.num_prefilled

    @property
    def has_chunks_to_issue(self) -> bool:
        """Prompt tokens of it are in no iteration yet."""
        return self.num_issued < self.task.num_prompt_tokens

    @property
    def load_tokens(self) -> int:
        """Tokens it holds for balancing: its context, or its prompt before prefill ends."""
        return max(self.context_tokens, self.task.num_prompt_tokens)


@dataclass(slots=True)
class MicroBatch:
    """One independent continuous batch of a node (one group of the pipeline)."""

    index: int
    running: list[Request] = field(default_factory=list)
    is_in_flight: bool = False
    batch_start_s: float = 0.0  # T_start of its join window
    # The iteration in flight's time on its slowest stage, by the profile's
    # model (what other groups' iterations may grow to: pipelined chunks).
    planned_s: float = 0.0
    last_start_s: float | None = None  # when its last iteration was formed

    @property
    def load_tokens(self) -> int:
        return sum(r.load_tokens for r in self.running)


@dataclass(slots=True)
class Iteration:
    """The work of one inference iteration (a `StageStart.work` payload).

    `prefill[i]` prefills prompt tokens [start, start + num_tokens) with
    `(start, num_tokens) = prefill_spans[i]`; without chunked prefill every span
    is a whole prompt, (0, num_prompt_tokens). A request's first token comes
    with the iteration that prefills its last prompt token. Every `decode`
    request makes one token.
    """

    prefill: list[Request]
    decode: list[Request]
    micro_batch: int = 0
    prefill_spans: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    request: Request
    start: int  # first prompt token of the chunk
    num_tokens: int


def micro_batch_cap(max_batch_size: int, num_micro_batches: int) -> int:
    """Requests one group may hold: an even share of the node's cap C."""
    return -(-max_batch_size // num_micro_batches)


def take_chunks(
    requests: Sequence[Request],
    budget: int | None,
    fit: Callable[[int, int, int], tuple[int, int]] | None = None,
) -> tuple[list[PrefillChunk], int]:
    """Prefill chunks for `requests` in order from `budget` tokens (None: no
    limit), and the budget tokens they use up. Each chunk starts where the
    request's last issued chunk ended and is counted issued (`num_issued`).

    Each gets the rest of its prompt or what is left of the budget; requests
    past the point the budget runs out get none. `fit(past, n, left)`, when
    given, prices a chunk that follows `past` cached tokens (it also attends
    over the earlier chunks' KV): it returns the tokens the chunk may take (at
    most `n`, costing no more time than `left` tokens with nothing cached)
    and the budget tokens that time is worth, which the chunk uses up.
    """
    chunks = []
    left = math.inf if budget is None else budget
    used = 0
    for req in requests:
        if left <= 0:
            break
        remaining = req.task.num_prompt_tokens - req.num_issued
        if remaining <= 0:
            continue  # its last chunk is on its way already
        num_tokens = int(min(remaining, left))
        charged = num_tokens
        if fit is not None and req.num_issued:
            num_tokens, charged = fit(req.num_issued, num_tokens, int(left))
        chunks.append(PrefillChunk(req, req.num_issued, num_tokens))
        req.num_issued += num_tokens
        left -= charged
        used += charged
    return chunks, used


def num_within_budget(prompt_tokens: Sequence[int], budget: int | None) -> int:
    """How many new requests (these prompts, in order) get at least one token."""
    if budget is None:
        return len(prompt_tokens)
    left, count = budget, 0
    for tokens in prompt_tokens:
        if left <= 0:
            break
        left -= min(tokens, left)
        count += 1
    return count


def num_balanced_joins(
    index: int,
    loads: Sequence[int],
    is_eligible: Sequence[bool],
    candidate_tokens: Sequence[int],
    num_waiting_tokens: int,
    is_head_overdue: bool,
) -> int:
    """How many of the waiting queue's head (`candidate_tokens`, prompts in
    order) group `index` may take at its boundary by the balance rule above.

    `loads` are the groups' tokens held, `is_eligible` whether each could take
    a request now, `num_waiting_tokens` the prompts of the waiting requests
    the node could admit now, `is_head_overdue` whether the head was already
    turned away M times (then it is taken regardless).
    """
    num_groups = len(loads)
    if num_groups == 1:
        return len(candidate_tokens)
    others = [load for i, load in enumerate(loads) if i != index and is_eligible[i]]
    lightest_other = min(others, default=None)
    share = (sum(loads) + num_waiting_tokens) / num_groups
    load = loads[index]
    for n, tokens in enumerate(candidate_tokens):
        is_lightest = lightest_other is None or load <= lightest_other
        # Nearer the even share with it than without it: load + tokens − share ≤ share − load.
        is_within_share = load + tokens / 2 <= share
        if not (is_lightest or is_within_share or (n == 0 and is_head_overdue)):
            return n
        load += tokens
    return len(candidate_tokens)


def num_slices(duration_s: float, max_slice_s: float | None) -> int:
    """Slices a training pass of `duration_s` on one stage runs as."""
    if max_slice_s is None or duration_s <= max_slice_s:
        return 1
    # Relative slack so that rounding (2.1 / 0.3 = 7.000000000000001) does not
    # add a slice: a slice may exceed the cap by 1e-9 of it.
    return math.ceil(duration_s / max_slice_s * (1.0 - 1e-9))


def slice_s(duration_s: float, index: int, count: int) -> float:
    """Duration of slice `index` of `count` equal slices of `duration_s`.

    Differences of the cumulative bounds d·i/k, with the last bound d itself,
    so the slices add up to d (up to rounding of the sum).
    """
    end_s = duration_s if index == count - 1 else duration_s * (index + 1) / count
    return end_s - duration_s * index / count


# ------------------------------------------------------------ iteration costs


def iteration_durations(
    truth: LatencyModel,
    num_stages: int,
    chunks: Sequence[PrefillChunk],
    decode: Sequence[Request],
    reload_s: float,
) -> tuple[float, ...]:
    """Per-stage time of an iteration carrying `chunks` and `decode` (plus KV
    reload time it owes), by `truth` (the node's actual latency)."""
    sum_context = sum(r.context_tokens for r in decode)
    out = []
    for s in range(num_stages):
        d = reload_s
        if chunks:
            # Ragged (unpadded) prefill, as vLLM/SGLang run it: per-sequence
            # terms add up, the fixed per-pass cost is paid once. A first
            # chunk (nothing cached) costs what a prompt of its length
            # would; a later one also attends over the earlier chunks' KV
            # (`chunk_forward_s`). First chunks keep the forward call so
            # that unchunked (v1) iterations are predicted as before.
            fixed_s = truth.forward_s(s, 1, 0)
            d += sum(chunk_s(truth, s, c) - fixed_s for c in chunks) + fixed_s
        if decode:
            d += truth.decode_step_s(s, len(decode), sum_context)
        out.append(d)
    return tuple(out)


def chunk_s(truth: LatencyModel, stage: int, chunk: PrefillChunk) -> float:
    """One prefill chunk alone on `stage`: with its cached past, if any."""
    if chunk.start:
        return truth.chunk_forward_s(stage, chunk.num_tokens, chunk.start)
    return truth.forward_s(stage, 1, chunk.num_tokens)


def fit_prefill_chunk(
    model: LatencyModel,
    num_stages: int,
    num_past_tokens: int,
    num_tokens: int,
    num_left_tokens: int,
) -> tuple[int, int]:
    """A chunk of at most `num_tokens` after `num_past_tokens` cached ones,
    fitted to the time `num_left_tokens` take with nothing cached on the
    slowest stage (`model` is the profile's, not the noisy truth: a decision,
    not a duration): (its tokens, at least 1 so a prompt always advances; the
    budget tokens its time is worth, at most `num_left_tokens`)."""
    stages = range(num_stages)

    def fresh_s(n: int) -> float:
        return max(model.forward_s(s, 1, n) for s in stages)

    def past_s(n: int) -> float:
        return max(model.chunk_forward_s(s, n, num_past_tokens) for s in stages)

    limit_s = fresh_s(num_left_tokens)
    lo, hi = 1, num_tokens  # time grows with n: the largest n within the limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if past_s(mid) <= limit_s else (lo, mid - 1)
    cost_s = past_s(lo)
    first, last = lo, num_left_tokens  # the fewest fresh tokens that take as long
    while first < last:
        mid = (first + last) // 2
        first, last = (first, mid) if fresh_s(mid) >= cost_s else (mid + 1, last)
    return lo, first
