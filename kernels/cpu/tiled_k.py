"""Q4_K and Q6_K weights repacked at load into 16-row tiles for the VNNI kernel: the K-quants of a Q4_K_M file,
the format most published GGUFs are, in the lane-per-row layout kernels/cpu/tiled.py gives Q4_0, Q5_0 and Q8_0.

Why: the row kernels of kernels/cpu/quant_dot.py keep ggml's order of float operations (8 float lanes a row,
reduced at the end), so every 256-weight block costs a row its lane sums, their scale products and float steps,
and a pair of rows at a time is all the zmm holds. In a tile, int32 lane r of a zmm is ROW r of the tile: 8
`vpdpbusd` (a sub-block's 32 weights in groups of 4, against the x-row's 4 bytes broadcast) leave each lane with
its row's whole sub-block sum, one `vpmulld` by the 16 rows' sub-block scales folds it into the block's sum, and
a block costs one conversion and one or two fmas for 16 rows.

A tile is 16 rows of `row_bytes`, the same bytes as the rows it replaces (`tile` keeps the array shape). Per block
b of the row, for the 16 rows together:
  Q4_K (144 bytes a row-block): qs: 32 zmm of 64 bytes, zmm c = the 16 rows' bytes qs[4c..4c+3] as stored (low
       nibbles: weights 64(c//8) + 4(c%8).. of sub-block 2(c//8), high nibbles: of sub-block 2(c//8) + 1);
       scales: the 12 bytes of packed 6-bit scales and mins, byte k of the 16 rows in 16 bytes; d and dmin: 16
       fp16 each.
  Q6_K (210 bytes a row-block): ql: 32 zmm, zmm c = the rows' ql[4c..4c+3]; qh: 16 zmm, zmm c = the rows'
       qh[4c..4c+3]; scales: the 16 int8 scales, byte k of the 16 rows in 16 bytes; d: 16 fp16.
laid out per tile block after block (a block's weights, then its scales: 2240 and 3328 bytes, multiples of 64, so
a tile is read front to back as one stream), then every block's d, then (Q4_K) every block's dmin.

The sum, per x-row (Q8_K activations: int8 y, float32 scale yd, int16 16-sums) and row, over blocks in order:
  Q4_K: isum = sum_s sc_s * (q_s . y_s), msum = sum_s m_s * (y_s's sum), both exact int32;
        acc = fma(d * yd, float(isum), acc); acc = fma(dmin * -yd, float(msum), acc)
  Q6_K: isum = sum_k sc_k * (u_k . y_k - 32 * (y_k's sum)), with u = q + 32 the unsigned 6-bit weight;
        acc = fma(d * yd, float(isum), acc)
Every x-row and every row gets exactly this sequence whatever the batch, so the kernel is batch invariant and the
portable loops (`rows_portable`) give its bits. The order differs from quant_dot's 8-lane one, so a tiled K-quant
weight's products differ from the untiled kernel's in the last bits (both within float32 rounding of the exact
sum; tests/test_tiled.py bounds it).
"""

from __future__ import annotations

import numpy as np
from numba import literally, njit, prange

from localllm.gguf_constants import GGMLQuantizationType as Q
from localllm.kernels.cpu import forget_stale_cache, simd
from localllm.kernels.cpu.dequant import f16_to_f32
from localllm.kernels.cpu.simd import HAVE_AVX512_VNNI, fma_f32

TILE = 16
KIND = {Q.Q4_K: 12, Q.Q6_K: 14}  # the GGML type ids, as the kernels' literal
# How far ahead of the bytes being read the kernel prefetches (as quant_dot's _PREFETCH_AHEAD)
AHEAD = 16 * 1024


@njit(cache=True, inline="always")
def _block_bytes(kind):
    """Bytes of one 256-weight block in the file: Q4_K 144, Q6_K 210."""
    return 144 if kind == 12 else 210


