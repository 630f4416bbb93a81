"""Attention of one packed ragged iteration, batched over all its requests.

A stage's iteration packs every token of every request into one sequence
(`lemix.model.staged`); each request's tokens attend to its own cached past
(a run of the stage's KV pool, `lemix.model.kv`) and causally to each other.
`AttentionPlan.build` turns the iteration's segments into index tensors once
per forward; `attend` then runs every layer with a fixed number of tensor ops,
whatever the batch size, so the Python work per layer does not grow with it:

1. one `index_copy_` per K and V writes the new tokens of all requests into
   their pool slots;
2. *decode steps* (one new token after its cache) attend in one SDPA: one
   `index_select` per K and V gathers their caches into a batch padded to the
   longest, masked by length; caches that sit at one stride in the pool (a
   batch admitted together) are read as a strided view instead, and a batch
   of one length needs no mask. Query heads that share a KV head ride as rows
   of one query (``[B, kv_heads, group, d]``), so GQA needs no K/V repeat;
3. *everything else* (prefills, chunked prefills after a cached past,
   training samples with no cache) attends in one more SDPA: queries padded to
   the longest such segment, keys to the longest past + chunk, with a mask that
   is causal at each segment's own offset and cuts its padding.

Why two groups rather than one padded batch or one group per shape: a decode
step padded to a 512-token prefill chunk would do 512× its work, and a group
per distinct shape brings back a Python loop that grows with the batch. Two
groups bound the padding to the spread of prefill lengths within one
iteration (the engine's chunk budget caps it) at a constant op count.

A lone segment with no cache (a training sample, `StagedModel.logits`) skips
the gathers: plain causal SDPA, autograd-friendly. The other paths are
differentiable in q/k/v as well (out-of-place index ops), so packed training
samples backpropagate through them; pool writes are detached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lemix.model.kv import RequestKV


@dataclass(frozen=True)
class _DecodeGroup:
    rows: torch.Tensor | None  # [B] rows of the packed batch; None: all rows, in order
    slots: torch.Tensor | None  # [B * L] pool slots to gather, L = longest cache (padding:
    # own base); None: the caches are read as one strided view (`first_slot`, `slot_stride`)
    first_slot: int  # with slots None: request i's cache starts at first_slot + i * slot_stride
    slot_stride: int
    mask: torch.Tensor | None  # [B, 1, 1, L] additive: 0 at real positions, -inf at
    # padding; None: every cache has L positions (SDPA runs ~15% faster with no mask)
    num_rows: int
    max_len: int


@dataclass(frozen=True)
class _PrefillGroup:
    rows: torch.Tensor  # [M] rows of the packed batch, segment by segment
    query_dest: torch.Tensor  # [M] flat index into [G * Q] of each row's query
    key_dest: torch.Tensor  # [P + M] flat index into [G * L]: the pasts, then the new rows
    past_slots: torch.Tensor | None  # [P] pool slots of the cached pasts; None: no past
    mask: torch.Tensor  # [G, 1, Q, L] additive: 0 where a query sees a key, -inf elsewhere
    num_segments: int  # G
    max_queries: int  # Q
    max_keys: int  # L


@dataclass(frozen=True)
class AttentionPlan:
    """Index tensors of one forward's attention, built once and used by every layer."""

    num_tokens: int
    write_rows: torch.Tensor | None  # [W] rows whose K/V go to the pool; None: all, in order
    write_slots: torch.Tensor | None  # [W] their pool slots; None: nothing to write
    decode: _DecodeGroup | None
    prefill: _PrefillGroup | None
    order: torch.Tensor | None  # [N] row r's place in cat(prefill, decode); None: identity
    is_plain_causal: bool  # one cache-less segment: causal SDPA over q/k/v as they are

    @staticmethod
    def build(
        bounds: Sequence[tuple[int, int, int]],
        caches: Sequence[RequestKV | None],
        num_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> AttentionPlan:
        """bounds: per segment (start, end, num_cached) over the packed rows;
        caches: its KV (None: no cache), `length` = cached positions before this
        forward. `dtype`: the activations' (masks are additive, in that dtype,
        made once here rather than converted from bool by every layer's SDPA)."""
        if len(bounds) == 1 and caches[0] is None:
            return AttentionPlan(num_tokens, None, None, None, None, None, True)
        write_rows: list[int] = []
        write_slots: list[int] = []
        dec: list[int] = []  # segment indices
        pre: list[int] = []
        for i, ((start, end, num_cached), cache) in enumerate(zip(bounds, caches, strict=True)):
            if cache is None:
                pre.append(i)
                continue
            if cache.length + num_cached > cache.capacity:
                # The pool has no bounds per request: past its run lies another's.
                raise ValueError(
                    f"segment [{start}, {end}) would fill {cache.length + num_cached} "
                    f"positions of a cache of capacity {cache.capacity}"
                )
            if num_cached:
                first = cache.base + cache.length
                write_rows.extend(range(start, start + num_cached))
                write_slots.extend(range(first, first + num_cached))
            (dec if end - start == num_cached == 1 else pre).append(i)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        rows_in_order = write_rows == list(range(num_tokens))
        decode = _decode_group(
            [bounds[i][0] for i in dec], [caches[i] for i in dec], num_tokens, device, dtype
        )
        prefill = _prefill_group([bounds[i] for i in pre], [caches[i] for i in pre], device, dtype)
        packed = [r for i in pre for r in range(bounds[i][0], bounds[i][1])]
        packed += [bounds[i][0] for i in dec]
        order = None
        if packed != list(range(num_tokens)):
            order = torch.empty(num_tokens, dtype=torch.long, device=device)
            order[tensor(packed)] = torch.arange(num_tokens, device=device)
        return AttentionPlan(
            num_tokens=num_tokens,
            write_rows=None if rows_in_order else tensor(write_rows),
            write_slots=tensor(write_slots) if write_slots else None,
            decode=decode,
            prefill=prefill,
            order=order,
            is_plain_causal=False,
        )


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True: attend) -> 0 / -inf in `dtype`."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, float("-inf"))


