"""Joining a split GGUF (llama.cpp's `gguf-split` layout) into one GGUF file.

gguf-split writes N files `NAME-00001-of-0000N.gguf`, each a valid GGUF of its own: the first holds every metadata
key of the model, the others none but the split keys; all of them carry `split.no` (0-based), `split.count` and
`split.tensors.count` (the tensors of the whole set), and each its own tensor directory and data. Joining (what
`gguf-split --merge` does) keeps the first part's keys without the `split.*` ones, concatenates the tensor
directories in part order, and lays the tensors' data out again at the file's alignment. The key/value bytes are
copied as they are (never re-encoded), and tensor data is streamed, so a joined file costs no more memory than a
chunk.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

from localllm.errors import ModelFileError
from localllm.gguf_file import DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFFile, _Cursor

SPLIT_PATTERN = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
CHUNK = 8 << 20


def split_index(filename: str) -> tuple[int, int] | None:
    """(part number from 1, part count) for a split part's file name, else None."""
    m = SPLIT_PATTERN.search(filename)
    if not m:
        return None
    no, count = int(m.group(1)), int(m.group(2))
    return (no, count) if 1 <= no <= count else None


def _raw_keys(path: Path) -> tuple[int, list[tuple[str, bytes]]]:
    """The GGUF version and every key of the file with its encoded bytes (key string, type and value)."""
    with open(path, "rb") as f:
        head = f.read(24)
        if head[:4] != GGUF_MAGIC:
            raise ModelFileError(f"{path}: not a GGUF file")
        version, _, n_kv = struct.unpack_from("<IQQ", head, 4)
    meta = GGUFFile(path)  # validates the whole header; its buffer gives the key bytes below
    try:
        cur = _Cursor(memoryview(meta._mmap), path)
        cur.pos = 24
        keys = []
        for _ in range(n_kv):
            start = cur.pos
            key = cur.string()
            cur.value(cur.value_type())
            keys.append((key, bytes(cur.buf[start:cur.pos])))
        del cur
    finally:
        meta.close()
    return version, keys


def _string(s: str) -> bytes:
    raw = s.encode("utf-8", errors="surrogateescape")
    return struct.pack("<Q", len(raw)) + raw


def join(parts: list[Path], dest: Path) -> None:
    """Write the model held by `parts` (in part order) into `dest` as one GGUF. The parts are checked first:
    each one's `split.no` is its position, they agree on `split.count`, and the tensors add up to
    `split.tensors.count`."""
    files = [GGUFFile(p) for p in parts]
    try:
        count = len(files)
        total = files[0].get("split.tensors.count")
        for i, gf in enumerate(files):
            if gf.get("split.no") != i or gf.get("split.count") != count:
                raise ModelFileError(f"{gf.path.name}: its split keys say part {gf.get('split.no')} of "
                                     f"{gf.get('split.count')}, expected part {i} of {count}")
        tensors = [t for gf in files for t in gf.tensors.values()]
        if total is not None and total != len(tensors):
            raise ModelFileError(f"the {count} parts hold {len(tensors)} tensors; split.tensors.count says {total}")
        if len({t.name for t in tensors}) != len(tensors):
            raise ModelFileError("the parts of the split GGUF hold a tensor twice")
        version, keys = _raw_keys(parts[0])
        keys = [(k, raw) for k, raw in keys if k not in SPLIT_KEYS]
        alignment = files[0].get("general.alignment", DEFAULT_ALIGNMENT)

        def padded(n: int) -> int:
            return (n + alignment - 1) // alignment * alignment

        directory = bytearray()
        offset = 0
        for t in tensors:
            ne = tuple(reversed(t.shape))
            directory += _string(t.name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
            directory += struct.pack("<IQ", int(t.qtype), offset)
            offset = padded(offset + t.n_bytes)
        header = GGUF_MAGIC + struct.pack("<IQQ", version, len(tensors), len(keys))
        header += b"".join(raw for _, raw in keys) + directory
        header += b"\0" * (padded(len(header)) - len(header))
        with open(dest, "wb") as out:
            out.write(header)
            for gf in files:
                with open(gf.path, "rb") as src:
                    for t in gf.tensors.values():
                        src.seek(t.offset)
                        left = t.n_bytes
                        while left:
                            block = src.read(min(CHUNK, left))
                            if not block:
                                raise ModelFileError(f"{gf.path.name}: truncated in tensor {t.name!r}")
                            out.write(block)
                            left -= len(block)
                        out.write(b"\0" * (padded(t.n_bytes) - t.n_bytes))
            out.flush()
            os.fsync(out.fileno())
    finally:
        for gf in files:
            gf.close()
    joined = GGUFFile(dest)  # the result must itself be a valid GGUF holding every tensor
    try:
        if len(joined.tensors) != len(tensors):
            raise ModelFileError(f"joining the split GGUF gave {len(joined.tensors)} tensors, not {len(tensors)}")
    finally:
        joined.close()