@njit(cache=True, inline="always")
def _off(kind, blocks, b):
    """Where block b's parts start in a tile (bytes): (qs, scales, scales, d, dmin) for Q4_K, (ql, qh, scales, d,
    d) for Q6_K. A block's weights and scales lie together, block after block (2240 and 3328 bytes, multiples of
    64), so a tile is read front to back as one stream; the fp16 d (and dmin) of every block follow at the end."""
    if kind == 12:
        return 2240 * b, 2240 * b + 2048, 2240 * b + 2048, 2240 * blocks + 32 * b, 2272 * blocks + 32 * b
    return 3328 * b, 3328 * b + 2048, 3328 * b + 3072, 3328 * blocks + 32 * b, 3328 * blocks + 32 * b


def tile(raw: np.ndarray, qtype, out: np.ndarray) -> None:
    """raw (rows, row_bytes) in GGUF layout -> `out` (same shape) in tiles (see the module)."""
    _tile_into(raw, KIND[Q(qtype)], out)


@njit(cache=True, inline="always")
def _u32_at(src, at):
    """4 bytes of src from `at` as a little-endian uint32 (LLVM makes it one unaligned load)."""
    return (np.uint32(src[at]) | (np.uint32(src[at + 1]) << np.uint32(8)) | (np.uint32(src[at + 2]) << np.uint32(16))
            | (np.uint32(src[at + 3]) << np.uint32(24)))


