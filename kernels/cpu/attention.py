"""Attention over the paged KV cache, and writing K/V rows into it, compiled with Numba.

Reading the cache through its block table means no gather copy of the keys, whatever the layout (one run of
blocks for a lone sequence, scattered blocks once sequences share a pool), and one call per layer instead of a
dozen numpy operations (which cost as much as the matrix products of a small model at decode).

Batch invariance: each (query, head) is computed alone, by the same sequence of float operations over its
visible keys in position order, whatever else is in the call. A prompt split into chunks, a speculative verify
of k tokens and a server batch therefore give bitwise what one token at a time gives.

Storage (see localllm/kv_cache.py): per layer, keys (n_kv, S, head_dim) and values (n_kv, S, value_dim),
float32, or int8 with a float32 scale per 32 values (`q8_0`: ggml's block_q8_0 rounding, with the scale kept
in float32, since these bytes never leave the process);
`*_scale` arrays have a last axis of 0 for float32 storage. Column c of block b is b * BLOCK + c.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from localllm.kernels.cpu import forget_stale_cache, simd
from localllm.kernels.cpu.simd import (HAVE_AVX2, address_of, bits_to_float, fmadd_ps, hsum_float_8, loadu_ps, set1_ps,
                              setzero_ps, storeu_ps)

BLOCK = 16  # tokens per KV block (localllm.kv_cache.BLOCK, which imports this)
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


@njit(cache=True, inline="always")
def _exp_nonpositive(x):
    """exp(x) for x <= 0 (a softmax's scores minus their max) in plain float operations, Cephes' expf: within
    2 ulp of libm, and a loop of it vectorises, where a call to expf per score cost as much as the score's dot
    product. Below -87 the result is 2^-126-ish instead of a denormal: nothing a softmax weight can notice."""
    x = max(x, np.float32(-87.0))
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


@njit(cache=True)
def _softmax_weights(scores, count, m):
    """scores[:count] = exp(scores - m), returning their sum, added in position order. Two loops, so the first
    vectorises (it has no reduction) and the sum keeps its order (no fastmath: every element is computed by the
    same operations, vector lane or not)."""
    for j in range(count):
        scores[j] = _exp_nonpositive(scores[j] - m)
    total = np.float32(0.0)
    for j in range(count):
        total += scores[j]
    return total


@njit(cache=True, inline="always")
def _column(table, first_block, pos):
    return table[pos // BLOCK - first_block] * BLOCK + pos % BLOCK


@njit(cache=True, fastmath={"contract", "reassoc", "nsz", "arcp"})
def _one_query(q, i, h, kvh, k_store, k_scale, v_store, v_scale, table, first_block, lo, hi, scale, scores, acc,
               out):
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
def _one_query_avx2(q, i, h, kvh, k_store, v_store, table, first_block, lo, hi, scale, scores, out):
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


@njit(cache=True)
def _attend_items(c, chunks, q, k_store, k_scale, v_store, v_scale, table, first_block, q_positions, key_start,
                  window, scale, out, scores, acc):
    """Work share c of `chunks`: the (query, head) items c, c + chunks, ... (interleaved, because causal rows
    grow longer with the query index and contiguous ranges would unbalance the threads)."""
    n, n_head, d = q.shape
    group = n_head // k_store.shape[0]
    registers = HAVE_AVX2 and k_scale.shape[2] == 0 and d % 32 == 0 and v_store.shape[2] % 32 == 0
    for item in range(c, n * n_head, chunks):
        i, h = item // n_head, item % n_head
        p = q_positions[i]
        lo = key_start
        if window > 0:
            lo = max(lo, p - window + 1)
        if registers:
            _one_query_avx2(q, i, h, h // group, k_store, v_store, table, first_block, lo, p, scale, scores, out)
        else:
            _one_query(q, i, h, h // group, k_store, k_scale, v_store, v_scale, table, first_block, lo, p, scale,
                       scores, acc, out)


@njit(cache=True)
def attend(q, k_store, k_scale, v_store, v_scale, table, first_block, q_positions, key_start, window, scale, out):
    """Causal grouped-query attention of q (n, n_head, d) over a paged cache; writes out (n, n_head * dv).

    A query at position p sees keys at max(key_start, p - window + 1) .. p (window = 0: no window). Query head
    h reads KV head h // (n_head // n_kv), as ggml's broadcasting does. Single-threaded: entering a parallel
    region costs ~15 us, as much as a decode step's attention over a short context.
    """
    scores = np.empty(q_positions[-1] - key_start + 1, np.float32)
    acc = np.empty(v_store.shape[2], np.float32)
    _attend_items(0, 1, q, k_store, k_scale, v_store, v_scale, table, first_block, q_positions, key_start, window,
                  scale, out, scores, acc)


@njit(cache=True, parallel=True)
def attend_parallel(q, k_store, k_scale, v_store, v_scale, table, first_block, q_positions, key_start, window,
                    scale, out, threads):
    """`attend` with the (query, head) items shared by `threads` threads; each item is computed exactly as
    `attend` computes it."""
    chunks = max(1, min(threads, q.shape[0] * q.shape[1]))
    scores = np.empty((chunks, q_positions[-1] - key_start + 1), np.float32)
    acc = np.empty((chunks, v_store.shape[2]), np.float32)
    for c in prange(chunks):
        _attend_items(c, chunks, q, k_store, k_scale, v_store, v_scale, table, first_block, q_positions, key_start,
                      window, scale, out, scores[c], acc[c])


# Built with simd.py's intrinsics: recompile when that file changes (see kernels.cpu.forget_stale_cache).
forget_stale_cache(__file__, attend._cache.cache_path, [simd.__file__])
