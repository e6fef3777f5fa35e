"""The table of weight formats, backend-neutral: one entry per GGML tensor type, like ggml's `type_traits`
(ggml.c) beside the per-backend `type_traits_cpu` (ggml-cpu.c). An entry holds what is true of the format on
any device: block geometry, the block's byte layout as a numpy structured dtype, and numpy reference
dequantize/quantize (gguf-py's ports of ggml's reference functions). Kernels live in per-backend tables keyed by
the same types: `kernels/cpu/cpu_formats.py` (Numba) and `kernels/opencl/` (OpenCL C). Inside the CPU's compiled
products the format is a branch, not a table lookup (`kernels/cpu/quant_dot.py`: one dot product and one row
kernel per format, dispatched on the weight's type): a per-format kernel must inline into the row loop to
vectorize, which a call through a table of function pointers prevents, and a `FormatSet`
(kernels/cpu/format_set.py) prunes the branches a model cannot take before they are compiled.

This module imports no backend: validating a file or listing formats never loads Numba or OpenCL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from localllm.errors import ModelFileError
from localllm.gguf_constants import GGML_QUANT_SIZES, GGMLQuantizationType

_T = GGMLQuantizationType
_F16 = np.dtype("<f2")
_U8 = np.dtype("u1")
_I8 = np.dtype("i1")

# Each block's fields in byte order, as ggml's `block_*` structs (ggml-common.h). The k-quants' super-block
# size is QK_K = 256; the legacy formats' block is 32.
_BLOCK_FIELDS: dict[GGMLQuantizationType, list[tuple]] = {
    _T.F32: [("v", "<f4")],
    _T.F16: [("v", _F16)],
    _T.BF16: [("v", "<u2")],  # the top half of a float32; numpy has no bfloat16
    _T.Q8_0: [("d", _F16), ("qs", _I8, (32,))],
    _T.Q4_0: [("d", _F16), ("qs", _U8, (16,))],
    _T.Q4_1: [("d", _F16), ("m", _F16), ("qs", _U8, (16,))],
    _T.Q5_0: [("d", _F16), ("qh", _U8, (4,)), ("qs", _U8, (16,))],  # qh: a little-endian u32, unaligned
    _T.Q5_1: [("d", _F16), ("m", _F16), ("qh", _U8, (4,)), ("qs", _U8, (16,))],
    _T.Q2_K: [("scales", _U8, (16,)), ("qs", _U8, (64,)), ("d", _F16), ("dmin", _F16)],
    _T.Q3_K: [("hmask", _U8, (32,)), ("qs", _U8, (64,)), ("scales", _U8, (12,)), ("d", _F16)],
    _T.Q4_K: [("d", _F16), ("dmin", _F16), ("scales", _U8, (12,)), ("qs", _U8, (128,))],
    _T.Q5_K: [("d", _F16), ("dmin", _F16), ("scales", _U8, (12,)), ("qh", _U8, (32,)), ("qs", _U8, (128,))],
    _T.Q6_K: [("ql", _U8, (128,)), ("qh", _U8, (64,)), ("scales", _I8, (16,)), ("d", _F16)],
}


@dataclass(frozen=True)
class QuantFormat:
    qtype: GGMLQuantizationType
    name: str
    block_size: int  # weights per block
    type_size: int  # bytes per block
    block_dtype: np.dtype  # numpy structured dtype of one block (packed, little-endian); itemsize == type_size
    f16_offsets: tuple[int, ...]  # byte offsets of the fp16 fields inside a block (derived from block_dtype)
    # numpy reference: raw uint8 (rows, row_bytes) -> float32 (rows, cols); gguf-py's port of dequantize_row_*
    dequantize: Callable[[np.ndarray], np.ndarray] = field(repr=False)
    # numpy reference: float32 (rows, cols) -> raw uint8 (rows, row_bytes); None where gguf-py has none (k-quants)
    quantize: Callable[[np.ndarray], np.ndarray] | None = field(repr=False)

    def row_bytes(self, cols: int) -> int:
        return cols // self.block_size * self.type_size

    def blocks(self, raw: np.ndarray) -> np.ndarray:
        """The raw bytes (rows, row_bytes) viewed as (rows, blocks) of `block_dtype`, no copy."""
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        return raw.view(self.block_dtype)


# The formats gguf-py quantizes (the float and legacy ones; it lists the k-quants but raises NotImplementedError):
# stated here rather than probed at import, which would import all of gguf-py on a model's warm start
# (localllm/gguf_constants.py); tests/test_kernels.py checks the set against gguf-py's behaviour.
REFERENCE_QUANTIZE = frozenset({_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0})


def _reference_dequantize(qtype: GGMLQuantizationType) -> Callable[[np.ndarray], np.ndarray]:
    def dequantize(raw: np.ndarray) -> np.ndarray:
        from gguf import quants

        return np.asarray(quants.dequantize(np.asarray(raw, dtype=np.uint8), qtype), dtype=np.float32)

    return dequantize


def _reference_quantize(qtype: GGMLQuantizationType) -> Callable[[np.ndarray], np.ndarray] | None:
    if qtype not in REFERENCE_QUANTIZE:
        return None

    def quantize(x: np.ndarray) -> np.ndarray:
        from gguf import quants

        out = np.asarray(quants.quantize(np.asarray(x, dtype=np.float32), qtype))
        return np.ascontiguousarray(out).view(np.uint8).reshape(out.shape[0], -1)

    return quantize


def _entry(qtype: GGMLQuantizationType) -> QuantFormat:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    dtype = np.dtype(_BLOCK_FIELDS[qtype])
    assert dtype.itemsize == type_size, (qtype.name, dtype.itemsize, type_size)
    f16_offsets = tuple(off for _, (sub, off) in dtype.fields.items() if sub.base == _F16)
    return QuantFormat(
        qtype=qtype,
        name=qtype.name,
        block_size=block_size,
        type_size=type_size,
        block_dtype=dtype,
        f16_offsets=f16_offsets,
        dequantize=_reference_dequantize(qtype),
        quantize=_reference_quantize(qtype),
    )


FORMATS: dict[GGMLQuantizationType, QuantFormat] = {q: _entry(q) for q in _BLOCK_FIELDS}


def format_of(qtype: GGMLQuantizationType | int) -> QuantFormat:
    """The table entry of a tensor type; a ModelFileError naming the type and the supported ones if we have none."""
    try:
        return FORMATS[qtype]  # type: ignore[index]
    except KeyError:
        pass
    try:
        name = GGMLQuantizationType(qtype).name
    except ValueError:
        name = f"#{int(qtype)}"
    supported = ", ".join(f.name for f in FORMATS.values())
    raise ModelFileError(
        f"tensor type {name} is not supported by this version of localllm (supported: {supported}); "
        "use a GGUF file quantized to one of those"
    )


def row_range(raw: np.ndarray, rows: tuple[int, int] | None, name: str = "tensor") -> np.ndarray:
    """Rows lo to hi of a (rows, row_bytes) tensor view (still C-contiguous: whole rows), checked."""
    if rows is None:
        return raw
    lo, hi = int(rows[0]), int(rows[1])
    if not 0 <= lo < hi <= raw.shape[0]:
        raise ValueError(f"{name}: rows {lo} to {hi} are not within its {raw.shape[0]} rows")
    return raw[lo:hi]