def _uniform_stride(bases: list[int], max_len: int, num_slots: int) -> int | None:
    """The stride between consecutive caches when every one starts `stride`
    slots after the one before (requests of one size admitted together: a
    static batch), so that B windows of `max_len` slots are one strided view of
    the pool and need no gather; None otherwise. A window may run past its own
    run into the next request's (a shorter cache's padding): those slots are
    masked, and the pool holds finite values everywhere."""
    stride = bases[1] - bases[0] if len(bases) > 1 else max_len
    if stride < 1 or bases[0] + (len(bases) - 1) * stride + max_len > num_slots:
        return None
    if any(b != bases[0] + i * stride for i, b in enumerate(bases)):
        return None
    return stride


def _decode_group(
    starts: list[int],
    caches: Sequence[RequestKV | None],
    num_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
) -> _DecodeGroup | None:
    if not starts:
        return None
    cached = [c for c in caches if c is not None]
    # This step's token is written before the gather, so each attends over length + 1.
    max_len = max(c.length for c in cached) + 1
    base_list = [c.base for c in cached]
    lengths = torch.tensor([c.length + 1 for c in cached], device=device)
    positions = torch.arange(max_len, device=device)
    mask = positions[None, :] < lengths[:, None]  # [B, L]
    is_all_rows = starts == list(range(num_tokens))  # a pure decode iteration
    is_unpadded = all(c.length + 1 == max_len for c in cached)
    stride = _uniform_stride(base_list, max_len, cached[0].store.num_slots)
    slots = None
    if stride is None:
        bases = torch.tensor(base_list, device=device)[:, None]
        slots = torch.where(mask, bases + positions[None, :], bases).reshape(-1)
    return _DecodeGroup(
        rows=None if is_all_rows else torch.tensor(starts, dtype=torch.long, device=device),
        slots=slots,
        first_slot=base_list[0],
        slot_stride=stride or 0,
        mask=None if is_unpadded else _additive(mask[:, None, None, :], dtype),
        num_rows=len(starts),
        max_len=max_len,
    )


def _prefill_group(
    bounds: Sequence[tuple[int, int, int]],
    caches: Sequence[RequestKV | None],
    device: torch.device,
    dtype: torch.dtype,
) -> _PrefillGroup | None:
    if not bounds:
        return None
    pasts = [c.length if c is not None else 0 for c in caches]
    counts = [end - start for start, end, _ in bounds]
    max_q = max(counts)
    max_k = max(p + n for p, n in zip(pasts, counts, strict=True))
    rows: list[int] = []
    query_dest: list[int] = []
    past_dest: list[int] = []
    past_slots: list[int] = []
    new_dest: list[int] = []
    for g, ((start, end, _), cache, past) in enumerate(zip(bounds, caches, pasts, strict=True)):
        n = end - start
        rows.extend(range(start, end))
        query_dest.extend(range(g * max_q, g * max_q + n))
        if cache is not None and past:
            past_dest.extend(range(g * max_k, g * max_k + past))
            past_slots.extend(range(cache.base, cache.base + past))
        new_dest.extend(range(g * max_k + past, g * max_k + past + n))
    past_t = torch.tensor(pasts, device=device)[:, None, None]
    total_t = past_t + torch.tensor(counts, device=device)[:, None, None]
    query = torch.arange(max_q, device=device)[None, :, None]
    key = torch.arange(max_k, device=device)[None, None, :]
    mask = (key <= past_t + query) & (key < total_t)  # [G, Q, L]

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return _PrefillGroup(
        rows=tensor(rows),
        query_dest=tensor(query_dest),
        key_dest=tensor(past_dest + new_dest),
        past_slots=tensor(past_slots) if past_slots else None,
        mask=_additive(mask[:, None], dtype),
        num_segments=len(bounds),
        max_queries=max_q,
        max_keys=max_k,
    )


