"""Copy-on-write weight stashing for pipeline training with several tasks in flight.

With up to S training tasks in the pipeline, task B's backward can reach a
stage after task A's optimizer step changed that stage's weights in place.
Autograd saved B's forward weights by reference, so its backward would either
fail (version counter) or, worse, mix weights. PipeDream's answer is weight
stashing: backward uses the weights its forward used. We stash lazily, per
parameter: saved tensors that are views of a stage parameter are packed as
(tensor, epoch), and each forward's `Recording` notes which parameters it
saved. An optimizer step on some parameters (all of the stage's for a whole
pass; one layer group's for a backward slice, see `lemix.model.training`)
first snapshots those of them that a still-live graph saved since their last
change; unpacking a tensor saved before its parameter's last change reads the
snapshot of the value it saw. Memory is spent only when a step really
overtakes a live graph that uses the stepped weights: a backward slice's
update of its own group never copies for the same task's later slices, which
saved only the other groups' weights.

Epochs count steps on the stage (any subset); a parameter's value is the same
for every epoch from its last change (`_since`) to now.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch


@dataclass(eq=False)
class Recording:
    """One training forward graph: the stash epoch it ran in and what it saved."""

    epoch: int
    params: set[int] = field(default_factory=set)  # storage pointers of saved parameters


@dataclass(frozen=True)
class _SavedParam:
    tensor: torch.Tensor  # the saved view of a parameter
    epoch: int  # the stash epoch when it was saved
    storage_ptr: int


@dataclass(frozen=True)
class _Snapshot:
    first_epoch: int  # the value held for epochs first_epoch..last_epoch
    last_epoch: int
    tensor: torch.Tensor


class WeightStash:
    """Stashing for one stage's parameters (one instance per stage)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self._params = {p.data_ptr(): p for p in params if p.storage_offset() == 0}
        self.epoch = 0
        self._since = dict.fromkeys(self._params, 0)  # ptr -> epoch of its last change
        # ptr -> epoch -> live graphs recorded then that saved that parameter
        self._live: dict[int, Counter[int]] = {ptr: Counter() for ptr in self._params}
        self._snapshots: dict[int, list[_Snapshot]] = {ptr: [] for ptr in self._params}
        self.num_snapshots = 0  # optimizer steps that had to copy anything

    @contextmanager
    def recording(self) -> Iterator[Recording]:
        """Wrap a training forward; yields the `Recording` to pass to `on_backward_done`."""
        recording = Recording(self.epoch)
        with torch.autograd.graph.saved_tensors_hooks(partial(self._pack, recording), self._unpack):
            yield recording
        # Live once the forward completed (a failed forward leaves no graph).
        for ptr in recording.params:
            self._live[ptr][recording.epoch] += 1

    def on_backward_done(self, recording: Recording) -> None:
        """That graph is consumed; drop snapshots nobody needs any more."""
        for ptr in recording.params:
            live = self._live[ptr]
            live[recording.epoch] -= 1
            if live[recording.epoch] > 0:
                continue
            del live[recording.epoch]
            self._snapshots[ptr] = [
                snap
                for snap in self._snapshots[ptr]
                if any(snap.first_epoch <= e <= snap.last_epoch for e in live)
            ]

    def before_step(self, params: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Call right before an in-place optimizer step on `params` (None: all of them)."""
        ptrs = list(self._params) if params is None else [p.data_ptr() for p in params]
        copied = False
        with torch.no_grad():
            for ptr in ptrs:
                if ptr not in self._params:
                    continue
                first = self._since[ptr]
                # Live epochs are all <= self.epoch: one at or after `first` saw this value.
                if any(e >= first for e in self._live[ptr]):
                    tensor = self._params[ptr].detach().clone()
                    self._snapshots[ptr].append(_Snapshot(first, self.epoch, tensor))
                    copied = True
                self._since[ptr] = self.epoch + 1
        self.num_snapshots += copied
        self.epoch += 1

    def _pack(self, recording: Recording, tensor: torch.Tensor) -> object:
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return tensor
        # The storage's base address, without materializing a Python storage
        # object: wrapping a storage from inside an autograd hook while other
        # threads run torch work corrupted the heap (seen on torch 2.13, CPU).
        ptr = int(tensor.data_ptr() - tensor.storage_offset() * tensor.element_size())
        if ptr in self._params:
            recording.params.add(ptr)
            return _SavedParam(tensor, recording.epoch, ptr)
        return tensor

    def _unpack(self, packed: object) -> torch.Tensor:
        if not isinstance(packed, _SavedParam):
            return packed  # type: ignore[return-value]
        if packed.epoch >= self._since[packed.storage_ptr]:
            return packed.tensor  # not stepped since: the live weights are the ones it used
        t = packed.tensor
        for snap in self._snapshots[packed.storage_ptr]:
            if snap.first_epoch <= packed.epoch <= snap.last_epoch:
                return snap.tensor.as_strided(t.size(), t.stride(), t.storage_offset())
        raise RuntimeError("a stashed weight was dropped while a graph still needed it")
