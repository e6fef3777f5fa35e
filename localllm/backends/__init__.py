"""Backends that run the model (localllm/backends/base.py): the registry.

This package is where the engine meets the kernels: the model code asks `get(name)` for a backend and calls its
operations; only the backends themselves import Numba, `kernels.ops` or `kernels.cpu`.
"""

from __future__ import annotations

from localllm.backends.base import Backend
from localllm.errors import LocalLLMError

NAMES = ("cpu",)
_instances: dict[str, Backend] = {}


def get(name: str = "cpu") -> Backend:
    """The backend called `name` (one instance per process: its compiled kernels and caches are shared)."""
    if name not in NAMES:
        raise LocalLLMError(f"unknown backend {name!r}; available: {', '.join(NAMES)}")
    if name not in _instances:
        from localllm.backends.cpu import CpuBackend

        _instances[name] = CpuBackend()
    return _instances[name]


__all__ = ["Backend", "NAMES", "get"]