def attend(
    plan: AttentionPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool_k: torch.Tensor | None,
    pool_v: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One layer's attention of a packed batch.

    q [1, h, N, d], k/v [1, kvh, N, d] (this step's); pool_k/pool_v: the
    layer's KV pool [num_slots, kvh, d] (None when no segment has a cache).
    Writes the plan's rows into the pool, then returns [1, N, h*d].
    """
    n = plan.num_tokens
    if plan.is_plain_causal:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(1, n, -1)
    q_rows, k_rows, v_rows = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)
    # ^ [N, h, d], [N, kvh, d]: views, rows are tokens
    if plan.write_slots is not None and pool_k is not None and pool_v is not None:
        # The pool keeps values, not a graph (a training forward has no cache,
        # but a scored prefill may run with grad enabled).
        k_new = k_rows.detach() if k_rows.requires_grad else k_rows
        v_new = v_rows.detach() if v_rows.requires_grad else v_rows
        if plan.write_rows is not None:
            k_new = k_new.index_select(0, plan.write_rows)
            v_new = v_new.index_select(0, plan.write_rows)
        pool_k.index_copy_(0, plan.write_slots, k_new)
        pool_v.index_copy_(0, plan.write_slots, v_new)
    parts: list[torch.Tensor] = []  # [rows, h, d] each
    if plan.prefill is not None:
        parts.append(_attend_prefill(plan.prefill, q_rows, k_rows, v_rows, pool_k, pool_v, scale))
    if plan.decode is not None and pool_k is not None and pool_v is not None:
        parts.append(_attend_decode(plan.decode, q_rows, pool_k, pool_v, scale))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    if plan.order is not None:
        out = out.index_select(0, plan.order)
    return out.reshape(1, n, -1)


def _attend_decode(
    group: _DecodeGroup,
    q_rows: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[B, h, d]: each decode token against its cache (this step's K/V included)."""
    b, length = group.num_rows, group.max_len
    num_kv_heads, head_dim = pool_k.shape[1], pool_k.shape[2]
    q = q_rows if group.rows is None else q_rows.index_select(0, group.rows)  # [B, h, d]
    num_heads = q.shape[1]
    # Query head i uses KV head i // group (HF's repeat_kv order): the group's
    # heads become `group` query rows against their one KV head.
    q = q.reshape(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if group.slots is None:
        # Window i = slots [first + i * stride, + L): unfold makes it [B, kvh, d, L], a view.
        span = (b - 1) * group.slot_stride + length
        keys = pool_k.narrow(0, group.first_slot, span).unfold(0, length, group.slot_stride)
        values = pool_v.narrow(0, group.first_slot, span).unfold(0, length, group.slot_stride)
        keys, values = keys.transpose(2, 3), values.transpose(2, 3)  # [B, kvh, L, d]
    else:
        keys = pool_k.index_select(0, group.slots).view(b, length, num_kv_heads, head_dim)
        values = pool_v.index_select(0, group.slots).view(b, length, num_kv_heads, head_dim)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=group.mask, scale=scale
    )  # [B, kvh, group, d]
    return out.reshape(b, num_heads, head_dim)


def _attend_prefill(
    group: _PrefillGroup,
    q_rows: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    pool_k: torch.Tensor | None,
    pool_v: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """[M, h, d]: each multi-token segment against its past and itself, causally."""
    g, num_q, num_k = group.num_segments, group.max_queries, group.max_keys
    num_heads, head_dim = q_rows.shape[1], q_rows.shape[2]
    num_kv_heads = k_rows.shape[1]
    q = q_rows.index_select(0, group.rows)
    q_pad = q.new_zeros(g * num_q, num_heads, head_dim).index_copy(0, group.query_dest, q)

    def keys_of(rows: torch.Tensor, pool: torch.Tensor | None) -> torch.Tensor:
        new = rows.index_select(0, group.rows)  # [M, kvh, d]
        if group.past_slots is not None and pool is not None:
            new = torch.cat((pool.index_select(0, group.past_slots), new))
        pad = new.new_zeros(g * num_k, num_kv_heads, head_dim)
        return pad.index_copy(0, group.key_dest, new).view(g, num_k, num_kv_heads, head_dim)

    out = F.scaled_dot_product_attention(
        q_pad.view(g, num_q, num_heads, head_dim).transpose(1, 2),
        keys_of(k_rows, pool_k).transpose(1, 2),
        keys_of(v_rows, pool_v).transpose(1, 2),
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=True,
    )  # [G, h, Q, d]
    return (
        out.transpose(1, 2)
        .reshape(g * num_q, num_heads, head_dim)
        .index_select(0, group.query_dest)
    )
