"""Tiled weights kept on disk between runs, so a warm start maps them instead of tiling again.

Why: tiling a weight writes a private copy of it, and the copy's memory is what costs. Measured on a 2-core Zen 4
(qwen2.5-coder-1.5b, 1,059 MiB of K-quant weights): tiling everything takes 0.84-1.00 s, of which the kernel's
handing out 1 GiB of zeroed anonymous pages alone is 0.47-0.61 s (a MAP_POPULATE allocation, nothing written);
mapping the same bytes from a file in the page cache takes 0.05-0.07 s (MADV_POPULATE_READ). So a load that
finds its tiles here maps them read-only (64-byte aligned as the kernels need: a mapping starts
on a page), and the file's own pages for that weight are never touched.

One file a weight, `<cache>/tiles/<model>-<weight>.tiles`, holding exactly the tiled bytes (`tiled.tile`'s
output), named by hashes of what decides them:
  - model: the GGUF's resolved path, size, mtime (ns), inode and device: a model replaced or re-downloaded gets
    new names (its old files are evicted as the cache fills).
  - weight: the tensor's name, row range, type and shape, 64 bytes from each end of its data, and the source of
    the tiled layout (tiled.py, tiled_k.py): a new layout never reads an old file.
A weight is tiled straight into a temporary file of the cache (mapped shared, its bytes reserved first), which is
renamed once the tiles are whole (os.replace: atomic), so a name that exists holds a complete tile; its size is
checked again on reading. The cache is best effort: a full disk or a read-only cache gets no file, and the weight
is tiled into memory as before.

Bounded: at most LOCALLLM_TILE_CACHE_GB (default 8) GiB of tiles, the least recently used files removed first,
and never written when the disk would keep less than 2 GiB free. LOCALLLM_TILE_CACHE_GB=0 turns it off.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import time
import weakref
from pathlib import Path

import numpy as np

from localllm.paths import model_file_key, tile_cache_dir

_SUFFIX = ".tiles"
_KEEP_FREE = 2 << 30  # bytes the disk keeps free after a write
_STALE_TMP_S = 3600  # a temporary file this old was left by a process that died mid-write
_layout: list[str] = []  # the tiled layout's source hash, computed once
_total: dict[Path, int] = {}  # bytes of tiles in a cache folder, counted on this process's first write there


def directory() -> Path:
    return tile_cache_dir()


def budget() -> int:
    """The cache's size limit in bytes (0: off)."""
    raw = os.environ.get("LOCALLLM_TILE_CACHE_GB", "8")
    try:
        return max(0, int(float(raw) * (1 << 30)))
    except (ValueError, OverflowError):  # not a number, or inf / nan
        return 8 << 30


def _layout_hash() -> str:
    if not _layout:
        from localllm.kernels.cpu import tiled, tiled_k
        h = hashlib.sha256()
        for module in (tiled, tiled_k):
            h.update(Path(module.__file__).read_bytes())
        _layout.append(h.hexdigest()[:16])
    return _layout[0]


def model_key(path) -> str | None:
    """The model file's part of a tile's name (paths.model_file_key: `localllm rm` deletes by it too)."""
    return model_file_key(path)


_model_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # an open file's key, found once a load


def tiled(gguf_file, name: str, rows, qtype, raw: np.ndarray, tile, release=None) -> np.ndarray:
    """The tiles of a weight: mapped from an earlier run's file, else made by `tile(raw, qtype, release, out)`
    into a new cache file (or into memory where there is none) for the next run."""
    model = None
    if budget():
        try:
            model = _model_keys[gguf_file]
        except (KeyError, TypeError):
            model = model_key(getattr(gguf_file, "path", None))
            try:
                _model_keys[gguf_file] = model
            except TypeError:  # a stand-in that takes no weak reference
                pass
    key = weight_key(name, rows, qtype, raw) if model else None
    found = load(model, key, raw.shape) if model else None
    if found is not None:
        return found
    pending = create(model, key, raw.shape) if model else None
    try:
        tiles = tile(raw, qtype, release=release, out=pending.array if pending else None)
    except BaseException:
        if pending:
            pending.abandon()
        raise
    if pending:
        pending.commit()
    return tiles


def weight_key(name: str, rows, qtype, raw: np.ndarray) -> str:
    flat = raw.reshape(-1)
    h = hashlib.sha256()
    h.update(f"{name}\0{rows}\0{int(qtype)}\0{raw.shape}\0{_layout_hash()}\0".encode())
    h.update(flat[:64].tobytes())
    h.update(flat[-64:].tobytes())
    return h.hexdigest()[:24]


def load(model: str, weight: str, shape) -> np.ndarray | None:
    """The cached tiles of a weight, mapped read-only, or None when they are not here whole."""
    path = directory() / f"{model}-{weight}{_SUFFIX}"
    size = int(np.prod(shape))
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != size or size == 0:
                return None
            mem = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        os.utime(path)  # most recently used: evicted last
    except (OSError, ValueError):
        return None
    return np.frombuffer(mem, np.uint8, count=size).reshape(tuple(shape))  # a plain read-only array


class Pending:
    """A weight's tiles being written: `array` is a shared writable mapping of a temporary file in the cache,
    which `tiled.tile` fills in place; `commit()` names the file for the next run, `abandon()` removes it."""

    def __init__(self, tmp: Path, path: Path, array: np.ndarray):
        self.tmp, self.path, self.array = tmp, path, array

    def commit(self) -> None:
        try:
            os.replace(self.tmp, self.path)
        except OSError:
            self.abandon()

    def abandon(self) -> None:
        _unlink(str(self.tmp))


def create(model: str, weight: str, shape) -> Pending | None:
    """Room on disk for a weight's tiles, to be tiled into directly: the tiles then live in the page cache, the
    kernel writes them back on its own, and nothing is copied twice. None where the cache is off, full, or its
    disk cannot reserve the bytes (the caller tiles into memory instead).

    The bytes are reserved with posix_fallocate before the file is mapped: a write through a mapping to a disk
    that has run out of space would otherwise be a SIGBUS, not an error."""
    size = int(np.prod(shape))
    limit = budget()
    if limit <= 0 or size > limit or size == 0:
        return None
    folder = directory()
    path = folder / f"{model}-{weight}{_SUFFIX}"
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(folder).free < size + _KEEP_FREE:
            return None
        if folder not in _total or _total[folder] + size > limit:
            _total[folder] = _evict(folder, limit - size)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)
        mem = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError, AttributeError):
        os.close(fd)
        _unlink(str(tmp))
        return None
    os.close(fd)  # the mapping keeps the file
    _total[folder] += size
    return Pending(tmp, path, np.frombuffer(mem, np.uint8, count=size).reshape(tuple(shape)))


def _evict(folder: Path, keep: int) -> int:
    """Remove the least recently used tiles until the rest take at most `keep` bytes, and temporary files
    that a killed process left; the bytes of tiles left."""
    now = time.time()
    files = []
    for entry in os.scandir(folder):
        try:
            st = entry.stat()
        except OSError:
            continue
        if entry.name.endswith(".tmp"):
            if now - st.st_mtime > _STALE_TMP_S:
                _unlink(entry.path)
        elif entry.name.endswith(_SUFFIX):
            files.append((st.st_mtime, st.st_size, entry.path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= keep:
            break
        _unlink(path)
        total -= size
    return total


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
