"""CPU kernels (Numba). See kernels/ops.py for the interface the engine calls.

Numba caches compiled kernels on disk. Ours go to the user's cache directory (`paths.kernel_cache_dir()`), so
that an installed, read-only package still starts fast on the second run; a user's NUMBA_CACHE_DIR wins. The
locator below answers for this package's own source files only: other Numba code in the process keeps Numba's
defaults, and no environment variable is set.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from numba.core import caching as _caching
from numba.core import config as _numba_config

from localllm.paths import kernel_cache_dir

_KERNELS_DIR = Path(__file__).resolve().parent.parent


class _KernelCacheLocator(_caching.UserProvidedCacheLocator):
    """Numba's user-provided-directory locator, pointed at our cache directory, for files of this package."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = os.path.join(str(kernel_cache_dir()), self.get_suitable_cache_subpath(py_file))

    @classmethod
    def from_function(cls, py_func, py_file):
        if _numba_config.CACHE_DIR:  # NUMBA_CACHE_DIR: Numba's own locator takes it
            return None
        try:
            Path(py_file).resolve().relative_to(_KERNELS_DIR)
        except (ValueError, OSError):
            return None
        self = cls(py_func, py_file)
        try:
            self.ensure_cache_path()
        except OSError:
            return None  # unwritable: Numba's next locator (or none) decides
        return self


if _KernelCacheLocator not in _caching.CacheImpl._locator_classes:
    _caching.CacheImpl._locator_classes.insert(0, _KernelCacheLocator)


# Numba's Cache.load_overload first refreshes the target context: it imports and installs every typing and
# lowering registry Numba has (~100 ms), which compiling needs (the compiler refreshes it itself) but loading
# machine code from the cache does not: that needs the NRT (our kernels allocate) and nothing else. For this
# package's kernels the load skips the refresh: a warm start of smollm2 0.75 -> 0.64 s in-process (2-core Zen 5).
_numba_load_overload = _caching.Cache.load_overload


def _load_overload(self, sig, target_context):
    impl = getattr(self, "_impl", None)
    if not isinstance(getattr(impl, "locator", None), _KernelCacheLocator) or \
            not hasattr(self, "_guard_against_spurious_io_errors") or not hasattr(self, "_load_overload"):
        return _numba_load_overload(self, sig, target_context)
    from numba.core.runtime import rtsys

    rtsys.initialize(target_context)
    with self._guard_against_spurious_io_errors():
        return self._load_overload(sig, target_context)


if _caching.Cache.load_overload is not _load_overload:
    _caching.Cache.load_overload = _load_overload


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
