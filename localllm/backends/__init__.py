"""Backends that run the model (localllm/backends/interface.py): the registry.

This package is where the engine meets the kernels: the model code asks `get(name)` for a backend and calls its
operations, and the forward itself imports no kernel. Some tools outside the forward still import the CPU's
kernels directly: `localllm/convert/quantize_gguf.py` (`kernels.cpu.formats`, `kernels.ops`), `cli/imatrix_cmd.py` and
`cli/generate.py` (`kernels.ops` for bench and importance matrices) and `warmup.py`; moving them behind a backend
is issue 40's work.
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


__all__ = ["Backend", "NAMES", "get"]
