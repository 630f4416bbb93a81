"""Copy-on-write weight stashing for pipeline training with several tasks in flight.

With up to S training tasks in the pipeline, task B's backward can reach a
stage after task A's optimizer step changed that stage's weights in place.
Autograd saved B's forward weights by reference, so its backward would either
fail (version counter) or, worse, mix weights. PipeDream's answer is weight
stashing: backward uses the weights its forward used. We stash lazily: saved
tensors that are views of a stage parameter are packed as (tensor, epoch); an
optimizer step that happens while a graph of the current epoch is still live
first snapshots the stage's parameters; unpacking an older epoch reads its
snapshot. Memory is spent only when a step really overtakes a live graph.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _SavedParam:
    tensor: torch.Tensor  # the saved view of a parameter
    epoch: int  # the stash epoch when it was saved
    storage_ptr: int


class WeightStash:
    """Stashing for one stage's parameters (one instance per stage)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self._params = {p.data_ptr(): p for p in params if p.storage_offset() == 0}
        self.epoch = 0
        self._live: Counter[int] = Counter()  # epoch -> graphs built then and not yet done
        self._snapshots: dict[int, dict[int, torch.Tensor]] = {}
        self.num_snapshots = 0

    @contextmanager
    def recording(self) -> Iterator[int]:
        """Wrap a training forward; yields the epoch to pass to `on_backward_done`."""
        epoch = self.epoch
        self._live[epoch] += 1
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield epoch

    def on_backward_done(self, epoch: int) -> None:
        """That graph is consumed; drop snapshots nobody needs any more."""
        self._live[epoch] -= 1
        if self._live[epoch] <= 0:
            del self._live[epoch]
            self._snapshots.pop(epoch, None)

    def before_step(self) -> None:
        """Call right before an in-place optimizer step on these parameters."""
        if self._live.get(self.epoch, 0) > 0:
            with torch.no_grad():
                self._snapshots[self.epoch] = {
                    ptr: p.detach().clone() for ptr, p in self._params.items()
                }
            self.num_snapshots += 1
        self.epoch += 1

    def _pack(self, tensor: torch.Tensor) -> object:
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return tensor
        # The storage's base address, without materializing a Python storage
        # object: wrapping a storage from inside an autograd hook while other
        # threads run torch work corrupted the heap (seen on torch 2.13, CPU).
        ptr = int(tensor.data_ptr() - tensor.storage_offset() * tensor.element_size())
        if ptr in self._params:
            return _SavedParam(tensor, self.epoch, ptr)
        return tensor

    def _unpack(self, packed: object) -> torch.Tensor:
        if not isinstance(packed, _SavedParam):
            return packed  # type: ignore[return-value]
        if packed.epoch == self.epoch:
            return packed.tensor  # no step since: the live weights are the ones it used
        snapshot = self._snapshots[packed.epoch][packed.storage_ptr]
        t = packed.tensor
        return snapshot.as_strided(t.size(), t.stride(), t.storage_offset())
