"""Attention over the paged KV cache, and writing K/V rows into it, compiled with Numba.

Reading the cache through its block table means no gather copy of the keys, whatever the layout (one run of
blocks for a lone sequence, scattered blocks once sequences share a pool), and one call per layer instead of a
dozen numpy operations (which cost as much as the matrix products of a small model at decode).

Batch invariance: each (query, head) is computed alone, by the same sequence of float operations over its
visible keys in position order, whatever else is in the call. A prompt split into chunks, a speculative verify
of k tokens and a server batch therefore give bitwise what one token at a time gives.

Storage (see localllm/runtime/kv_cache.py): per layer, keys (n_kv, S, head_dim) and values (n_kv, S, value_dim),
float32, or int8 with a float32 scale per 32 values (`q8_0`: ggml's block_q8_0 rounding, with the scale kept
in float32, since these bytes never leave the process);
`*_scale` arrays have a last axis of 0 for float32 storage. Column c of block b is b * BLOCK + c.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from localllm.kernels.cpu import forget_stale_cache, simd
from localllm.kernels.cpu.simd import (HAVE_AVX2, HAVE_AVX512, add_ps, address_of, bits_to_float, fmadd_ps,
                                       fmadd_ps_512, high_ps_256, hmax_float_8, hsum_float_8, load_cvtepi8_ps,
                                       load_cvtepi8_ps_512, loadu_ps, loadu_ps_512, low_ps_256, m256, max_ps, mul_ps,
                                       mul_ps_512, set1_ps, set1_ps_512, setzero_ps, setzero_ps_512, storeu_ps,
                                       storeu_ps_512, sub_ps)

BLOCK = 16  # tokens per KV block (localllm.runtime.kv_cache.BLOCK, which imports this)
QBLOCK = 32  # values per q8_0 scale
PARALLEL_MIN_WORK = 1 << 18  # (query, head, key, dim) products below which waking a second thread costs more


@njit(cache=True)
def write_rows(store, scales, cols, x):
    """store[h, cols[i], :] = x[i, h, :] (x: (n, n_kv, dim) float32), quantized to q8_0 when `scales` has a
    non-empty last axis (ggml's quantize_row_q8_0: d = amax / 127, q = round(x / d))."""
    n, n_kv, dim = x.shape
    quantized = scales.shape[2] > 0
    for i in range(n):
        c = cols[i]
        for h in range(n_kv):
            if not quantized:
                for t in range(dim):
                    store[h, c, t] = x[i, h, t]
                continue
            for b in range(dim // QBLOCK):
                amax = np.float32(0.0)
                for t in range(b * QBLOCK, (b + 1) * QBLOCK):
                    amax = max(amax, abs(x[i, h, t]))
                d = amax / np.float32(127.0)
                inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
                scales[h, c, b] = d
                for t in range(b * QBLOCK, (b + 1) * QBLOCK):
                    store[h, c, t] = np.int8(np.rint(x[i, h, t] * inv))


@njit(cache=True)
def read_rows(store, scales, cols, out):
    """out[h, i, :] = store[h, cols[i], :] as float32 (dequantized for q8_0)."""
    n_kv, _, dim = store.shape
    quantized = scales.shape[2] > 0
    for h in range(n_kv):
        for i in range(cols.shape[0]):
            c = cols[i]
            for t in range(dim):
                v = np.float32(store[h, c, t])
                out[h, i, t] = v * scales[h, c, t // QBLOCK] if quantized else v


@njit(cache=True)
def _exp_nonpositive(x):
    """exp(x) for x <= 0 (a softmax's scores minus their max) in float32 operations, Cephes' expf: within 2 ulp
    of libm, and a loop of it vectorises, where a call to expf per score cost as much as the score's dot product.
    Below -87 the result is 2^-126-ish instead of a denormal: nothing a softmax weight can notice. The kernels
    pass a float32 x (float32 scores minus a float32 maximum): the exponentials, 16 to a zmm, were 14% of a
    prompt chunk's attention at depth while they ran in float64 (8 to a zmm), as a float64 maximum made them."""
    x = max(np.float32(x), np.float32(-87.0))
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    return p * bits_to_float((np.int32(n) + np.int32(127)) << np.int32(23))


_I32, _F32, _F64 = ir.IntType(32), ir.FloatType(), ir.DoubleType()


def _exp_codegen(lanes):
    def codegen(context, builder, signature, args):
        vf = ir.VectorType(_F32, lanes)
        vi = ir.VectorType(_I32, lanes)

        def const(value):
            return ir.Constant(vf, [float(np.float32(value))] * lanes)

        m = context.cast(builder, args[1], signature.args[1], types.float32)
        splat = builder.insert_element(ir.Constant(vf, ir.Undefined), m, ir.Constant(_I32, 0))
        splat = builder.shuffle_vector(splat, splat, ir.Constant(vi, [0] * lanes))
        x = builder.fsub(args[0], splat)
        low = const(-87.0)
        x = builder.select(builder.fcmp_ordered("<", x, low), low, x)
        t = builder.fadd(builder.fmul(x, const(1.44269504088896341)), const(0.5))
        floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf]), f"llvm.floor.v{lanes}f32")
        n = builder.call(floor, [t])
        r = builder.fsub(builder.fsub(x, builder.fmul(n, const(0.693359375))), builder.fmul(n, const(-2.12194440e-4)))
        p = const(1.9875691500e-4)
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = builder.fadd(builder.fmul(p, r), const(c))
        p = builder.fadd(builder.fadd(builder.fmul(p, builder.fmul(r, r)), r), const(1.0))
        bits = builder.shl(builder.add(builder.fptosi(n, vi), ir.Constant(vi, [127] * lanes)),
                           ir.Constant(vi, [23] * lanes))
        return builder.fmul(p, builder.bitcast(bits, vf))

    return codegen


@intrinsic
def exp_nonpositive_8(typingctx, x, m):
    """[_exp_nonpositive(x[k] - m) for the 8 lanes of x], m taken as float32: the same float32 operations in the
    same order, in vector registers (LLVM leaves the scalar loop unvectorised)."""
    if x != m256 or not isinstance(m, types.Float):
        return None
    return m256(x, m), _exp_codegen(8)


@intrinsic
def exp_nonpositive_16(typingctx, x, m):
    """exp_nonpositive_8 on the 16 lanes of a zmm."""
    if x != simd.m512 or not isinstance(m, types.Float):
        return None
    return simd.m512(x, m), _exp_codegen(16)


