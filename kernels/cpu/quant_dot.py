"""Quantized matmul the way llama.cpp does it on the CPU: 8-bit activations and integer dot products.

`matmul(raw, qtype, x, out)` computes out = x @ W.T for W stored in a GGUF quantized format, without ever
dequantizing W to floats:

1. Each row of x is quantized once per call to the 8-bit format ggml pairs with W's format
   (`quantize_row_q8_0` / `quantize_row_q8_1` / `quantize_row_q8_K_ref`): Q8_0 for Q8_0, Q4_0, Q5_0; Q8_1 (with
   per-block sums d*sum(q), which carry the min term of Q4_1/Q5_1) for Q4_1, Q5_1; Q8_K (blocks of 256 with
   per-16 sums, which carry the min terms of the K-quants) for Q2_K..Q6_K.
2. Each weight block is loaded from memory once and applied to all n rows of x, so a k-token forward pass
   (speculative verify, small batches) streams the weights once, like a single decode step. K-quant blocks are
   decoded once for all n rows; 32-element blocks are decoded once per group of up to 4 x-rows (their
   accumulators live in registers; a fifth row re-decodes the block from L1, a few instructions).
3. The block dot products are integer: `vpmaddubsw` (u8 x s8 -> s16 pairs) then `vpmaddwd` (s16 x s16 -> s32),
   one float fused multiply-add per block (per 256-block for the K-quants), following ggml's
   `ggml_vec_dot_<fmt>_q8_<0|1|K>` AVX2 code in `ggml/src/ggml-cpu/arch/x86/quants.c` step by step.
4. Output rows are split across threads (`prange`); each output element is computed by the same sequence of
   operations whatever n or the thread split is, so results are batch invariant bit for bit.

Two implementations of the same arithmetic: `*_avx2` kernels use the AVX2 primitives of `simd.py`; `*_portable`
kernels are plain Numba loops for CPUs without AVX2 and serve as the test oracle. They agree bit for bit: the
integer lane sums are exact whatever the order (no int16 saturation can occur for any input, see the notes
above the portable kernels), and the float work (fp16 scale conversion, the per-block scale product, one fma per lane per
block, ggml's `hsum_float_8` reduction order) is the same sequence in both, with `llvm.fma` in both.

Differences from ggml: the 32-block formats accumulate even and odd blocks in two sets of 8 lanes that meet
before the final sum (ggml has one set: two sets let the VNNI kernel run two blocks per float instruction, see
_group_32_avx2); C compilers may contract the scalar `summs += m * s` of Q4_1/Q5_1/Q5_K into an fma where we round
the product; and llama.cpp itself may route Q4_0/Q4_K through repacked "x8" kernels with another summation order.
On CPUs with AVX-512 (and VNNI) the kernels run the same arithmetic on zmm: tiles of 4 weight rows for the
32-block formats (_rows_32_avx512, at the x-row counts _rows_32 gives it), weight-row pairs whose float steps
share a register for the K-quants; their results are the AVX2 kernels' bits (tests/test_kernels.py). The kernels
that stream several weight rows at once prefetch them in software (_PREFETCH_AHEAD).

Helpers are plain `@njit` calls, left to LLVM's inliner: Numba's `inline="always"` deep-copies and re-types the
callee's IR at every call site (compiling quantize_q8_0 took 1.43 s with its helpers inlined that way, 0.46 s
without; smollm2's cold start 37-40 s -> 31 s on 2-core Zen 3), for the same machine code. Only helpers that must
see a caller's literal format keep it (_decode_32_avx2, inside the literal-dispatched VNNI kernel), with the
VNNI-only helpers and the tiled kernels' (not measured without it).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import get_num_threads, literally, njit, prange
from numba.extending import overload

from localllm.gguf_constants import GGML_QUANT_SIZES, GGMLQuantizationType
from localllm.kernels.cpu import forget_stale_cache, simd
from localllm.kernels.cpu import tiled as _tiled
from localllm.kernels.cpu.format_set import FormatSetType
from localllm.kernels.cpu.tiled import TILE as _TILE
from localllm.kernels.cpu.tiled import rows_fast as tiled_rows
from localllm.kernels.cpu import tiled_k as _tiled_k
from localllm.kernels.cpu.tiled_k import rows_fast as tiled_k_rows
from localllm.kernels.cpu.simd import (
    HAVE_AVX2,
    HAVE_AVX512,
    add_epi32_512,
    concat_si256,
    loadu_si512,
    HAVE_AVX512_VNNI,
    dpbusd_epi32_512,
    zero_si512,
    keep_alive,
    nibble_pair_512,
    or_bit4_512,
    storeu_si512,
    prefetch,
    add_adjacent_epi32_512,
    dpwssd_epi32_512,
    fold_pair_epi32_512,
    set1_ps_512,
    set2_ps_512,
    add_ps,
    cvtepi32_ps_512,
    dpbusd_epi32_256,
    even_ps_256,
    interleave_dwords_512,
    odd_ps_256,
    repeat4_ps_512,
    store_pair_sums_4,
    repeat_pair_ps_512,
    fmadd_ps_512,
    loadu_ps_512,
    mul_ps_512,
    neg_epi32_512,
    pair_ps_512,
    set1_epi8_512,
    setzero_ps_512,
    storeu_ps_512,
    sub_epi32,
    madd_epi16_512,
    maddubs_epi16_512,
    sub_epi16_512,
    add_epi8,
    add_epi32,
    address_of,
    and_si256,
    andnot_si256,
    bits_to_float,
    bytes_from_bits_32,
    bytes_from_nibbles_32,
    cvtepi32_ps,
    float_to_bits,
    fma_f32,
    fmadd_ps,
    load_halves,
    add_adjacent_epi32,
    cvtepu8_epi16_words,
    duplicate_high_epi16,
    hsum_epi32,
    hsum_float_8,
    load_cvtepi8_epi16,
    load_cvtepu8_epi16,
    load_f32,
    load_u32,
    loadu_ps,
    loadu_si256,
    madd_epi16,
    maddubs_epi16,
    mul_sum_i8_pairs,
    mul_sum_us8_pairs,
    or_si256,
    set1_epi8,
    set1_epi16,
    set1_ps,
    setzero_ps,
    shuffle_epi16_halves,
    slli_epi16,
    srli_epi16,
    storeu_ps,
    storeu_si256,
    sub_epi8,
    sub_epi16,
)

Q = GGMLQuantizationType


# Below this many weights a matmul runs on the calling thread. A 2-thread fork/join costs ~10 us (measured with
# the passive wait policy below) and one core does ~14 G weights/s, so splitting pays from ~2 * 10 us * 14 G/s
# ~ 280K weights; smaller matrices (e.g. the 128x896 K/V projections of Qwen2.5-0.5B) stay serial.
SERIAL_BELOW_WEIGHTS = 256 * 1024

# Kernel-family codes (ints, so one compiled kernel serves a family; compared inside the jitted code).
KIND_Q8_0, KIND_Q4_0, KIND_Q4_1, KIND_Q5_0, KIND_Q5_1 = 0, 1, 2, 3, 4
QT_Q2_K, QT_Q3_K, QT_Q4_K, QT_Q5_K, QT_Q6_K = int(Q.Q2_K), int(Q.Q3_K), int(Q.Q4_K), int(Q.Q5_K), int(Q.Q6_K)
QT_Q4_0, QT_Q4_1, QT_Q5_0, QT_Q5_1, QT_Q8_0 = int(Q.Q4_0), int(Q.Q4_1), int(Q.Q5_0), int(Q.Q5_1), int(Q.Q8_0)

# x-rows per pass of the integer kernels: callers (kernels/ops.py, the fused forward) feed x in slices of this
# many rows, each slice's 8-bit activations staying in L1/L2 while the weight's rows stream past them. The 32-block
# kernels decode each weight tile once per slice, so longer slices decode less often; the K-quant kernels, which
# decode nothing, lose past 64 rows (the slice outgrows the caches). One Zen 5 core, 256 x-rows, G MAC/s with
# slices of 16 / 32 / 64 / 128: Q5_0 4864x896 108.6 / 121.8 / 127.3 / 131.5, 896x4864 120.0 / 128.8 / 142.3 /
# 143.6; Q6_K 1536x8960 154.1 / 162.0 / 165.8 / 146.1; Q4_K 1536x8960 153.4 / 167.3 / 156.4 / 98.3, 8960x1536
# 142.3 / 141.8 / 142.4 / 115.4. The bits do not depend on it: each x-row's products are its own.
PASS_32_BLOCK = 64
PASS_K_QUANT = 32
PASS_OTHER = 16


@njit(cache=True)
def rows_per_pass(qtype):
    """x-rows per pass for weights of GGML type `qtype` (see PASS_32_BLOCK)."""
    if qtype == QT_Q4_0 or qtype == QT_Q4_1 or qtype == QT_Q5_0 or qtype == QT_Q5_1 or qtype == QT_Q8_0:
        return PASS_32_BLOCK
    if qtype >= 100:  # a tiled twin (kernels/cpu/tiled.py: 100 + the GGML type)
        return PASS_32_BLOCK
    if QT_Q2_K <= qtype <= QT_Q6_K:
        return PASS_K_QUANT
    return PASS_OTHER


_F0 = np.float32(0.0)
_F127 = np.float32(127.0)
_FNEG127 = np.float32(-127.0)
_F1 = np.float32(1.0)
# Adding 1.5 * 2**23 to a float32 of magnitude < 2**22 rounds it to an integer, ties to even (ggml's nearest_int,
# and what _mm256_round_ps(_MM_ROUND_NEAREST) does in quantize_row_q8_0).
_ROUND_MAGIC = np.float32(12582912.0)
_F16_SUBNORMAL_UNIT = np.float32(2.0**-24)

# ---------------------------------------------------------------------------------------------------------------
# fp16 <-> fp32, exact and in plain integer code (the portable path may run where F16C does not)
# ---------------------------------------------------------------------------------------------------------------


@njit(cache=True)
def half_bits_to_float(h):
    """IEEE fp16 bits -> float32 (exact), as GGML_CPU_FP16_TO_FP32 / vcvtph2ps compute it."""
    h = np.uint32(h) & np.uint32(0xFFFF)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exponent = (h >> np.uint32(10)) & np.uint32(0x1F)
    mantissa = h & np.uint32(0x3FF)
    if exponent == 0:
        value = np.float32(mantissa) * _F16_SUBNORMAL_UNIT  # zero or subnormal: mantissa * 2**-24, exact
        return -value if sign else value
    if exponent == 31:
        return bits_to_float(sign | np.uint32(0x7F800000) | (mantissa << np.uint32(13)))
    return bits_to_float(sign | ((exponent + np.uint32(112)) << np.uint32(23)) | (mantissa << np.uint32(13)))


@njit(cache=True)
def float_to_half_bits(f):
    """float32 -> IEEE fp16 bits, rounding to nearest even (GGML_CPU_FP32_TO_FP16 / vcvtps2ph)."""
    bits = float_to_bits(np.float32(f))
    sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
    exponent = np.int32((bits >> np.uint32(23)) & np.uint32(0xFF))
    mantissa = bits & np.uint32(0x7FFFFF)
    if exponent == 255:  # inf / nan
        return sign | np.uint32(0x7C00) | (np.uint32(0x200) if mantissa else np.uint32(0))
    e = exponent - 112  # re-biased exponent (127 -> 15)
    if e >= 31:
        return sign | np.uint32(0x7C00)
    if e <= 0:  # fp16 subnormal or zero: count units of 2**-24
        if e < -10:
            return sign
        full = mantissa | np.uint32(0x800000)
        shift = np.uint32(14 - e)
        half = full >> shift
        rest = full & ((np.uint32(1) << shift) - np.uint32(1))
        halfway = np.uint32(1) << (shift - np.uint32(1))
        if rest > halfway or (rest == halfway and (half & np.uint32(1))):
            half += np.uint32(1)
        return sign | half
    half = sign | (np.uint32(e) << np.uint32(10)) | (mantissa >> np.uint32(13))
    rest = mantissa & np.uint32(0x1FFF)
    if rest > np.uint32(0x1000) or (rest == np.uint32(0x1000) and (half & np.uint32(1))):
        half += np.uint32(1)  # a carry into the exponent is the right answer (up to inf)
    return half


@njit(cache=True)
def round_to_half(f):
    """The float32 value of fp16(f): what a ggml_half field read back as float holds."""
    return half_bits_to_float(float_to_half_bits(f))


@njit(cache=True)
def _nearest_int(value):
    return np.int32((value + _ROUND_MAGIC) - _ROUND_MAGIC)


# ---------------------------------------------------------------------------------------------------------------
# Activation quantization (shared by both paths, so both see the same integers)
# ---------------------------------------------------------------------------------------------------------------


@njit(cache=True)
def _ordered(bits):
    """A float's bits as an int32 that orders like the float (negative floats' magnitude bits flipped); its own
    inverse."""
    b = np.int32(bits)
    return b ^ ((b >> 31) & np.int32(0x7FFFFFFF))


@njit(cache=True)
def quantize_q8_0(x):
    """Rows of x -> Q8_0 blocks of 32: int8 quants and the fp16 scale (as float32). ggml's x86 quantize_row_q8_0.

    d = amax / 127 is stored as fp16 and that rounded value is what the dot product uses; the quants use the
    unrounded reciprocal 127 / amax, as ggml does.
    """
    n, cols = x.shape
    blocks = cols // 32
    qs = np.empty((n, cols), np.int8)
    scales = np.empty((n, blocks), np.float32)
    for i in range(n):
        for b in range(blocks):
            base = 32 * b
            amax = _F0
            for j in range(32):
                amax = max(amax, abs(x[i, base + j]))
            scales[i, b] = round_to_half(amax / _F127)
            inverse = _F127 / amax if amax != _F0 else _F0
            for j in range(32):
                qs[i, base + j] = _nearest_int(x[i, base + j] * inverse)
    return qs, scales


@njit(cache=True)
def quantize_q8_1(x):
    """Rows of x -> Q8_1 blocks of 32: Q8_0 plus s = fp16(d * sum(q)). ggml's x86 quantize_row_q8_1.

    s lets the Q4_1/Q5_1 dot products add their per-block minimum m as m * s instead of m * sum(x).
    """
    n, cols = x.shape
    blocks = cols // 32
    qs = np.empty((n, cols), np.int8)
    scales = np.empty((n, blocks), np.float32)
    sums = np.empty((n, blocks), np.float32)
    for i in range(n):
        for b in range(blocks):
            base = 32 * b
            amax = _F0
            for j in range(32):
                amax = max(amax, abs(x[i, base + j]))
            d = amax / _F127
            scales[i, b] = round_to_half(d)
            inverse = _F127 / amax if amax != _F0 else _F0
            total = 0
            for j in range(32):
                q = _nearest_int(x[i, base + j] * inverse)
                qs[i, base + j] = q
                total += q
            sums[i, b] = round_to_half(d * np.float32(total))
    return qs, scales, sums


@njit(cache=True, error_model="numpy")
def quantize_q8_K(x):
    """Rows of x -> Q8_K blocks of 256: int8 quants, float32 scale, int16 sums of each 16 quants.

    ggml's quantize_row_q8_K_ref (which the x86 build uses): the scale is set by the element of largest magnitude
    (first one on ties), mapped to -127; the 16-sums carry the K-quants' per-sub-block minimum terms.

    Written for LLVM to vectorize (integer max/min reductions on order-preserving bit patterns, a float max
    with its NaN rules stays scalar; the rounding loop apart from the 16-sums): a 256x8960 x, the input of
    qwen2.5-coder-1.5b's ffn_down, 2.5 -> 0.64 ms, the same bytes.
    """
    n, cols = x.shape
    blocks = cols // 256
    qs = np.empty((n, cols), np.int8)
    scales = np.empty((n, blocks), np.float32)
    bsums = np.empty((n, blocks * 16), np.int16)
    for i in range(n):
        for b in range(blocks):
            base = 256 * b
            # the largest and smallest element settle the extreme's sign, unless both reach the same magnitude:
            # then the first of them, as ggml's scan finds it
            top, bottom = np.int32(-2147483648), np.int32(2147483647)
            for j in range(base, base + 256):
                key = _ordered(float_to_bits(x[i, j]))
                top = max(top, key)
                bottom = min(bottom, key)
            high, low = bits_to_float(_ordered(top)), bits_to_float(_ordered(bottom))
            amax = max(high, -low)
            extreme = high if high > -low else low
            if high == -low:
                for j in range(base, base + 256):
                    if abs(x[i, j]) == amax:
                        extreme = x[i, j]
                        break
            if amax == _F0:
                scales[i, b] = _F0
                for j in range(base, base + 256):
                    qs[i, j] = 0
                for g in range(16):
                    bsums[i, 16 * b + g] = 0
                continue
            iscale = _FNEG127 / extreme
            for j in range(base, base + 256):
                qs[i, j] = min(127, _nearest_int(iscale * x[i, j]))
            for g in range(16):
                total = np.int32(0)
                for j in range(base + 16 * g, base + 16 * g + 16):
                    total += np.int32(qs[i, j])
                bsums[i, 16 * b + g] = total
            scales[i, b] = _F1 / iscale
    return qs, scales, bsums


# ---------------------------------------------------------------------------------------------------------------
# Scalar pieces: block fields for the portable kernels, reductions that both paths use
# ---------------------------------------------------------------------------------------------------------------


@njit(cache=True)
def _hsum_float_8(acc, i):
    """Sum of acc[i, 0:8] in the order of ggml's hsum_float_8 (128-bit halves, then movehl, then movehdup)."""
    return ((acc[i, 0] + acc[i, 4]) + (acc[i, 2] + acc[i, 6])) + ((acc[i, 1] + acc[i, 5]) + (acc[i, 3] + acc[i, 7]))


