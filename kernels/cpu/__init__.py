"""CPU kernels (Numba). See kernels/ops.py for the interface the engine calls.

Numba caches compiled kernels on disk. Ours go to the user's cache directory (`paths.kernel_cache_dir()`), so
that an installed, read-only package still starts fast on the second run; a user's NUMBA_CACHE_DIR wins. The
locator below answers for this package's own source files only: other Numba code in the process keeps Numba's
defaults, and no environment variable is set.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import threading
from pathlib import Path

from numba.core import caching as _caching
from numba.core import codegen as _codegen
from numba.core import config as _numba_config
from numba.core import environment as _environment

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
        if self._cache_path not in _writable:  # once a directory: Numba's check writes a file (267 at import)
            try:
                self.ensure_cache_path()
            except OSError:
                return None  # unwritable: Numba's next locator (or none) decides
            _writable.add(self._cache_path)
        return self


_writable: set[str] = set()  # cache directories this process has found writable


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
    _loading.ours = True
    try:
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)
    finally:
        _loading.ours = False


if _caching.Cache.load_overload is not _load_overload:
    _caching.Cache.load_overload = _load_overload


# A cached kernel is its machine code (an ELF object) and its LLVM bitcode, which Numba keeps for linking the
# kernel into code compiled later. Numba parses the bitcode at every load, and walks it for the names the object
# defines: 29 ms of parsing and 6 ms of walking for the 12 libraries of smollm2's warm start (its _worker alone:
# 19 ms for 224 names), for code that nothing compiled later links to on a warm start. For this package's kernels
# the names come from the object's ELF symbol table (the same 224, 191, 51 and 8 names on the four largest, read
# in 0.2-0.5 ms) and the bitcode is parsed only when something links to the kernel.
_loading = threading.local()
_numba_unserialize = _codegen.CPUCodeLibrary.__dict__.get("_unserialize")


class _LazyLinkingLibrary(_codegen.JITCodeLibrary):
    """A kernel library loaded from our cache: its module for linking is parsed from the bitcode on first use."""

    @property
    def _shared_module(self):
        mod = self.__dict__.get("_shared_module_parsed")
        if mod is None and self.__dict__.get("_shared_bitcode") is not None:
            import llvmlite.binding as ll

            mod = self.__dict__["_shared_module_parsed"] = ll.parse_bitcode(self.__dict__.pop("_shared_bitcode"))
        return mod

    @_shared_module.setter
    def _shared_module(self, mod):
        self.__dict__["_shared_module_parsed"] = mod


def elf_defined_symbols(obj: bytes) -> set[str] | None:
    """Names of the functions and data objects an ELF64 little-endian relocatable object defines (its .symtab's
    symbols with a section); None for any other format (macOS' Mach-O, Windows' COFF: Numba's own path)."""
    if obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1:
        return None
    (shoff,) = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, sh_type, _, _, offset, size, link, _, _, _ in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        str_offset, str_size = sections[link][4], sections[link][5]
        strtab = obj[str_offset:str_offset + str_size]
        for st_name, st_info, _, st_shndx, _, _ in struct.iter_unpack("<IBBHQQ", obj[offset:offset + size]):
            if st_name and st_shndx != 0 and st_info & 0xF in (1, 2):  # defined STT_OBJECT / STT_FUNC
                names.add(strtab[st_name:strtab.index(b"\0", st_name)].decode())
    return names


def _unserialize(cls, codegen, state):
    name, kind, data = state
    symbols = None
    if kind == "object" and cls is _codegen.JITCodeLibrary and getattr(_loading, "ours", False):
        try:
            symbols = elf_defined_symbols(data[0])
        except (struct.error, ValueError, IndexError, UnicodeDecodeError):
            symbols = None
    if symbols is None:
        return _numba_unserialize.__func__(cls, codegen, state)
    object_code, shared_bitcode = data
    self = codegen.create_library(name)
    self.__class__ = _LazyLinkingLibrary
    self.__dict__["_shared_bitcode"] = shared_bitcode
    self.enable_object_caching()
    self._set_compiled_object(object_code)
    self._finalize_final_module()
    self._codegen._engine._defined_symbols |= symbols  # what Numba's _load_defined_symbols(bitcode) adds
    return self


if isinstance(_numba_unserialize, classmethod) and hasattr(_codegen.JitEngine, "_load_defined_symbols"):
    _codegen.JITCodeLibrary._unserialize = classmethod(_unserialize)


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


# Each cached function carries the environments of the functions compiled into it, pickled as (module name,
# constants), and Numba imports that module to hand the environment its globals. For Numba's own array code
# inlined into ours (np.empty, broadcasting, np.max) that imports numba.np.arrayobj, npyimpl and arraymath, 35 ms
# of smollm2's warm start. Compiled code reads an environment's globals only in object mode, which our kernels
# never use (nopython throughout; exceptions and constants travel in the constants, restored as Numba does), so
# while loading our kernels such an environment gets the module's name alone and the module is not imported.
_numba_rebuild_env = _environment._rebuild_env


def _rebuild_env(modname, consts, env_name):
    if not (getattr(_loading, "ours", False) and modname and modname.startswith("numba.")
            and modname not in sys.modules):
        return _numba_rebuild_env(modname, consts, env_name)
    env = _environment.lookup_environment(env_name)
    if env is None:
        env = _environment.Environment({"__name__": modname})
        env.consts[:] = consts
        env.env_name = env_name
        _environment.Environment._memo[env_name] = env
    return env


# Environment.__reduce__ names the module's _rebuild_env at pickling time: under Numba's own name, cache files
# written by this process stay Numba's format (loading them elsewhere calls Numba's function).
_rebuild_env.__module__, _rebuild_env.__qualname__ = _environment.__name__, "_rebuild_env"
if hasattr(_environment, "lookup_environment") and hasattr(_environment.Environment, "_memo"):
    _environment._rebuild_env = _rebuild_env
