"""A causal LM split into S pipeline stages, each on its own device.

Stage 0 owns the embeddings, the last stage the final norm and LM head, and
the decoder layers are split as evenly as possible (earlier stages take the
remainder). A stage's `forward` takes the previous stage's output (token ids
on stage 0) and returns its own: hidden states, or logits on the last stage.
Activations cross devices explicitly between calls; for training each stage
builds its own autograd graph and gradients are handed back stage by stage
(`lemix.model.training`), so no graph spans devices.

Batches are packed and ragged (`Segment`s over one token sequence, see
`lemix.model.families`); each segment attends to its own KV cache, all of
them batched per layer (`lemix.model.attention`, over `lemix.model.kv`'s
per-stage pool).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lemix.model.attention import AttentionPlan, attend
from lemix.model.families import Family, attention_scale, family_for
from lemix.model.kv import KVStore


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
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        segments: Sequence[Segment],
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs: ids [N] (first stage) or hidden [1, N, hidden]; positions [N].

        Returns hidden [1, N, hidden], or logits [1, N, vocab] on the last stage
        ([1, R, vocab] for `logit_rows` [R]: only the rows sampling reads, since
        the LM head over a whole prompt costs more than the rest of a decode
        step). Appends each segment's first `num_cached` K/V to its cache.
        """
        return self.forward_part(
            inputs,
            positions,
            segments,
            self.layers,
            embed=self.is_first,
            head=self.is_last,
            logit_rows=logit_rows,
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
        logit_rows: torch.Tensor | None = None,
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
        bounds = [(s.start, s.end, s.num_cached) for s in segments]
        uses_pool = any(c is not None for c in caches)
        # The pool lock keeps the pool from growing (a copy) under this forward's writes.
        with self.kv.pool_lock if uses_pool else contextlib.nullcontext():
            plan = AttentionPlan.build(bounds, caches, x.shape[1], self.device, x.dtype)

            def attend_layer(
                layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
            ) -> torch.Tensor:
                local = layer - self.layers.start
                pool_k, pool_v = self.kv.layer_views(local) if uses_pool else (None, None)
                return attend(plan, q, k, v, pool_k, pool_v, self._scales[local])

            for i in layers:
                x = self.family.layer_forward(i, x, positions, attend_layer)
        for seg, cache in zip(segments, caches, strict=True):
            if cache is not None:
                cache.length += seg.num_cached
        if not head:
            return x
        if logit_rows is not None:
            x = x.index_select(1, logit_rows.to(self.device))
        return self.family.head(x)


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
