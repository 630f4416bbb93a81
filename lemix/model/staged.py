"""A causal LM split into S pipeline stages, each on its own device.

Stage 0 owns the embeddings, the last stage the final norm and LM head, and
the decoder layers are split as evenly as possible (earlier stages take the
remainder). A stage's `forward` takes the previous stage's output (token ids
on stage 0) and returns its own: hidden states, or logits on the last stage.
Activations cross devices explicitly between calls; for training each stage
builds its own autograd graph and gradients are handed back stage by stage
(`lemix.model.training`), so no graph spans devices.

Batches are packed and ragged (`Segment`s over one token sequence, see
`lemix.model.families`); each segment attends to its own KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from lemix.model.families import Family, attention_scale, family_for
from lemix.model.kv import KVStore, RequestKV


@dataclass(frozen=True)
class Segment:
    """One request's (or training sample's) run of tokens in a packed batch."""

    start: int  # slice [start, end) of the packed sequence
    end: int
    cache_key: str | None = None  # its KV cache on this stage; None: no cache (training)
    num_cached: int = 0  # leading tokens of the run to append to the cache

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges per stage; earlier stages take the remainder."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"num_stages must be in [1, {num_layers}] (the model's layers), got {num_stages}"
        )
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


class Stage:
    """One pipeline stage: its layers (plus embeddings / head), device and KV."""

    def __init__(
        self,
        index: int,
        num_stages: int,
        family: Family,
        model: Any,
        layers: range,
        device: torch.device,
        host_device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.index = index
        self.device = device
        self.layers = layers
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.family = family
        self._scales = [attention_scale(model, i, family.head_dim) for i in layers]
        modules: list[nn.Module] = [family.layer(i) for i in layers]
        if self.is_first:
            modules += family.embed_modules()
        if self.is_last:
            modules += family.head_modules()
        self.modules = nn.ModuleList(modules).to(device)
        self.kv = KVStore(
            len(layers),
            family.num_kv_heads,
            family.head_dim,
            dtype=dtype,
            device=device,
            host_device=host_device,
        )

    def parameters(self) -> list[nn.Parameter]:
        return list(self.modules.parameters())

    def forward(
        self, inputs: torch.Tensor, positions: torch.Tensor, segments: Sequence[Segment]
    ) -> torch.Tensor:
        """inputs: ids [N] (first stage) or hidden [1, N, hidden]; positions [N].

        Returns hidden [1, N, hidden], or logits [1, N, vocab] on the last stage.
        Appends each segment's first `num_cached` K/V to its cache.
        """
        return self.forward_part(
            inputs, positions, segments, self.layers, embed=self.is_first, head=self.is_last
        )

    def forward_part(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        segments: Sequence[Segment],
        layers: range,
        *,
        embed: bool,
        head: bool,
    ) -> torch.Tensor:
        """Part of `forward`: the embedding (if `embed`), `layers` (a sub-range of
        this stage's, model-wide indices), then the head (if `head`).

        Training in slices runs a stage this way, a layer group at a time
        (`lemix.model.training`); inputs are ids [N] when `embed`, else hidden.
        Segments with a KV cache go through `forward` only: each call advances
        their cache lengths, so parts would count their tokens once per part.
        """
        inputs = inputs.to(self.device)
        positions = positions.to(self.device)
        x = self.family.embed(inputs, positions) if embed else inputs
        caches = [self.kv.get(s.cache_key) if s.cache_key is not None else None for s in segments]
        past = [c.length if c is not None else 0 for c in caches]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            local = layer - self.layers.start
            return ragged_attention(q, k, v, segments, caches, past, local, self._scales[local])

        for i in layers:
            x = self.family.layer_forward(i, x, positions, attend)
        for seg, cache in zip(segments, caches, strict=True):
            if cache is not None:
                cache.length += seg.num_cached
        return self.family.head(x) if head else x


# Decode steps batched into one attention call from this many on; fewer run
# one by one (the gather into a padded batch costs more than it saves).
MIN_BATCHED_DECODES = 2


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Sequence[Segment],
    caches: Sequence[RequestKV | None],
    past: Sequence[int],
    local: int,
    scale: float,
) -> torch.Tensor:
    """Attention of a packed batch, each segment against its own cache.

    q [1, h, N, d], k/v [1, kvh, N, d] (this step's) -> [1, N, h*d]. Writes each
    segment's first `num_cached` K/V into its cache (layer `local`). Decode
    steps (one new token after a cached past) attend together: their caches
    are gathered into one padded batch with a length mask, one SDPA call.
    Everything else (prefills, a lone decode) attends segment by segment.
    """
    out = torch.empty_like(q)
    decode = [
        i
        for i, (seg, cache, num_past) in enumerate(zip(segments, caches, past, strict=True))
        if cache is not None and num_past and seg.num_tokens == seg.num_cached == 1
    ]
    batched = set(decode) if len(decode) >= MIN_BATCHED_DECODES else set()
    for i, (seg, cache, num_past) in enumerate(zip(segments, caches, past, strict=True)):
        a, b = seg.start, seg.end
        qs, ks, vs = q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]
        if cache is not None and seg.num_cached:
            end = num_past + seg.num_cached
            cache.keys[local][:, num_past:end] = ks[0, :, : seg.num_cached]
            cache.values[local][:, num_past:end] = vs[0, :, : seg.num_cached]
        if i in batched:
            continue
        if cache is not None and num_past:
            total = num_past + seg.num_tokens
            if seg.num_cached == seg.num_tokens:
                # Every new token is already in the cache: attend over a view
                # of it, no copy of the past.
                ks = cache.keys[local][None, :, :total]
                vs = cache.values[local][None, :, :total]
            else:
                ks = torch.cat((cache.keys[local][None, :, :num_past], ks), dim=2)
                vs = torch.cat((cache.values[local][None, :, :num_past], vs), dim=2)
            mask = _offset_causal_mask(seg.num_tokens, total, q.device)
            out[:, :, a:b] = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True
            )
        else:
            out[:, :, a:b] = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=seg.num_tokens > 1, scale=scale, enable_gqa=True
            )
    if batched:
        _batched_decode(
            out,
            q,
            [segments[i].start for i in decode],
            [caches[i] for i in decode],
            [past[i] + 1 for i in decode],
            local,
            scale,
        )
    return out.transpose(1, 2).reshape(1, out.shape[2], -1)


def _batched_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    rows: list[int],
    caches: Sequence[RequestKV | None],
    lengths: list[int],
    local: int,
    scale: float,
) -> None:
    """One SDPA for B decode tokens: caches padded to the longest, masked."""
    device = q.device
    keys = pad_sequence(
        [
            c.keys[local][:, :n].transpose(0, 1)  # type: ignore[union-attr]
            for c, n in zip(caches, lengths, strict=True)
        ],
        batch_first=True,
    )
    values = pad_sequence(
        [
            c.values[local][:, :n].transpose(0, 1)  # type: ignore[union-attr]
            for c, n in zip(caches, lengths, strict=True)
        ],
        batch_first=True,
    )
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, kvh, Lmax, d]
    length_t = torch.tensor(lengths, device=device)
    mask = torch.arange(keys.shape[2], device=device)[None, :] < length_t[:, None]
    index = torch.tensor(rows, device=device)
    q_rows = q[0].index_select(1, index).transpose(0, 1)[:, :, None]  # [B, h, 1, d]
    attended = F.scaled_dot_product_attention(
        q_rows, keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )  # [B, h, 1, d]
    out[0].index_copy_(1, index, attended[:, :, 0].transpose(0, 1))


def _offset_causal_mask(num_new: int, total: int, device: torch.device) -> torch.Tensor | None:
    """Bool mask [num_new, total]: new token i sees positions <= total - num_new + i."""
    if num_new == 1:
        return None  # one new token sees every cached position and itself
    rows = torch.arange(num_new, device=device)[:, None] + (total - num_new)
    return torch.arange(total, device=device)[None, :] <= rows


class StagedModel:
    """A loaded HF causal LM as S `Stage`s."""

    def __init__(
        self,
        model: Any,
        num_stages: int,
        devices: Sequence[str | torch.device] | None = None,
        host_device: str | torch.device = "cpu",
    ) -> None:
        self.model = model
        self.family = family_for(model)
        self.num_stages = num_stages
        if devices is None:
            devices = ["cpu"] * num_stages
        if len(devices) != num_stages:
            raise ValueError(f"{num_stages} stages need {num_stages} devices, got {len(devices)}")
        dtype = next(model.parameters()).dtype
        ranges = split_layers(self.family.num_layers, num_stages)
        self.stages = [
            Stage(
                s,
                num_stages,
                self.family,
                model,
                ranges[s],
                torch.device(d),
                torch.device(host_device),
                dtype,
            )
            for s, d in enumerate(devices)
        ]
        self.dtype = dtype

    @property
    def vocab_size(self) -> int:
        return self.family.vocab_size

    def kv_bytes_per_token(self) -> list[int]:
        return [stage.kv.bytes_per_token() for stage in self.stages]

    def weight_bytes(self) -> list[int]:
        return [
            sum(p.numel() * p.element_size() for p in stage.parameters()) for stage in self.stages
        ]

    @torch.no_grad()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits [T, vocab] of one sequence through every stage, no cache."""
        ids_t = torch.tensor(list(ids), dtype=torch.long)
        positions = torch.arange(len(ids))
        segments = [Segment(0, len(ids))]
        x: torch.Tensor = ids_t
        for stage in self.stages:
            x = stage.forward(x, positions, segments)
        return x[0].cpu()
