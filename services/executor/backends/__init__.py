"""Executor backends: what carries out a node engine's decisions.

`ExecutorBackend` (base.py) is the protocol; `EmulatedBackend` (emulated.py)
sleeps the profile's timing; `TorchBackend` (torch.py, imported on its own so
that an emulated executor never imports torch) runs a real staged model.
"""

from services.executor.backends.base import ExecutorBackend, RequestsFailed
from services.executor.backends.emulated import EmulatedBackend

__all__ = ["EmulatedBackend", "ExecutorBackend", "RequestsFailed"]
