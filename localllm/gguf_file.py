"""Reading GGUF files: metadata, tensor directory, and memory-mapped tensor data.

The layout is the GGUF v2/v3 format (ggml's `docs/gguf.md`). We take the type constants and block sizes from
the `gguf` package but parse the header ourselves: `gguf.GGUFReader` builds a Python object per array element
and needs ~12 s to open a 262k-token vocabulary, where this parser needs ~0.2 s. Weights are never copied:
every tensor is a view into one read-only memory map of the file.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localllm.errors import ModelFileError
from localllm.gguf_constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8  # arrays of arrays nest no deeper than this (a corrupt type would otherwise recurse away)

# Scalar value types: struct format and size.
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# Numeric arrays are read in one go as numpy arrays.
_NUMPY_DTYPES = {
    GGUFValueType.UINT8: np.uint8,
    GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32,
    GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32,
    GGUFValueType.BOOL: np.bool_,
    GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file. `shape` is in numpy order (rows first): GGUF's ne[] reversed."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    """Sequential little-endian reads over a buffer, turning overruns into a 'truncated' error."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf = buf
        self.pos = 0
        self.path = path

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ModelFileError(
                f"{self.path}: the file is truncated (its header needs more than its {len(self.buf)} bytes); "
                "download it again"
            )

    def scalar(self, vtype: GGUFValueType) -> Any:
        fmt = _SCALAR_FORMATS[vtype]
        size = struct.calcsize(fmt)
        self.need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self) -> int:
        return self.scalar(GGUFValueType.UINT32)

    def u64(self) -> int:
        return self.scalar(GGUFValueType.UINT64)

    def string(self) -> str:
        n = self.u64()
        self.need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        # Vocabularies hold byte-level pieces that are not always valid UTF-8; keep them lossless.
        return raw.decode("utf-8", errors="surrogateescape")

    def value_type(self) -> GGUFValueType:
        raw = self.u32()
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ModelFileError(f"{self.path}: corrupt metadata (unknown value type {raw})") from None

    def value(self, vtype: GGUFValueType, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise ModelFileError(f"{self.path}: corrupt metadata (arrays nested more than {MAX_ARRAY_DEPTH} deep)")
            elem_type = self.value_type()
            count = self.u64()
            if elem_type == GGUFValueType.STRING:
                return self._string_array(count)
            if elem_type == GGUFValueType.ARRAY:
                return [self.value(self.value_type(), depth + 1) for _ in range(count)]
            dtype = np.dtype(_NUMPY_DTYPES[elem_type])
            self.need(count * dtype.itemsize)
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return arr
        return self.scalar(vtype)

    def _string_array(self, count: int) -> list[str]:
        """The hot loop of opening a model (49k + 49k strings for smollm2, 151k + 151k for qwen2.5): one pass in
        Python finds the lengths, then numpy puts a NUL where each length field was and the strings come from
        one decode and one split in C: smollm2's header 36 -> 26 ms. Strings holding a NUL byte themselves are
        cut one by one at the lengths found, which gives the same strings (tests/test_gguf_file.py)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        if count == 0:
            return []
        cached = _lengths_cache(self.path, pos, count) if count >= _CACHED_LENGTHS_FROM else None
        lengths = _checked_lengths(buf, pos, cached) if cached is not None else None
        if lengths is None:
            lengths = self._read_lengths(count)
            if count >= _CACHED_LENGTHS_FROM:
                _store_lengths(self.path, pos, lengths)
        sizes = np.asarray(lengths, np.int64) + 8
        p = pos + int(sizes.sum())
        self.pos = p
        region = np.frombuffer(buf, np.uint8, count=p - pos, offset=pos)
        fields = np.cumsum(sizes) - sizes  # each length field's offset in the region
        joined = region.copy()
        joined[fields] = 0  # the field's first byte becomes the separator, its other 7 go
        keep = np.ones(region.size, bool)
        keep[(fields[:, None] + np.arange(1, 8)).ravel()] = False
        data = joined[keep].tobytes()
        if data.count(0) == count:
            return data.decode("utf-8", "surrogateescape").split("\x00")[1:]
        # a NUL inside a string would split it: cut each at its length instead
        starts = (fields + 8).tolist()
        raw = region.tobytes()
        return [str(raw[a:a + n], "utf-8", "surrogateescape") for a, n in zip(starts, np.asarray(lengths).tolist())]

    def _read_lengths(self, count: int) -> list[int]:
        """The strings' lengths, one length field after another (each string's place depends on the one before:
        a Python loop, 0.15 s of the 1.5b's 151k + 151k strings on a Zen 4, hence `_lengths_cache`)."""
        buf, end = self.buf, len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        lengths = []
        append = lengths.append
        p = self.pos
        for _ in range(count):
            if p + 8 > end:
                self.pos = p
                self.need(8)
            (n,) = unpack(buf, p)
            p += 8
            if p + n > end:
                self.pos = p
                self.need(n)
            append(n)
            p += n
        return lengths


# A string array this long has its lengths kept in the cache (paths.header_cache_dir()) for the next open of the
# file. They are never trusted: `_checked_lengths` reads every length field they point at and compares, in numpy,
# so a stale or damaged cache file only costs the loop it would have saved.
_CACHED_LENGTHS_FROM = 4096
_CACHED_LENGTHS_FILES = 64  # kept at most (a 151k-string array's file is 590 KiB), the oldest dropped first


def _lengths_file(path, pos: int) -> Path | None:
    from localllm import paths

    key = paths.model_file_key(path)
    return None if key is None else paths.header_cache_dir() / f"{key}-{pos}.lengths"


def _lengths_cache(path, pos: int, count: int) -> np.ndarray | None:
    """The lengths cached for the string array at `pos`, if a file of the right size is there (unchecked)."""
    try:
        file = _lengths_file(path, pos)
        if file is None:
            return None
        data = np.fromfile(file, np.uint32)
    except (OSError, ValueError):
        return None
    return data if data.size == count else None


def _checked_lengths(buf, pos: int, lengths: np.ndarray) -> np.ndarray | None:
    """`lengths` if they are exactly what the file's length fields say, one after another from `pos`, else None."""
    sizes = lengths.astype(np.int64) + 8
    total = int(sizes.sum())
    if pos + total > len(buf):
        return None
    fields = np.cumsum(sizes) - sizes
    region = np.frombuffer(buf, np.uint8, count=total, offset=pos)
    stored = region[fields[:, None] + np.arange(8)].view("<u8").reshape(-1)
    return lengths if np.array_equal(stored, sizes - 8) else None


def _store_lengths(path, pos: int, lengths: list[int]) -> None:
    """Best effort, written whole under a temporary name and renamed: a full or read-only cache costs nothing."""
    arr = np.asarray(lengths, np.uint64)
    if arr.size and int(arr.max()) >= 1 << 32:
        return
    try:
        file = _lengths_file(path, pos)
        if file is None:
            return
        file.parent.mkdir(parents=True, exist_ok=True)
        _forget_oldest(file.parent, _CACHED_LENGTHS_FILES - 1)
        tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        try:
            arr.astype(np.uint32).tofile(tmp)
            os.replace(tmp, file)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError:
        pass


def _forget_oldest(folder: Path, keep: int) -> None:
    try:
        found = sorted((e.stat().st_mtime, e.path) for e in os.scandir(folder) if e.name.endswith(".lengths"))
    except OSError:
        return
    for _, name in found[:max(0, len(found) - keep)]:
        try:
            os.unlink(name)
        except OSError:
            pass


class GGUFFile:
    """An open GGUF file: `metadata` (key -> value), `tensors` (name -> TensorInfo), and tensor data views."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise ModelFileError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise ModelFileError(f"{self.path}: is a directory, not a GGUF file") from None
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot open ({e.strerror})") from None
        try:
            self.file_size = os.fstat(fd).st_size
            if self.file_size < 4:
                raise ModelFileError(f"{self.path}: not a GGUF file (only {self.file_size} bytes)")
            self._mmap = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self._buffer = np.frombuffer(self._mmap, dtype=np.uint8)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    def _parse(self) -> None:
        cur = _Cursor(memoryview(self._mmap), self.path)
        magic = bytes(cur.buf[:4])
        if magic != GGUF_MAGIC:
            raise ModelFileError(f"{self.path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        cur.pos = 4
        self.version = cur.u32()
        if self.version not in (2, 3):
            hint = " (a big-endian file?)" if self.version > 0xFFFF else ""
            raise ModelFileError(f"{self.path}: unsupported GGUF version {self.version}{hint}; expected 2 or 3")
        n_tensors = cur.u64()
        n_kv = cur.u64()
        # A corrupt count would otherwise make us loop for a very long time before running out of bytes.
        if n_tensors > self.file_size or n_kv > self.file_size:
            raise ModelFileError(f"{self.path}: corrupt header (claims {n_tensors} tensors, {n_kv} keys)")
        for _ in range(n_kv):
            key = cur.string()
            if key in self.metadata:
                raise ModelFileError(f"{self.path}: corrupt metadata (key {key!r} appears twice)")
            self.metadata[key] = cur.value(cur.value_type())

        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.u32()
            if not 1 <= n_dims <= MAX_DIMS:
                raise ModelFileError(f"{self.path}: corrupt tensor directory ({name!r} has {n_dims} dimensions)")
            ne = [cur.u64() for _ in range(n_dims)]
            raw_type = cur.u32()
            offset = cur.u64()
            infos.append((name, ne, raw_type, offset))

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
                or alignment & (alignment - 1)):
            raise ModelFileError(f"{self.path}: general.alignment is {alignment!r}; it must be a power of two")
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        self.data_offset = data_start
        for name, ne, raw_type, offset in infos:
            if name in self.tensors:
                raise ModelFileError(f"{self.path}: corrupt tensor directory (tensor {name!r} appears twice)")
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ModelFileError(
                    f"{self.path}: tensor {name!r} has tensor type {raw_type}, which this version of "
                    "localllm does not know"
                ) from None
            if 0 in ne:
                raise ModelFileError(f"{self.path}: tensor {name!r} has a dimension of 0 (its shape is {ne[::-1]})")
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            if ne[0] % block_size:
                raise ModelFileError(
                    f"{self.path}: tensor {name!r} has {ne[0]} columns, not a multiple of the "
                    f"{qtype.name} block size {block_size}"
                )
            if offset % alignment:
                raise ModelFileError(f"{self.path}: tensor {name!r} starts at data offset {offset}, not a multiple "
                                     f"of the file's alignment {alignment}: the file is corrupt")
            n_bytes = math.prod(ne) // block_size * type_size  # Python integers: a corrupt shape cannot wrap
            start = data_start + offset
            if start + n_bytes > self.file_size:
                raise ModelFileError(
                    f"{self.path}: the data of tensor {name!r} lies outside the file (bytes {start}..{start + n_bytes}"
                    f" of a {self.file_size}-byte file): the file is truncated or corrupt; download it again"
                )
            self.tensors[name] = TensorInfo(name, qtype, tuple(int(d) for d in reversed(ne)), start, n_bytes)
        # Tensors never share bytes (ggml lays them out one after another): an overlap is a corrupt directory.
        placed = sorted(self.tensors.values(), key=lambda t: t.offset)
        for a, b in zip(placed, placed[1:]):
            if b.offset < a.offset + a.n_bytes:
                raise ModelFileError(f"{self.path}: the data of tensors {a.name!r} and {b.name!r} overlap: the file "
                                     "is corrupt")

    # ---- access -------------------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view shaped (rows, bytes_per_row)."""
        info = self.tensor_info(name)
        flat = self._buffer[info.offset : info.offset + info.n_bytes]
        rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
        return flat.reshape(rows, info.n_bytes // rows)

    def release(self, view: np.ndarray) -> None:
        """Drop the pages under `view` (a tensor read by `raw` and copied elsewhere, e.g. repacked) from this
        process's memory: they stay in the page cache and come back from it if read again, but no longer count
        twice in the resident set."""
        if self._buffer is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = view.ctypes.data - self._buffer.ctypes.data
        if start < 0 or start + view.nbytes > self._buffer.nbytes:
            return
        page = mmap.PAGESIZE
        lo, hi = start // page * page, min(-(-(start + view.nbytes) // page) * page, len(self._mmap))
        try:
            self._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):
            pass  # only memory accounting is lost

    def tensor_info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing from the file") from None

    def close(self) -> None:
        self._buffer = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            # Views handed out (weights in use) keep the mapping alive; it closes when they are gone.
            pass

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Only the metadata of a GGUF file (tokenizer tests and `show` use this)."""
    return GGUFFile(path).metadata