@njit(cache=True)
def _softmax_weights(scores, count, m):
    """scores[:count] = exp(scores - m), m taken as float32, returning their sum, added in position order. Two
    loops: the exponentials 16 or 8 at a time (exp_nonpositive_16/_8, the scalar function's operations lane by
    lane), then the sum in its order (no fastmath: every element is computed by the same operations, vector lane
    or not)."""
    mf = np.float32(m)
    j = 0
    if HAVE_AVX2:
        a = address_of(scores)
        while HAVE_AVX512 and j + 16 <= count:
            storeu_ps_512(a + 4 * j, exp_nonpositive_16(loadu_ps_512(a + 4 * j), mf))
            j += 16
        while j + 8 <= count:
            storeu_ps(a + 4 * j, exp_nonpositive_8(loadu_ps(a + 4 * j), mf))
            j += 8
    while j < count:
        scores[j] = _exp_nonpositive(scores[j] - mf)
        j += 1
    total = np.float32(0.0)
    for j in range(count):
        total += scores[j]
    return total


@njit(cache=True)
def _soft_cap(scores, count, cap):
    """scores[:count] = tanh(s / cap) * cap (gemma2's attention logit soft-capping), returning their maximum.
    Every path (scalar, AVX2, grouped; the fused forward) caps its scores here, after scaling and before the
    softmax, so they stay bitwise alike; cap 0 (every other model) never calls it."""
    m = -np.inf
    for j in range(count):
        s = np.float32(np.tanh(scores[j] / cap)) * cap
        scores[j] = s
        m = max(m, s)
    return m


