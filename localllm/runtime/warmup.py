"""Compile the kernels a model needs before its first token, with progress the first time.

Numba compiles each kernel on first use and caches the machine code on disk (`paths.kernel_cache_dir()`). A
cold start would otherwise sit silent for many seconds inside the first forward pass. Warm-up calls every
kernel variant the model's weights use once; a marker per variant, keyed by the kernels' source, Numba's
version and the CPU, says whether it was compiled before, so only a real compile shows a progress bar.
"""

from __future__ import annotations

import contextvars
import hashlib
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from localllm import paths
from localllm.progress import note, progress_bar


@cache
def _build_key() -> str:
    from importlib.metadata import version

    import llvmlite.binding as llvm

    import localllm.kernels as kernels

    digest = hashlib.sha256()
    root = Path(kernels.__file__).parent
    for src in sorted([*root.rglob("*.py"), *root.rglob("*.cl")]):  # Numba's and OpenCL's kernel sources
        digest.update(src.read_bytes())
    digest.update(version("numba").encode())  # compiled code is Numba's: a new one compiles anew
    digest.update(llvm.get_host_cpu_name().encode())
    return digest.hexdigest()[:16]


# A front end that draws its own progress (the TUI) listens here instead of the console bar. A context variable,
# so each thread that loads a model reports to its own listener.
_listener: contextvars.ContextVar = contextvars.ContextVar("warm_up_listener", default=None)


@contextmanager
def reporting(listener):
    """Within this block, warm_up calls `listener(done, total)` as it compiles (only on a cold start)."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)


def _marker(label: str) -> Path:
    return paths.kernel_cache_dir() / "compiled" / _build_key() / label.replace(" ", "_").replace("/", "_")


def warm_up(calls, quiet: bool = False, where: str = "this CPU") -> int:
    """Run the (label, thunk) warm-up calls a backend gives for a model (`Backend.warm_up_calls`, then the model's
    whole-forward ones) that are not yet marked compiled; returns how many ran (0 on a warm start). `where`
    names the device in the message (labels of a device's calls name the device, so each has its markers)."""
    calls = list(calls)
    cold = [(label, thunk) for label, thunk in calls if not _marker(label).exists()]
    if not cold:
        return 0
    listener = _listener.get()
    note(f"Compiling kernels for {where} (first run only; later runs start in seconds)", quiet)
    with progress_bar("compiling kernels", len(cold), quiet, unit="items") as bar:
        for i, (label, thunk) in enumerate(cold):
            if listener:
                listener(i, len(cold))
            thunk()
            marker = _marker(label)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            bar.update(i + 1)
        if listener:
            listener(len(cold), len(cold))
    return len(cold)
