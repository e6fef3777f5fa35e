"""The CPU backend's kernel table: one entry per format of the backend-neutral table (`kernels/formats.py`),
holding that format's Numba kernels, as ggml's `type_traits_cpu` sits beside `type_traits`. An entry also
answers the neutral entry's geometry (qtype, name, block_size, type_size, row_bytes), so the CPU code keeps one
object per format. Adding a format is adding its neutral entry, its decoder and kernels here in `kernels/cpu/`,
and a line below.

Kernel calling conventions (all Numba, all parallel over rows, all taking `n16`, the integer 16 passed at run
time; see `kernels/cpu/dequant.py` for why it is not a constant):

* `dequantize_rows(raw, row_ids, out, n16)`: out[k] = float32 values of raw row row_ids[k]
* `matmul(raw, x, out, n16)`: out (n, rows) = x (n, cols) @ W.T, W decoded block by block, never copied
* `quantize(x, out)`: out[r] = the blocks of float32 row x[r], byte for byte what llama-quantize writes
  (`kernels/cpu/quantize.py`, ported from ggml's reference quantizers)
* `quantize_imatrix(x, qw, out)`: the same with an importance per column (qw float32 (cols,)), as llama-quantize
  --imatrix; None where ggml ignores the importance (floats, Q8_0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from localllm.gguf_constants import GGMLQuantizationType
from localllm.kernels import formats as _neutral
from localllm.kernels.cpu import dequant, float_matmul, quantize


@dataclass(frozen=True)
class CpuFormat:
    format: _neutral.QuantFormat  # the backend-neutral entry: geometry, block dtype, numpy reference
    dequantize_rows: Callable  # Numba kernel, exact (bit-equal to gguf-py / ggml dequantize_row_*)
    matmul: Callable  # Numba fused dequantize-and-multiply kernel (the portable path)
    quantize: Callable  # Numba kernel, float32 rows -> blocks, byte-exact with llama-quantize (no imatrix)
    quantize_imatrix: Callable | None  # the same weighted by an importance matrix (ggml's quantize_row_*_impl)

    @property
    def qtype(self) -> GGMLQuantizationType:
        return self.format.qtype

    @property
    def name(self) -> str:
        return self.format.name

    @property
    def block_size(self) -> int:
        return self.format.block_size

    @property
    def type_size(self) -> int:
        return self.format.type_size

    def row_bytes(self, cols: int) -> int:
        return self.format.row_bytes(cols)


def _entry(qtype: GGMLQuantizationType, kernel_suffix: str) -> CpuFormat:
    return CpuFormat(
        format=_neutral.FORMATS[qtype],
        dequantize_rows=getattr(dequant, f"dequantize_rows_{kernel_suffix}"),
        matmul=getattr(float_matmul, f"matmul_{kernel_suffix}"),
        quantize=getattr(quantize, f"quantize_rows_{kernel_suffix}"),
        quantize_imatrix=getattr(quantize, f"quantize_rows_{kernel_suffix}_imatrix", None),
    )


FORMATS: dict[GGMLQuantizationType, CpuFormat] = {
    q: _entry(q, q.name.lower()) for q in _neutral.FORMATS
}


def format_of(qtype: GGMLQuantizationType | int) -> CpuFormat:
    """The CPU entry of a tensor type; the neutral table's ModelFileError (naming the type and the supported
    ones) if the type is not in the table."""
    return FORMATS[_neutral.format_of(qtype).qtype]