@njit(parallel=True, cache=True)
def _tile_into(raw, kind, out):
    """Word by word where the layout moves 4 bytes together (the quants), byte by byte for the scales: the
    1.5b's 934 MiB of K-quants tile in about a second on 2 cores, where a byte at a time took several."""
    rows, row_bytes = raw.shape
    bb = _block_bytes(kind)
    blocks = row_bytes // bb
    for t in prange(rows // TILE):
        dst = out[TILE * t : TILE * (t + 1)].reshape(TILE * row_bytes)
        words = dst.view(np.uint32)  # a tile is 16 rows: a multiple of 4 bytes from a 64-byte aligned start
        for r in range(TILE):
            src = raw[TILE * t + r]
            for b in range(blocks):
                s = bb * b
                o = _off(kind, blocks, b)
                if kind == 12:
                    for c in range(32):
                        words[(o[0] + 64 * c + 4 * r) // 4] = _u32_at(src, s + 16 + 4 * c)
                    for k in range(12):
                        dst[o[1] + 16 * k + r] = src[s + 4 + k]
                    dst[o[3] + 2 * r] = src[s]
                    dst[o[3] + 2 * r + 1] = src[s + 1]
                    dst[o[4] + 2 * r] = src[s + 2]
                    dst[o[4] + 2 * r + 1] = src[s + 3]
                else:
                    for c in range(32):
                        words[(o[0] + 64 * c + 4 * r) // 4] = _u32_at(src, s + 4 * c)
                    for c in range(16):
                        words[(o[1] + 64 * c + 4 * r) // 4] = _u32_at(src, s + 128 + 4 * c)
                    for k in range(16):
                        dst[o[2] + 16 * k + r] = src[s + 192 + k]
                    dst[o[4] + 2 * r] = src[s + 208]
                    dst[o[4] + 2 * r + 1] = src[s + 209]


def untile_rows(tiled: np.ndarray, qtype, ids: np.ndarray) -> np.ndarray:
    """The GGUF-layout bytes (len(ids), row_bytes) of rows `ids` of a tiled weight (`tile` inverted)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    out = np.empty((len(ids), tiled.shape[1]), np.uint8)
    _untile_into(tiled, KIND[Q(qtype)], ids, out)
    return out


@njit(cache=True)
def _untile_into(tiled, kind, ids, out):
    rows, row_bytes = tiled.shape
    bb = _block_bytes(kind)
    blocks = row_bytes // bb
    for j in range(ids.shape[0]):
        t, r = ids[j] // TILE, ids[j] % TILE
        src = tiled[TILE * t : TILE * (t + 1)].reshape(TILE * row_bytes)
        dst = out[j]
        for b in range(blocks):
            s = bb * b
            if kind == 12:
                for c in range(32):
                    for m in range(4):
                        dst[s + 16 + 4 * c + m] = src[_off(kind, blocks, b)[0] + 64 * c + 4 * r + m]
                for k in range(12):
                    dst[s + 4 + k] = src[_off(kind, blocks, b)[1] + 16 * k + r]
                dst[s] = src[_off(kind, blocks, b)[3] + 2 * r]
                dst[s + 1] = src[_off(kind, blocks, b)[3] + 2 * r + 1]
                dst[s + 2] = src[_off(kind, blocks, b)[4] + 2 * r]
                dst[s + 3] = src[_off(kind, blocks, b)[4] + 2 * r + 1]
            else:
                for c in range(32):
                    for m in range(4):
                        dst[s + 4 * c + m] = src[_off(kind, blocks, b)[0] + 64 * c + 4 * r + m]
                for c in range(16):
                    for m in range(4):
                        dst[s + 128 + 4 * c + m] = src[_off(kind, blocks, b)[1] + 64 * c + 4 * r + m]
                for k in range(16):
                    dst[s + 192 + k] = src[_off(kind, blocks, b)[2] + 16 * k + r]
                dst[s + 208] = src[_off(kind, blocks, b)[4] + 2 * r]
                dst[s + 209] = src[_off(kind, blocks, b)[4] + 2 * r + 1]


# ---------------------------------------------------------------------------------------------------------------
# The portable loops: the oracle (same integers, same float operations in the same order)
# ---------------------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _half(flat, at):
    return f16_to_f32(flat[at], flat[at + 1])


@njit(cache=True, inline="always")
def _scale_min(flat, at, lane, j):
    """Row `lane`'s 6-bit scale and min of sub-block j from the tile's scale bytes at `at` (get_scale_min_k4)."""
    if j < 4:
        return (np.int32(flat[at + 16 * j + lane]) & 63, np.int32(flat[at + 16 * (j + 4) + lane]) & 63)
    high = np.int32(flat[at + 16 * (j + 4) + lane])
    sc = (high & 0xF) | ((np.int32(flat[at + 16 * (j - 4) + lane]) >> 6) << 4)
    mn = (high >> 4) | ((np.int32(flat[at + 16 * j + lane]) >> 6) << 4)
    return sc, mn


@njit(cache=True)
def rows_portable(raw, kind, xq, xd, bsums, out, r0, r1):
    """out[:, r0:r1] for a tiled K-quant weight (r0, r1 multiples of TILE), in plain loops."""
    n = xd.shape[0]
    rows, row_bytes = raw.shape
    flat = raw.reshape(rows * row_bytes)
    blocks = row_bytes // _block_bytes(kind)
    for r in range(r0, r1):
        tb = (r // TILE) * TILE * row_bytes
        lane = r % TILE
        for i in range(n):
            acc = np.float32(0.0)
            for b in range(blocks):
                o = _off(kind, blocks, b)
                yd = xd[i, b]
                isum = np.int32(0)
                if kind == 12:
                    msum = np.int32(0)
                    for s in range(8):
                        sc, mn = _scale_min(flat, tb + o[1], lane, s)
                        dot = np.int32(0)
                        for e in range(32):
                            c = 8 * (s // 2) + e // 4
                            byte = np.int32(flat[tb + o[0] + 64 * c + 4 * lane + e % 4])
                            q = (byte >> 4) if s % 2 else (byte & 15)
                            dot += q * np.int32(xq[i, 256 * b + 32 * s + e])
                        isum += sc * dot
                        msum += mn * (np.int32(bsums[i, 16 * b + 2 * s]) + np.int32(bsums[i, 16 * b + 2 * s + 1]))
                    dw = _half(flat, tb + o[3] + 2 * lane)
                    dmin = _half(flat, tb + o[4] + 2 * lane)
                    acc = fma_f32(dw * yd, np.float32(isum), acc)
                    acc = fma_f32(dmin * -yd, np.float32(msum), acc)
                else:
                    for k in range(16):
                        sc = np.int32(np.int8(flat[tb + o[2] + 16 * k + lane]))
                        dot = np.int32(0)
                        for e in range(16):
                            el = 16 * k + e  # element of the block: half h, quarter q, position p
                            h, q, p = el // 128, (el % 128) // 32, el % 32
                            low = np.int32(flat[tb + o[0] + 64 * (16 * h + 8 * (q % 2) + p // 4)
                                                + 4 * lane + p % 4])
                            low = (low >> 4) if q >= 2 else (low & 15)
                            high = np.int32(flat[tb + o[1] + 64 * (8 * h + p // 4) + 4 * lane + p % 4])
                            u = low | (((high >> (2 * q)) & 3) << 4)
                            dot += u * np.int32(xq[i, 256 * b + el])
                        isum += sc * (dot - 32 * np.int32(bsums[i, 16 * b + k]))
                    dw = _half(flat, tb + o[4] + 2 * lane)
                    acc = fma_f32(dw * yd, np.float32(isum), acc)
            out[i, r] = acc


# ---------------------------------------------------------------------------------------------------------------
# The VNNI kernel
# ---------------------------------------------------------------------------------------------------------------

if HAVE_AVX512_VNNI:
    from localllm.kernels.cpu.simd import (
        add_epi32_512, address_of, and_si512, cvtepi32_ps_512, cvtph_ps_512, dpbusd_epi32_512, dpwssd_epi32_512,
        fmadd_ps_512,
        keep_alive, load_cvtepi8_epi32_512, load_cvtepu8_epi32_512, load_u32, loadu_ps_512, loadu_si512,
        mul_ps_512, mullo_epi32_512, nibbles_512, or_si512, prefetch, set1_epi8_512, set1_epi32_512, set1_ps_512,
        setzero_ps_512, slli_epi16_512, slli_epi32_512, srli_epi16_512, srli_epi32_512, storeu_ps_512,
        storeu_si512, zero_si512,
    )

    @njit(cache=True, inline="always")
    def _decode_block(kind, tb, b, blocks, w, sc, weights):
        """Block b of the tile at tb into the scratch: w = 64 zmm of unsigned weights in element order (zmm
        g: the 16 rows' weights 4g..4g+3), sc = the rows' scales as int32 zmm (Q4_K: 8 scales, then 8 mins;
        Q6_K: 16 scales)."""
        if kind == 12:
            a = tb + _off(kind, blocks, b)[0]
            for c in range(32 if weights else 0):
                v = loadu_si512(a + 64 * c)
                g = 16 * (c // 8) + c % 8  # low nibbles: element 64(c//8) + 4(c%8), i.e. zmm g; high: g + 8
                storeu_si512(w + 64 * g, nibbles_512(v, 0))
                storeu_si512(w + 64 * (g + 8), nibbles_512(v, 1))
            s = tb + _off(kind, blocks, b)[1]
            m63, m15 = set1_epi32_512(63), set1_epi32_512(15)
            for j in range(4):
                storeu_si512(sc + 64 * j, and_si512(load_cvtepu8_epi32_512(s + 16 * j), m63))
                storeu_si512(sc + 64 * (8 + j), and_si512(load_cvtepu8_epi32_512(s + 16 * (j + 4)), m63))
            for j in range(4, 8):
                high = load_cvtepu8_epi32_512(s + 16 * (j + 4))
                low_sc = slli_epi32_512(srli_epi32_512(load_cvtepu8_epi32_512(s + 16 * (j - 4)), 6), 4)
                low_mn = slli_epi32_512(srli_epi32_512(load_cvtepu8_epi32_512(s + 16 * j), 6), 4)
                storeu_si512(sc + 64 * j, or_si512(and_si512(high, m15), low_sc))
                storeu_si512(sc + 64 * (8 + j), or_si512(srli_epi32_512(high, 4), low_mn))
        else:
            a, h = tb + _off(kind, blocks, b)[0], tb + _off(kind, blocks, b)[1]
            m4, m30 = set1_epi8_512(0x0F), set1_epi8_512(0x30)
            for half in range(2 if weights else 0):
                for p in range(8):  # elements 128 half + 32 q + 4p .. + 3, q = 0..3
                    la = loadu_si512(a + 64 * (16 * half + p))
                    lb = loadu_si512(a + 64 * (16 * half + 8 + p))
                    qh = loadu_si512(h + 64 * (8 * half + p))
                    g = 32 * half + p
                    storeu_si512(w + 64 * g, or_si512(and_si512(la, m4), and_si512(slli_epi16_512(qh, 4), m30)))
                    storeu_si512(w + 64 * (g + 8),
                                 or_si512(and_si512(lb, m4), and_si512(slli_epi16_512(qh, 2), m30)))
                    storeu_si512(w + 64 * (g + 16), or_si512(nibbles_512(la, 1), and_si512(qh, m30)))
                    storeu_si512(w + 64 * (g + 24),
                                 or_si512(nibbles_512(lb, 1), and_si512(srli_epi16_512(qh, 2), m30)))
            s = tb + _off(kind, blocks, b)[2]
            for k in range(16):
                storeu_si512(sc + 64 * k, load_cvtepi8_epi32_512(s + 16 * k))

    @njit(cache=True, inline="always")
    def _prefetch_part(pf, lines, part):
        """Quarter `part` of the `lines` cache lines from pf: a block's prefetches spread over its four steps
        (35 or 52 at once overran the core's outstanding misses: one x-row fell from ~55 to ~30 GB/s)."""
        for q in range(part * lines // 4, (part + 1) * lines // 4):
            prefetch(pf + 64 * q)

    @njit(cache=True, inline="always")
    def _min_pair(bs, k):
        """The x-row's sums of sub-blocks 2k and 2k + 1 of a Q4_K block as one int32 of two int16 (each sum of 32
        int8 fits: |s| <= 4064), for vpdpwssd against the rows' paired mins."""
        s0 = np.int32(bs[4 * k]) + np.int32(bs[4 * k + 1])
        s1 = np.int32(bs[4 * k + 2]) + np.int32(bs[4 * k + 3])
        return (s0 & 0xFFFF) | (s1 << 16)

    @njit(cache=True, inline="always")
    def _pair_mins(sc):
        """The rows' 8 mins (int32 zmm at sc + 512 ..) as 4 zmm of int16 pairs: lane r = m_2k | m_2k+1 << 16."""
        return (or_si512(loadu_si512(sc + 512), slli_epi32_512(loadu_si512(sc + 576), 16)),
                or_si512(loadu_si512(sc + 640), slli_epi32_512(loadu_si512(sc + 704), 16)),
                or_si512(loadu_si512(sc + 768), slli_epi32_512(loadu_si512(sc + 832), 16)),
                or_si512(loadu_si512(sc + 896), slli_epi32_512(loadu_si512(sc + 960), 16)))

    @njit(cache=True, inline="always")
    def _q4_k_min_sum(mp, bs):
        m = dpwssd_epi32_512(zero_si512(), mp[0], set1_epi32_512(_min_pair(bs, 0)))
        m = dpwssd_epi32_512(m, mp[1], set1_epi32_512(_min_pair(bs, 1)))
        m = dpwssd_epi32_512(m, mp[2], set1_epi32_512(_min_pair(bs, 2)))
        return dpwssd_epi32_512(m, mp[3], set1_epi32_512(_min_pair(bs, 3)))

    @njit(cache=True, inline="always")
    def _one_row(kind, tb, b, blocks, sc, y, bs, pf, lines):
        """One x-row's exact block sum (isum, and Q4_K's msum) for the 16 rows, the weights decoded from the tile
        straight into the products (decode: one x-row a step)."""
        isum = zero_si512()
        if kind == 12:
            a = tb + _off(kind, blocks, b)[0]
            for j in range(4):  # two chains per sub-block: a dpbusd's latency is 5 cycles
                _prefetch_part(pf, lines, j)
                d0, d1, e0, e1 = zero_si512(), zero_si512(), zero_si512(), zero_si512()
                for k in range(0, 8, 2):
                    v = loadu_si512(a + 64 * (8 * j + k))
                    u = loadu_si512(a + 64 * (8 * j + k + 1))
                    d0 = dpbusd_epi32_512(d0, nibbles_512(v, 0), set1_epi32_512(load_u32(y + 64 * j + 4 * k)))
                    d1 = dpbusd_epi32_512(d1, nibbles_512(v, 1), set1_epi32_512(load_u32(y + 64 * j + 32 + 4 * k)))
                    e0 = dpbusd_epi32_512(e0, nibbles_512(u, 0), set1_epi32_512(load_u32(y + 64 * j + 4 * k + 4)))
                    e1 = dpbusd_epi32_512(e1, nibbles_512(u, 1), set1_epi32_512(load_u32(y + 64 * j + 36 + 4 * k)))
                isum = add_epi32_512(isum, mullo_epi32_512(loadu_si512(sc + 128 * j), add_epi32_512(d0, e0)))
                isum = add_epi32_512(isum, mullo_epi32_512(loadu_si512(sc + 128 * j + 64), add_epi32_512(d1, e1)))
            return isum, _q4_k_min_sum(_pair_mins(sc), bs)
        a, h = tb + _off(kind, blocks, b)[0], tb + _off(kind, blocks, b)[1]
        m4, m30 = set1_epi8_512(0x0F), set1_epi8_512(0x30)
        for half in range(2):
            for odd in range(2):  # p = 4 odd .. 4 odd + 3: sub-blocks 8 half + odd + {0, 2, 4, 6}
                _prefetch_part(pf, lines, 2 * half + odd)
                k0 = 8 * half + odd
                e0 = set1_epi32_512(-32 * np.int32(bs[k0]))
                e1 = set1_epi32_512(-32 * np.int32(bs[k0 + 2]))
                e2 = set1_epi32_512(-32 * np.int32(bs[k0 + 4]))
                e3 = set1_epi32_512(-32 * np.int32(bs[k0 + 6]))
                for p in range(4 * odd, 4 * odd + 4):
                    la = loadu_si512(a + 64 * (16 * half + p))
                    lb = loadu_si512(a + 64 * (16 * half + 8 + p))
                    qh = loadu_si512(h + 64 * (8 * half + p))
                    yy = y + 128 * half + 4 * p
                    e0 = dpbusd_epi32_512(e0, or_si512(and_si512(la, m4), and_si512(slli_epi16_512(qh, 4), m30)),
                                          set1_epi32_512(load_u32(yy)))
                    e1 = dpbusd_epi32_512(e1, or_si512(and_si512(lb, m4), and_si512(slli_epi16_512(qh, 2), m30)),
                                          set1_epi32_512(load_u32(yy + 32)))
                    e2 = dpbusd_epi32_512(e2, or_si512(nibbles_512(la, 1), and_si512(qh, m30)),
                                          set1_epi32_512(load_u32(yy + 64)))
                    e3 = dpbusd_epi32_512(e3, or_si512(nibbles_512(lb, 1), and_si512(srli_epi16_512(qh, 2), m30)),
                                          set1_epi32_512(load_u32(yy + 96)))
                isum = add_epi32_512(isum, mullo_epi32_512(loadu_si512(sc + 64 * k0), e0))
                isum = add_epi32_512(isum, mullo_epi32_512(loadu_si512(sc + 64 * (k0 + 2)), e1))
                isum = add_epi32_512(isum, mullo_epi32_512(loadu_si512(sc + 64 * (k0 + 4)), e2))
                isum = add_epi32_512(isum, mullo_epi32_512(loadu_si512(sc + 64 * (k0 + 6)), e3))
        return isum, isum

    @njit(cache=True, inline="always")
    def _four_rows(kind, w, sc, y, ys, bs0, bs1, bs2, bs3):
        """Four x-rows' exact block sums (at y, y + ys, ..) from the decoded scratch: each weight zmm loaded once
        for the four. Returns (isum x4, msum x4) (msum: Q4_K only)."""
        i0 = i1 = i2 = i3 = zero_si512()
        if kind == 12:
            for s in range(8):
                d0 = d1 = d2 = d3 = zero_si512()
                for g in range(8):
                    v = loadu_si512(w + 64 * (8 * s + g))
                    at = y + 32 * s + 4 * g
                    d0 = dpbusd_epi32_512(d0, v, set1_epi32_512(load_u32(at)))
                    d1 = dpbusd_epi32_512(d1, v, set1_epi32_512(load_u32(at + ys)))
                    d2 = dpbusd_epi32_512(d2, v, set1_epi32_512(load_u32(at + 2 * ys)))
                    d3 = dpbusd_epi32_512(d3, v, set1_epi32_512(load_u32(at + 3 * ys)))
                c = loadu_si512(sc + 64 * s)
                i0 = add_epi32_512(i0, mullo_epi32_512(c, d0))
                i1 = add_epi32_512(i1, mullo_epi32_512(c, d1))
                i2 = add_epi32_512(i2, mullo_epi32_512(c, d2))
                i3 = add_epi32_512(i3, mullo_epi32_512(c, d3))
            mp = _pair_mins(sc)
            return ((i0, i1, i2, i3),
                    (_q4_k_min_sum(mp, bs0), _q4_k_min_sum(mp, bs1), _q4_k_min_sum(mp, bs2), _q4_k_min_sum(mp, bs3)))
        for k in range(16):
            d0 = set1_epi32_512(-32 * np.int32(bs0[k]))
            d1 = set1_epi32_512(-32 * np.int32(bs1[k]))
            d2 = set1_epi32_512(-32 * np.int32(bs2[k]))
            d3 = set1_epi32_512(-32 * np.int32(bs3[k]))
            for g in range(4):
                v = loadu_si512(w + 64 * (4 * k + g))
                at = y + 16 * k + 4 * g
                d0 = dpbusd_epi32_512(d0, v, set1_epi32_512(load_u32(at)))
                d1 = dpbusd_epi32_512(d1, v, set1_epi32_512(load_u32(at + ys)))
                d2 = dpbusd_epi32_512(d2, v, set1_epi32_512(load_u32(at + 2 * ys)))
                d3 = dpbusd_epi32_512(d3, v, set1_epi32_512(load_u32(at + 3 * ys)))
            c = loadu_si512(sc + 64 * k)
            i0 = add_epi32_512(i0, mullo_epi32_512(c, d0))
            i1 = add_epi32_512(i1, mullo_epi32_512(c, d1))
            i2 = add_epi32_512(i2, mullo_epi32_512(c, d2))
            i3 = add_epi32_512(i3, mullo_epi32_512(c, d3))
        return (i0, i1, i2, i3), (i0, i1, i2, i3)

    @njit(cache=True, inline="always")
    def _accumulate(kind, a, dw, dm, yd, isum, msum):
        """acc (16 floats at a) + the block: fma(d * yd, isum, acc), then Q4_K's fma(dmin * -yd, msum, acc)."""
        f = fmadd_ps_512(mul_ps_512(dw, set1_ps_512(yd)), cvtepi32_ps_512(isum), loadu_ps_512(a))
        if kind == 12:
            f = fmadd_ps_512(mul_ps_512(dm, set1_ps_512(-yd)), cvtepi32_ps_512(msum), f)
        storeu_ps_512(a, f)

    @njit(cache=True)
    def rows_vnni(raw, kind, xq, xd, bsums, out, r0, r1):
        """out[:, r0:r1] for a tiled K-quant weight (r0, r1 multiples of TILE): bitwise rows_portable.

        Per tile, per block, the rows' scales are decoded into int32 lanes (a 1 KiB scratch). One x-row (decode):
        the weights go from the tile straight into the products. More: the block's weights are decoded once into
        an L1 scratch (4 KiB: 256 unsigned bytes for each of 16 rows), then read by x-rows in fours (each weight
        zmm loaded once for four x-rows) and the rest one by one; each x-row's float accumulator (one zmm) is kept
        in `acc` across the blocks. The next tile is prefetched, a block's share at a time."""
        literally(kind)
        n = xd.shape[0]
        rows, row_bytes = raw.shape
        stride = TILE * row_bytes
        blocks = row_bytes // _block_bytes(kind)
        base = address_of(raw)
        xb, xs = address_of(xq), xq.strides[0]
        ob, ostride = address_of(out), out.strides[0]
        scratch = np.empty(4096 + 1024, np.uint8)
        w = address_of(scratch)
        sc = w + 4096
        acc = np.empty((n, TILE), np.float32)
        ab = address_of(acc)
        chunk = (stride + blocks - 1) // blocks
        lines = (chunk + 63) // 64
        group = n - n % 4 if n > 1 else 0
        for t in range(r0 // TILE, r1 // TILE):
            tb = base + t * stride
            for i in range(n):
                storeu_ps_512(ab + 64 * i, setzero_ps_512())
            for b in range(blocks):
                pf = tb + b * chunk + AHEAD  # the tile's bytes swept at a block's share a block, AHEAD in front
                if n > 1:
                    for q in range(4):
                        _prefetch_part(pf, lines, q)
                _decode_block(kind, tb, b, blocks, w, sc, n > 1)
                if kind == 12:
                    dw, dm = cvtph_ps_512(tb + _off(kind, blocks, b)[3]), cvtph_ps_512(tb + _off(kind, blocks, b)[4])
                else:
                    dw = cvtph_ps_512(tb + _off(kind, blocks, b)[4])
                    dm = dw
                if n == 1:
                    isum, msum = _one_row(kind, tb, b, blocks, sc, xb + 256 * b, bsums[0, 16 * b : 16 * b + 16], pf,
                                          lines)
                    _accumulate(kind, ab, dw, dm, xd[0, b], isum, msum)
                    continue
                for i in range(0, group, 4):
                    y = xb + i * xs + 256 * b
                    (s0, s1, s2, s3), (m0, m1, m2, m3) = _four_rows(
                        kind, w, sc, y, xs, bsums[i, 16 * b : 16 * b + 16], bsums[i + 1, 16 * b : 16 * b + 16],
                        bsums[i + 2, 16 * b : 16 * b + 16], bsums[i + 3, 16 * b : 16 * b + 16])
                    _accumulate(kind, ab + 64 * i, dw, dm, xd[i, b], s0, m0)
                    _accumulate(kind, ab + 64 * (i + 1), dw, dm, xd[i + 1, b], s1, m1)
                    _accumulate(kind, ab + 64 * (i + 2), dw, dm, xd[i + 2, b], s2, m2)
                    _accumulate(kind, ab + 64 * (i + 3), dw, dm, xd[i + 3, b], s3, m3)
                for i in range(group, n):
                    bs = bsums[i, 16 * b : 16 * b + 16]
                    (s0, _, _, _), (m0, _, _, _) = _four_rows(kind, w, sc, xb + i * xs + 256 * b, 0, bs, bs, bs, bs)
                    _accumulate(kind, ab + 64 * i, dw, dm, xd[i, b], s0, m0)
            for i in range(n):
                storeu_ps_512(ob + i * ostride + 64 * t, loadu_ps_512(ab + 64 * i))
        keep_alive(scratch, acc, acc)

    rows_fast = rows_vnni
else:
    rows_fast = rows_portable


forget_stale_cache(__file__, rows_portable._cache.cache_path, [simd.__file__])