@njit(cache=True)
def _half_at(raw, r, offset):
    """The fp16 field at byte `offset` of weight row r, as float32."""
    return half_bits_to_float(np.uint32(raw[r, offset]) | (np.uint32(raw[r, offset + 1]) << np.uint32(8)))


@njit(cache=True)
def _scale_min_k4(raw, r, offset, scales, mins):
    """The 8 six-bit scales and mins packed in the 12 `scales` bytes of a Q4_K/Q5_K block (get_scale_min_k4)."""
    for j in range(4):
        scales[j] = np.int32(raw[r, offset + j]) & 63
        mins[j] = np.int32(raw[r, offset + j + 4]) & 63
    for j in range(4, 8):
        high = np.int32(raw[r, offset + j + 4])
        scales[j] = (high & 0xF) | ((np.int32(raw[r, offset + j - 4]) >> 6) << 4)
        mins[j] = (high >> 4) | ((np.int32(raw[r, offset + j]) >> 6) << 4)


@njit(cache=True)
def _scales_q3_k(raw, r, offset, scales):
    """The 16 six-bit signed scales of a Q3_K block (the kmask1/kmask2 unpacking of ggml, minus 32)."""
    for j in range(16):
        low = np.int32(raw[r, offset + (j % 8)])
        low = (low & 0xF) if j < 8 else (low >> 4)
        high = (np.int32(raw[r, offset + 8 + (j % 4)]) >> (2 * (j // 4))) & 3
        scales[j] = (low | (high << 4)) - 32


@njit(cache=True)
def _min_lanes_q4_k(acc_m, i, dmin, mins, bsums, b):
    """The dmin * mins . bsums term of Q4_K in ggml's 4 float lanes (acc_m of ggml_vec_dot_q4_K_q8_K).

    Lane l holds mins[2l] * (bsum of sub-block 2l) + mins[2l+1] * (sub-block 2l+1), one fma per block;
    a 32-element sub-block's sum is the two 16-sums added (_mm_hadd_epi16).
    """
    base = 16 * b
    for lane in range(4):
        s0 = np.int32(bsums[i, base + 4 * lane]) + np.int32(bsums[i, base + 4 * lane + 1])
        s1 = np.int32(bsums[i, base + 4 * lane + 2]) + np.int32(bsums[i, base + 4 * lane + 3])
        product = mins[2 * lane] * s0 + mins[2 * lane + 1] * s1
        acc_m[i, lane] = fma_f32(dmin, np.float32(product), acc_m[i, lane])


@njit(cache=True)
def _min_sum_q5_k(mins, bsums, i, b):
    """sum over sub-blocks of mins * bsums, as one integer (ggml_vec_dot_q5_K_q8_K's hadd of `prod`)."""
    total = 0
    base = 16 * b
    for k in range(8):
        total += mins[k] * (np.int32(bsums[i, base + 2 * k]) + np.int32(bsums[i, base + 2 * k + 1]))
    return np.int32(total)


@njit(cache=True)
def _finish_min_lanes(acc_m, i):
    """acc_m's reduction in ggml_vec_dot_q4_K_q8_K: movehl + add, then movehdup + add_ss."""
    return (acc_m[i, 0] + acc_m[i, 2]) + (acc_m[i, 1] + acc_m[i, 3])


def _chunk_bounds(c, chunks, rows):
    return c * rows // chunks, (c + 1) * rows // chunks


_chunk_bounds = njit(cache=True, inline="always")(_chunk_bounds)

# ---------------------------------------------------------------------------------------------------------------
# Portable kernels: integer lanes in plain loops
# ---------------------------------------------------------------------------------------------------------------
#
# A 32-element block's products are summed into 8 int32 lanes, lane m holding elements 4m..4m+3: exactly the
# lanes vpmaddubsw + vpmaddwd produce from one 32-byte register. For the 256-element K-quant blocks, lane m holds
# elements e with (e % 32) // 4 == m across all eight 32-element chunks, each times its sub-block scale.
# Saturation: vpmaddubsw saturates a pair sum to int16; the largest pair here is 2 * 128 * 127 = 32512 (a -128
# Q8_0 weight with |x| = 127; Q8 activations never reach -128), so it never does, and the sums are exact.


@njit(cache=True)
def _signed_byte(v):
    return (np.int32(v) ^ 0x80) - 0x80


@njit(cache=True)
def _lane_sums_32(weights, xq, i, x0, lanes):
    for m in range(8):
        total = 0
        for t in range(4 * m, 4 * m + 4):
            total += weights[t] * np.int32(xq[i, x0 + t])
        lanes[m] = total


@njit(cache=True)
def _lane_sums_256(weights, scales16, xq, i, x0, lanes):
    for m in range(8):
        lanes[m] = 0
    for e in range(256):
        lanes[(e & 31) >> 2] += scales16[e >> 4] * weights[e] * np.int32(xq[i, x0 + e])


@njit(cache=True)
def _decode_32(raw, r, blk, kind, weights):
    """Integer weights of one 32-block: kind 0 = Q8_0, 1 = Q4_0, 2 = Q4_1, 3 = Q5_0, 4 = Q5_1."""
    if kind == 0:
        for e in range(32):
            weights[e] = _signed_byte(raw[r, blk + 2 + e])
        return
    qs = blk + (2, 2, 4, 6, 8)[kind]
    for e in range(16):
        byte = np.int32(raw[r, qs + e])
        weights[e] = byte & 0xF
        weights[e + 16] = byte >> 4
    if kind == 1:
        for e in range(32):
            weights[e] -= 8
    elif kind >= 3:
        qh_at = blk + (2 if kind == 3 else 4)
        qh = np.uint32(0)
        for k in range(4):
            qh |= np.uint32(raw[r, qh_at + k]) << np.uint32(8 * k)
        for e in range(32):
            weights[e] |= np.int32((qh >> np.uint32(e)) & np.uint32(1)) << 4
            if kind == 3:
                weights[e] -= 16


@njit(cache=True)
def _rows_32_portable(raw, kind, block_bytes, xq, xd, xs, out, r0, r1):
    """Rows r0..r1 of a 32-block format against Q8_0 (xs unused) or Q8_1 activations.

    Follows ggml_vec_dot_q8_0_q8_0 / q4_0_q8_0 / q5_0_q8_0 (acc = fma(dx*dy, lanes, acc)) and q4_1_q8_1 /
    q5_1_q8_1 (the same, plus summs += m * s, added after the lane reduction), except that even and odd blocks
    accumulate apart and meet before the lane sum (_group_32_avx2 says why).
    """
    n, blocks = xd.shape
    has_min = kind == 2 or kind == 4
    acc = np.zeros((2, n, 8), np.float32)  # even blocks, odd blocks (see _group_32_avx2)
    total = np.empty((n, 8), np.float32)
    summs = np.zeros(n, np.float32)
    weights = np.empty(32, np.int32)
    lanes = np.empty(8, np.int32)
    for r in range(r0, r1):
        acc[:] = _F0
        summs[:] = _F0
        for b in range(blocks):
            blk = block_bytes * b
            wd = _half_at(raw, r, blk)
            wm = _half_at(raw, r, blk + 2) if has_min else _F0
            _decode_32(raw, r, blk, kind, weights)
            for i in range(n):
                if has_min:
                    summs[i] = summs[i] + wm * xs[i, b]
                scale = wd * xd[i, b]
                _lane_sums_32(weights, xq, i, 32 * b, lanes)
                for m in range(8):
                    acc[b & 1, i, m] = fma_f32(scale, np.float32(lanes[m]), acc[b & 1, i, m])
        for i in range(n):
            for m in range(8):
                total[i, m] = acc[0, i, m] + acc[1, i, m]
            out[i, r] = _hsum_float_8(total, i) + summs[i] if has_min else _hsum_float_8(total, i)


@njit(cache=True)
def _decode_q4_k(raw, r, blk, weights, scales16, scales, mins):
    _scale_min_k4(raw, r, blk + 4, scales, mins)
    for j in range(4):
        for p in range(32):
            byte = np.int32(raw[r, blk + 16 + 32 * j + p])
            weights[64 * j + p] = byte & 0xF
            weights[64 * j + 32 + p] = byte >> 4
    for k in range(16):
        scales16[k] = scales[k >> 1]


@njit(cache=True)
def _decode_q5_k(raw, r, blk, weights, scales16, scales, mins):
    _scale_min_k4(raw, r, blk + 4, scales, mins)
    for j in range(4):
        for p in range(32):
            byte = np.int32(raw[r, blk + 48 + 32 * j + p])
            high = np.int32(raw[r, blk + 16 + p])
            weights[64 * j + p] = (byte & 0xF) | (((high >> (2 * j)) & 1) << 4)
            weights[64 * j + 32 + p] = (byte >> 4) | (((high >> (2 * j + 1)) & 1) << 4)
    for k in range(16):
        scales16[k] = scales[k >> 1]


@njit(cache=True)
def _decode_q6_k(raw, r, blk, weights, scales16):
    for h in range(2):
        ql = blk + 64 * h
        qh = blk + 128 + 32 * h
        for p in range(32):
            low_a = np.int32(raw[r, ql + p])
            low_b = np.int32(raw[r, ql + 32 + p])
            high = np.int32(raw[r, qh + p])
            weights[128 * h + p] = ((low_a & 0xF) | ((high & 3) << 4)) - 32
            weights[128 * h + 32 + p] = ((low_b & 0xF) | (((high >> 2) & 3) << 4)) - 32
            weights[128 * h + 64 + p] = ((low_a >> 4) | (((high >> 4) & 3) << 4)) - 32
            weights[128 * h + 96 + p] = ((low_b >> 4) | (((high >> 6) & 3) << 4)) - 32
    for k in range(16):
        scales16[k] = _signed_byte(raw[r, blk + 192 + k])


@njit(cache=True)
def _decode_q3_k(raw, r, blk, weights, scales16):
    _scales_q3_k(raw, r, blk + 96, scales16)
    for h in range(2):
        for j in range(4):
            bit = 4 * h + j
            for p in range(32):
                low = (np.int32(raw[r, blk + 32 + 32 * h + p]) >> (2 * j)) & 3
                has_high = (np.int32(raw[r, blk + p]) >> bit) & 1
                weights[128 * h + 32 * j + p] = low - (0 if has_high else 4)


@njit(cache=True)
def _decode_q2_k(raw, r, blk, weights, scales16, mins16):
    for k in range(16):
        byte = np.int32(raw[r, blk + k])
        scales16[k] = byte & 0xF
        mins16[k] = byte >> 4
    for h in range(2):
        for j in range(4):
            for p in range(32):
                weights[128 * h + 32 * j + p] = (np.int32(raw[r, blk + 16 + 32 * h + p]) >> (2 * j)) & 3


@njit(cache=True)
def _rows_k_portable(raw, qtype, block_bytes, xq, xd, bsums, out, r0, r1):
    """Rows r0..r1 of a K-quant format against Q8_K activations (ggml_vec_dot_q{2..6}_K_q8_K, AVX2 variants).

    d = y.d * fp16(x.d); dmin = -y.d * fp16(x.dmin). Per block: Q2_K first adds its min lanes (dmin * madd(mins,
    bsums)) to the 8-lane accumulator, Q4_K keeps them in 4 separate lanes, Q5_K in one scalar; then every format
    adds d * (integer lanes). The final sum is hsum_float_8 plus the min part.
    """
    n, blocks = xd.shape
    acc = np.zeros((n, 8), np.float32)
    acc_m = np.zeros((n, 4), np.float32)
    summs = np.zeros(n, np.float32)
    weights = np.empty(256, np.int32)
    scales16 = np.empty(16, np.int32)
    mins16 = np.empty(16, np.int32)
    scales = np.empty(8, np.int32)
    mins = np.empty(8, np.int32)
    lanes = np.empty(8, np.int32)
    for r in range(r0, r1):
        acc[:] = _F0
        acc_m[:] = _F0
        summs[:] = _F0
        for b in range(blocks):
            blk = block_bytes * b
            if qtype == QT_Q4_K:
                wd, wdmin = _half_at(raw, r, blk), _half_at(raw, r, blk + 2)
                _decode_q4_k(raw, r, blk, weights, scales16, scales, mins)
            elif qtype == QT_Q5_K:
                wd, wdmin = _half_at(raw, r, blk), _half_at(raw, r, blk + 2)
                _decode_q5_k(raw, r, blk, weights, scales16, scales, mins)
            elif qtype == QT_Q6_K:
                wd, wdmin = _half_at(raw, r, blk + 208), _F0
                _decode_q6_k(raw, r, blk, weights, scales16)
            elif qtype == QT_Q3_K:
                wd, wdmin = _half_at(raw, r, blk + 108), _F0
                _decode_q3_k(raw, r, blk, weights, scales16)
            else:  # Q2_K
                wd, wdmin = _half_at(raw, r, blk + 80), _half_at(raw, r, blk + 82)
                _decode_q2_k(raw, r, blk, weights, scales16, mins16)
            for i in range(n):
                yd = xd[i, b]
                d = yd * wd
                dmin = -yd * wdmin
                if qtype == QT_Q4_K:
                    _min_lanes_q4_k(acc_m, i, dmin, mins, bsums, b)
                elif qtype == QT_Q5_K:
                    summs[i] = summs[i] + dmin * np.float32(_min_sum_q5_k(mins, bsums, i, b))
                elif qtype == QT_Q2_K:
                    for m in range(8):
                        product = mins16[2 * m] * np.int32(bsums[i, 16 * b + 2 * m]) + mins16[2 * m + 1] * np.int32(
                            bsums[i, 16 * b + 2 * m + 1]
                        )
                        acc[i, m] = fma_f32(dmin, np.float32(product), acc[i, m])
                _lane_sums_256(weights, scales16, xq, i, 256 * b, lanes)
                for m in range(8):
                    acc[i, m] = fma_f32(d, np.float32(lanes[m]), acc[i, m])
        for i in range(n):
            total = _hsum_float_8(acc, i)
            if qtype == QT_Q4_K:
                total += _finish_min_lanes(acc_m, i)
            elif qtype == QT_Q5_K:
                total += summs[i]
            out[i, r] = total


# ---------------------------------------------------------------------------------------------------------------
# AVX2 kernels
# ---------------------------------------------------------------------------------------------------------------
#
# Addresses: w = start of weight row r, blk = start of a block in it, y = start of an activation block.
# Activations are our own C-contiguous arrays, read by address (xd at xd_base + 4 * (i * blocks + b)).

# kmask1/kmask2/kmask3 of ggml_vec_dot_q4_K_q8_K (6-bit scale unpacking) and of q3_K (kmask1 = 2-bit high parts)
_KMASK_6BIT = 0x3F3F3F3F
_KMASK_LOW4 = 0x0F0F0F0F
_KMASK_2BIT = 0x03030303


# How far ahead (bytes) the kernels that stream several weight rows at once prefetch, in one forward sweep of the
# rows' memory. Interleaved streams (a pair's two rows, 7 KiB apart for 8960 columns of Q6_K) defeated the
# hardware prefetcher: one Zen 5 core, 8 copies of Q6_K 1536x8960 (cold, from DRAM), pairs kernel, G MAC/s at
# 1 / 4 / 8 / 16 x-rows: 11 / 33 / 49 / 92 without, 52 / 112 / 127 / 155 with 16 KiB (4 KiB: 28 / 53 / 79 / 151;
# 64 KiB: 49 / 107 / 127 / 152).
_PREFETCH_AHEAD = 16 * 1024


@njit(cache=True)
def _prefetch_lines(address, lines):
    """Prefetches `lines` cache lines from `address` on."""
    for k in range(lines):
        prefetch(address + 64 * k)


@njit(cache=True, inline="always")
def _decode_32_avx2(blk, kind):
    """One 32-block as 32 bytes in a register (signed for Q8_0/Q4_0/Q5_0, unsigned for Q4_1/Q5_1)."""
    if kind == KIND_Q8_0:  # the quants as stored (ggml_vec_dot_q8_0_q8_0)
        return loadu_si256(blk + 2)
    if kind == KIND_Q4_0:  # nibbles - 8 (ggml_vec_dot_q4_0_q8_0)
        return sub_epi8(bytes_from_nibbles_32(blk + 2), set1_epi8(8))
    if kind == KIND_Q4_1:  # nibbles, unsigned (ggml_vec_dot_q4_1_q8_1)
        return bytes_from_nibbles_32(blk + 4)
    if kind == KIND_Q5_0:  # nibble | 0xF0 where the 5th bit is clear == (nibble | bit << 4) - 16 as int8
        return or_si256(bytes_from_nibbles_32(blk + 6), andnot_si256(bytes_from_bits_32(blk + 2), set1_epi8(0xF0)))
    # Q5_1: nibble | 0x10 where the 5th bit is set, unsigned (ggml_vec_dot_q5_1_q8_1)
    return or_si256(bytes_from_nibbles_32(blk + 8), and_si256(bytes_from_bits_32(blk + 4), set1_epi8(0x10)))


@njit(cache=True)
def _lanes_32_avx2(qx, y, kind):
    """Float lanes of one block's integer dot; signed formats move the sign onto y (mul_sum_i8_pairs_float)."""
    if kind == KIND_Q4_1 or kind == KIND_Q5_1:
        return cvtepi32_ps(mul_sum_us8_pairs(qx, loadu_si256(y)))
    return cvtepi32_ps(mul_sum_i8_pairs(qx, loadu_si256(y)))


@njit(cache=True)
def _step_32_avx2(qx, wd, y, d, acc, kind):
    """One x-row's float step for one block: acc = fma(d_w * d_x, float(lanes), acc)."""
    return fmadd_ps(set1_ps(wd * load_f32(d)), _lanes_32_avx2(qx, y, kind), acc)


@njit(cache=True)
def _group_32_avx2(w, kind, block_bytes, blocks, xq, xd, xs, out, r, i, count, decoded):
    """Weight row r against x-rows i .. i+count-1 (count = 1, 2 or 4), accumulators in registers.

    Each block is decoded once for the group, or read back from `decoded` (the address of the row's blocks
    already decoded, 32 bytes each, when the row serves several groups; 0 otherwise). `kind` and `count` are
    compile-time constants (`literally`: one specialization each), so the format and `count > k` tests cost
    nothing in the loop. Every x-row sees the same float operations whatever the group it is in, and whether
    its weights were decoded here or before (the same bytes either way).

    The order of the 32-block dots (all kernels, portable and AVX2 and VNNI): even blocks accumulate into one
    set of 8 lanes, odd blocks into another, and the result is hsum_float_8(even + odd) (+ the min term). Two
    independent fma chains instead of ggml's one; the VNNI kernel runs both sets in one zmm (blocks 2h and
    2h + 1 side by side), which the single chain would not allow.
    """
    literally(kind)
    literally(count)
    has_min = kind == KIND_Q4_1 or kind == KIND_Q5_1
    ys = xq.strides[0]
    y0 = address_of(xq) + i * ys
    d0 = address_of(xd) + 4 * i * blocks  # fp16-rounded activation scales, then block sums, per x-row
    s0 = address_of(xs) + 4 * i * blocks
    a0, a1, a2, a3 = setzero_ps(), setzero_ps(), setzero_ps(), setzero_ps()  # even blocks
    e0, e1, e2, e3 = setzero_ps(), setzero_ps(), setzero_ps(), setzero_ps()  # odd blocks
    m0, m1, m2, m3 = _F0, _F0, _F0, _F0
    for b in range(blocks):
        blk = w + block_bytes * b
        if not decoded:
            prefetch(blk + _PREFETCH_AHEAD)
        wd, wm = load_halves(blk)  # d, and m for Q4_1/Q5_1 (else the first bytes of qh/qs, unused)
        qx = loadu_si256(decoded + 32 * b) if decoded else _decode_32_avx2(blk, kind)
        if has_min:  # summs += m * s (ggml_vec_dot_q4_1_q8_1 / q5_1_q8_1)
            m0 = m0 + wm * load_f32(s0 + 4 * b)
            if count > 1:
                m1 = m1 + wm * load_f32(s0 + 4 * (blocks + b))
            if count > 2:
                m2 = m2 + wm * load_f32(s0 + 4 * (2 * blocks + b))
            if count > 3:
                m3 = m3 + wm * load_f32(s0 + 4 * (3 * blocks + b))
        y, d = y0 + 32 * b, d0 + 4 * b
        if b & 1:
            e0 = _step_32_avx2(qx, wd, y, d, e0, kind)
            if count > 1:
                e1 = _step_32_avx2(qx, wd, y + ys, d + 4 * blocks, e1, kind)
            if count > 2:
                e2 = _step_32_avx2(qx, wd, y + 2 * ys, d + 8 * blocks, e2, kind)
            if count > 3:
                e3 = _step_32_avx2(qx, wd, y + 3 * ys, d + 12 * blocks, e3, kind)
        else:
            a0 = _step_32_avx2(qx, wd, y, d, a0, kind)
            if count > 1:
                a1 = _step_32_avx2(qx, wd, y + ys, d + 4 * blocks, a1, kind)
            if count > 2:
                a2 = _step_32_avx2(qx, wd, y + 2 * ys, d + 8 * blocks, a2, kind)
            if count > 3:
                a3 = _step_32_avx2(qx, wd, y + 3 * ys, d + 12 * blocks, a3, kind)
    out[i, r] = hsum_float_8(add_ps(a0, e0)) + m0 if has_min else hsum_float_8(add_ps(a0, e0))
    if count > 1:
        out[i + 1, r] = hsum_float_8(add_ps(a1, e1)) + m1 if has_min else hsum_float_8(add_ps(a1, e1))
    if count > 2:
        out[i + 2, r] = hsum_float_8(add_ps(a2, e2)) + m2 if has_min else hsum_float_8(add_ps(a2, e2))
    if count > 3:
        out[i + 3, r] = hsum_float_8(add_ps(a3, e3)) + m3 if has_min else hsum_float_8(add_ps(a3, e3))


@njit(cache=True)
def _rows_32_avx2(raw, kind, block_bytes, xq, xd, xs, out, r0, r1):
    """AVX2 twin of _rows_32_portable (same integer lanes, same float operations), x-rows in groups of 4.

    With more than one group, a weight row's blocks are decoded once into a scratch row that every group
    reads (decoding Q5_0 costs more than its dot product): prompts then pay the decode once per 16 x-rows.
    """
    literally(kind)
    n, blocks = xd.shape
    wbase, wstride = address_of(raw), raw.strides[0]
    scratch = np.empty(32 * blocks, np.uint8)
    decoded = address_of(scratch) if n > 4 else 0
    for r in range(r0, r1):
        w = wbase + r * wstride
        if decoded:
            for b in range(blocks):
                prefetch(w + block_bytes * b + _PREFETCH_AHEAD)
                storeu_si256(decoded + 32 * b, _decode_32_avx2(w + block_bytes * b, kind))
        i = n * 0  # an int64: a literal 0 here typed the first call apart, a 4th _group_32_avx2 per format
        while n - i >= 4:
            _group_32_avx2(w, kind, block_bytes, blocks, xq, xd, xs, out, r, i, 4, decoded)
            i += 4
        if n - i >= 2:  # groups of 4, 2, 1 only: each group size is one more specialization to compile
            _group_32_avx2(w, kind, block_bytes, blocks, xq, xd, xs, out, r, i, 2, decoded)
            i += 2
        if n - i == 1:
            _group_32_avx2(w, kind, block_bytes, blocks, xq, xd, xs, out, r, i, 1, decoded)
    keep_alive(scratch, scratch, scratch)  # read through its address until here


@njit(cache=True)
def _rows_32_avx2_few(raw, kind, block_bytes, xq, xd, xs, out, r0, r1):
    """_rows_32_avx2 for the few x-rows a VNNI machine leaves it (_rows_32: Q4_1/Q5_1 at 1-3): groups of 2
    and 1 only (no group of 4, no decoded scratch row), 2 specializations of _group_32_avx2 per format where
    _rows_32_avx2 compiles 3 (each about 1 s of a cold start, on the path that decides it). The same bits at
    any n: a group's size changes no x-row's float operations."""
    literally(kind)
    n, blocks = xd.shape
    wbase, wstride = address_of(raw), raw.strides[0]
    for r in range(r0, r1):
        w = wbase + r * wstride
        i = n * 0  # an int64, as in _rows_32_avx2
        while n - i >= 2:
            _group_32_avx2(w, kind, block_bytes, blocks, xq, xd, xs, out, r, i, 2, 0)
            i += 2
        if n - i == 1:
            _group_32_avx2(w, kind, block_bytes, blocks, xq, xd, xs, out, r, i, 1, 0)


@njit(cache=True)
def _rows_32_avx2_one(raw, kind, block_bytes, xq, xd, xs, out, r0, r1):
    """_rows_32_avx2 one x-row at a time: a VNNI machine's Q8_0 at 1 x-row (one specialization of
    _group_32_avx2). The same bits at any n."""
    literally(kind)
    n, blocks = xd.shape
    wbase, wstride = address_of(raw), raw.strides[0]
    for r in range(r0, r1):
        w = wbase + r * wstride
        for i in range(n):
            _group_32_avx2(w, kind, block_bytes, blocks, xq, xd, xs, out, r, i, 1, 0)


# Block pairs per column pass of _rows_32_avx512 (512 columns): a 4-row tile decoded (2 KiB) with its scales (1 KiB)
# stays in L1 while the x-rows' bytes and corrections for those columns (1 KiB an x-row) stream from L1/L2.
_TILE_PASS_PAIRS = 16


@njit(cache=True)
def _rows_32_avx512(raw, kind, block_bytes, xq, xd, xs, out, r0, r1):
    """The 32-block formats on VNNI (_rows_32 says at how many x-rows): tiles of 4 weight rows x two x-rows at
    a time (8 accumulators: each weight load serves both x-rows; a last odd x-row alone), two blocks per integer
    product, bitwise _rows_32_avx2's results (the same integer lanes, the same float steps in each of the two
    lane sets, the same final sums). The 4- and 5-bit formats decode two blocks at a time (nibble_pair_512,
    or_bit4_512): their nibbles (| the 5th bit) are the offset weights.

    Signed weights are stored offset to unsigned bytes (Q4_0 + 8, Q5_0 + 16, Q8_0 + 128) so one `vpdpbusd`
    takes them with no sign juggling; its accumulator starts at -offset * (the x-row's bytes summed in fours),
    which makes every int32 lane exactly the signed dot's lane (made once per call for the x-rows that go in
    twos, and loaded).

    A block pair's two blocks have their 4-byte groups alternated, in the decoded weights and in the x-rows
    alike (interleave_dwords_512): int32 lane 2k is the first block's group k, lane 2k + 1 the second's. A
    pair's float step then needs its two scale products (weight d x x-row d) as [pa, pb] x 8, one vpermpd out
    of a register holding all 16 of the pair's products for the tile (4 rows x 2 x-rows x 2 blocks, one
    vmulps), where [pa x 8 | pb x 8] took a vmulps for each (row, x-row): with the corrections loaded, 17 where
    there were 26 multiplies, dot products and fmas a pair, on the two pipes that run all three. Each product is
    the same float product and each lane sees the same float steps in the same order, so the bits are unchanged;
    the tile's four rows are summed together at the end (store_pair_sums_4, hsum_float_8's order).

    Columns go in passes of _TILE_PASS_PAIRS block pairs so a tile's decoded weights and the x-rows' bytes stay
    in L1; the accumulators wait in `acc` between passes (the same float operations in the same order, only
    stored and reloaded), and the last pass sums them from the registers. One Zen 5 core, G MAC/s at 8 / 16
    x-rows, against the kernel with a vmulps per (row, x-row), corrections made per tile and the sums from `acc`
    (f9bc2e6): Q5_0 4864x896 96.7 / 109.6 -> 108.4 / 129.8, Q8_0 151936x896 90.8 / 105.1 -> 108.3 / 127.0."""
    literally(kind)
    has_min = kind == KIND_Q4_1 or kind == KIND_Q5_1
    off = 128 if kind == KIND_Q8_0 else 8 if kind == KIND_Q4_0 else 16 if kind == KIND_Q5_0 else 0
    n, blocks = xd.shape
    pairs = blocks // 2
    half_pairs = (n + 1) // 2
    wbase, wstride = address_of(raw), raw.strides[0]
    ybase, ystride = address_of(xq), xq.strides[0]
    offsets = set1_epi8_512(off)
    zero = zero_si512()
    # The x-rows as the products read them (each pair's groups alternated), and each x-row pair's block scales
    # per block pair: dx(i0, a), dx(i0, b), dx(i1, a), dx(i1, b) (a last odd x-row pairs with itself)
    ys = np.empty((n, 64 * pairs), np.uint8)
    xds = np.empty((half_pairs, pairs, 4), np.float32)
    # the offset corrections of the x-rows that go in twos, in the same lane order: loaded where the products
    # run, one load in place of a vpdpbusd on the two pipes the products keep busy (Q8_0 151936x896 at 8 / 16
    # x-rows, one Zen 5 core: 102.2 / 118.8 -> 109.0 / 127.9 G MAC/s; Q5_0 4864x896 101.5 / 119.5 -> 104.2 / 123.1)
    paired = n - n % 2
    cs = np.empty((paired, 64 * pairs), np.uint8)
    ysbase, xdsbase, csbase = address_of(ys), address_of(xds), address_of(cs)
    for i in range(n):
        for h in range(pairs):
            v = interleave_dwords_512(loadu_si512(ybase + i * ystride + 64 * h))
            storeu_si512(ysbase + i * 64 * pairs + 64 * h, v)
            if i < paired:
                storeu_si512(csbase + i * 64 * pairs + 64 * h,
                             neg_epi32_512(dpbusd_epi32_512(zero, offsets, v)) if off else zero)
    for ip in range(half_pairs):
        i0 = 2 * ip
        i1 = min(i0 + 1, n - 1)
        for h in range(pairs):
            xds[ip, h, 0] = xd[i0, 2 * h]
            xds[ip, h, 1] = xd[i0, 2 * h + 1]
            xds[ip, h, 2] = xd[i1, 2 * h]
            xds[ip, h, 3] = xd[i1, 2 * h + 1]
    decoded = np.empty((4, 64 * pairs + 32), np.uint8)  # a tile's rows, offset to unsigned; a last odd block after
    wsc = np.empty((max(pairs, 1), 16), np.float32)  # per block pair, lane (j, i, b): row j's d of block 2h + b
    wlast = np.empty(4, np.float32)  # each row's d of a last odd block
    acc = np.zeros((n, 4, 16), np.float32)
    res_cols = r1 - r0 + 3
    res = np.empty((n, res_cols), np.float32)
    resbase = address_of(res)
    wmins = np.empty((blocks, 4), np.float32)  # each block's m for the tile's rows side by side
    summs = np.empty((n, 4), np.float32)
    sums_t = np.empty((blocks if has_min else 0, n), np.float32)  # xs transposed: the x-rows side by side
    for i in range(n if has_min else 0):
        for b in range(blocks):
            sums_t[b, i] = xs[i, b]
    dbase, dstride = address_of(decoded), decoded.strides[0]
    wscbase = address_of(wsc)
    abase = address_of(acc)
    ylen = 64 * pairs
    qs = 2 if kind == KIND_Q8_0 or kind == KIND_Q4_0 else 4 if kind == KIND_Q4_1 else 6 if kind == KIND_Q5_0 else 8
    qh = 2 if kind == KIND_Q5_0 else 4
    for r in range(r0, r1, 4):
        for j in range(4):  # rows past r1 repeat the last one (computed, not written)
            w = wbase + min(r + j, r1 - 1) * wstride
            for h in range(pairs):
                blk = w + block_bytes * 2 * h
                blk2 = blk + block_bytes
                prefetch(blk + _PREFETCH_AHEAD)
                prefetch(blk2 + _PREFETCH_AHEAD)
                if kind == KIND_Q8_0:
                    v2 = concat_si256(add_epi8(loadu_si256(blk + qs), set1_epi8(off)),
                                      add_epi8(loadu_si256(blk2 + qs), set1_epi8(off)))
                else:  # two blocks at a time: the offset weights are their nibbles (| the 5th bits)
                    v2 = nibble_pair_512(blk + qs, blk2 + qs)
                    if kind == KIND_Q5_0 or kind == KIND_Q5_1:
                        v2 = or_bit4_512(v2, np.uint64(load_u32(blk + qh)) |
                                         (np.uint64(load_u32(blk2 + qh)) << np.uint64(32)))
                storeu_si512(dbase + j * dstride + 64 * h, interleave_dwords_512(v2))
                wd, wm = load_halves(blk)
                wd2, wm2 = load_halves(blk2)
                wsc[h, 4 * j] = wd
                wsc[h, 4 * j + 1] = wd2
                wsc[h, 4 * j + 2] = wd
                wsc[h, 4 * j + 3] = wd2
                if has_min:
                    wmins[2 * h, j] = wm
                    wmins[2 * h + 1, j] = wm2
            if blocks % 2:
                b = blocks - 1
                blk = w + block_bytes * b
                prefetch(blk + _PREFETCH_AHEAD)  # (a block is at most 34 bytes: one line each covers the rows)
                v = _decode_32_avx2(blk, kind)
                if off:
                    v = add_epi8(v, set1_epi8(off))
                storeu_si256(dbase + j * dstride + 64 * pairs, v)
                wd, wm = load_halves(blk)
                wlast[j] = wd
                if has_min:
                    wmins[b, j] = wm
        direct = blocks % 2 == 0  # the last pass sums its registers straight into res (else: `acc`, then below)
        for p0 in range(0, pairs, _TILE_PASS_PAIRS):
            p1 = min(p0 + _TILE_PASS_PAIRS, pairs)
            last = p1 == pairs and direct
            for ip in range(half_pairs):
                i0 = 2 * ip
                y = ysbase + i0 * ylen
                a = abase + 256 * i0
                if p0 == 0:
                    a0 = a1 = a2 = a3 = setzero_ps_512()
                else:
                    a0, a1, a2, a3 = loadu_ps_512(a), loadu_ps_512(a + 64), loadu_ps_512(a + 128), loadu_ps_512(a + 192)
                if i0 + 1 < n:  # two x-rows: each weight load serves both (8 accumulators)
                    y2 = y + ylen
                    e = a + 256
                    if p0 == 0:
                        b0 = b1 = b2 = b3 = setzero_ps_512()
                    else:
                        b0, b1, b2, b3 = (loadu_ps_512(e), loadu_ps_512(e + 64), loadu_ps_512(e + 128),
                                          loadu_ps_512(e + 192))
                    for h in range(p0, p1):
                        o = 64 * h
                        # the 16 scale products of this pair: lane (j, i, b) = row j's d x x-row i's d, block b
                        pr = mul_ps_512(loadu_ps_512(wscbase + 64 * h), repeat4_ps_512(xdsbase + 16 * (ip * pairs + h)))
                        yv, yw = loadu_si512(y + o), loadu_si512(y2 + o)
                        cv, cw = loadu_si512(csbase + i0 * ylen + o), loadu_si512(csbase + (i0 + 1) * ylen + o)
                        w = loadu_si512(dbase + o)
                        a0 = fmadd_ps_512(repeat_pair_ps_512(pr, 0), cvtepi32_ps_512(dpbusd_epi32_512(cv, w, yv)), a0)
                        b0 = fmadd_ps_512(repeat_pair_ps_512(pr, 1), cvtepi32_ps_512(dpbusd_epi32_512(cw, w, yw)), b0)
                        w = loadu_si512(dbase + dstride + o)
                        a1 = fmadd_ps_512(repeat_pair_ps_512(pr, 2), cvtepi32_ps_512(dpbusd_epi32_512(cv, w, yv)), a1)
                        b1 = fmadd_ps_512(repeat_pair_ps_512(pr, 3), cvtepi32_ps_512(dpbusd_epi32_512(cw, w, yw)), b1)
                        w = loadu_si512(dbase + 2 * dstride + o)
                        a2 = fmadd_ps_512(repeat_pair_ps_512(pr, 4), cvtepi32_ps_512(dpbusd_epi32_512(cv, w, yv)), a2)
                        b2 = fmadd_ps_512(repeat_pair_ps_512(pr, 5), cvtepi32_ps_512(dpbusd_epi32_512(cw, w, yw)), b2)
                        w = loadu_si512(dbase + 3 * dstride + o)
                        a3 = fmadd_ps_512(repeat_pair_ps_512(pr, 6), cvtepi32_ps_512(dpbusd_epi32_512(cv, w, yv)), a3)
                        b3 = fmadd_ps_512(repeat_pair_ps_512(pr, 7), cvtepi32_ps_512(dpbusd_epi32_512(cw, w, yw)), b3)
                    if last:  # rows past r1 land in res's spare columns
                        store_pair_sums_4(resbase + 4 * ((i0 + 1) * res_cols + r - r0), b0, b1, b2, b3)
                    else:
                        storeu_ps_512(e, b0)
                        storeu_ps_512(e + 64, b1)
                        storeu_ps_512(e + 128, b2)
                        storeu_ps_512(e + 192, b3)
                else:
                    for h in range(p0, p1):
                        o = 64 * h
                        pr = mul_ps_512(loadu_ps_512(wscbase + 64 * h), repeat4_ps_512(xdsbase + 16 * (ip * pairs + h)))
                        yv = loadu_si512(y + o)
                        cv = neg_epi32_512(dpbusd_epi32_512(zero, offsets, yv)) if off else zero
                        a0 = fmadd_ps_512(repeat_pair_ps_512(pr, 0), cvtepi32_ps_512(
                            dpbusd_epi32_512(cv, loadu_si512(dbase + o), yv)), a0)
                        a1 = fmadd_ps_512(repeat_pair_ps_512(pr, 2), cvtepi32_ps_512(
                            dpbusd_epi32_512(cv, loadu_si512(dbase + dstride + o), yv)), a1)
                        a2 = fmadd_ps_512(repeat_pair_ps_512(pr, 4), cvtepi32_ps_512(
                            dpbusd_epi32_512(cv, loadu_si512(dbase + 2 * dstride + o), yv)), a2)
                        a3 = fmadd_ps_512(repeat_pair_ps_512(pr, 6), cvtepi32_ps_512(
                            dpbusd_epi32_512(cv, loadu_si512(dbase + 3 * dstride + o), yv)), a3)
                if last:
                    store_pair_sums_4(resbase + 4 * (i0 * res_cols + r - r0), a0, a1, a2, a3)
                else:
                    storeu_ps_512(a, a0)
                    storeu_ps_512(a + 64, a1)
                    storeu_ps_512(a + 128, a2)
                    storeu_ps_512(a + 192, a3)
        if has_min:  # summs += m * s per block, in block order (ggml_vec_dot_q4_1_q8_1 / q5_1_q8_1): each
            # (x-row, row) lane the scalar sequence, the tile's 4 rows side by side (a loop per row and x-row cost
            # more than the products at 1-4 x-rows)
            for i in range(n):
                for j in range(4):
                    summs[i, j] = _F0
            for b in range(blocks):
                for i in range(n):
                    sb = sums_t[b, i]
                    for j in range(4):
                        summs[i, j] = summs[i, j] + wmins[b, j] * sb
        if direct:
            if has_min:
                for i in range(n):
                    for j in range(4):
                        res[i, r - r0 + j] = res[i, r - r0 + j] + summs[i, j]
            continue
        for j in range(min(4, r1 - r)):
            for i in range(n):
                lanes16 = loadu_ps_512(abase + 256 * i + 64 * j)
                even, odd = even_ps_256(lanes16), odd_ps_256(lanes16)
                if blocks % 2:  # the last block, alone, into the even lanes (as the AVX2 kernel steps it)
                    b = blocks - 1
                    yv = loadu_si256(ybase + i * ystride + 32 * b)
                    cv = _neg_offset_sums_256(yv, off)
                    lanes = dpbusd_epi32_256(cv, loadu_si256(dbase + j * dstride + 64 * pairs), yv)
                    even = fmadd_ps(set1_ps(wlast[j] * xd[i, b]), cvtepi32_ps(lanes), even)
                total = hsum_float_8(add_ps(even, odd))
                res[i, r - r0 + j] = total + summs[i, j] if has_min else total
    for i in range(n):  # out's rows are far apart (a whole weight's width): written here, each in one run
        for r in range(r0, r1):
            out[i, r] = res[i, r - r0]
    keep_alive(decoded, wsc, acc)  # used through their addresses until here
    keep_alive(ys, xds, res)
    keep_alive(cs, cs, cs)


@njit(cache=True, inline="always")
def _neg_offset_sums_256(yv, off):
    """-off * (y's bytes summed in fours) per int32 lane: the accumulator that undoes an unsigned offset."""
    zero = set1_epi8(0)
    if off == 0:
        return zero
    return sub_epi32(zero, dpbusd_epi32_256(zero, set1_epi8(off), yv))



# The 32-block row kernel this CPU runs (the VNNI one gives the AVX2 one's bits). One Zen 5 core, cold weights,
# G MAC/s at 1 / 2 / 4 / 8 / 16 x-rows, AVX2 against VNNI: Q5_0 4864x896 22 / 31 / 41 / 47 / 51 against
# 30 / 50 / 74 / 92 / 106, Q8_0 18992x896 34 / 47 / 51 / 49 / 48 against 30 / 51 / 78 / 94 / 107, Q4_0 at 1 x-row
# 25 against 32; Q4_1 1536x576 25 / 34 / 42 / - / 43 against 17 / 26 / 47 / - / 69 (the m * s sums cost the VNNI
# kernel more at few x-rows). A choice inside _rows_32_avx512 that called _rows_32_avx2 crashed (both take `kind`
# as a literal); inlined here it does not.
if HAVE_AVX512_VNNI:
    def _rows_32(raw, kind, block_bytes, xq, xd, xs, out, r0, r1):
        """The 32-block rows of format `kind` (a literal): typed by _rows_32_for."""
        raise NotImplementedError("called from compiled code only")

    @overload(_rows_32, inline="always")
    def _rows_32_for(raw, kind, block_bytes, xq, xd, xs, out, r0, r1):
        # The choice of kernel per format is made here, at typing, so a format's code holds only the AVX2
        # groups it can reach (a `kind ==` test inside compiled code would type every branch for every format)
        k = getattr(kind, "literal_value", None)
        if k is None:
            return None
        if k == KIND_Q4_0 or k == KIND_Q5_0:
            def impl(raw, kind, block_bytes, xq, xd, xs, out, r0, r1):
                _rows_32_avx512(raw, kind, block_bytes, xq, xd, xs, out, r0, r1)
        elif k == KIND_Q8_0:
            def impl(raw, kind, block_bytes, xq, xd, xs, out, r0, r1):
                if xd.shape[0] >= 2:
                    _rows_32_avx512(raw, kind, block_bytes, xq, xd, xs, out, r0, r1)
                else:
                    _rows_32_avx2_one(raw, kind, block_bytes, xq, xd, xs, out, r0, r1)
        else:
            def impl(raw, kind, block_bytes, xq, xd, xs, out, r0, r1):
                if xd.shape[0] >= 4:
                    _rows_32_avx512(raw, kind, block_bytes, xq, xd, xs, out, r0, r1)
                else:
                    _rows_32_avx2_few(raw, kind, block_bytes, xq, xd, xs, out, r0, r1)
        return impl
else:
    _rows_32 = _rows_32_avx2


@njit(cache=True)
def _accumulate_avx2(address, d, sumi):
    """acc (8 floats at `address`) = fma(d, float(sumi), acc): one x-row's per-block step of every K-quant dot."""
    storeu_ps(address, fmadd_ps(set1_ps(d), cvtepi32_ps(sumi), loadu_ps(address)))


@njit(cache=True)
def _scales_mins_k4_avx2(blk):
    """A Q4_K/Q5_K block's 8 scales (int16 lanes 0-7) and 8 mins (lanes 8-15), by ggml's utmp/kmask unpacking."""
    a0, a1, a2 = load_u32(blk + 4), load_u32(blk + 8), load_u32(blk + 12)
    return cvtepu8_epi16_words(
        a0 & _KMASK_6BIT,
        (a2 & _KMASK_LOW4) | (((a0 >> 6) & _KMASK_2BIT) << 4),
        a1 & _KMASK_6BIT,
        ((a2 >> 4) & _KMASK_LOW4) | (((a1 >> 6) & _KMASK_2BIT) << 4),
    )


@njit(cache=True)
def _finish_min_lanes_avx2(acc_m, i):
    """(l0 + l2) + (l1 + l3) of ggml's 4 acc_m lanes, which the AVX2 kernel keeps twice each (lanes 2l, 2l+1)."""
    return (acc_m[i, 0] + acc_m[i, 4]) + (acc_m[i, 2] + acc_m[i, 6])


@njit(cache=True)
def _rows_q4_k_avx2(raw, xq, xd, bsums, out, r0, r1):
    """ggml_vec_dot_q4_K_q8_K, AVX2 branch: 4 chunks of 64, low nibbles then high nibbles, scale per 32.

    The min term: madd(bsums, mins paired) gives mins[k] * (two 16-sums of sub-block k); adding adjacent lanes
    gives ggml's prod[l] (l = 0..3) in lanes 2l and 2l+1, accumulated with one fma like ggml's 128-bit acc_m.
    """
    n, blocks = xd.shape
    wbase, wstride = address_of(raw), raw.strides[0]
    xbase, xstride = address_of(xq), xq.strides[0]
    dbase, bbase, bstride = address_of(xd), address_of(bsums), bsums.strides[0]
    acc = np.zeros((n, 8), np.float32)
    acc_m = np.zeros((n, 8), np.float32)
    abase, mbase = address_of(acc), address_of(acc_m)
    m4 = set1_epi8(0xF)
    for r in range(r0, r1):
        acc[:] = _F0
        acc_m[:] = _F0
        w = wbase + r * wstride
        for b in range(blocks):
            blk = w + 144 * b
            wd, wdmin = load_halves(blk)
            scales_mins = _scales_mins_k4_avx2(blk)
            mins_paired = duplicate_high_epi16(scales_mins)
            bits0, bits1 = loadu_si256(blk + 16), loadu_si256(blk + 48)
            bits2, bits3 = loadu_si256(blk + 80), loadu_si256(blk + 112)
            l0, h0 = and_si256(bits0, m4), and_si256(srli_epi16(bits0, 4), m4)
            l1, h1 = and_si256(bits1, m4), and_si256(srli_epi16(bits1, 4), m4)
            l2, h2 = and_si256(bits2, m4), and_si256(srli_epi16(bits2, 4), m4)
            l3, h3 = and_si256(bits3, m4), and_si256(srli_epi16(bits3, 4), m4)
            for i in range(n):
                yd = load_f32(dbase + 4 * (i * blocks + b))
                prod = add_adjacent_epi32(madd_epi16(loadu_si256(bbase + i * bstride + 32 * b), mins_paired))
                _accumulate_avx2(mbase + 32 * i, -yd * wdmin, prod)
                y = xbase + i * xstride + 256 * b
                p0 = add_epi32(
                    madd_epi16(shuffle_epi16_halves(scales_mins, 0, 0), maddubs_epi16(l0, loadu_si256(y))),
                    madd_epi16(shuffle_epi16_halves(scales_mins, 1, 1), maddubs_epi16(h0, loadu_si256(y + 32))),
                )
                p1 = add_epi32(
                    madd_epi16(shuffle_epi16_halves(scales_mins, 2, 2), maddubs_epi16(l1, loadu_si256(y + 64))),
                    madd_epi16(shuffle_epi16_halves(scales_mins, 3, 3), maddubs_epi16(h1, loadu_si256(y + 96))),
                )
                p2 = add_epi32(
                    madd_epi16(shuffle_epi16_halves(scales_mins, 4, 4), maddubs_epi16(l2, loadu_si256(y + 128))),
                    madd_epi16(shuffle_epi16_halves(scales_mins, 5, 5), maddubs_epi16(h2, loadu_si256(y + 160))),
                )
                p3 = add_epi32(
                    madd_epi16(shuffle_epi16_halves(scales_mins, 6, 6), maddubs_epi16(l3, loadu_si256(y + 192))),
                    madd_epi16(shuffle_epi16_halves(scales_mins, 7, 7), maddubs_epi16(h3, loadu_si256(y + 224))),
                )
                _accumulate_avx2(abase + 32 * i, yd * wd, add_epi32(add_epi32(p0, p1), add_epi32(p2, p3)))
        for i in range(n):
            out[i, r] = _hsum_float_8(acc, i) + _finish_min_lanes_avx2(acc_m, i)


# The AVX-512 K-quant kernels take weight rows in pairs: each activation block read serves both rows, their
# float steps share a zmm, and with VNNI the scale products fold into the sums. Pairs used to lose to one row at
# a time below 16 x-rows, because two interleaved weight streams fetched badly from DRAM; with the software
# prefetch (_PREFETCH_AHEAD) they win at every count. One Zen 5 core, cold weights, G MAC/s at 1 / 4 / 8 / 16
# x-rows, one row at a time against pairs: Q4_K 8960x1536 40 / 76 / 96 / 105 against 52 / 108 / 135 / 144,
# 1536x8960 46 / 35 / 64 / 84 against 61 / 119 / 145 / 162; Q6_K 1536x8960 37 / 29 / 37 / 47 against
# 49 / 114 / 131 / 139, 151936x1536 (an output head) 36 / 93 / 104 / 108 against 45 / 103 / 129 / 140.


@njit(cache=True, inline="always")
def _q4_k_decode_avx512(blk, m4):
    """A Q4_K block as four zmm of weights (sub-blocks 2j | 2j+1), four of their scales, the paired mins, d, dmin."""
    wd, wdmin = load_halves(blk)
    scales_mins = _scales_mins_k4_avx2(blk)
    bits0, bits1 = loadu_si256(blk + 16), loadu_si256(blk + 48)
    bits2, bits3 = loadu_si256(blk + 80), loadu_si256(blk + 112)
    qs = (concat_si256(and_si256(bits0, m4), and_si256(srli_epi16(bits0, 4), m4)),
          concat_si256(and_si256(bits1, m4), and_si256(srli_epi16(bits1, 4), m4)),
          concat_si256(and_si256(bits2, m4), and_si256(srli_epi16(bits2, 4), m4)),
          concat_si256(and_si256(bits3, m4), and_si256(srli_epi16(bits3, 4), m4)))
    ss = (concat_si256(shuffle_epi16_halves(scales_mins, 0, 0), shuffle_epi16_halves(scales_mins, 1, 1)),
          concat_si256(shuffle_epi16_halves(scales_mins, 2, 2), shuffle_epi16_halves(scales_mins, 3, 3)),
          concat_si256(shuffle_epi16_halves(scales_mins, 4, 4), shuffle_epi16_halves(scales_mins, 5, 5)),
          concat_si256(shuffle_epi16_halves(scales_mins, 6, 6), shuffle_epi16_halves(scales_mins, 7, 7)))
    return qs, ss, duplicate_high_epi16(scales_mins), wd, wdmin


@njit(cache=True, inline="always")
def _q4_k_sum_vnni(qs, ss, y0, y1, y2, y3):
    """One x-row's int32 sums of a decoded Q4_K block (16 lanes, unfolded): maddubs then vpdpwssd with the
    sub-blocks' scales, madd and add in one (the same integers as _rows_q4_k_avx2's)."""
    if HAVE_AVX512_VNNI:
        a = dpwssd_epi32_512(dpwssd_epi32_512(zero_si512(), ss[0], maddubs_epi16_512(qs[0], y0)), ss[1],
                             maddubs_epi16_512(qs[1], y1))
        b = dpwssd_epi32_512(dpwssd_epi32_512(zero_si512(), ss[2], maddubs_epi16_512(qs[2], y2)), ss[3],
                             maddubs_epi16_512(qs[3], y3))
        return add_epi32_512(a, b)
    return add_epi32_512(add_epi32_512(madd_epi16_512(ss[0], maddubs_epi16_512(qs[0], y0)),
                                       madd_epi16_512(ss[1], maddubs_epi16_512(qs[1], y1))),
                         add_epi32_512(madd_epi16_512(ss[2], maddubs_epi16_512(qs[2], y2)),
                                       madd_epi16_512(ss[3], maddubs_epi16_512(qs[3], y3))))


@njit(cache=True)
def _rows_q4_k_avx512(raw, xq, xd, bsums, out, r0, r1):
    """_rows_q4_k_avx2 on zmm, two weight rows at a time (bitwise its results): each activation block read
    serves both, and the two rows' float steps run side by side in one zmm (row r in lanes 0-7, r + 1 in 8-15,
    each half exactly the AVX2 kernel's 8-lane step). With VNNI the scale products fold into the sums
    (vpdpwssd). A lone last row pairs with itself (computed twice, written once)."""
    n, blocks = xd.shape
    wbase, wstride = address_of(raw), raw.strides[0]
    xbase, xstride = address_of(xq), xq.strides[0]
    dbase, bbase, bstride = address_of(xd), address_of(bsums), bsums.strides[0]
    acc = np.zeros((n, 16), np.float32)
    acc_m = np.zeros((n, 16), np.float32)
    abase, mbase = address_of(acc), address_of(acc_m)
    m4 = set1_epi8(0xF)
    zero = setzero_ps_512()
    for r in range(r0, r1, 2):
        two = r + 1 < r1
        for i in range(n):  # (see _rows_q6_k_avx512)
            storeu_ps_512(abase + 64 * i, zero)
            storeu_ps_512(mbase + 64 * i, zero)
        w = wbase + r * wstride
        w2 = w + wstride if two else w
        for b in range(blocks):
            _prefetch_lines(w + 288 * b + _PREFETCH_AHEAD, 5)  # the pair's memory (two rows) swept at 288 B a block
            qs, ss, mins, wd, wdmin = _q4_k_decode_avx512(w + 144 * b, m4)
            qs2, ss2, mins2, wd2, wdmin2 = _q4_k_decode_avx512(w2 + 144 * b, m4)
            mins_both = concat_si256(mins, mins2)
            d_both, dmin_both = set2_ps_512(wd, wd2), set2_ps_512(wdmin, wdmin2)
            for i in range(n):
                y = xbase + i * xstride + 256 * b
                yd = load_f32(dbase + 4 * (i * blocks + b))
                bs = loadu_si256(bbase + i * bstride + 32 * b)
                prod = add_adjacent_epi32_512(madd_epi16_512(concat_si256(bs, bs), mins_both))
                am = mbase + 64 * i
                storeu_ps_512(am, fmadd_ps_512(mul_ps_512(set1_ps_512(-yd), dmin_both), cvtepi32_ps_512(prod),
                                               loadu_ps_512(am)))
                y0, y1, y2, y3 = loadu_si512(y), loadu_si512(y + 64), loadu_si512(y + 128), loadu_si512(y + 192)
                sums = fold_pair_epi32_512(_q4_k_sum_vnni(qs, ss, y0, y1, y2, y3),
                                           _q4_k_sum_vnni(qs2, ss2, y0, y1, y2, y3))
                a = abase + 64 * i
                storeu_ps_512(a, fmadd_ps_512(mul_ps_512(set1_ps_512(yd), d_both), cvtepi32_ps_512(sums),
                                              loadu_ps_512(a)))
        for i in range(n):
            out[i, r] = _hsum_float_8(acc[:, 0:8], i) + _finish_min_lanes_avx2(acc_m[:, 0:8], i)
            if two:
                out[i, r + 1] = _hsum_float_8(acc[:, 8:16], i) + _finish_min_lanes_avx2(acc_m[:, 8:16], i)


# The Q4_K row kernel this CPU runs (the AVX-512 one gives the AVX2 one's bits).
_rows_q4_k = _rows_q4_k_avx512 if HAVE_AVX512 else _rows_q4_k_avx2


@njit(cache=True)
def _q5_k_chunk(bits, hbits, bit):
    """32 five-bit weights: 4 low bits from a nibble, the 5th from bit `bit` of each qh byte, shifted to 16."""
    high = slli_epi16(srli_epi16(and_si256(hbits, set1_epi8(1 << bit)), bit), 4)
    return add_epi8(bits, high)


@njit(cache=True)
def _rows_q5_k_avx2(raw, xq, xd, bsums, out, r0, r1):
    """ggml_vec_dot_q5_K_q8_K, AVX2 branch: Q4_K's layout plus a 5th bit per weight from qh; mins summed to one int."""
    n, blocks = xd.shape
    wbase, wstride = address_of(raw), raw.strides[0]
    xbase, xstride = address_of(xq), xq.strides[0]
    dbase, bbase, bstride = address_of(xd), address_of(bsums), bsums.strides[0]
    acc = np.zeros((n, 8), np.float32)
    abase = address_of(acc)
    summs = np.zeros(n, np.float32)
    m4 = set1_epi8(0xF)
    for r in range(r0, r1):
        acc[:] = _F0
        summs[:] = _F0
        w = wbase + r * wstride
        for b in range(blocks):
            blk = w + 176 * b
            wd, wdmin = load_halves(blk)
            scales_mins = _scales_mins_k4_avx2(blk)
            mins_paired = duplicate_high_epi16(scales_mins)
            hbits = loadu_si256(blk + 16)
            bits0, bits1 = loadu_si256(blk + 48), loadu_si256(blk + 80)
            bits2, bits3 = loadu_si256(blk + 112), loadu_si256(blk + 144)
            q0 = _q5_k_chunk(and_si256(bits0, m4), hbits, 0)
            q1 = _q5_k_chunk(and_si256(srli_epi16(bits0, 4), m4), hbits, 1)
            q2 = _q5_k_chunk(and_si256(bits1, m4), hbits, 2)
            q3 = _q5_k_chunk(and_si256(srli_epi16(bits1, 4), m4), hbits, 3)
            q4 = _q5_k_chunk(and_si256(bits2, m4), hbits, 4)
            q5 = _q5_k_chunk(and_si256(srli_epi16(bits2, 4), m4), hbits, 5)
            q6 = _q5_k_chunk(and_si256(bits3, m4), hbits, 6)
            q7 = _q5_k_chunk(and_si256(srli_epi16(bits3, 4), m4), hbits, 7)
            for i in range(n):
                yd = load_f32(dbase + 4 * (i * blocks + b))
                min_sum = hsum_epi32(madd_epi16(loadu_si256(bbase + i * bstride + 32 * b), mins_paired))
                summs[i] = summs[i] + (-yd * wdmin) * np.float32(min_sum)
                y = xbase + i * xstride + 256 * b
                p0 = add_epi32(
                    madd_epi16(shuffle_epi16_halves(scales_mins, 0, 0), maddubs_epi16(q0, loadu_si256(y))),
                    madd_epi16(shuffle_epi16_halves(scales_mins, 1, 1), maddubs_epi16(q1, loadu_si256(y + 32))),
                )
                p1 = add_epi32(
                    madd_epi16(shuffle_epi16_halves(scales_mins, 2, 2), maddubs_epi16(q2, loadu_si256(y + 64))),
                    madd_epi16(shuffle_epi16_halves(scales_mins, 3, 3), maddubs_epi16(q3, loadu_si256(y + 96))),
                )
                p2 = add_epi32(
                    madd_epi16(shuffle_epi16_halves(scales_mins, 4, 4), maddubs_epi16(q4, loadu_si256(y + 128))),
                    madd_epi16(shuffle_epi16_halves(scales_mins, 5, 5), maddubs_epi16(q5, loadu_si256(y + 160))),
                )
                p3 = add_epi32(
                    madd_epi16(shuffle_epi16_halves(scales_mins, 6, 6), maddubs_epi16(q6, loadu_si256(y + 192))),
                    madd_epi16(shuffle_epi16_halves(scales_mins, 7, 7), maddubs_epi16(q7, loadu_si256(y + 224))),
                )
                _accumulate_avx2(abase + 32 * i, yd * wd, add_epi32(add_epi32(p0, p1), add_epi32(p2, p3)))
        for i in range(n):
            out[i, r] = _hsum_float_8(acc, i) + summs[i]


@njit(cache=True)
def _q6_k_product(q, y, scales, lo, hi):
    """(q - 32) . y for one 32-chunk, times its two 16-element scales (lanes lo, hi of `scales`, constants).

    maddubs wants unsigned weights, so ggml subtracts maddubs(32, y) instead of 32 from each weight.
    """
    q8 = loadu_si256(y)
    p16 = sub_epi16(maddubs_epi16(q, q8), maddubs_epi16(set1_epi8(32), q8))
    return madd_epi16(shuffle_epi16_halves(scales, lo, hi), p16)


@njit(cache=True)
def _rows_q6_k_avx2(raw, xq, xd, bsums, out, r0, r1):
    """ggml_vec_dot_q6_K_q8_K, AVX2 branch: 6-bit weights from ql nibbles and qh bit pairs, int8 scale per 16."""
    n, blocks = xd.shape
    wbase, wstride = address_of(raw), raw.strides[0]
    xbase, xstride = address_of(xq), xq.strides[0]
    dbase = address_of(xd)
    acc = np.zeros((n, 8), np.float32)
    abase = address_of(acc)
    m4 = set1_epi8(0xF)
    m2 = set1_epi8(3)
    for r in range(r0, r1):
        acc[:] = _F0
        w = wbase + r * wstride
        for b in range(blocks):
            blk = w + 210 * b
            wd = load_halves(blk + 206)[1]  # the block's last word: scales[14:16], then d
            scales = load_cvtepi8_epi16(blk + 192)
            low_a0, low_b0, high0 = loadu_si256(blk), loadu_si256(blk + 32), loadu_si256(blk + 128)
            low_a1, low_b1, high1 = loadu_si256(blk + 64), loadu_si256(blk + 96), loadu_si256(blk + 160)
            q0 = or_si256(and_si256(low_a0, m4), slli_epi16(and_si256(high0, m2), 4))
            q1 = or_si256(and_si256(low_b0, m4), slli_epi16(and_si256(srli_epi16(high0, 2), m2), 4))
            q2 = or_si256(and_si256(srli_epi16(low_a0, 4), m4), slli_epi16(and_si256(srli_epi16(high0, 4), m2), 4))
            q3 = or_si256(and_si256(srli_epi16(low_b0, 4), m4), slli_epi16(and_si256(srli_epi16(high0, 6), m2), 4))
            q4 = or_si256(and_si256(low_a1, m4), slli_epi16(and_si256(high1, m2), 4))
            q5 = or_si256(and_si256(low_b1, m4), slli_epi16(and_si256(srli_epi16(high1, 2), m2), 4))
            q6 = or_si256(and_si256(srli_epi16(low_a1, 4), m4), slli_epi16(and_si256(srli_epi16(high1, 4), m2), 4))
            q7 = or_si256(and_si256(srli_epi16(low_b1, 4), m4), slli_epi16(and_si256(srli_epi16(high1, 6), m2), 4))
            for i in range(n):
                y = xbase + i * xstride + 256 * b
                sumi = add_epi32(_q6_k_product(q0, y, scales, 0, 1), _q6_k_product(q1, y + 32, scales, 2, 3))
                sumi = add_epi32(
                    sumi, add_epi32(_q6_k_product(q2, y + 64, scales, 4, 5), _q6_k_product(q3, y + 96, scales, 6, 7))
                )
                sumi = add_epi32(
                    sumi, add_epi32(_q6_k_product(q4, y + 128, scales, 8, 9), _q6_k_product(q5, y + 160, scales, 10, 11))
                )
                sumi = add_epi32(
                    sumi, add_epi32(_q6_k_product(q6, y + 192, scales, 12, 13), _q6_k_product(q7, y + 224, scales, 14, 15))
                )
                _accumulate_avx2(abase + 32 * i, load_f32(dbase + 4 * (i * blocks + b)) * wd, sumi)
        for i in range(n):
            out[i, r] = _hsum_float_8(acc, i)


@njit(cache=True, inline="always")
def _q6_k_decode_avx512(blk, m4, m2):
    """A Q6_K block's 6-bit weights as four zmm (32-chunks 2j | 2j+1) and their 16-element scales likewise."""
    scales = load_cvtepi8_epi16(blk + 192)
    low_a0, low_b0, high0 = loadu_si256(blk), loadu_si256(blk + 32), loadu_si256(blk + 128)
    low_a1, low_b1, high1 = loadu_si256(blk + 64), loadu_si256(blk + 96), loadu_si256(blk + 160)
    q0 = or_si256(and_si256(low_a0, m4), slli_epi16(and_si256(high0, m2), 4))
    q1 = or_si256(and_si256(low_b0, m4), slli_epi16(and_si256(srli_epi16(high0, 2), m2), 4))
    q2 = or_si256(and_si256(srli_epi16(low_a0, 4), m4), slli_epi16(and_si256(srli_epi16(high0, 4), m2), 4))
    q3 = or_si256(and_si256(srli_epi16(low_b0, 4), m4), slli_epi16(and_si256(srli_epi16(high0, 6), m2), 4))
    q4 = or_si256(and_si256(low_a1, m4), slli_epi16(and_si256(high1, m2), 4))
    q5 = or_si256(and_si256(low_b1, m4), slli_epi16(and_si256(srli_epi16(high1, 2), m2), 4))
    q6 = or_si256(and_si256(srli_epi16(low_a1, 4), m4), slli_epi16(and_si256(srli_epi16(high1, 4), m2), 4))
    q7 = or_si256(and_si256(srli_epi16(low_b1, 4), m4), slli_epi16(and_si256(srli_epi16(high1, 6), m2), 4))
    qs = (concat_si256(q0, q1), concat_si256(q2, q3), concat_si256(q4, q5), concat_si256(q6, q7))
    ss = (concat_si256(shuffle_epi16_halves(scales, 0, 1), shuffle_epi16_halves(scales, 2, 3)),
          concat_si256(shuffle_epi16_halves(scales, 4, 5), shuffle_epi16_halves(scales, 6, 7)),
          concat_si256(shuffle_epi16_halves(scales, 8, 9), shuffle_epi16_halves(scales, 10, 11)),
          concat_si256(shuffle_epi16_halves(scales, 12, 13), shuffle_epi16_halves(scales, 14, 15)))
    return qs, ss


@njit(cache=True, inline="always")
def _q6_k_sum_pair(qs, ss, y0, y1, y2, y3, o0, o1, o2, o3):
    """One x-row's int32 sums of a decoded Q6_K block (16 lanes, unfolded): for each 32-chunk, (maddubs(q, y) -
    maddubs(32, y)) madd scales as _q6_k_product computes it (exact integers), with the offset products
    maddubs(32, y) given (o0..o3: shared by the weight rows of a pair) and, with VNNI, the scale products folded
    into the sums (vpdpwssd): the same integers."""
    t0 = sub_epi16_512(maddubs_epi16_512(qs[0], y0), o0)
    t1 = sub_epi16_512(maddubs_epi16_512(qs[1], y1), o1)
    t2 = sub_epi16_512(maddubs_epi16_512(qs[2], y2), o2)
    t3 = sub_epi16_512(maddubs_epi16_512(qs[3], y3), o3)
    if HAVE_AVX512_VNNI:
        return add_epi32_512(dpwssd_epi32_512(dpwssd_epi32_512(zero_si512(), ss[0], t0), ss[1], t1),
                             dpwssd_epi32_512(dpwssd_epi32_512(zero_si512(), ss[2], t2), ss[3], t3))
    return add_epi32_512(add_epi32_512(madd_epi16_512(ss[0], t0), madd_epi16_512(ss[1], t1)),
                         add_epi32_512(madd_epi16_512(ss[2], t2), madd_epi16_512(ss[3], t3)))


@njit(cache=True)
def _rows_q6_k_avx512(raw, xq, xd, bsums, out, r0, r1):
    """_rows_q6_k_avx2 on zmm, two weight rows at a time (bitwise its results; bsums unused, as there): each
    activation block read (and its offset products) serves both, and the two rows' float steps run side by side
    in one zmm (row r in lanes 0-7, r + 1 in 8-15, each half exactly the AVX2 kernel's step). A lone last row
    pairs with itself (computed twice, written once)."""
    n, blocks = xd.shape
    wbase, wstride = address_of(raw), raw.strides[0]
    xbase, xstride = address_of(xq), xq.strides[0]
    dbase = address_of(xd)
    acc = np.zeros((n, 16), np.float32)
    abase = address_of(acc)
    m4, m2 = set1_epi8(0xF), set1_epi8(3)
    k32 = concat_si256(set1_epi8(32), set1_epi8(32))
    zero = setzero_ps_512()
    for r in range(r0, r1, 2):
        two = r + 1 < r1
        for i in range(n):  # (a slice assignment of the 3-d array cost ~100 ns a row pair: 3x the kernel)
            storeu_ps_512(abase + 64 * i, zero)
        w = wbase + r * wstride
        w2 = w + wstride if two else w
        for b in range(blocks):
            _prefetch_lines(w + 420 * b + _PREFETCH_AHEAD, 7)  # the pair's memory (two rows) swept at 420 B a block
            blk, blk2 = w + 210 * b, w2 + 210 * b
            d_both = set2_ps_512(load_halves(blk + 206)[1], load_halves(blk2 + 206)[1])  # scales[14:16], then d
            qs, ss = _q6_k_decode_avx512(blk, m4, m2)
            qs2, ss2 = _q6_k_decode_avx512(blk2, m4, m2)
            for i in range(n):
                y = xbase + i * xstride + 256 * b
                y0, y1, y2, y3 = loadu_si512(y), loadu_si512(y + 64), loadu_si512(y + 128), loadu_si512(y + 192)
                o0, o1 = maddubs_epi16_512(k32, y0), maddubs_epi16_512(k32, y1)
                o2, o3 = maddubs_epi16_512(k32, y2), maddubs_epi16_512(k32, y3)
                sums = fold_pair_epi32_512(_q6_k_sum_pair(qs, ss, y0, y1, y2, y3, o0, o1, o2, o3),
                                           _q6_k_sum_pair(qs2, ss2, y0, y1, y2, y3, o0, o1, o2, o3))
                a = abase + 64 * i
                yd = load_f32(dbase + 4 * (i * blocks + b))
                storeu_ps_512(a, fmadd_ps_512(mul_ps_512(set1_ps_512(yd), d_both), cvtepi32_ps_512(sums),
                                              loadu_ps_512(a)))
        for i in range(n):
            out[i, r] = _hsum_float_8(acc[:, 0:8], i)
            if two:
                out[i, r + 1] = _hsum_float_8(acc[:, 8:16], i)


# The Q6_K row kernel this CPU runs (the AVX-512 one gives the AVX2 one's bits).
_rows_q6_k = _rows_q6_k_avx512 if HAVE_AVX512 else _rows_q6_k_avx2


@njit(cache=True)
def _q3_k_product(low_bits, hbits, shift, bit, y, scales, lo, hi):
    """((q >> shift) & 3) - 4 * (hmask bit clear), dotted with y, times the chunk's two scales (ggml's q3l/q3h)."""
    q8 = loadu_si256(y)
    q3l = and_si256(srli_epi16(low_bits, shift), set1_epi8(3))
    q3h = slli_epi16(srli_epi16(andnot_si256(hbits, set1_epi8(1 << bit)), bit), 2)
    p16 = sub_epi16(maddubs_epi16(q3l, q8), maddubs_epi16(q3h, q8))
    return madd_epi16(shuffle_epi16_halves(scales, lo, hi), p16)


@njit(cache=True)
def _rows_q3_k_avx2(raw, xq, xd, bsums, out, r0, r1):
    """ggml_vec_dot_q3_K_q8_K, AVX2 branch: 2 low bits from qs, the 3rd from hmask, signed 6-bit scale per 16."""
    n, blocks = xd.shape
    wbase, wstride = address_of(raw), raw.strides[0]
    xbase, xstride = address_of(xq), xq.strides[0]
    dbase = address_of(xd)
    acc = np.zeros((n, 8), np.float32)
    abase = address_of(acc)
    for r in range(r0, r1):
        acc[:] = _F0
        w = wbase + r * wstride
        for b in range(blocks):
            blk = w + 110 * b
            wd = load_halves(blk + 106)[1]  # the block's last word: scales[10:12], then d
            a0, a1, a2 = load_u32(blk + 96), load_u32(blk + 100), load_u32(blk + 104)
            scales = sub_epi16(
                cvtepu8_epi16_words(
                    (a0 & _KMASK_LOW4) | ((a2 & _KMASK_2BIT) << 4),
                    (a1 & _KMASK_LOW4) | (((a2 >> 2) & _KMASK_2BIT) << 4),
                    ((a0 >> 4) & _KMASK_LOW4) | (((a2 >> 4) & _KMASK_2BIT) << 4),
                    ((a1 >> 4) & _KMASK_LOW4) | (((a2 >> 6) & _KMASK_2BIT) << 4),
                ),
                set1_epi16(32),
            )
            hbits = loadu_si256(blk)
            bits0 = loadu_si256(blk + 32)
            bits1 = loadu_si256(blk + 64)
            for i in range(n):
                y = xbase + i * xstride + 256 * b
                s0 = add_epi32(
                    add_epi32(
                        _q3_k_product(bits0, hbits, 0, 0, y, scales, 0, 1),
                        _q3_k_product(bits0, hbits, 2, 1, y + 32, scales, 2, 3),
                    ),
                    add_epi32(
                        _q3_k_product(bits0, hbits, 4, 2, y + 64, scales, 4, 5),
                        _q3_k_product(bits0, hbits, 6, 3, y + 96, scales, 6, 7),
                    ),
                )
                s1 = add_epi32(
                    add_epi32(
                        _q3_k_product(bits1, hbits, 0, 4, y + 128, scales, 8, 9),
                        _q3_k_product(bits1, hbits, 2, 5, y + 160, scales, 10, 11),
                    ),
                    add_epi32(
                        _q3_k_product(bits1, hbits, 4, 6, y + 192, scales, 12, 13),
                        _q3_k_product(bits1, hbits, 6, 7, y + 224, scales, 14, 15),
                    ),
                )
                _accumulate_avx2(abase + 32 * i, load_f32(dbase + 4 * (i * blocks + b)) * wd, add_epi32(s0, s1))
        for i in range(n):
            out[i, r] = _hsum_float_8(acc, i)


@njit(cache=True)
def _q2_k_product(bits, shift, y, scales, lo, hi):
    """((q >> shift) & 3) . y for one 32-chunk, times its two 16-element scales (lanes lo, hi of `scales`)."""
    q2 = and_si256(srli_epi16(bits, shift), set1_epi8(3))
    return madd_epi16(shuffle_epi16_halves(scales, lo, hi), maddubs_epi16(q2, loadu_si256(y)))


@njit(cache=True)
def _rows_q2_k_avx2(raw, xq, xd, bsums, out, r0, r1):
    """ggml_vec_dot_q2_K_q8_K, AVX2 branch: 2-bit weights, 4-bit scale and min per 16 (mins via bsums)."""
    n, blocks = xd.shape
    wbase, wstride = address_of(raw), raw.strides[0]
    xbase, xstride = address_of(xq), xq.strides[0]
    dbase, bbase, bstride = address_of(xd), address_of(bsums), bsums.strides[0]
    acc = np.zeros((n, 8), np.float32)
    abase = address_of(acc)
    for r in range(r0, r1):
        acc[:] = _F0
        w = wbase + r * wstride
        for b in range(blocks):
            blk = w + 84 * b
            wd, wdmin = load_halves(blk + 80)
            scales_and_mins = load_cvtepu8_epi16(blk)
            scales = and_si256(scales_and_mins, set1_epi16(0xF))
            mins = srli_epi16(scales_and_mins, 4)
            bits0 = loadu_si256(blk + 16)
            bits1 = loadu_si256(blk + 48)
            for i in range(n):
                yd = load_f32(dbase + 4 * (i * blocks + b))
                prod = madd_epi16(mins, loadu_si256(bbase + i * bstride + 32 * b))
                _accumulate_avx2(abase + 32 * i, -yd * wdmin, prod)
                y = xbase + i * xstride + 256 * b
                s0 = add_epi32(
                    add_epi32(_q2_k_product(bits0, 0, y, scales, 0, 1), _q2_k_product(bits0, 2, y + 32, scales, 2, 3)),
                    add_epi32(_q2_k_product(bits0, 4, y + 64, scales, 4, 5), _q2_k_product(bits0, 6, y + 96, scales, 6, 7)),
                )
                s1 = add_epi32(
                    add_epi32(
                        _q2_k_product(bits1, 0, y + 128, scales, 8, 9), _q2_k_product(bits1, 2, y + 160, scales, 10, 11)
                    ),
                    add_epi32(
                        _q2_k_product(bits1, 4, y + 192, scales, 12, 13), _q2_k_product(bits1, 6, y + 224, scales, 14, 15)
                    ),
                )
                _accumulate_avx2(abase + 32 * i, yd * wd, add_epi32(s0, s1))
        for i in range(n):
            out[i, r] = _hsum_float_8(acc, i)


# ---------------------------------------------------------------------------------------------------------------
# Drivers: quantize x once, then split the output rows over the threads
# ---------------------------------------------------------------------------------------------------------------
#
# One driver per (family, path), spelled out: Numba does not cache a function that receives another jitted
# function as an argument, and a cold start compiling every kernel would cost seconds.


@njit(cache=True)
def _n_chunks(rows, cols, threads):
    """How many row ranges to run in parallel: one per thread, or 1 when waking threads costs more than it saves."""
    if rows * cols < SERIAL_BELOW_WEIGHTS:
        return 1
    return max(1, min(threads, rows))


@njit(cache=True)  # not inlined: one compiled copy serves every 32-block format's driver
def _quantize_for_32(x, kind):
    if kind == KIND_Q4_1 or kind == KIND_Q5_1:
        return quantize_q8_1(x)
    xq, xd = quantize_q8_0(x)
    return xq, xd, xd  # no block sums for the Q8_0 family


@njit(parallel=True, cache=True)
def _matmul_32_avx2(raw, kind, block_bytes, x, out, threads):
    # One specialization per format, so its branches fold away. `literally` must not see a value from Python
    # (every call would re-run type inference), hence the per-format entry points below pass a constant.
    literally(kind)
    xq, xd, xs = _quantize_for_32(x, kind)
    rows = raw.shape[0]
    chunks = _n_chunks(rows, x.shape[1], threads)
    if chunks == 1:
        _rows_32(raw, kind, block_bytes, xq, xd, xs, out, 0, rows)
        return
    for c in prange(chunks):
        r0, r1 = _chunk_bounds(c, chunks, rows)
        _rows_32(raw, kind, block_bytes, xq, xd, xs, out, r0, r1)


@njit(cache=True)
def _matmul_q8_0_avx2(raw, x, out, threads):
    _matmul_32_avx2(raw, 0, 34, x, out, threads)  # KIND_Q8_0, block bytes


@njit(cache=True)
def _matmul_q4_0_avx2(raw, x, out, threads):
    _matmul_32_avx2(raw, 1, 18, x, out, threads)  # KIND_Q4_0


@njit(cache=True)
def _matmul_q4_1_avx2(raw, x, out, threads):
    _matmul_32_avx2(raw, 2, 20, x, out, threads)  # KIND_Q4_1


@njit(cache=True)
def _matmul_q5_0_avx2(raw, x, out, threads):
    _matmul_32_avx2(raw, 3, 22, x, out, threads)  # KIND_Q5_0


@njit(cache=True)
def _matmul_q5_1_avx2(raw, x, out, threads):
    _matmul_32_avx2(raw, 4, 24, x, out, threads)  # KIND_Q5_1


@njit(parallel=True, cache=True)
def _matmul_32_portable(raw, kind, block_bytes, x, out, threads):
    xq, xd, xs = _quantize_for_32(x, kind)
    rows = raw.shape[0]
    chunks = _n_chunks(rows, x.shape[1], threads)
    if chunks == 1:
        _rows_32_portable(raw, kind, block_bytes, xq, xd, xs, out, 0, rows)
        return
    for c in prange(chunks):
        r0, r1 = _chunk_bounds(c, chunks, rows)
        _rows_32_portable(raw, kind, block_bytes, xq, xd, xs, out, r0, r1)


@njit(parallel=True, cache=True)
def _matmul_k_portable(raw, qtype, block_bytes, x, out, threads):
    xq, xd, bsums = quantize_q8_K(x)
    rows = raw.shape[0]
    chunks = _n_chunks(rows, x.shape[1], threads)
    if chunks == 1:
        _rows_k_portable(raw, qtype, block_bytes, xq, xd, bsums, out, 0, rows)
        return
    for c in prange(chunks):
        r0, r1 = _chunk_bounds(c, chunks, rows)
        _rows_k_portable(raw, qtype, block_bytes, xq, xd, bsums, out, r0, r1)


@njit(parallel=True, cache=True)
def _matmul_q4_k_avx2(raw, x, out, threads):
    xq, xd, bsums = quantize_q8_K(x)
    rows = raw.shape[0]
    chunks = _n_chunks(rows, x.shape[1], threads)
    if chunks == 1:
        _rows_q4_k(raw, xq, xd, bsums, out, 0, rows)
        return
    for c in prange(chunks):
        r0, r1 = _chunk_bounds(c, chunks, rows)
        _rows_q4_k(raw, xq, xd, bsums, out, r0, r1)


@njit(parallel=True, cache=True)
def _matmul_q5_k_avx2(raw, x, out, threads):
    xq, xd, bsums = quantize_q8_K(x)
    rows = raw.shape[0]
    chunks = _n_chunks(rows, x.shape[1], threads)
    if chunks == 1:
        _rows_q5_k_avx2(raw, xq, xd, bsums, out, 0, rows)
        return
    for c in prange(chunks):
        r0, r1 = _chunk_bounds(c, chunks, rows)
        _rows_q5_k_avx2(raw, xq, xd, bsums, out, r0, r1)


@njit(parallel=True, cache=True)
def _matmul_q6_k_avx2(raw, x, out, threads):
    xq, xd, bsums = quantize_q8_K(x)
    rows = raw.shape[0]
    chunks = _n_chunks(rows, x.shape[1], threads)
    if chunks == 1:
        _rows_q6_k(raw, xq, xd, bsums, out, 0, rows)
        return
    for c in prange(chunks):
        r0, r1 = _chunk_bounds(c, chunks, rows)
        _rows_q6_k(raw, xq, xd, bsums, out, r0, r1)


@njit(parallel=True, cache=True)
def _matmul_q3_k_avx2(raw, x, out, threads):
    xq, xd, bsums = quantize_q8_K(x)
    rows = raw.shape[0]
    chunks = _n_chunks(rows, x.shape[1], threads)
    if chunks == 1:
        _rows_q3_k_avx2(raw, xq, xd, bsums, out, 0, rows)
        return
    for c in prange(chunks):
        r0, r1 = _chunk_bounds(c, chunks, rows)
        _rows_q3_k_avx2(raw, xq, xd, bsums, out, r0, r1)


@njit(parallel=True, cache=True)
def _matmul_q2_k_avx2(raw, x, out, threads):
    xq, xd, bsums = quantize_q8_K(x)
    rows = raw.shape[0]
    chunks = _n_chunks(rows, x.shape[1], threads)
    if chunks == 1:
        _rows_q2_k_avx2(raw, xq, xd, bsums, out, 0, rows)
        return
    for c in prange(chunks):
        r0, r1 = _chunk_bounds(c, chunks, rows)
        _rows_q2_k_avx2(raw, xq, xd, bsums, out, r0, r1)


# Several weights of one format applied to the same x (attention's Q, K, V; the FFN's gate and up) in one call:
# x is quantized once and all their rows share one parallel region, instead of a region (~10 us to wake the
# threads) and a quantization per weight. Each row is computed by the same row function as alone, so the
# outputs are bitwise those of separate calls.


@njit(cache=True)
def _multi_ranges(raws, c, chunks):
    """The part of weight w's rows that work share c of `chunks` covers: yields (w, r0, r1) over all weights'
    rows laid end to end."""
    total = 0
    for w in range(len(raws)):
        total += raws[w].shape[0]
    lo, hi = _chunk_bounds(c, chunks, total)
    ranges = []
    start = 0
    for w in range(len(raws)):
        rows = raws[w].shape[0]
        r0, r1 = max(lo - start, 0), min(hi - start, rows)
        if r0 < r1:
            ranges.append((w, r0, r1))
        start += rows
    return ranges, total


@njit(parallel=True, cache=True)
def _matmul_32_avx2_multi(raws, kind, block_bytes, x, outs, threads):
    literally(kind)
    xq, xd, xs = _quantize_for_32(x, kind)
    _, total = _multi_ranges(raws, 0, 1)
    chunks = _n_chunks(total, x.shape[1], threads)
    for c in prange(chunks):
        ranges, _ = _multi_ranges(raws, c, chunks)
        for w, r0, r1 in ranges:
            _rows_32(raws[w], kind, block_bytes, xq, xd, xs, outs[w], r0, r1)


@njit(parallel=True, cache=True)
def _matmul_k_avx2_multi(raws, qtype, x, outs, threads):
    literally(qtype)
    xq, xd, bsums = quantize_q8_K(x)
    _, total = _multi_ranges(raws, 0, 1)
    chunks = _n_chunks(total, x.shape[1], threads)
    for c in prange(chunks):
        ranges, _ = _multi_ranges(raws, c, chunks)
        for w, r0, r1 in ranges:
            if qtype == 12:  # Q4_K
                _rows_q4_k(raws[w], xq, xd, bsums, outs[w], r0, r1)
            elif qtype == 13:  # Q5_K
                _rows_q5_k_avx2(raws[w], xq, xd, bsums, outs[w], r0, r1)
            elif qtype == 14:  # Q6_K
                _rows_q6_k(raws[w], xq, xd, bsums, outs[w], r0, r1)
            elif qtype == 11:  # Q3_K
                _rows_q3_k_avx2(raws[w], xq, xd, bsums, outs[w], r0, r1)
            else:  # Q2_K
                _rows_q2_k_avx2(raws[w], xq, xd, bsums, outs[w], r0, r1)


# Entry points with the format as a constant (`literally` must not see a value from Python: every call would
# re-run type inference).
@njit(cache=True)
def _matmul_q8_0_avx2_multi(raws, x, outs, threads):
    _matmul_32_avx2_multi(raws, 0, 34, x, outs, threads)  # KIND_Q8_0, block bytes


@njit(cache=True)
def _matmul_q4_0_avx2_multi(raws, x, outs, threads):
    _matmul_32_avx2_multi(raws, 1, 18, x, outs, threads)


@njit(cache=True)
def _matmul_q4_1_avx2_multi(raws, x, outs, threads):
    _matmul_32_avx2_multi(raws, 2, 20, x, outs, threads)


@njit(cache=True)
def _matmul_q5_0_avx2_multi(raws, x, outs, threads):
    _matmul_32_avx2_multi(raws, 3, 22, x, outs, threads)


@njit(cache=True)
def _matmul_q5_1_avx2_multi(raws, x, outs, threads):
    _matmul_32_avx2_multi(raws, 4, 24, x, outs, threads)


@njit(cache=True)
def _matmul_q2_k_avx2_multi(raws, x, outs, threads):
    _matmul_k_avx2_multi(raws, 10, x, outs, threads)  # GGML type id


@njit(cache=True)
def _matmul_q3_k_avx2_multi(raws, x, outs, threads):
    _matmul_k_avx2_multi(raws, 11, x, outs, threads)


@njit(cache=True)
def _matmul_q4_k_avx2_multi(raws, x, outs, threads):
    _matmul_k_avx2_multi(raws, 12, x, outs, threads)


@njit(cache=True)
def _matmul_q5_k_avx2_multi(raws, x, outs, threads):
    _matmul_k_avx2_multi(raws, 13, x, outs, threads)


@njit(cache=True)
def _matmul_q6_k_avx2_multi(raws, x, outs, threads):
    _matmul_k_avx2_multi(raws, 14, x, outs, threads)


# Row ranges of the formats a model uses, for callers that split the work themselves (the fused forward,
# kernels/cpu/fused_forward.py): activations are quantized once per step (every family a layer's weights need),
# and `rows_avx2` computes out[:, r0:r1] with the same row functions as the drivers above, so results are bitwise
# theirs. Both take the model's `FormatSet` (kernels/cpu/format_set.py) first: their compiled code has branches
# for its formats only (smollm2's cold compile of the fused forward: 55 s with all ten formats, 37 s with its two).

ACT_Q8_0, ACT_Q8_1, ACT_Q8_K = 1, 2, 4  # activation families, as bits of a mask


def activation_family(qtype) -> int:
    """The activation family (ACT_*) that weights of `qtype` (or its tiled twin's kernel type) are multiplied
    with."""
    if int(qtype) >= 100:  # tiled Q4_0 / Q5_0 / Q8_0 (kernels/cpu/tiled.py), Q4_K / Q6_K (tiled_k.py)
        return ACT_Q8_K if int(qtype) - 100 in _tiled_k.KIND.values() else ACT_Q8_0
    qtype = GGMLQuantizationType(qtype)
    if qtype in (Q.Q4_1, Q.Q5_1):
        return ACT_Q8_1
    return ACT_Q8_0 if qtype in _KIND_32 else ACT_Q8_K


def quantize_activations(formats, x, families):
    """x quantized for every family in the mask `families` (of those `formats` can need); missing ones are empty
    arrays of the right types. Returns (q8_0 quants, scales, q8_1 quants, scales, sums, q8_K quants, scales,
    16-sums). Jitted code only."""
    raise TypeError("quantize_activations is called from compiled code only")


@overload(quantize_activations)
def _quantize_activations_for(formats, x, families):
    if not isinstance(formats, FormatSetType):
        return None
    needed = 0
    for qtype in list(SUPPORTED) + [100 + int(q) for q in (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q6_K)]:
        if formats.has(qtype):
            needed |= activation_family(qtype)
    # Constants of the closure: Numba prunes the branches they rule out before typing them.
    a0, a1, ak = bool(needed & ACT_Q8_0), bool(needed & ACT_Q8_1), bool(needed & ACT_Q8_K)

    def impl(formats, x, families):
        n = x.shape[0]
        q0, d0 = np.empty((n, 0), np.int8), np.empty((n, 0), np.float32)
        q1, d1, s1 = q0, d0, d0
        qk, dk, bk = q0, d0, np.empty((n, 0), np.int16)
        if a0:
            if families & ACT_Q8_0:
                q0, d0 = quantize_q8_0(x)
        if a1:
            if families & ACT_Q8_1:
                q1, d1, s1 = quantize_q8_1(x)
        if ak:
            if families & ACT_Q8_K:
                qk, dk, bk = quantize_q8_K(x)
        return q0, d0, q1, d1, s1, qk, dk, bk

    return impl


def rows_avx2(formats, raw, qtype, acts, out, r0, r1):
    """out[:, r0:r1] = x @ W[r0:r1].T for W = raw in format `qtype` (GGML type id, one of `formats`), x given as
    `acts` (quantize_activations with this format's family). Jitted code only."""
    raise TypeError("rows_avx2 is called from compiled code only")


@overload(rows_avx2)
def _rows_avx2_for(formats, raw, qtype, acts, out, r0, r1):
    if not isinstance(formats, FormatSetType):
        return None
    q8_0, q4_0, q4_1, q5_0, q5_1 = (formats.has(q) for q in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1))
    q2_k, q3_k, q4_k, q5_k, q6_k = (formats.has(q) for q in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K))
    # tiled twins (kernels/cpu/tiled.py): kernel type 100 + the GGML type
    t8_0, t4_0, t5_0 = (formats.has(100 + int(q)) for q in (Q.Q8_0, Q.Q4_0, Q.Q5_0))
    t4_k, t6_k = (formats.has(100 + int(q)) for q in (Q.Q4_K, Q.Q6_K))

    def impl(formats, raw, qtype, acts, out, r0, r1):
        q0, d0, q1, d1, s1, qk, dk, bk = acts
        if t4_k:
            if qtype == 112:
                tiled_k_rows(raw, 12, qk, dk, bk, out, r0, r1)
        if t6_k:
            if qtype == 114:
                tiled_k_rows(raw, 14, qk, dk, bk, out, r0, r1)
        if t8_0:
            if qtype == 108:
                tiled_rows(raw, 0, q0, d0, out, r0, r1)
        if t4_0:
            if qtype == 102:
                tiled_rows(raw, 1, q0, d0, out, r0, r1)
        if t5_0:
            if qtype == 106:
                tiled_rows(raw, 3, q0, d0, out, r0, r1)
        if q8_0:
            if qtype == 8:
                _rows_32(raw, 0, 34, q0, d0, d0, out, r0, r1)
        if q4_0:
            if qtype == 2:
                _rows_32(raw, 1, 18, q0, d0, d0, out, r0, r1)
        if q4_1:
            if qtype == 3:
                _rows_32(raw, 2, 20, q1, d1, s1, out, r0, r1)
        if q5_0:
            if qtype == 6:
                _rows_32(raw, 3, 22, q0, d0, d0, out, r0, r1)
        if q5_1:
            if qtype == 7:
                _rows_32(raw, 4, 24, q1, d1, s1, out, r0, r1)
        if q4_k:
            if qtype == 12:
                _rows_q4_k(raw, qk, dk, bk, out, r0, r1)
        if q5_k:
            if qtype == 13:
                _rows_q5_k_avx2(raw, qk, dk, bk, out, r0, r1)
        if q6_k:
            if qtype == 14:
                _rows_q6_k(raw, qk, dk, bk, out, r0, r1)
        if q3_k:
            if qtype == 11:
                _rows_q3_k_avx2(raw, qk, dk, bk, out, r0, r1)
        if q2_k:
            if qtype == 10:
                _rows_q2_k_avx2(raw, qk, dk, bk, out, r0, r1)

    return impl


# ---------------------------------------------------------------------------------------------------------------
# Weights in 16-row tiles (kernels/cpu/tiled.py): the drivers; the row kernels are tiled.py's
# ---------------------------------------------------------------------------------------------------------------

@njit(cache=True)
def _tiled_range(raws, kind, xq, xd, bsums, outs, lo, hi):
    """Tiles lo..hi of several tiled weights laid end to end: tiled.py's row kernel, or tiled_k.py's (kind 12 and
    14, with the Q8_K activations' 16-sums)."""
    start = 0
    for w in range(len(raws)):
        tiles = raws[w].shape[0] // _TILE
        t0, t1 = max(lo - start, 0), min(hi - start, tiles)
        if t0 < t1:
            if kind >= 12:
                tiled_k_rows(raws[w], kind, xq, xd, bsums, outs[w], _TILE * t0, _TILE * t1)
            else:
                tiled_rows(raws[w], kind, xq, xd, outs[w], _TILE * t0, _TILE * t1)
        start += tiles


@njit(parallel=True, cache=True)
def _tiled_matmul_many(raws, kind, xq, xd, bsums, outs, chunks):
    """Tiled weights of one format on one x, their tiles laid end to end and cut into `chunks` (one: no parallel
    region, for the small weights)."""
    literally(kind)
    total = 0
    for w in range(len(raws)):
        total += raws[w].shape[0] // _TILE
    if chunks == 1:
        _tiled_range(raws, kind, xq, xd, bsums, outs, 0, total)
        return
    for c in prange(chunks):
        _tiled_range(raws, kind, xq, xd, bsums, outs, c * total // chunks, (c + 1) * total // chunks)


# One compiled driver per format (the kind a literal):
@njit(cache=True)
def _tiled_matmul_q8_0(raws, xq, xd, bsums, outs, chunks):
    _tiled_matmul_many(raws, 0, xq, xd, bsums, outs, chunks)


@njit(cache=True)
def _tiled_matmul_q4_0(raws, xq, xd, bsums, outs, chunks):
    _tiled_matmul_many(raws, 1, xq, xd, bsums, outs, chunks)


@njit(cache=True)
def _tiled_matmul_q5_0(raws, xq, xd, bsums, outs, chunks):
    _tiled_matmul_many(raws, 3, xq, xd, bsums, outs, chunks)


@njit(cache=True)
def _tiled_matmul_q4_k(raws, xq, xd, bsums, outs, chunks):
    _tiled_matmul_many(raws, 12, xq, xd, bsums, outs, chunks)


@njit(cache=True)
def _tiled_matmul_q6_k(raws, xq, xd, bsums, outs, chunks):
    _tiled_matmul_many(raws, 14, xq, xd, bsums, outs, chunks)


_TILED = {Q.Q8_0: _tiled_matmul_q8_0, Q.Q4_0: _tiled_matmul_q4_0, Q.Q5_0: _tiled_matmul_q5_0,
          Q.Q4_K: _tiled_matmul_q4_k, Q.Q6_K: _tiled_matmul_q6_k}
_NO_SUMS = np.empty((0, 0), np.int16)  # the 32-block formats' activations carry no 16-sums


def _tiled_chunks(tiles: int, cols: int, threads: int) -> int:
    if tiles * _TILE * cols < SERIAL_BELOW_WEIGHTS:
        return 1
    return max(1, min(threads, tiles))


def bind_tiled(raw: np.ndarray, qtype):
    """`bind` for a weight in 16-row tiles (kernels/cpu/tiled.py, tiled_k.py)."""
    many = bind_many_tiled([raw], qtype)
    return lambda x, out, threads: many(x, (out,), threads)


def bind_many_tiled(raws: list[np.ndarray], qtype):
    """`kernel(x, outs, n_threads)` for several tiled weights of one format and width on one x."""
    qtype = Q(qtype)
    many = _TILED[qtype]
    raws = tuple(raws)
    size, block_bytes = GGML_QUANT_SIZES[qtype]
    tiles = sum(r.shape[0] for r in raws) // _TILE
    cols = raws[0].shape[1] // block_bytes * size
    k_quant = qtype in _tiled_k.KIND

    def kernel(x, outs, threads):
        if k_quant:
            xq, xd, bsums = quantize_q8_K(x)
        else:
            (xq, xd), bsums = quantize_q8_0(x), _NO_SUMS
        many(raws, xq, xd, bsums, tuple(outs), _tiled_chunks(tiles, cols, threads))

    return kernel


def matmul_tiled_portable(raw: np.ndarray, qtype, x: np.ndarray, out: np.ndarray) -> None:
    """The oracle: rows_portable over all rows, one thread."""
    if Q(qtype) in _tiled_k.KIND:
        xq, xd, bsums = quantize_q8_K(np.ascontiguousarray(x, dtype=np.float32))
        _tiled_k.rows_portable(raw, _tiled_k.KIND[Q(qtype)], xq, xd, bsums, out, 0, raw.shape[0])
        return
    xq, xd = quantize_q8_0(np.ascontiguousarray(x, dtype=np.float32))
    _tiled.rows_portable(raw, _tiled.KIND[Q(qtype)], xq, xd, out, 0, raw.shape[0])


# Built with simd.py's intrinsics: recompile when that file changes (see kernels.cpu.forget_stale_cache).
forget_stale_cache(__file__, _matmul_q8_0_avx2._cache.cache_path, [simd.__file__, _tiled.__file__, _tiled_k.__file__])

# ---------------------------------------------------------------------------------------------------------------
# Public interface (called by kernels.ops.matmul)
# ---------------------------------------------------------------------------------------------------------------

_KIND_32 = {Q.Q8_0: KIND_Q8_0, Q.Q4_0: KIND_Q4_0, Q.Q4_1: KIND_Q4_1, Q.Q5_0: KIND_Q5_0, Q.Q5_1: KIND_Q5_1}
_AVX2 = {
    Q.Q8_0: _matmul_q8_0_avx2,
    Q.Q4_0: _matmul_q4_0_avx2,
    Q.Q4_1: _matmul_q4_1_avx2,
    Q.Q5_0: _matmul_q5_0_avx2,
    Q.Q5_1: _matmul_q5_1_avx2,
    Q.Q2_K: _matmul_q2_k_avx2,
    Q.Q3_K: _matmul_q3_k_avx2,
    Q.Q4_K: _matmul_q4_k_avx2,
    Q.Q5_K: _matmul_q5_k_avx2,
    Q.Q6_K: _matmul_q6_k_avx2,
}

_AVX2_MULTI = {
    Q.Q8_0: _matmul_q8_0_avx2_multi,
    Q.Q4_0: _matmul_q4_0_avx2_multi,
    Q.Q4_1: _matmul_q4_1_avx2_multi,
    Q.Q5_0: _matmul_q5_0_avx2_multi,
    Q.Q5_1: _matmul_q5_1_avx2_multi,
    Q.Q2_K: _matmul_q2_k_avx2_multi,
    Q.Q3_K: _matmul_q3_k_avx2_multi,
    Q.Q4_K: _matmul_q4_k_avx2_multi,
    Q.Q5_K: _matmul_q5_k_avx2_multi,
    Q.Q6_K: _matmul_q6_k_avx2_multi,
}

SUPPORTED: frozenset[GGMLQuantizationType] = frozenset(_AVX2)
USES_AVX2: bool = HAVE_AVX2  # which path `matmul` takes on this machine


def _checked(raw: np.ndarray, qtype, x: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate the contract; return raw as a read-only view (one compiled variant), x C-contiguous, block bytes."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED:
        raise ValueError(f"quant_dot has no kernel for {qtype.name}")
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.strides[1] != 1:
        raise ValueError(f"raw must be uint8 (rows, row_bytes) with contiguous rows, got {raw.dtype} {raw.shape}")
    if x.dtype != np.float32 or x.ndim != 2:
        raise ValueError(f"x must be float32 (n, cols), got {x.dtype} {x.shape}")
    n, cols = x.shape
    rows, row_bytes = raw.shape
    if cols % block_size or row_bytes != cols // block_size * block_bytes:
        raise ValueError(f"{qtype.name} rows of {row_bytes} bytes do not hold {cols} columns")
    if out.dtype != np.float32 or out.shape != (n, rows):
        raise ValueError(f"out must be float32 {(n, rows)}, got {out.dtype} {out.shape}")
    if raw.flags.writeable:
        raw = raw.view()
        raw.flags.writeable = False
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    return raw, x, block_bytes


def matmul(raw: np.ndarray, qtype, x: np.ndarray, out: np.ndarray) -> None:
    """out = x @ W.T for W = `raw` in GGUF format `qtype`, with x quantized to 8 bits like llama.cpp does.

    raw: uint8 (rows, row_bytes), read in place (never copied); x: float32 (n, cols), n small; out: float32 (n, rows).
    Uses the AVX2 kernels when the CPU (as Numba targets it) has AVX2+FMA+F16C, else the portable ones; the two
    give bit-identical results.
    """
    if USES_AVX2:
        matmul_avx2(raw, qtype, x, out)
    else:
        matmul_portable(raw, qtype, x, out)


def bind(raw: np.ndarray, qtype):
    """Validate a weight once and return `kernel(x, out, n_threads)` for it.

    The per-token path calls hundreds of matmuls; checking the contract, converting the enum and asking Numba
    for its thread count on every call cost ~15 us each (measured), as much as a small matmul itself.
    """
    rows, row_bytes = raw.shape
    block_size, _ = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    cols = row_bytes // GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1] * block_size
    probe_x, probe_out = np.zeros((1, cols), np.float32), np.zeros((1, rows), np.float32)
    raw, _, block_bytes = _checked(raw, qtype, probe_x, probe_out)
    qtype = GGMLQuantizationType(qtype)
    if USES_AVX2:
        return functools.partial(_AVX2[qtype], raw)
    kind = _KIND_32.get(qtype)
    if kind is not None:
        return lambda x, out, threads: _matmul_32_portable(raw, kind, block_bytes, x, out, threads)
    return lambda x, out, threads: _matmul_k_portable(raw, int(qtype), block_bytes, x, out, threads)


def bind_many(raws: list[np.ndarray], qtype):
    """`kernel(x, outs, n_threads)` applying several weights of one format (same columns) to one x in a single
    call, or None where there is no such kernel (the portable path: callers then make one call per weight)."""
    if not USES_AVX2 or len(raws) < 2:
        return None
    qtype = GGMLQuantizationType(qtype)
    checked = []
    for raw in raws:
        rows, row_bytes = raw.shape
        block_size, block_bytes = GGML_QUANT_SIZES[qtype]
        cols = row_bytes // block_bytes * block_size
        raw, _, _ = _checked(raw, qtype, np.zeros((1, cols), np.float32), np.zeros((1, rows), np.float32))
        checked.append(raw)
    if len({r.shape[1] for r in checked}) != 1:
        return None
    return functools.partial(_AVX2_MULTI[qtype], tuple(checked))


def matmul_avx2(raw: np.ndarray, qtype, x: np.ndarray, out: np.ndarray) -> None:
    """`matmul` through the AVX2 kernels (only valid where simd.HAVE_AVX2)."""
    raw, x, _ = _checked(raw, qtype, x, out)
    _AVX2[qtype](raw, x, out, get_num_threads())


def matmul_portable(raw: np.ndarray, qtype, x: np.ndarray, out: np.ndarray) -> None:
    """`matmul` through the plain-loop kernels: same integers and float operations, any CPU."""
    raw, x, block_bytes = _checked(raw, qtype, x, out)
    kind = _KIND_32.get(qtype)
    if kind is not None:
        _matmul_32_portable(raw, kind, block_bytes, x, out, get_num_threads())
    else:
        _matmul_k_portable(raw, int(qtype), block_bytes, x, out, get_num_threads())