@njit(cache=True)
def _column(table, first_block, pos):
    return table[pos // BLOCK - first_block] * BLOCK + pos % BLOCK


@njit(cache=True, fastmath={"contract", "reassoc", "nsz", "arcp"})
def _one_query(q, i, h, kvh, k_store, k_scale, v_store, v_scale, table, first_block, lo, hi, scale, softcap, scores,
               acc, out):
    """Softmax(q . K / sqrt(d)) V for query row i, head h, over keys at positions lo..hi (inclusive).

    fastmath lets LLVM vectorise the dot products and the V accumulation; the operation order still depends
    only on (lo, hi, dims), never on the other queries, which is what batch invariance needs.
    """
    d = q.shape[2]
    dv = v_store.shape[2]
    quantized = k_scale.shape[2] > 0
    m = -np.inf
    for j in range(hi - lo + 1):
        c = _column(table, first_block, lo + j)
        s = np.float32(0.0)
        if quantized:
            for b in range(d // QBLOCK):
                sb = np.float32(0.0)
                for t in range(b * QBLOCK, (b + 1) * QBLOCK):
                    sb += q[i, h, t] * np.float32(k_store[kvh, c, t])
                s += sb * k_scale[kvh, c, b]
        else:
            for t in range(d):
                s += q[i, h, t] * k_store[kvh, c, t]
        s *= scale
        scores[j] = s
        m = max(m, s)
    if softcap > 0:
        m = _soft_cap(scores, hi - lo + 1, softcap)
    total = _softmax_weights(scores, hi - lo + 1, m)
    acc[:dv] = 0.0
    for j in range(hi - lo + 1):
        c = _column(table, first_block, lo + j)
        w = scores[j]
        if quantized:
            for b in range(dv // QBLOCK):
                wb = w * v_scale[kvh, c, b]
                for t in range(b * QBLOCK, (b + 1) * QBLOCK):
                    acc[t] += wb * np.float32(v_store[kvh, c, t])
        else:
            for t in range(dv):
                acc[t] += w * v_store[kvh, c, t]
    inv = np.float32(1.0) / total
    for t in range(dv):
        out[i, h * dv + t] = acc[t] * inv


@njit(cache=True)
def _one_query_avx2(q, i, h, kvh, k_store, v_store, table, first_block, lo, hi, scale, softcap, scores, out):
    """_one_query for float32 storage with head sizes that are multiples of 32, in explicit AVX2 registers:
    two accumulators per dot product (summed in ggml's hsum order), four for the weighted sum of values, so
    no loop is bound by a chain of dependent FMAs."""
    d = q.shape[2]
    dv = v_store.shape[2]
    qa = address_of(q) + (i * q.shape[1] + h) * d * 4
    k_row = k_store.shape[2] * 4
    ka0 = address_of(k_store) + kvh * k_store.shape[1] * k_row
    v_row = dv * 4
    va0 = address_of(v_store) + kvh * v_store.shape[1] * v_row
    m = -np.inf
    for j in range(hi - lo + 1):
        ka = ka0 + _column(table, first_block, lo + j) * k_row
        a0, a1 = setzero_ps(), setzero_ps()
        for t in range(0, d, 16):
            a0 = fmadd_ps(loadu_ps(qa + 4 * t), loadu_ps(ka + 4 * t), a0)
            a1 = fmadd_ps(loadu_ps(qa + 4 * t + 32), loadu_ps(ka + 4 * t + 32), a1)
        s = (hsum_float_8(a0) + hsum_float_8(a1)) * scale
        scores[j] = s
        m = max(m, s)
    if softcap > 0:
        m = _soft_cap(scores, hi - lo + 1, softcap)
    total = _softmax_weights(scores, hi - lo + 1, m)
    inv = set1_ps(np.float32(1.0) / total)
    zero = setzero_ps()
    oa = address_of(out) + (i * out.shape[1] + h * dv) * 4
    for t in range(0, dv, 32):
        a0, a1, a2, a3 = setzero_ps(), setzero_ps(), setzero_ps(), setzero_ps()
        for j in range(hi - lo + 1):
            va = va0 + _column(table, first_block, lo + j) * v_row + 4 * t
            w = set1_ps(scores[j])
            a0 = fmadd_ps(w, loadu_ps(va), a0)
            a1 = fmadd_ps(w, loadu_ps(va + 32), a1)
            a2 = fmadd_ps(w, loadu_ps(va + 64), a2)
            a3 = fmadd_ps(w, loadu_ps(va + 96), a3)
        storeu_ps(oa + 4 * t, fmadd_ps(a0, inv, zero))
        storeu_ps(oa + 4 * t + 32, fmadd_ps(a1, inv, zero))
        storeu_ps(oa + 4 * t + 64, fmadd_ps(a2, inv, zero))
        storeu_ps(oa + 4 * t + 96, fmadd_ps(a3, inv, zero))


TILE_BYTES = 16384  # keys (or values) of one tile: a group's heads reread them from L1


def _lanes(*idx):
    return ir.Constant(ir.VectorType(_I32, len(idx)), list(idx))


@intrinsic
def hsum_float_8x8(typingctx, a0, a1, a2, a3, a4, a5, a6, a7):
    """[hsum_float_8(a0), ..., hsum_float_8(a7)] as one vector: each lane is added up in exactly hsum_float_8's
    order, ((x0+x4)+(x2+x6)) + ((x1+x5)+(x3+x7)), by 7 vector additions instead of 8 x 7 scalar ones."""
    if not all(a == m256 for a in (a0, a1, a2, a3, a4, a5, a6, a7)):
        return None

    def codegen(context, builder, signature, args):
        def add(x, y, left, right):
            return builder.fadd(builder.shuffle_vector(x, y, left), builder.shuffle_vector(x, y, right))

        # x_i + x_{i+4} for two vectors at a time; then (s0 + s2), (s1 + s3); then the two halves.
        halves = [add(args[k], args[k + 1], _lanes(0, 1, 2, 3, 8, 9, 10, 11), _lanes(4, 5, 6, 7, 12, 13, 14, 15))
                  for k in (0, 2, 4, 6)]
        pairs = [add(halves[k], halves[k + 1], _lanes(0, 1, 4, 5, 8, 9, 12, 13), _lanes(2, 3, 6, 7, 10, 11, 14, 15))
                 for k in (0, 2)]
        return add(pairs[0], pairs[1], _lanes(0, 2, 4, 6, 8, 10, 12, 14), _lanes(1, 3, 5, 7, 9, 11, 13, 15))

    return m256(a0, a1, a2, a3, a4, a5, a6, a7), codegen


def _sum_16x16_plan():
    """The shuffles of hsum_float_16x16: per level, per output vector, the lanes (of the two input vectors side by
    side, 0-31) whose pairwise sums it holds. A term is (accumulator, level, index); level 0's are the lanes."""
    def operands(level, a, k):  # the two terms that make term k of accumulator a at `level`
        if level == 1:  # x_i + x_{i+4} within each 8-lane half: k = 4h + i
            h, i = divmod(k, 4)
            return (a, 0, 8 * h + i), (a, 0, 8 * h + i + 4)
        if level == 2:  # y_i + y_{i+2}: k = 2h + i
            h, i = divmod(k, 2)
            return (a, 1, 4 * h + i), (a, 1, 4 * h + i + 2)
        if level == 3:  # z_0 + z_1: the half's sum, k = h
            return (a, 2, 2 * k), (a, 2, 2 * k + 1)
        return (a, 3, 0), (a, 3, 1)  # level 4: the low half's sum + the high half's
    per_acc = {1: 8, 2: 4, 3: 2, 4: 1}
    vectors = [[(a, 0, lane) for lane in range(16)] for a in range(16)]
    plan = []
    for level in (1, 2, 3, 4):
        out_vectors, shuffles = [], []
        for v in range(0, len(vectors), 2):
            where = {term: n for n, term in enumerate(vectors[v] + vectors[v + 1])}
            accs = sorted({t[0] for t in vectors[v] + vectors[v + 1]})
            terms = [(a, level, k) for a in accs for k in range(per_acc[level])]
            assert len(terms) == 16
            left = [where[operands(level, a, k)[0]] for a, _, k in terms]
            right = [where[operands(level, a, k)[1]] for a, _, k in terms]
            out_vectors.append(terms)
            shuffles.append((left, right))
        vectors = out_vectors
        plan.append(shuffles)
    assert vectors == [[(a, 4, 0) for a in range(16)]]
    return plan


_SUM_16X16 = _sum_16x16_plan()


@intrinsic
def hsum_float_16x16(typingctx, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    """Lane k = hsum_float_8(low 8 lanes of a_k) + hsum_float_8(high 8 lanes of a_k), each added in exactly
    that order ((x0+x4)+(x2+x6)) + ((x1+x5)+(x3+x7)) per half, then the halves: the same sums _finish_8 makes
    of a zmm accumulator, for sixteen of them at once by 15 vector additions (two lane shuffles each), where
    _finish_8 takes 7 per 8-lane half and an extract per accumulator (about 52 operations for eight scores
    against 23). With d = 64 a score is four FMAs, so the sums were most of the scores' work."""
    args_ = (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)
    if not all(a == simd.m512 for a in args_):
        return None

    def codegen(context, builder, signature, args):
        vectors = list(args)
        for level in _SUM_16X16:
            vectors = [builder.fadd(builder.shuffle_vector(vectors[2 * n], vectors[2 * n + 1], _lanes(*left)),
                                    builder.shuffle_vector(vectors[2 * n], vectors[2 * n + 1], _lanes(*right)))
                       for n, (left, right) in enumerate(level)]
        return vectors[0]

    return simd.m512(*args_), codegen


@njit(cache=True)
def _dot_scaled(qa, ka, d, scale):
    """One key's score as _one_query_avx2 computes it."""
    a0, a1 = setzero_ps(), setzero_ps()
    for t in range(0, d, 16):
        a0 = fmadd_ps(loadu_ps(qa + 4 * t), loadu_ps(ka + 4 * t), a0)
        a1 = fmadd_ps(loadu_ps(qa + 4 * t + 32), loadu_ps(ka + 4 * t + 32), a1)
    return (hsum_float_8(a0) + hsum_float_8(a1)) * scale


@njit(cache=True)
def _finish_8(b0, b1, b2, b3, b4, b5, b6, b7, scale_v, out_address):
    """_scores_8's last step: eight keys' zmm accumulators (two 8-lane halves each) to their scaled scores."""
    sx = hsum_float_8x8(low_ps_256(b0), low_ps_256(b1), low_ps_256(b2), low_ps_256(b3), low_ps_256(b4),
                        low_ps_256(b5), low_ps_256(b6), low_ps_256(b7))
    sy = hsum_float_8x8(high_ps_256(b0), high_ps_256(b1), high_ps_256(b2), high_ps_256(b3), high_ps_256(b4),
                        high_ps_256(b5), high_ps_256(b6), high_ps_256(b7))
    storeu_ps(out_address, mul_ps(add_ps(sx, sy), scale_v))


@njit(cache=True)
def _scores_8(qa, rows, j, d, scale_v, out_address):
    """The scores of the keys whose rows are at addresses rows[j .. j + 7], as _dot_scaled computes each: the
    eight dot products run side by side (independent chains of FMAs) and their two accumulators are added up
    in hsum_float_8's order, in vector registers."""
    k0, k1, k2, k3 = rows[j], rows[j + 1], rows[j + 2], rows[j + 3]
    k4, k5, k6, k7 = rows[j + 4], rows[j + 5], rows[j + 6], rows[j + 7]
    if HAVE_AVX512:  # each key's two 8-lane accumulators as one zmm (lanes 0-7 and 8-15): the same lanes' FMAs
        w = setzero_ps_512()
        b0, b1, b2, b3, b4, b5, b6, b7 = w, w, w, w, w, w, w, w
        for t in range(0, d, 16):
            qv = loadu_ps_512(qa + 4 * t)
            o = 4 * t
            b0 = fmadd_ps_512(qv, loadu_ps_512(k0 + o), b0)
            b1 = fmadd_ps_512(qv, loadu_ps_512(k1 + o), b1)
            b2 = fmadd_ps_512(qv, loadu_ps_512(k2 + o), b2)
            b3 = fmadd_ps_512(qv, loadu_ps_512(k3 + o), b3)
            b4 = fmadd_ps_512(qv, loadu_ps_512(k4 + o), b4)
            b5 = fmadd_ps_512(qv, loadu_ps_512(k5 + o), b5)
            b6 = fmadd_ps_512(qv, loadu_ps_512(k6 + o), b6)
            b7 = fmadd_ps_512(qv, loadu_ps_512(k7 + o), b7)
        _finish_8(b0, b1, b2, b3, b4, b5, b6, b7, scale_v, out_address)
        return
    z = setzero_ps()
    x0, x1, x2, x3, x4, x5, x6, x7 = z, z, z, z, z, z, z, z
    y0, y1, y2, y3, y4, y5, y6, y7 = z, z, z, z, z, z, z, z
    for t in range(0, d, 16):
        qx = loadu_ps(qa + 4 * t)
        qy = loadu_ps(qa + 4 * t + 32)
        o = 4 * t
        x0 = fmadd_ps(qx, loadu_ps(k0 + o), x0)
        y0 = fmadd_ps(qy, loadu_ps(k0 + o + 32), y0)
        x1 = fmadd_ps(qx, loadu_ps(k1 + o), x1)
        y1 = fmadd_ps(qy, loadu_ps(k1 + o + 32), y1)
        x2 = fmadd_ps(qx, loadu_ps(k2 + o), x2)
        y2 = fmadd_ps(qy, loadu_ps(k2 + o + 32), y2)
        x3 = fmadd_ps(qx, loadu_ps(k3 + o), x3)
        y3 = fmadd_ps(qy, loadu_ps(k3 + o + 32), y3)
        x4 = fmadd_ps(qx, loadu_ps(k4 + o), x4)
        y4 = fmadd_ps(qy, loadu_ps(k4 + o + 32), y4)
        x5 = fmadd_ps(qx, loadu_ps(k5 + o), x5)
        y5 = fmadd_ps(qy, loadu_ps(k5 + o + 32), y5)
        x6 = fmadd_ps(qx, loadu_ps(k6 + o), x6)
        y6 = fmadd_ps(qy, loadu_ps(k6 + o + 32), y6)
        x7 = fmadd_ps(qx, loadu_ps(k7 + o), x7)
        y7 = fmadd_ps(qy, loadu_ps(k7 + o + 32), y7)
    sx = hsum_float_8x8(x0, x1, x2, x3, x4, x5, x6, x7)
    sy = hsum_float_8x8(y0, y1, y2, y3, y4, y5, y6, y7)
    storeu_ps(out_address, mul_ps(add_ps(sx, sy), scale_v))


@njit(cache=True)
def _scores_16(qa, rows, j, d, scale, out_address):
    """_scores_8 (AVX-512) for the sixteen keys at rows[j .. j + 15], their sums made by hsum_float_16x16: a
    lone head of a group (the seventh of qwen2.5-coder-0.5b's) without _finish_8's extracts."""
    k0, k1, k2, k3 = rows[j], rows[j + 1], rows[j + 2], rows[j + 3]
    k4, k5, k6, k7 = rows[j + 4], rows[j + 5], rows[j + 6], rows[j + 7]
    k8, k9, k10, k11 = rows[j + 8], rows[j + 9], rows[j + 10], rows[j + 11]
    k12, k13, k14, k15 = rows[j + 12], rows[j + 13], rows[j + 14], rows[j + 15]
    w = setzero_ps_512()
    b0, b1, b2, b3, b4, b5, b6, b7 = w, w, w, w, w, w, w, w
    c0, c1, c2, c3, c4, c5, c6, c7 = w, w, w, w, w, w, w, w
    for t in range(0, d, 16):
        qv = loadu_ps_512(qa + 4 * t)
        o = 4 * t
        b0 = fmadd_ps_512(qv, loadu_ps_512(k0 + o), b0)
        b1 = fmadd_ps_512(qv, loadu_ps_512(k1 + o), b1)
        b2 = fmadd_ps_512(qv, loadu_ps_512(k2 + o), b2)
        b3 = fmadd_ps_512(qv, loadu_ps_512(k3 + o), b3)
        b4 = fmadd_ps_512(qv, loadu_ps_512(k4 + o), b4)
        b5 = fmadd_ps_512(qv, loadu_ps_512(k5 + o), b5)
        b6 = fmadd_ps_512(qv, loadu_ps_512(k6 + o), b6)
        b7 = fmadd_ps_512(qv, loadu_ps_512(k7 + o), b7)
        c0 = fmadd_ps_512(qv, loadu_ps_512(k8 + o), c0)
        c1 = fmadd_ps_512(qv, loadu_ps_512(k9 + o), c1)
        c2 = fmadd_ps_512(qv, loadu_ps_512(k10 + o), c2)
        c3 = fmadd_ps_512(qv, loadu_ps_512(k11 + o), c3)
        c4 = fmadd_ps_512(qv, loadu_ps_512(k12 + o), c4)
        c5 = fmadd_ps_512(qv, loadu_ps_512(k13 + o), c5)
        c6 = fmadd_ps_512(qv, loadu_ps_512(k14 + o), c6)
        c7 = fmadd_ps_512(qv, loadu_ps_512(k15 + o), c7)
    sums = hsum_float_16x16(b0, b1, b2, b3, b4, b5, b6, b7, c0, c1, c2, c3, c4, c5, c6, c7)
    storeu_ps_512(out_address, mul_ps_512(sums, set1_ps_512(scale)))


@njit(cache=True)
def _scores_8x2(qa, qb, rows, j, d, scale, out_a, out_b):
    """_scores_8 (AVX-512) for two queries against the same eight keys: each key row loaded once serves both
    (16 accumulators); every score goes through _scores_8's operations."""
    k0, k1, k2, k3 = rows[j], rows[j + 1], rows[j + 2], rows[j + 3]
    k4, k5, k6, k7 = rows[j + 4], rows[j + 5], rows[j + 6], rows[j + 7]
    w = setzero_ps_512()
    b0, b1, b2, b3, b4, b5, b6, b7 = w, w, w, w, w, w, w, w
    c0, c1, c2, c3, c4, c5, c6, c7 = w, w, w, w, w, w, w, w
    for t in range(0, d, 16):
        qv, qw = loadu_ps_512(qa + 4 * t), loadu_ps_512(qb + 4 * t)
        o = 4 * t
        kv = loadu_ps_512(k0 + o)
        b0, c0 = fmadd_ps_512(qv, kv, b0), fmadd_ps_512(qw, kv, c0)
        kv = loadu_ps_512(k1 + o)
        b1, c1 = fmadd_ps_512(qv, kv, b1), fmadd_ps_512(qw, kv, c1)
        kv = loadu_ps_512(k2 + o)
        b2, c2 = fmadd_ps_512(qv, kv, b2), fmadd_ps_512(qw, kv, c2)
        kv = loadu_ps_512(k3 + o)
        b3, c3 = fmadd_ps_512(qv, kv, b3), fmadd_ps_512(qw, kv, c3)
        kv = loadu_ps_512(k4 + o)
        b4, c4 = fmadd_ps_512(qv, kv, b4), fmadd_ps_512(qw, kv, c4)
        kv = loadu_ps_512(k5 + o)
        b5, c5 = fmadd_ps_512(qv, kv, b5), fmadd_ps_512(qw, kv, c5)
        kv = loadu_ps_512(k6 + o)
        b6, c6 = fmadd_ps_512(qv, kv, b6), fmadd_ps_512(qw, kv, c6)
        kv = loadu_ps_512(k7 + o)
        b7, c7 = fmadd_ps_512(qv, kv, b7), fmadd_ps_512(qw, kv, c7)
    sums = mul_ps_512(hsum_float_16x16(b0, b1, b2, b3, b4, b5, b6, b7, c0, c1, c2, c3, c4, c5, c6, c7),
                      set1_ps_512(scale))
    storeu_ps(out_a, low_ps_256(sums))
    storeu_ps(out_b, high_ps_256(sums))


@njit(cache=True)
def _weigh_values_2(aa, w_a, w_b, vaddr, a, b, s, totals, rg):
    """Two heads' weighted sums of 64 values (their 8-lane chains at aa and aa + 256, two to a zmm, as the
    one-head loops keep them) over keys a .. b-1, whose weights are w_a[j - s] and w_b[j - s]: eight independent
    chains of FMAs where one head's four were bound by the FMA latency; each chain's operations unchanged. The
    weights' running sums (totals[rg], totals[rg + 1]: the softmax's denominators, added in position order as
    one loop per row adds them) ride along, one add per key beside eight FMAs: as a pass of their own, four
    rows' chains side by side, they cost about 4 ms of a 97 ms layer (qwen2.5-coder-0.5b, 512 rows at a depth
    of 4,096)."""
    ta, tb = totals[rg], totals[rg + 1]
    c0, c1 = loadu_ps_512(aa), loadu_ps_512(aa + 64)
    c2, c3 = loadu_ps_512(aa + 128), loadu_ps_512(aa + 192)
    e0, e1 = loadu_ps_512(aa + 256), loadu_ps_512(aa + 320)
    e2, e3 = loadu_ps_512(aa + 384), loadu_ps_512(aa + 448)
    for j in range(a, b):
        va = vaddr[j]
        v0, v1 = loadu_ps_512(va), loadu_ps_512(va + 64)
        v2, v3 = loadu_ps_512(va + 128), loadu_ps_512(va + 192)
        wa, wb = w_a[j - s], w_b[j - s]
        ta += wa
        tb += wb
        w = set1_ps_512(wa)
        u = set1_ps_512(wb)
        c0 = fmadd_ps_512(w, v0, c0)
        c1 = fmadd_ps_512(w, v1, c1)
        c2 = fmadd_ps_512(w, v2, c2)
        c3 = fmadd_ps_512(w, v3, c3)
        e0 = fmadd_ps_512(u, v0, e0)
        e1 = fmadd_ps_512(u, v1, e1)
        e2 = fmadd_ps_512(u, v2, e2)
        e3 = fmadd_ps_512(u, v3, e3)
    storeu_ps_512(aa, c0)
    storeu_ps_512(aa + 64, c1)
    storeu_ps_512(aa + 128, c2)
    storeu_ps_512(aa + 192, c3)
    storeu_ps_512(aa + 256, e0)
    storeu_ps_512(aa + 320, e1)
    storeu_ps_512(aa + 384, e2)
    storeu_ps_512(aa + 448, e3)
    totals[rg], totals[rg + 1] = ta, tb


@njit(cache=True)
def _weigh_values_4(aa, scores, rg, vaddr, a, b, s, totals):
    """_weigh_values_2 for four heads (lines rg .. rg + 3 of `scores`, accumulators from aa, 256 bytes each):
    each value row loaded once serves four heads, 16 FMAs per 8 loads where two heads had 8 per 6; each chain's
    operations, and each running sum's, unchanged."""
    ta, tb, tc, td = totals[rg], totals[rg + 1], totals[rg + 2], totals[rg + 3]
    c0, c1, c2, c3 = loadu_ps_512(aa), loadu_ps_512(aa + 64), loadu_ps_512(aa + 128), loadu_ps_512(aa + 192)
    e0, e1, e2, e3 = loadu_ps_512(aa + 256), loadu_ps_512(aa + 320), loadu_ps_512(aa + 384), loadu_ps_512(aa + 448)
    f0, f1, f2, f3 = loadu_ps_512(aa + 512), loadu_ps_512(aa + 576), loadu_ps_512(aa + 640), loadu_ps_512(aa + 704)
    g0, g1, g2, g3 = loadu_ps_512(aa + 768), loadu_ps_512(aa + 832), loadu_ps_512(aa + 896), loadu_ps_512(aa + 960)
    for j in range(a, b):
        va = vaddr[j]
        v0, v1 = loadu_ps_512(va), loadu_ps_512(va + 64)
        v2, v3 = loadu_ps_512(va + 128), loadu_ps_512(va + 192)
        wa, wb, wc, wd = scores[rg, j - s], scores[rg + 1, j - s], scores[rg + 2, j - s], scores[rg + 3, j - s]
        ta += wa
        tb += wb
        tc += wc
        td += wd
        w = set1_ps_512(wa)
        c0 = fmadd_ps_512(w, v0, c0)
        c1 = fmadd_ps_512(w, v1, c1)
        c2 = fmadd_ps_512(w, v2, c2)
        c3 = fmadd_ps_512(w, v3, c3)
        w = set1_ps_512(wb)
        e0 = fmadd_ps_512(w, v0, e0)
        e1 = fmadd_ps_512(w, v1, e1)
        e2 = fmadd_ps_512(w, v2, e2)
        e3 = fmadd_ps_512(w, v3, e3)
        w = set1_ps_512(wc)
        f0 = fmadd_ps_512(w, v0, f0)
        f1 = fmadd_ps_512(w, v1, f1)
        f2 = fmadd_ps_512(w, v2, f2)
        f3 = fmadd_ps_512(w, v3, f3)
        w = set1_ps_512(wd)
        g0 = fmadd_ps_512(w, v0, g0)
        g1 = fmadd_ps_512(w, v1, g1)
        g2 = fmadd_ps_512(w, v2, g2)
        g3 = fmadd_ps_512(w, v3, g3)
    storeu_ps_512(aa, c0)
    storeu_ps_512(aa + 64, c1)
    storeu_ps_512(aa + 128, c2)
    storeu_ps_512(aa + 192, c3)
    storeu_ps_512(aa + 256, e0)
    storeu_ps_512(aa + 320, e1)
    storeu_ps_512(aa + 384, e2)
    storeu_ps_512(aa + 448, e3)
    storeu_ps_512(aa + 512, f0)
    storeu_ps_512(aa + 576, f1)
    storeu_ps_512(aa + 640, f2)
    storeu_ps_512(aa + 704, f3)
    storeu_ps_512(aa + 768, g0)
    storeu_ps_512(aa + 832, g1)
    storeu_ps_512(aa + 896, g2)
    storeu_ps_512(aa + 960, g3)
    totals[rg], totals[rg + 1], totals[rg + 2], totals[rg + 3] = ta, tb, tc, td


@njit(cache=True)
def _dequantize_row(store, scales, h, c, first, count, out, at):
    """out[at + u] = store[h, c, first + u] * its q8_0 block's scale, u < count, as float32 (read_rows' values):
    `first` and `count` are multiples of QBLOCK."""
    src = address_of(store) + (h * store.shape[1] + c) * store.shape[2] + first
    dst = address_of(out) + 4 * at
    for b in range(count // QBLOCK):
        sc = scales[h, c, (first // QBLOCK) + b]
        if HAVE_AVX512:
            s16 = set1_ps_512(sc)
            storeu_ps_512(dst + 128 * b, mul_ps_512(load_cvtepi8_ps_512(src + 32 * b), s16))
            storeu_ps_512(dst + 128 * b + 64, mul_ps_512(load_cvtepi8_ps_512(src + 32 * b + 16), s16))
        else:
            s8 = set1_ps(sc)
            for u in range(0, QBLOCK, 8):
                storeu_ps(dst + 128 * b + 4 * u, mul_ps(load_cvtepi8_ps(src + 32 * b + u), s8))


@njit(cache=True)
def _max_of(row, n):
    """row[:n].max(), as the array method gives it, in four 8-lane max_ps chains: the one scalar chain of
    compare-and-select cost about 1.5 cycles a score, 43 of the 566 us of a 9-token verify's attention over 1,100
    keys (qwen2.5-coder-1.5b, one layer). A NaN or an infinity anywhere (caught as x - x, not 0) leaves the
    answer to the array method; otherwise the largest value does not depend on the order it is found in (of -0.0
    and 0.0 either may come out; a softmax subtracting it cannot tell them apart)."""
    if n < 32 or not HAVE_AVX2:
        return row[:n].max()
    a = address_of(row)
    m0 = loadu_ps(a)
    m1, m2, m3 = m0, m0, m0
    bad = setzero_ps()
    j = 0
    while j + 32 <= n:
        b = a + 4 * j
        v0, v1, v2, v3 = loadu_ps(b), loadu_ps(b + 32), loadu_ps(b + 64), loadu_ps(b + 96)
        m0, m1, m2, m3 = max_ps(v0, m0), max_ps(v1, m1), max_ps(v2, m2), max_ps(v3, m3)
        bad = add_ps(bad, add_ps(sub_ps(v0, v0), sub_ps(v1, v1)))
        bad = add_ps(bad, add_ps(sub_ps(v2, v2), sub_ps(v3, v3)))
        j += 32
    while j + 8 <= n:
        v0 = loadu_ps(a + 4 * j)
        m0 = max_ps(v0, m0)
        bad = add_ps(bad, sub_ps(v0, v0))
        j += 8
    m0 = max_ps(max_ps(m0, m1), max_ps(m2, m3))
    if hsum_float_8(bad) != 0:
        return row[:n].max()
    m = hmax_float_8(m0)
    for k in range(j, n):
        m = max(m, row[k])
    return m


# Query rows that one item of _attend_items takes at once (a speculative verify, a prompt chunk), at most, and
# the most bytes their scores may take (with a long context, fewer rows: the scores stay in L2).
ROWS_PER_ITEM = 8
ROW_SCORES_BYTES = 512 * 1024


@njit(cache=True)
def _rows_query_avx2(q, i0, i1, kvh, group, k_store, k_scale, v_store, v_scale, table, first_block, key_start,
                     window, q_positions, scale, softcap, scores, acc, rows, totals, deq, out):
    """_one_query_avx2 for every query head that reads KV head kvh (a grouped-query group), for the query rows
    i0 .. i1-1 at once: eight keys' dot products at a time (on AVX-512 two heads share each key row loaded), their
    sums added up in vector registers; the weighted sums of values in eight chains of FMAs, the softmax's serial
    sums riding along in the same loop; keys and values read in tiles that stay in L1 while every row's heads of the
    group use them. Prompt chunks over a long context took 2.2x llama.cpp's time with one head at a time, and a
    9-token speculative verify after 1,100 tokens (qwen2.5-coder-1.5b) re-read each layer's KV heads, 1.1 MB
    each, from L3 nine times with one row at a time. `scores` holds (rows x group) lines, `acc` as many 64-lane
    accumulators, `totals` their sums.

    Row r attends its own keys (causal, and the window), and each score and each output lane goes through
    exactly the operations _one_query_avx2 performs for it, in the same order (a lane's accumulator waits in
    `acc` between tiles): bitwise the same output.

    A q8_0 cache (k_scale with a non-empty last axis) is read a tile at a time into `deq` as float32 (each value
    int8 * its block's scale, one rounding: what KVCache.keys()/values() give), and the float32 operations run on
    that: bitwise the float32 attention over the dequantized cache. The scalar loop this replaces took 12.5x the
    float32 kernel's time (1,327 against 106 ms, one layer of qwen2.5-coder-0.5b, 512 rows at a depth of 4,096);
    dequantizing a tile once for every row and head of the block costs a few percent."""
    d = q.shape[2]
    dv = v_store.shape[2]
    nr = i1 - i0
    his = np.empty(nr, np.int64)
    starts = np.empty(nr, np.int64)  # row r's first key, as an index into the block's keys
    lo_all = q_positions[i0]
    hi_all = q_positions[i0]
    for r in range(nr):
        p = q_positions[i0 + r]
        lo = key_start
        if window > 0:
            lo = max(lo, p - window + 1)
        starts[r] = lo
        his[r] = p
        lo_all = min(lo_all, lo)
        hi_all = max(hi_all, p)
    for r in range(nr):
        starts[r] -= lo_all
        his[r] -= lo_all  # the row's last key, as an index
    n_all = hi_all - lo_all + 1
    h0 = kvh * group
    quantized = k_scale.shape[2] > 0
    k_row = d * 4
    ka0 = address_of(k_store) + kvh * k_store.shape[1] * k_row
    v_row = dv * 4
    va0 = address_of(v_store) + kvh * v_store.shape[1] * v_row
    for j in range(n_all):
        rows[j] = _column(table, first_block, lo_all + j)
    scale_v = set1_ps(scale)
    k_tile = max(BLOCK, TILE_BYTES // k_row) // 8 * 8
    if quantized:
        kaddr = np.empty(n_all, np.int64)
    else:
        kaddr = rows[:n_all] * k_row + ka0
    da = address_of(deq)
    line = scores.shape[1] * 4
    for j0 in range(0, n_all, k_tile):
        j1 = min(j0 + k_tile, n_all)
        if quantized:  # the tile's keys as float32 rows in deq
            for j in range(j0, j1):
                _dequantize_row(k_store, k_scale, kvh, rows[j], 0, d, deq, (j - j0) * d)
                kaddr[j] = da + (j - j0) * k_row
        for r in range(nr):
            s = starts[r]
            a, b = max(j0, s), min(j1, his[r] + 1)
            for g in range(group):
                qa = address_of(q) + ((i0 + r) * q.shape[1] + h0 + g) * d * 4
                sa = address_of(scores) + (r * group + g) * line - 4 * s  # row-relative: key s is score 0
                j = a
                if HAVE_AVX512 and g % 2 == 0 and g + 1 < group and d % 16 == 0:
                    # heads g and g + 1 together on each eight keys; g + 1's tail keys in its own turn below
                    qb, sb = qa + d * 4, sa + line
                    while j + 8 <= b:
                        _scores_8x2(qa, qb, kaddr, j, d, scale, sa + 4 * j, sb + 4 * j)
                        j += 8
                elif HAVE_AVX512 and g % 2 == 1 and d % 16 == 0:  # the keys head g - 1 took with it
                    j = a + (b - a) // 8 * 8
                elif HAVE_AVX512 and d % 16 == 0:  # a lone head: sixteen keys at a time
                    while j + 16 <= b:
                        _scores_16(qa, kaddr, j, d, scale, sa + 4 * j)
                        j += 16
                while j + 8 <= b:
                    _scores_8(qa, kaddr, j, d, scale_v, sa + 4 * j)
                    j += 8
                while j < b:
                    scores[r * group + g, j - s] = _dot_scaled(qa, kaddr[j], d, scale)
                    j += 1
    for r in range(nr):
        n_keys = his[r] - starts[r] + 1
        for g in range(group):
            rg = r * group + g
            m = -np.inf
            if softcap > 0:
                m = _soft_cap(scores[rg], n_keys, softcap)
            else:
                m = max(m, _max_of(scores[rg], n_keys))
            mf = np.float32(m)
            sa = address_of(scores) + rg * line
            j = 0
            while HAVE_AVX512 and j + 16 <= n_keys:
                storeu_ps_512(sa + 4 * j, exp_nonpositive_16(loadu_ps_512(sa + 4 * j), mf))
                j += 16
            while j + 8 <= n_keys:
                storeu_ps(sa + 4 * j, exp_nonpositive_8(loadu_ps(sa + 4 * j), mf))
                j += 8
            while j < n_keys:
                scores[rg, j] = _exp_nonpositive(scores[rg, j] - mf)
                j += 1
    v_tile = max(BLOCK, TILE_BYTES // 256)  # 64 values of each row per pass
    zero = setzero_ps()
    for t in range(0, dv, 64):
        wide = t + 64 <= dv  # eight chains (64 values), or four for a last 32
        if quantized:
            vaddr = np.empty(n_all, np.int64)
        else:
            vaddr = rows[:n_all] * v_row + (va0 + 4 * t)
        acc[: nr * group, :] = 0.0
        totals[: nr * group] = 0.0  # the denominators, summed in the first pass and again (the same) in others
        for j0 in range(0, n_all, v_tile):
            j1 = min(j0 + v_tile, n_all)
            if quantized:  # values t .. t + 63 (or 31) of the tile's rows, as float32, 64 floats apart in deq
                for j in range(j0, j1):
                    _dequantize_row(v_store, v_scale, kvh, rows[j], t, 64 if wide else 32, deq, (j - j0) * 64)
                    vaddr[j] = da + (j - j0) * 256
            for r in range(nr):
                s = starts[r]
                a, b = max(j0, s), min(j1, his[r] + 1)
                g2 = 0
                if HAVE_AVX512 and wide:  # four or two heads at a time: 16 or 8 independent chains of FMAs
                    while g2 + 4 <= group:
                        rg = r * group + g2
                        _weigh_values_4(address_of(acc) + rg * 256, scores, rg, vaddr, a, b, s, totals)
                        g2 += 4
                    while g2 + 2 <= group:
                        rg = r * group + g2
                        _weigh_values_2(address_of(acc) + rg * 256, scores[rg], scores[rg + 1], vaddr, a, b, s,
                                        totals, rg)
                        g2 += 2
                for g in range(g2, group):
                    rg = r * group + g
                    aa = address_of(acc) + rg * 256
                    tg = totals[rg]
                    if HAVE_AVX512:  # the same 8-lane chains, two to a zmm
                        c0, c1 = loadu_ps_512(aa), loadu_ps_512(aa + 64)
                        if wide:
                            c2, c3 = loadu_ps_512(aa + 128), loadu_ps_512(aa + 192)
                            for j in range(a, b):
                                va = vaddr[j]
                                wj = scores[rg, j - s]
                                tg += wj
                                w = set1_ps_512(wj)
                                c0 = fmadd_ps_512(w, loadu_ps_512(va), c0)
                                c1 = fmadd_ps_512(w, loadu_ps_512(va + 64), c1)
                                c2 = fmadd_ps_512(w, loadu_ps_512(va + 128), c2)
                                c3 = fmadd_ps_512(w, loadu_ps_512(va + 192), c3)
                            storeu_ps_512(aa + 128, c2)
                            storeu_ps_512(aa + 192, c3)
                        else:
                            for j in range(a, b):
                                va = vaddr[j]
                                wj = scores[rg, j - s]
                                tg += wj
                                w = set1_ps_512(wj)
                                c0 = fmadd_ps_512(w, loadu_ps_512(va), c0)
                                c1 = fmadd_ps_512(w, loadu_ps_512(va + 64), c1)
                        storeu_ps_512(aa, c0)
                        storeu_ps_512(aa + 64, c1)
                        totals[rg] = tg
                        continue
                    a0, a1, a2, a3 = loadu_ps(aa), loadu_ps(aa + 32), loadu_ps(aa + 64), loadu_ps(aa + 96)
                    if wide:
                        a4, a5 = loadu_ps(aa + 128), loadu_ps(aa + 160)
                        a6, a7 = loadu_ps(aa + 192), loadu_ps(aa + 224)
                        for j in range(a, b):
                            va = vaddr[j]
                            wj = scores[rg, j - s]
                            tg += wj
                            w = set1_ps(wj)
                            a0 = fmadd_ps(w, loadu_ps(va), a0)
                            a1 = fmadd_ps(w, loadu_ps(va + 32), a1)
                            a2 = fmadd_ps(w, loadu_ps(va + 64), a2)
                            a3 = fmadd_ps(w, loadu_ps(va + 96), a3)
                            a4 = fmadd_ps(w, loadu_ps(va + 128), a4)
                            a5 = fmadd_ps(w, loadu_ps(va + 160), a5)
                            a6 = fmadd_ps(w, loadu_ps(va + 192), a6)
                            a7 = fmadd_ps(w, loadu_ps(va + 224), a7)
                        storeu_ps(aa + 128, a4)
                        storeu_ps(aa + 160, a5)
                        storeu_ps(aa + 192, a6)
                        storeu_ps(aa + 224, a7)
                    else:
                        for j in range(a, b):
                            va = vaddr[j]
                            wj = scores[rg, j - s]
                            tg += wj
                            w = set1_ps(wj)
                            a0 = fmadd_ps(w, loadu_ps(va), a0)
                            a1 = fmadd_ps(w, loadu_ps(va + 32), a1)
                            a2 = fmadd_ps(w, loadu_ps(va + 64), a2)
                            a3 = fmadd_ps(w, loadu_ps(va + 96), a3)
                    storeu_ps(aa, a0)
                    storeu_ps(aa + 32, a1)
                    storeu_ps(aa + 64, a2)
                    storeu_ps(aa + 96, a3)
                    totals[rg] = tg
        for r in range(nr):
            for g in range(group):
                rg = r * group + g
                aa = address_of(acc) + rg * 256
                inv = set1_ps(np.float32(1.0) / totals[rg])
                oa = address_of(out) + ((i0 + r) * out.shape[1] + (h0 + g) * dv + t) * 4
                for u in range(0, 64 if wide else 32, 8):
                    storeu_ps(oa + 4 * u, fmadd_ps(loadu_ps(aa + 4 * u), inv, zero))


@njit(cache=True)
def _attend_items(c, chunks, q, k_store, k_scale, v_store, v_scale, table, first_block, q_positions, key_start,
                  window, scale, softcap, out, scores, acc):
    """Work share c of `chunks`: the (query, head) items c, c + chunks, ... (interleaved, because causal rows
    grow longer with the query index and contiguous ranges would unbalance the threads). With AVX2 registers
    and at least two of them (two threads' worth), the items are (row block, KV head) pairs instead, each head of
    each row computed as alone (_rows_query_avx2): same output, bit for bit."""
    n, n_head, d = q.shape
    n_kv = k_store.shape[0]
    group = n_head // n_kv
    quantized = k_scale.shape[2] > 0
    registers = HAVE_AVX2 and d % 32 == 0 and v_store.shape[2] % 32 == 0
    if registers and (quantized or (group > 1 and n * n_kv >= min(chunks, 2))):
        # Items (row block, KV head): blocks of up to ROWS_PER_ITEM rows, at least as many items as work shares
        # while rows last, and rows whose scores fit ROW_SCORES_BYTES (one row: its KV heads)
        size = min(ROWS_PER_ITEM, max(1, ROW_SCORES_BYTES // (group * scores.shape[0] * 4)))
        n_blocks = max((n + size - 1) // size, min(n, (chunks + n_kv - 1) // n_kv))
        size = (n + n_blocks - 1) // n_blocks
        n_blocks = (n + size - 1) // size
        block_scores = np.empty((size * group, scores.shape[0]), np.float32)
        block_acc = np.empty((size * group, 64), np.float32)
        block_totals = np.empty(size * group, np.float32)
        rows = np.empty(scores.shape[0], np.int64)
        deq = np.empty(max(TILE_BYTES // 4, BLOCK * d, max(BLOCK, TILE_BYTES // 256) * 64) if quantized else 0,
                       np.float32)
        for item in range(c, n_blocks * n_kv, chunks):
            b, kvh = item // n_kv, item % n_kv
            _rows_query_avx2(q, b * size, min(n, (b + 1) * size), kvh, group, k_store, k_scale, v_store, v_scale,
                             table, first_block, key_start, window, q_positions, scale, softcap, block_scores,
                             block_acc, rows, block_totals, deq, out)
        return
    _query_items(c, chunks, q, k_store, k_scale, v_store, v_scale, table, first_block, q_positions, key_start,
                 window, scale, softcap, out, scores, acc, registers)


@njit(cache=True)
def _query_items(c, chunks, q, k_store, k_scale, v_store, v_scale, table, first_block, q_positions, key_start,
                 window, scale, softcap, out, scores, acc, registers):
    """Work share c of `chunks` as (query, head) items, c, c + chunks, ...: each (row, head) alone."""
    n, n_head, d = q.shape
    group = n_head // k_store.shape[0]
    for item in range(c, n * n_head, chunks):
        i, h = item // n_head, item % n_head
        p = q_positions[i]
        lo = key_start
        if window > 0:
            lo = max(lo, p - window + 1)
        if registers:
            _one_query_avx2(q, i, h, h // group, k_store, v_store, table, first_block, lo, p, scale, softcap, scores,
                            out)
        else:
            _one_query(q, i, h, h // group, k_store, k_scale, v_store, v_scale, table, first_block, lo, p, scale,
                       softcap, scores, acc, out)


@njit(cache=True)
def _attend_items_per_head(c, chunks, q, k_store, k_scale, v_store, v_scale, table, first_block, q_positions,
                           key_start, window, scale, softcap, out, scores, acc):
    """_attend_items for a float32 cache with (query, head) items only: the same output, bit for bit (each head of
    each row computed as alone, which is what the row blocks compute too; tests/test_attention.py), without
    _rows_query_avx2, whose compile is 6-10 s of a cold start (2-core Zen 5). A cold start's first answers use
    this while the row-block kernel compiles in the background (fused_forward.compiled)."""
    d = q.shape[2]
    # (a q8_0 cache goes to the portable loop: correct, but _attend_items' bits are its row blocks')
    registers = HAVE_AVX2 and d % 32 == 0 and v_store.shape[2] % 32 == 0 and k_scale.shape[2] == 0
    _query_items(c, chunks, q, k_store, k_scale, v_store, v_scale, table, first_block, q_positions, key_start,
                 window, scale, softcap, out, scores, acc, registers)


@njit(cache=True)
def attend(q, k_store, k_scale, v_store, v_scale, table, first_block, q_positions, key_start, window, scale, softcap,
           out):
    """Causal grouped-query attention of q (n, n_head, d) over a paged cache; writes out (n, n_head * dv).

    A query at position p sees keys at max(key_start, p - window + 1) .. p (window = 0: no window). softcap > 0:
    each scaled score s becomes tanh(s / softcap) * softcap before the softmax (gemma2); 0: none. Query head
    h reads KV head h // (n_head // n_kv), as ggml's broadcasting does. Single-threaded: entering a parallel
    region costs ~15 us, as much as a decode step's attention over a short context.
    """
    scores = np.empty(q_positions[-1] - key_start + 1, np.float32)
    acc = np.empty(v_store.shape[2], np.float32)
    _attend_items(0, 1, q, k_store, k_scale, v_store, v_scale, table, first_block, q_positions, key_start, window,
                  scale, softcap, out, scores, acc)


@njit(cache=True, parallel=True)
def attend_parallel(q, k_store, k_scale, v_store, v_scale, table, first_block, q_positions, key_start, window,
                    scale, softcap, out, threads):
    """`attend` with the (query, head) items shared by `threads` threads; each item is computed exactly as
    `attend` computes it."""
    chunks = max(1, min(threads, q.shape[0] * q.shape[1]))
    scores = np.empty((chunks, q_positions[-1] - key_start + 1), np.float32)
    acc = np.empty((chunks, v_store.shape[2]), np.float32)
    for c in prange(chunks):
        _attend_items(c, chunks, q, k_store, k_scale, v_store, v_scale, table, first_block, q_positions, key_start,
                      window, scale, softcap, out, scores[c], acc[c])


# Built with simd.py's intrinsics: recompile when that file changes (see kernels.cpu.forget_stale_cache).
forget_stale_cache(__file__, attend._cache.cache_path, [simd.__file__])
