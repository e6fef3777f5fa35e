"""Backends that run the model (localllm/backends/interface.py): the registry.

This package is where the engine meets the kernels: the model code asks `get(name)` for a backend and calls its
operations (its own kernels, or the numpy reference where it has none: `Backend.supports`), and nothing else in
localllm/ imports Numba or the CPU kernels (tests/test_backend_forward.py checks it). The tools that run the CPU's
kernels on the host whatever the device (the quantizer's row kernels, `--threads`) take them from
`host_kernels()`.
"""

from __future__ import annotations

from localllm.backends.interface import Backend
from localllm.errors import LocalLLMError

NAMES = ("cpu", "opencl")
_instances: dict[str, Backend] = {}


def get(name: str = "cpu") -> Backend:
    """The backend a `--device` value names: "cpu", or "opencl" / "opencl:PLATFORM:DEVICE" (substrings of the
    names `localllm devices` lists; plain "opencl" takes the preferred device, GPUs first). One instance per
    name and process: its compiled kernels, device context and caches are shared."""
    kind, _, spec = name.partition(":")
    if kind not in NAMES:
        raise LocalLLMError(f"unknown device {name!r}; use cpu or opencl[:PLATFORM:DEVICE] (see `localllm devices`)")
    if name not in _instances:
        if kind == "cpu":
            from localllm.backends.cpu_backend import CpuBackend

            _instances[name] = CpuBackend()
        else:
            from localllm.backends.opencl_backend import OpenCLBackend

            _instances[name] = OpenCLBackend(spec)
    return _instances[name]


def host_kernels():
    """The CPU backend's kernels (kernels/ops.py) for the tools that run them on the host whatever the device
    (quantizing rows, importance matrices, the thread count of `--threads`). Importing them loads Numba."""
    from localllm.kernels import ops

    return ops


__all__ = ["Backend", "NAMES", "get", "host_kernels"]
