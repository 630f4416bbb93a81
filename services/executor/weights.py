"""Saving, loading and averaging one pipeline stage's weights (SEPARATE's
weight sync; replica sync's averaging).

One safetensors file per stage under the sync location, keyed by the stage's
own parameter names, so the stage of another node with the same split loads
it directly. Writes go to a temporary name and are renamed into place: a
reader never sees a half-written file.

A location comes over the network (`Executor.SyncWeights`), so
`confine_location` keeps it under the executor's weight-sync directory before
anything is read or written. torch is imported only by the functions that
move tensors: the check runs in emulated executors too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lemix.infra.rpc.errors import InvalidArgument

if TYPE_CHECKING:
    from lemix.model.staged import Stage


def confine_location(location: str, root: str | Path) -> str:
    """`location` as an absolute path with `..` and symlinks resolved, if that
    lies under `root` (resolved alike); else `InvalidArgument`.

    A relative location is taken relative to `root`. "" (the backend's default
    location) passes unchanged. The resolved path is what the caller must use:
    re-resolving it later could follow a symlink swapped in meanwhile.
    """
    if not location:
        return location
    if "\0" in location:
        raise InvalidArgument(
            "location must be a path under the weight-sync directory; it contains a NUL byte"
        )
    base = Path(root).resolve()
    resolved = (base / location).resolve()  # joining an absolute location yields it
    if not resolved.is_relative_to(base):
        raise InvalidArgument(
            f"location must be under {base}, got {location!r} (resolves to "
            f"{resolved}); this executor's weight-sync directory is "
            "LEMIX_WEIGHT_SYNC_DIR"
        )
    return str(resolved)


def save_stage(stage: Stage, path: Path) -> int:
    """Write `stage`'s parameters to `path`; returns the bytes written."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: p.detach().to("cpu").contiguous() for name, p in stage.modules.named_parameters()
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _read_matching(stage: Stage, path: Path) -> dict[str, Any]:
    """The tensors in `path`, checked against `stage`'s parameter names and
    shapes: FileNotFoundError, or ValueError (another model or split)."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"no stage weights at {path}")
    tensors = load_file(str(path))
    params = dict(stage.modules.named_parameters())
    if set(tensors) != set(params):
        missing = sorted(set(params) - set(tensors))[:3]
        extra = sorted(set(tensors) - set(params))[:3]
        raise ValueError(
            f"{path} does not match stage {stage.index}: missing {missing}, unexpected {extra}"
        )
    for name, p in params.items():
        if tensors[name].shape != p.shape:
            raise ValueError(
                f"{path}: {name} has shape {tuple(tensors[name].shape)}, the stage "
                f"expects {tuple(p.shape)}"
            )
    return tensors


def average_into_stage(stage: Stage, own: Path, sources: Sequence[Path]) -> int:
    """Replica sync: ``weights += mean(sources) - own``, per parameter.

    `own` is this node's save from the same round (normally one of `sources`):
    what the node trained after saving it is kept on top of the mean rather
    than overwritten, so no update is lost between the two phases. Right
    after the save this is exactly the mean. Accumulates in float32. Reads
    everything before writing anything: a bad file leaves the stage as it
    was. Returns the bytes read.
    """
    import torch

    if not sources:
        raise ValueError("an average needs at least one source")
    base = _read_matching(stage, own)
    total: dict[str, Any] = {}
    num_bytes = sum(t.numel() * t.element_size() for t in base.values())
    for path in sources:
        tensors = _read_matching(stage, path)
        num_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        for name, t in tensors.items():
            if name in total:
                total[name] += t.float()
            else:
                total[name] = t.float().clone()
    with torch.no_grad():
        for name, p in stage.modules.named_parameters():
            delta = total[name] / len(sources) - base[name].float()  # mean - own save
            p.add_(delta.to(p.device, p.dtype))
    return num_bytes


def load_stage(stage: Stage, path: Path) -> int:
    """Copy the parameters in `path` into `stage`; returns the bytes loaded.

    Raises FileNotFoundError, or ValueError when the file's names or shapes do
    not match this stage (a different model or split)."""
    import torch

    tensors = _read_matching(stage, path)
    with torch.no_grad():
        for name, p in stage.modules.named_parameters():
            p.copy_(tensors[name].to(p.device, p.dtype))
    return sum(t.numel() * t.element_size() for t in tensors.values())
