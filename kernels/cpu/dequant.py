"""Numba dequantization kernels, bit-exact with ggml's `dequantize_row_*` (ggml-quants.c) and gguf-py's
`gguf.quants.dequantize`.

Every format has two pieces:

* `decode_<fmt>(row, off, out, o)`: decode the one block whose bytes start at `row[off]` into the
  `block_size` floats `out[o:o + block_size]`. This is the only place that knows the format's byte layout;
  the fused matmul kernels (`float_matmul.py`) call the same functions, so the two cannot drift apart.
* `dequantize_rows_<fmt>(raw, row_ids, out)`: `out[k] = dequantized raw[row_ids[k]]`, parallel over the
  selected rows. Full dequantization passes every row id; embedding lookup passes the token ids.

Exactness: the arithmetic is float32 and in the same order as ggml and gguf-py (e.g. Q4_K is `(d * sc) * q -
(dmin * m)`), and no kernel here uses fastmath, so LLVM may neither fuse a multiply and add into an FMA nor
reorder anything. The fp16 scales are decoded bit by bit (`f16_to_f32`), as ggml's `ggml_compute_fp16_to_fp32`
does in software, so there is no dependence on F16C or a runtime library call.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

QK = 32  # block size of the legacy formats (ggml's QK4_0, QK4_1, QK5_0, QK5_1, QK8_0)
QK_K = 256  # super-block size of the k-quants
K_SCALE_SIZE = 12  # bytes of packed 6-bit scales and mins in Q4_K / Q5_K

# ---- scalar helpers ------------------------------------------------------------------------------------------


@intrinsic
def _bits_to_f32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32 (a C `memcpy` / union pun)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        as_u32 = context.cast(builder, args[0], signature.args[0], types.uint32)
        return builder.bitcast(as_u32, ir.FloatType())

    return types.float32(bits), codegen


@njit(cache=True)
def f16_to_f32(lo, hi):
    """IEEE half (two little-endian bytes) -> float32, exactly (subnormals, inf and NaN included).

    Same result as ggml's `ggml_compute_fp16_to_fp32` and numpy's `float16.astype(float32)`."""
    h = np.uint32(lo) | (np.uint32(hi) << np.uint32(8))
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exponent = h & np.uint32(0x7C00)
    mantissa = h & np.uint32(0x03FF)
    if exponent == 0x7C00:  # inf / NaN: keep the payload, like numpy
        return _bits_to_f32(sign | np.uint32(0x7F800000) | (mantissa << np.uint32(13)))
    if exponent != 0:  # normal: rebias the exponent from 15 to 127 (a shift of 112 << 23)
        return _bits_to_f32(sign | (((h & np.uint32(0x7FFF)) << np.uint32(13)) + np.uint32(0x38000000)))
    # zero or subnormal: mantissa * 2**-24 is exact in float32
    value = np.float32(mantissa) * np.float32(5.960464477539063e-08)
    return -value if sign else value


@njit(cache=True)
def _read_u32(row, off):
    return (
        np.uint32(row[off])
        | (np.uint32(row[off + 1]) << np.uint32(8))
        | (np.uint32(row[off + 2]) << np.uint32(16))
        | (np.uint32(row[off + 3]) << np.uint32(24))
    )


@njit(cache=True)
def scale_min_k4(j, row, q):
    """The 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes at row[q:] (Q4_K, Q5_K).

    ggml's `get_scale_min_k4`: sub-blocks 0..3 keep their low 6 bits in bytes 0..3 (scales) and 4..7 (mins);
    sub-blocks 4..7 have their low 4 bits in the nibbles of bytes 8..11 and their top 2 bits in the top bits of
    bytes 0..7."""
    if j < 4:
        sc = np.int32(row[q + j]) & 63
        m = np.int32(row[q + j + 4]) & 63
    else:
        sc = (np.int32(row[q + j + 4]) & 0xF) | ((np.int32(row[q + j - 4]) >> 6) << 4)
        m = (np.int32(row[q + j + 4]) >> 4) | ((np.int32(row[q + j]) >> 6) << 4)
    return sc, m


@njit(cache=True)
def q3_k_scale(j, row, q):
    """The signed 6-bit scale of sub-block j (0..15) of a Q3_K block from the 12 bytes at row[q:].

    ggml's `dequantize_row_q3_K` unpacks them with the kmask1/kmask2 trick; per scale that is: low 4 bits from
    the low (j < 8) or high (j >= 8) nibble of byte j % 8, top 2 bits from byte 8 + j % 4 at bit 2 * (j // 4),
    and an offset of 32."""
    if j < 8:
        low = np.int32(row[q + j]) & 0xF
    else:
        low = np.int32(row[q + j - 8]) >> 4
    high = (np.int32(row[q + 8 + (j & 3)]) >> (2 * (j >> 2))) & 3
    return (low | (high << 4)) - 32


# ---- block decoders (one per format) ------------------------------------------------------------------------


@njit(cache=True)
def decode_f32(row, off, out, o, n16):
    out[o] = _bits_to_f32(_read_u32(row, off))


@njit(cache=True)
def decode_f16(row, off, out, o, n16):
    out[o] = f16_to_f32(row[off], row[off + 1])


@njit(cache=True)
def decode_bf16(row, off, out, o, n16):
    # bf16 is the top half of a float32 (ggml_compute_bf16_to_fp32)
    out[o] = _bits_to_f32((np.uint32(row[off]) << np.uint32(16)) | (np.uint32(row[off + 1]) << np.uint32(24)))


@njit(cache=True)
def decode_q8_0(row, off, out, o, n16):
    # block_q8_0 { half d; int8 qs[32]; }  ->  y = qs * d
    blk = row[off : off + 34]  # the block's bytes; slicing lets LLVM see in-bounds, affine indices
    dst = out[o : o + QK]
    d = f16_to_f32(blk[0], blk[1])
    for j in range(2 * n16):
        dst[j] = np.float32(np.int8(blk[2 + j])) * d


@njit(cache=True)
def decode_q4_0(row, off, out, o, n16):
    # block_q4_0 { half d; uint8 qs[16]; }: element j in the low nibble of qs[j], element j+16 in its high
    # nibble; y = (q - 8) * d  (dequantize_row_q4_0)
    blk = row[off : off + 18]  # the block's bytes; slicing lets LLVM see in-bounds, affine indices
    dst = out[o : o + QK]
    d = f16_to_f32(blk[0], blk[1])
    for j in range(n16):
        q = np.int32(blk[2 + j])
        dst[j] = np.float32((q & 0xF) - 8) * d
        dst[j + QK // 2] = np.float32((q >> 4) - 8) * d


@njit(cache=True)
def decode_q4_1(row, off, out, o, n16):
    # block_q4_1 { half d; half m; uint8 qs[16]; }: y = q * d + m  (dequantize_row_q4_1)
    blk = row[off : off + 20]  # the block's bytes; slicing lets LLVM see in-bounds, affine indices
    dst = out[o : o + QK]
    d = f16_to_f32(blk[0], blk[1])
    m = f16_to_f32(blk[2], blk[3])
    for j in range(n16):
        q = np.int32(blk[4 + j])
        dst[j] = np.float32(q & 0xF) * d + m
        dst[j + QK // 2] = np.float32(q >> 4) * d + m


@njit(cache=True)
def decode_q5_0(row, off, out, o, n16):
    # block_q5_0 { half d; uint8 qh[4]; uint8 qs[16]; }: bit j of the little-endian u32 qh is the 5th bit of
    # element j; y = (q - 16) * d  (dequantize_row_q5_0)
    blk = row[off : off + 22]  # the block's bytes; slicing lets LLVM see in-bounds, affine indices
    dst = out[o : o + QK]
    d = f16_to_f32(blk[0], blk[1])
    qh = np.int64(_read_u32(blk, 2))
    for j in range(n16):
        q = np.int32(blk[6 + j])
        lo = (q & 0xF) | np.int32(((qh >> j) & 1) << 4)
        hi = (q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
        dst[j] = np.float32(lo - 16) * d
        dst[j + QK // 2] = np.float32(hi - 16) * d


@njit(cache=True)
def decode_q5_1(row, off, out, o, n16):
    # block_q5_1 { half d; half m; uint8 qh[4]; uint8 qs[16]; }: y = q * d + m  (dequantize_row_q5_1)
    blk = row[off : off + 24]  # the block's bytes; slicing lets LLVM see in-bounds, affine indices
    dst = out[o : o + QK]
    d = f16_to_f32(blk[0], blk[1])
    m = f16_to_f32(blk[2], blk[3])
    qh = np.int64(_read_u32(blk, 4))
    for j in range(n16):
        q = np.int32(blk[8 + j])
        lo = (q & 0xF) | np.int32(((qh >> j) & 1) << 4)
        hi = (q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
        dst[j] = np.float32(lo) * d + m
        dst[j + QK // 2] = np.float32(hi) * d + m


@njit(cache=True)
def decode_q2_k(row, off, out, o, n16):
    # block_q2_K { uint8 scales[16]; uint8 qs[64]; half d; half dmin; }  (dequantize_row_q2_K)
    # Two halves of 128 elements; half h uses qs[32h:32h+32], element 128h + 32s + l is bits 2s..2s+1 of
    # qs[32h + l]. Each group of 16 elements has scale byte (low nibble: scale, high nibble: min);
    # y = (d * sc) * q - (dmin * m).
    blk = row[off : off + 84]  # the block's bytes; slicing lets LLVM see in-bounds, affine indices
    dst = out[o : o + QK_K]
    d = f16_to_f32(blk[80], blk[81])
    dmin = f16_to_f32(blk[82], blk[83])
    for h in range(2):
        for s in range(4):
            for g in range(2):
                sc = np.int32(blk[h * 8 + s * 2 + g])
                dl = d * np.float32(sc & 0xF)
                ml = dmin * np.float32(sc >> 4)
                base = h * 128 + s * 32 + g * 16
                for l in range(n16):
                    q = (np.int32(blk[16 + h * 32 + g * 16 + l]) >> (2 * s)) & 3
                    dst[base + l] = dl * np.float32(q) - ml


@njit(cache=True)
def decode_q3_k(row, off, out, o, n16):
    # block_q3_K { uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half d; }  (dequantize_row_q3_K)
    # Low 2 bits as in Q2_K (element 128h + 32s + l: bits 2s.. of qs[32h + l]); the high bit of element
    # 32b + l is bit b of hmask[l], and a *clear* bit subtracts 4: q = low - (hbit ? 0 : 4).
    blk = row[off : off + 110]  # the block's bytes; slicing lets LLVM see in-bounds, affine indices
    dst = out[o : o + QK_K]
    d_all = f16_to_f32(blk[108], blk[109])
    for h in range(2):
        for s in range(4):
            b = h * 4 + s  # which hmask bit
            for g in range(2):
                dl = d_all * np.float32(q3_k_scale(b * 2 + g, blk, 96))
                base = h * 128 + s * 32 + g * 16
                for l in range(n16):
                    i = g * 16 + l
                    low = (np.int32(blk[32 + h * 32 + i]) >> (2 * s)) & 3
                    hbit = (np.int32(blk[i]) >> b) & 1
                    dst[base + l] = dl * np.float32(low - ((hbit ^ 1) << 2))


@njit(cache=True)
def decode_q4_k(row, off, out, o, n16):
    # block_q4_K { half d; half dmin; uint8 scales[12]; uint8 qs[128]; }  (dequantize_row_q4_K)
    # Eight sub-blocks of 32: sub-block 2c uses the low nibbles of qs[32c:32c+32], 2c+1 the high nibbles;
    # y = (d * sc) * q - (dmin * m) with (sc, m) from get_scale_min_k4.
    blk = row[off : off + 144]  # the block's bytes; slicing lets LLVM see in-bounds, affine indices
    dst = out[o : o + QK_K]
    d = f16_to_f32(blk[0], blk[1])
    dmin = f16_to_f32(blk[2], blk[3])
    for j in range(8):
        sc, m = scale_min_k4(j, blk, 4)
        d1 = d * np.float32(sc)
        m1 = dmin * np.float32(m)
        shift = 4 * (j & 1)
        q_off = 16 + (j >> 1) * 32
        for l in range(2 * n16):
            q = (np.int32(blk[q_off + l]) >> shift) & 0xF
            dst[j * 32 + l] = d1 * np.float32(q) - m1


@njit(cache=True)
def decode_q5_k(row, off, out, o, n16):
    # block_q5_K { half d; half dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]; }  (dequantize_row_q5_K)
    # As Q4_K, plus a 5th bit: bit j of qh[l] for element 32j + l.
    blk = row[off : off + 176]  # the block's bytes; slicing lets LLVM see in-bounds, affine indices
    dst = out[o : o + QK_K]
    d = f16_to_f32(blk[0], blk[1])
    dmin = f16_to_f32(blk[2], blk[3])
    for j in range(8):
        sc, m = scale_min_k4(j, blk, 4)
        d1 = d * np.float32(sc)
        m1 = dmin * np.float32(m)
        shift = 4 * (j & 1)
        q_off = 48 + (j >> 1) * 32
        for l in range(2 * n16):
            q = ((np.int32(blk[q_off + l]) >> shift) & 0xF) | (((np.int32(blk[16 + l]) >> j) & 1) << 4)
            dst[j * 32 + l] = d1 * np.float32(q) - m1


@njit(cache=True)
def decode_q6_k(row, off, out, o, n16):
    # block_q6_K { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d; }  (dequantize_row_q6_K)
    # Two halves of 128; in half h, element 128h + 32t + l (t = 0..3, l = 0..31) has its low 4 bits in
    # ql[64h + l + 32 (t & 1)] (low nibble for t < 2, high for t >= 2) and its top 2 bits at bit 2t of
    # qh[32h + l]; y = (d * scale[e // 16]) * (q - 32).
    blk = row[off : off + 210]  # the block's bytes; slicing lets LLVM see in-bounds, affine indices
    dst = out[o : o + QK_K]
    d = f16_to_f32(blk[208], blk[209])
    for h in range(2):
        for t in range(4):
            for g in range(2):
                sc = np.int8(blk[192 + h * 8 + t * 2 + g])
                dl = d * np.float32(sc)
                base = h * 128 + t * 32 + g * 16
                for l in range(n16):
                    i = g * 16 + l
                    low = (np.int32(blk[h * 64 + (t & 1) * 32 + i]) >> (4 * (t >> 1))) & 0xF
                    high = (np.int32(blk[128 + h * 32 + i]) >> (2 * t)) & 3
                    dst[base + l] = dl * np.float32((low | (high << 4)) - 32)


# ---- row kernels --------------------------------------------------------------------------------------------
# One per format, each the same loop around its decoder. They cannot share one generic kernel that takes the
# decoder as an argument: Numba does not cache functions specialised on a function argument, and every user
# would pay the compile at start-up.


@njit(cache=True, parallel=True)
def dequantize_rows_f32(raw, row_ids, out, n16):
    for k in prange(row_ids.shape[0]):
        row = raw[row_ids[k]]
        for b in range(out.shape[1]):
            decode_f32(row, b * 4, out[k], b, n16)


@njit(cache=True, parallel=True)
def dequantize_rows_f16(raw, row_ids, out, n16):
    for k in prange(row_ids.shape[0]):
        row = raw[row_ids[k]]
        for b in range(out.shape[1]):
            decode_f16(row, b * 2, out[k], b, n16)


@njit(cache=True, parallel=True)
def dequantize_rows_bf16(raw, row_ids, out, n16):
    for k in prange(row_ids.shape[0]):
        row = raw[row_ids[k]]
        for b in range(out.shape[1]):
            decode_bf16(row, b * 2, out[k], b, n16)


@njit(cache=True, parallel=True)
def dequantize_rows_q8_0(raw, row_ids, out, n16):
    for k in prange(row_ids.shape[0]):
        row = raw[row_ids[k]]
        for b in range(out.shape[1] // QK):
            decode_q8_0(row, b * 34, out[k], b * QK, n16)


@njit(cache=True, parallel=True)
def dequantize_rows_q4_0(raw, row_ids, out, n16):
    for k in prange(row_ids.shape[0]):
        row = raw[row_ids[k]]
        for b in range(out.shape[1] // QK):
            decode_q4_0(row, b * 18, out[k], b * QK, n16)


@njit(cache=True, parallel=True)
def dequantize_rows_q4_1(raw, row_ids, out, n16):
    for k in prange(row_ids.shape[0]):
        row = raw[row_ids[k]]
        for b in range(out.shape[1] // QK):
            decode_q4_1(row, b * 20, out[k], b * QK, n16)


@njit(cache=True, parallel=True)
def dequantize_rows_q5_0(raw, row_ids, out, n16):
    for k in prange(row_ids.shape[0]):
        row = raw[row_ids[k]]
        for b in range(out.shape[1] // QK):
            decode_q5_0(row, b * 22, out[k], b * QK, n16)


@njit(cache=True, parallel=True)
def dequantize_rows_q5_1(raw, row_ids, out, n16):
    for k in prange(row_ids.shape[0]):
        row = raw[row_ids[k]]
        for b in range(out.shape[1] // QK):
            decode_q5_1(row, b * 24, out[k], b * QK, n16)


@njit(cache=True, parallel=True)
def dequantize_rows_q2_k(raw, row_ids, out, n16):
    for k in prange(row_ids.shape[0]):
        row = raw[row_ids[k]]
        for b in range(out.shape[1] // QK_K):
            decode_q2_k(row, b * 84, out[k], b * QK_K, n16)


@njit(cache=True, parallel=True)
def dequantize_rows_q3_k(raw, row_ids, out, n16):
    for k in prange(row_ids.shape[0]):
        row = raw[row_ids[k]]
        for b in range(out.shape[1] // QK_K):
            decode_q3_k(row, b * 110, out[k], b * QK_K, n16)


@njit(cache=True, parallel=True)
def dequantize_rows_q4_k(raw, row_ids, out, n16):
    for k in prange(row_ids.shape[0]):
        row = raw[row_ids[k]]
        for b in range(out.shape[1] // QK_K):
            decode_q4_k(row, b * 144, out[k], b * QK_K, n16)


@njit(cache=True, parallel=True)
def dequantize_rows_q5_k(raw, row_ids, out, n16):
    for k in prange(row_ids.shape[0]):
        row = raw[row_ids[k]]
        for b in range(out.shape[1] // QK_K):
            decode_q5_k(row, b * 176, out[k], b * QK_K, n16)


@njit(cache=True, parallel=True)
def dequantize_rows_q6_k(raw, row_ids, out, n16):
    for k in prange(row_ids.shape[0]):
        row = raw[row_ids[k]]
        for b in range(out.shape[1] // QK_K):
            decode_q6_k(row, b * 210, out[k], b * QK_K, n16)
