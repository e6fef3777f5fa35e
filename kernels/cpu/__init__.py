"""CPU kernels (Numba). See kernels/ops.py for the interface the engine calls."""

from __future__ import annotations

import hashlib
from pathlib import Path


def forget_stale_cache(module_file: str, cache_path: str, dependencies: list[str]) -> None:
    """Drop a module's cached compiled kernels when a module they were compiled with has changed.

    Numba checks a cached kernel against the content of its own source file only, but a kernel also contains the
    code of the jitted functions it calls from other modules (simd.py's intrinsics, quant_dot's row functions):
    after an edit there, Numba would keep loading kernels built from the old code. So a stamp of the
    dependencies' content lives beside the cache; when it does not match, this module's cache files go (its
    kernels recompile on first use). Call at import, before any kernel of the module is loaded.
    """
    try:
        digest = hashlib.sha256()
        for dep in dependencies:
            digest.update(Path(dep).read_bytes())
        stem = Path(module_file).stem
        cache_dir = Path(cache_path)
        stamp = cache_dir / f"{stem}.deps-{digest.hexdigest()[:16]}.stamp"
        if stamp.exists():
            return
        for stale in cache_dir.glob(f"{stem}.*"):
            stale.unlink(missing_ok=True)
        cache_dir.mkdir(parents=True, exist_ok=True)
        stamp.touch()
    except OSError:
        pass  # an unwritable cache directory: Numba does not cache there either
