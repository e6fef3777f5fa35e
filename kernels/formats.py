"""The table of weight formats: one entry per GGML tensor type, like ggml's `type_traits` and gguf-py's
`gguf/quants.py`. Everything that depends on the format (block geometry, the dequantize kernel, the fused
matmul kernel, the quantizer, later an OpenCL kernel) hangs off its entry; nothing else in the code base
switches on the format. Adding Q5_K was adding its decoder and kernels in `kernels/cpu/` and one entry here.

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

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localllm.kernels.cpu import dequant, float_matmul, quantize
from localllm.errors import ModelFileError


@dataclass(frozen=True)
class QuantFormat:
    qtype: GGMLQuantizationType
    name: str
    block_size: int  # weights per block
    type_size: int  # bytes per block
    dequantize_rows: Callable  # Numba kernel, exact (bit-equal to gguf-py / ggml dequantize_row_*)
    matmul: Callable  # Numba fused dequantize-and-multiply kernel (the portable path)
    f16_offsets: tuple[int, ...]  # byte offsets of the fp16 scale fields inside a block (layout fact; tests use it)
    quantize: Callable  # Numba kernel, float32 rows -> blocks, byte-exact with llama-quantize (no imatrix)
    quantize_imatrix: Callable | None  # the same weighted by an importance matrix (ggml's quantize_row_*_impl)
    opencl_source: str | None = None  # OpenCL C source of the GPU kernels (later backend)

    def row_bytes(self, cols: int) -> int:
        return cols // self.block_size * self.type_size


def _entry(qtype: GGMLQuantizationType, kernel_suffix: str, f16_offsets: tuple[int, ...]) -> QuantFormat:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return QuantFormat(
        qtype=qtype,
        name=qtype.name,
        block_size=block_size,
        type_size=type_size,
        dequantize_rows=getattr(dequant, f"dequantize_rows_{kernel_suffix}"),
        matmul=getattr(float_matmul, f"matmul_{kernel_suffix}"),
        f16_offsets=f16_offsets,
        quantize=getattr(quantize, f"quantize_rows_{kernel_suffix}"),
        quantize_imatrix=getattr(quantize, f"quantize_rows_{kernel_suffix}_imatrix", None),
    )


_T = GGMLQuantizationType
FORMATS: dict[GGMLQuantizationType, QuantFormat] = {
    f.qtype: f
    for f in (
        _entry(_T.F32, "f32", ()),
        _entry(_T.F16, "f16", (0,)),
        _entry(_T.BF16, "bf16", ()),
        _entry(_T.Q8_0, "q8_0", (0,)),  # block_q8_0: d, qs[32]
        _entry(_T.Q4_0, "q4_0", (0,)),  # block_q4_0: d, qs[16]
        _entry(_T.Q4_1, "q4_1", (0, 2)),  # block_q4_1: d, m, qs[16]
        _entry(_T.Q5_0, "q5_0", (0,)),  # block_q5_0: d, qh[4], qs[16]
        _entry(_T.Q5_1, "q5_1", (0, 2)),  # block_q5_1: d, m, qh[4], qs[16]
        _entry(_T.Q2_K, "q2_k", (80, 82)),  # block_q2_K: scales[16], qs[64], d, dmin
        _entry(_T.Q3_K, "q3_k", (108,)),  # block_q3_K: hmask[32], qs[64], scales[12], d
        _entry(_T.Q4_K, "q4_k", (0, 2)),  # block_q4_K: d, dmin, scales[12], qs[128]
        _entry(_T.Q5_K, "q5_k", (0, 2)),  # block_q5_K: d, dmin, scales[12], qh[32], qs[128]
        _entry(_T.Q6_K, "q6_k", (208,)),  # block_q6_K: ql[128], qh[64], scales[16], d
    )
}


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
