"""What a stage's memory really is: the device's size and what the stage holds.

On a GPU, capacity comes from NVML (`pynvml`, the driver's own figure for the
physical device, found by UUID so ``CUDA_VISIBLE_DEVICES`` remaps are right)
with `torch.cuda` as the fallback, and use is the caching allocator's
``memory_allocated``. On a CPU there is no device to ask: use is counted from
the tensors the stage holds (weights, gradients, optimizer state, KV cache on
the device), which is what the accounted CPU budget is checked against.
"""

from __future__ import annotations

import torch

from lemix.model.staged import Stage


def device_total_bytes(device: torch.device) -> int | None:
    """Total memory of a CUDA device (None for a CPU)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{props.uuid}")
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML (driver too old, a container without it): torch knows too
        return int(props.total_memory)


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def stage_used_bytes(stage: Stage, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes the stage holds on its device now."""
    if stage.device.type == "cuda":
        return int(torch.cuda.memory_allocated(stage.device))
    total = stage.kv.device_bytes
    for p in stage.parameters():
        total += _tensor_bytes(p) + _tensor_bytes(p.grad)
        if optimizer is not None:
            total += sum(
                _tensor_bytes(v)
                for v in optimizer.state.get(p, {}).values()
                if isinstance(v, torch.Tensor)
            )
    return total
