"""A safetensors reader of our own: an 8-byte header length, a JSON header, then raw little-endian bytes.

Each tensor is read on its own into a fresh buffer, so converting a model holds one tensor at a time, never the
whole checkpoint. No torch, no safetensors package.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localllm.errors import LocalLLMError

# safetensors dtype -> numpy dtype as stored. BF16 has no numpy type: it is read as uint16 and widened.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
# Dtypes that mean the checkpoint holds quantized weights (fp8 and friends): refused by name upstream.
QUANTIZED_DTYPES = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"}
_MAX_HEADER = 100 * 1024 * 1024
_BF16_CHUNK = 1 << 22  # values widened at a time (8 MB of bf16)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class CheckpointError(LocalLLMError):
    """A Hugging Face checkpoint that cannot be converted (missing, truncated, inconsistent, unsupported)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors spelling: "BF16", "F16", "F32", ...
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """The tensors of one .safetensors file, checked against the file's size; data read lazily."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path.name}: truncated (no safetensors header)")
                n = int.from_bytes(head, "little")
                if n > _MAX_HEADER or 8 + n > size:
                    raise CheckpointError(f"{self.path.name}: truncated or not a safetensors file "
                                          f"(header of {n} bytes in a file of {size})")
                raw = f.read(n)
        except OSError as e:
            raise CheckpointError(f"cannot read {self.path}: {e.strerror or e}") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path.name}: corrupt safetensors header ({e})") from None
        except RecursionError:
            raise CheckpointError(f"{self.path.name}: corrupt safetensors header (JSON nested too deeply)") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path.name}: corrupt safetensors header")
        self.metadata = header.pop("__metadata__", None) or {}
        base = 8 + n
        self.tensors: dict[str, TensorEntry] = {}
        for name, meta in header.items():
            try:
                dtype, shape, (lo, hi) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
                ok = (isinstance(dtype, str) and all(_is_int(d) and d >= 0 for d in shape) and len(shape) <= 8
                      and _is_int(lo) and _is_int(hi) and 0 <= lo <= hi)
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise CheckpointError(f"{self.path.name}: corrupt entry for tensor {name[:100]!r}") from None
            if base + hi > size:
                raise CheckpointError(f"{self.path.name} is truncated: tensor {name!r} ends at byte {base + hi}, "
                                      f"the file has {size} (an interrupted download?)")
            if dtype in DTYPES:
                expected = math.prod(shape) * DTYPES[dtype].itemsize
                if expected != hi - lo:
                    raise CheckpointError(f"{self.path.name}: tensor {name!r} has {hi - lo} bytes, "
                                          f"its shape {list(shape)} of {dtype} needs {expected}")
            elif math.prod(shape) > 8 * (hi - lo):  # no dtype holds more than 8 values a byte
                raise CheckpointError(f"{self.path.name}: tensor {name[:100]!r} has {hi - lo} bytes, too few for "
                                      f"its shape {list(shape)}")
            self.tensors[name] = TensorEntry(name, dtype, shape, self.path, base + lo, hi - lo)

    def read(self, entry: TensorEntry) -> np.ndarray:
        """The tensor as numpy: f32/f16 as stored, BF16 widened to float32 (exact). Read into a fresh buffer
        (not a memory map, whose pages would stay in the process's resident set until the file is closed), so
        memory holds this tensor only."""
        if entry.dtype not in DTYPES:
            raise CheckpointError(f"tensor {entry.name!r} has dtype {entry.dtype}, which cannot be converted")
        dt = DTYPES[entry.dtype]
        n = entry.nbytes // dt.itemsize
        with open(self.path, "rb") as f:
            f.seek(entry.start)
            if entry.dtype != "BF16":
                out = np.empty(n, dtype=dt)
                got = f.readinto(memoryview(out).cast("B"))
            else:
                # widened chunk by chunk: peak memory is the float32 tensor, not float32 + bf16 copies
                out = np.empty(n, dtype=np.uint32)
                chunk = np.empty(min(n, _BF16_CHUNK), dtype=np.uint16)
                got = 0
                for lo in range(0, n, _BF16_CHUNK):
                    part = chunk[: min(_BF16_CHUNK, n - lo)]
                    k = f.readinto(memoryview(part).cast("B"))
                    got += k
                    if k != part.nbytes:
                        break
                    np.left_shift(part, np.uint32(16), out=out[lo:lo + len(part)], dtype=np.uint32)
                out = out.view(np.float32)
        if got != entry.nbytes:
            raise CheckpointError(f"{self.path.name} is truncated: tensor {entry.name!r} is short by "
                                  f"{entry.nbytes - got} bytes")
        return out.reshape(entry.shape)

    def close(self) -> None:
        pass
