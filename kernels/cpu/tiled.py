"""Q4_0, Q5_0 and Q8_0 weights repacked at load into 16-row tiles for the VNNI kernel (llama.cpp's CPU backend
repacks Q4_0 the same way, into its 4x8 / 8x8 interleaved blocks). The CPU backend tiles every dense weight whose
rows fill whole tiles on a CPU with AVX-512 VNNI (`can_tile`); kernels/ops.Weight keeps the GGML type for
everything a user sees and dispatches on `kernel_type` (TILED_BASE + the GGML type).

Why: in the file's layout a row's 32-weight block is summed by one `vpdpbusd` into 8 int32 lanes that must be
reduced, scaled (one float step per two blocks) and decoded first (nibbles spread, 5th bits merged, dwords
interleaved): at 8 x-rows a third of the row kernel's time went to decoding, and most of the rest to the float
steps (cvt, permute, fma for every 64 products). In a tile, int32 lane r of a zmm is ROW r of the tile: the
8 `vpdpbusd` of a block (its 8 groups of 4 weights, against the x-row's 4 bytes broadcast) leave each lane holding
that row's whole block sum, so a block costs one cvt, one multiply and one fma for 16 rows, with no reduction at
all; the decode is two ops per 64 weights (and a masked or for the 5th bits).

A tile (16 rows of `row_bytes`, so the same bytes as the rows it replaces; `tile` keeps the array shape), per
block b of the row:
  - qs:  Q8_0: 8 groups of 64 bytes, group g = the 16 rows' weights 4g..4g+3, each XOR 0x80 (= weight + 128,
         unsigned for vpdpbusd); Q4_0 / Q5_0: 4 zmm of 64 bytes, zmm k = the 16 rows' bytes qs[4k..4k+3] as
         stored (low nibbles: weights 4k..4k+3, high nibbles: weights 16 + 4k..)
  - qh (Q5_0): 8 x 64 bits, word g: bit 4r + m = the 5th bit of row r's weight 4g + m (in the order of the
         bytes the 8 weight zmm hold: word g is zmm g's mask)
  - d:   16 fp16, row r's scale
laid out per tile as all blocks' qs, then all blocks' qh, then all blocks' d (each part 64-byte aligned when the
row has an even number of blocks: the tile is then a multiple of 64 bytes and so is every part).

The sum: out[i, row] = sum over blocks b, in order, of fma(d_w * d_x, float(isum_b), acc), with isum_b the exact
signed integer dot of the block (the unsigned weights' vpdpbusd plus -offset x the x-row block's byte sum). Every
x-row and every row gets exactly this sequence whatever the batch, so results are batch invariant and the
portable loops (`rows_portable`) give the same bits.
"""

from __future__ import annotations

import mmap

import numpy as np
from numba import literally, njit, prange

from localllm.gguf_constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from localllm.kernels.cpu import forget_stale_cache, simd
from localllm.kernels.cpu import tiled_k as _tiled_k
from localllm.kernels.cpu.dequant import f16_to_f32
from localllm.kernels.cpu.simd import HAVE_AVX512_VNNI, fma_f32

TILE = 16  # rows per tile: one zmm of int32 lanes
KIND = {Q.Q8_0: 0, Q.Q4_0: 1, Q.Q5_0: 3}  # quant_dot's KIND_* numbers
# Kernel type ids of tiled weights (what the fused forward dispatches on): this base + the GGML type id, past
# every GGML type.
TILED_BASE = 100


def can_tile(qtype, rows: int) -> bool:
    """Whether a weight of this format and row count is tiled on this CPU (the kernels need AVX-512 VNNI): Q4_0,
    Q5_0 and Q8_0 here, Q4_K and Q6_K in kernels/cpu/tiled_k.py."""
    return (HAVE_AVX512_VNNI and (Q(qtype) in KIND or Q(qtype) in _tiled_k.KIND) and rows > 0
            and rows % TILE == 0)


def kernel_type(qtype) -> int:
    return TILED_BASE + int(qtype)


def _aligned_empty(shape) -> np.ndarray:
    """Page-aligned memory of its own mapping: given back to the system when the weight goes (a model unloaded
    by the server), where malloc kept ~65 MiB of gemma3-270m's smaller tiled weights in its heap after they were
    freed (measured). In 4 KiB pages: with huge pages asked for (MADV_HUGEPAGE, as numpy asks for its large
    arrays), the kernel compacted memory for them as the tiles were written, and qwen2.5-coder-1.5b loaded in
    2.3-2.6 s instead of 0.9-1.0 s, with the same speed after (pp512 159-161 / 168-172 t/s, tg64 21.6-21.7 /
    21.4-23.1; 2-core Zen 5, THP on madvise as most distributions ship it)."""
    n = max(int(np.prod(shape)), 1)
    mem = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mem, np.uint8, count=int(np.prod(shape))).reshape(shape)


_CHUNK_BYTES = 8 << 20  # tiled at a time, then handed to `release`


def tile(raw: np.ndarray, qtype, release=None, out: np.ndarray | None = None) -> np.ndarray:
    """raw (rows, row_bytes) in GGUF layout -> the same shape in tiles (see the module), 64-byte aligned.

    Compiled and parallel: numpy's transposes took 1.03 s of every load of qwen2.5-coder-0.5b (393 MiB tiled),
    this loop 0.2-0.4 s on this shared 2-core machine (each byte read once and written once). `release(part)`
    is called on each 8 MiB of raw once it is tiled (the loader drops those file pages): a whole tensor's
    source and copy side by side put gemma3-270m's 170 MiB embedding table twice into the peak resident set.
    `out`: where to write the tiles (raw's shape, 64-byte aligned: a tile cache file's mapping), else new memory."""
    qtype = Q(qtype)
    out = _aligned_empty(raw.shape) if out is None else out
    rows, row_bytes = raw.shape
    step = max(TILE, _CHUNK_BYTES // max(row_bytes, 1) // TILE * TILE)
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        if qtype in _tiled_k.KIND:
            _tiled_k.tile(raw[r0:r1], qtype, out[r0:r1])
        else:
            _tile_into(raw[r0:r1], KIND[qtype], out[r0:r1])
        if release is not None:
            release(raw[r0:r1])
    out.flags.writeable = False
    return out


@njit(cache=True, inline="always")
def _u32_at(src, at):
    """4 bytes of src from `at` as a little-endian uint32 (LLVM makes it one unaligned load)."""
    return (np.uint32(src[at]) | (np.uint32(src[at + 1]) << np.uint32(8)) | (np.uint32(src[at + 2]) << np.uint32(16))
            | (np.uint32(src[at + 3]) << np.uint32(24)))


@njit(cache=True, inline="always")
def _geometry(kind, row_bytes):
    """A tiled row's layout for format `kind`: (file block bytes, blocks, where qh starts in a tile, where d
    starts, where a file block's qs start, the offset its unsigned weights carry)."""
    bb = 34 if kind == 0 else 18 if kind == 1 else 22
    blocks = row_bytes // bb
    qh_at = (512 if kind == 0 else 256) * blocks
    d_at = qh_at + (64 * blocks if kind == 3 else 0)
    return bb, blocks, qh_at, d_at, 6 if kind == 3 else 2, 128 if kind == 0 else 8 if kind == 1 else 16


@njit(parallel=True, cache=True)
def _tile_into(raw, kind, out):
    rows, row_bytes = raw.shape
    bb, blocks, qh_at, d_at, o, _ = _geometry(kind, row_bytes)
    flip = np.uint32(0x80808080) if kind == 0 else np.uint32(0)
    for t in prange(rows // TILE):
        dst = out[TILE * t : TILE * (t + 1)].reshape(TILE * row_bytes)
        words = dst[: d_at].view(np.uint32)  # qs and qh: 4-byte aligned parts of a 64-byte aligned tile
        halves = dst[d_at:].view(np.uint16)
        if kind == 3:  # the 5th-bit masks, a block at a time: word g gathers the 16 rows' 4 bits of group g
            qh = np.empty(TILE, np.uint32)
            for b in range(blocks):
                for r in range(TILE):
                    qh[r] = _u32_at(raw[TILE * t + r], bb * b + 2)
                for g in range(8):
                    lo = np.uint32(0)
                    hi = np.uint32(0)
                    for r in range(8):
                        lo |= ((qh[r] >> np.uint32(4 * g)) & np.uint32(0xF)) << np.uint32(4 * r)
                        hi |= ((qh[r + 8] >> np.uint32(4 * g)) & np.uint32(0xF)) << np.uint32(4 * r)
                    at = (qh_at + 64 * b + 8 * g) // 4
                    words[at] = lo
                    words[at + 1] = hi
        for r in range(TILE):
            src = raw[TILE * t + r]
            for b in range(blocks):
                s = bb * b
                halves[16 * b + r] = np.uint16(src[s]) | (np.uint16(src[s + 1]) << np.uint16(8))
                if kind == 0:
                    for g in range(8):
                        words[128 * b + 16 * g + r] = _u32_at(src, s + 2 + 4 * g) ^ flip
                else:
                    for k in range(4):
                        words[64 * b + 16 * k + r] = _u32_at(src, s + o + 4 * k)


def untile_rows(tiled: np.ndarray, qtype, ids: np.ndarray) -> np.ndarray:
    """The GGUF-layout bytes (len(ids), row_bytes) of rows `ids` of a tiled weight (`tile` inverted); each row
    is gathered from its tile alone (an embedding lookup reads a few rows of a 150k-row table every step)."""
    if Q(qtype) in _tiled_k.KIND:
        return _tiled_k.untile_rows(tiled, qtype, ids)
    ids = np.asarray(ids, np.int64).reshape(-1)
    out = np.empty((len(ids), tiled.shape[1]), np.uint8)
    _untile_into(tiled, KIND[Q(qtype)], ids, out)
    return out


@njit(cache=True)
def _untile_into(tiled, kind, ids, out):
    rows, row_bytes = tiled.shape
    bb, blocks, qh_at, d_at, o, _ = _geometry(kind, row_bytes)
    for j in range(ids.shape[0]):
        t, r = ids[j] // TILE, ids[j] % TILE
        src = tiled[TILE * t : TILE * (t + 1)].reshape(TILE * row_bytes)
        dst = out[j]
        for b in range(blocks):
            s = bb * b
            dst[s] = src[d_at + 32 * b + 2 * r]
            dst[s + 1] = src[d_at + 32 * b + 2 * r + 1]
            if kind == 0:
                for g in range(8):
                    for m in range(4):
                        dst[s + 2 + 4 * g + m] = src[512 * b + 64 * g + 4 * r + m] ^ np.uint8(0x80)
            else:
                for k in range(4):
                    for m in range(4):
                        dst[s + o + 4 * k + m] = src[256 * b + 64 * k + 4 * r + m]
                if kind == 3:
                    qh = np.uint32(0)
                    for g in range(8):
                        byte = src[qh_at + 64 * b + 8 * g + r // 2]
                        qh |= np.uint32((byte >> np.uint8(4 * (r % 2))) & np.uint8(0xF)) << np.uint32(4 * g)
                    for q in range(4):
                        dst[s + 2 + q] = np.uint8((qh >> np.uint32(8 * q)) & np.uint32(0xFF))


# ---------------------------------------------------------------------------------------------------------------
# The portable loops: the oracle (same integers, same float operations in the same order)
# ---------------------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _half(raw_flat, at):
    return f16_to_f32(raw_flat[at], raw_flat[at + 1])


@njit(cache=True)
def rows_portable(raw, kind, xq, xd, out, r0, r1):
    """out[:, r0:r1] for a tiled weight (r0, r1 multiples of TILE), in plain loops."""
    n = xd.shape[0]
    rows, row_bytes = raw.shape
    flat = raw.reshape(rows * row_bytes)
    _, blocks, qh_at, d_at, _, off = _geometry(kind, row_bytes)
    w = np.empty(32, np.int32)
    for r in range(r0, r1):
        tb = (r // TILE) * TILE * row_bytes
        lane = r % TILE
        for i in range(n):
            acc = np.float32(0.0)
            for b in range(blocks):
                for e in range(32):
                    g = e // 4
                    m = e % 4
                    if kind == 0:
                        w[e] = np.int32(flat[tb + 512 * b + 64 * g + 4 * lane + m]) - off
                    else:
                        k = g % 4
                        byte = flat[tb + 256 * b + 64 * k + 4 * lane + m]
                        v = np.int32(byte >> 4) if g >= 4 else np.int32(byte & 15)
                        if kind == 3:
                            at = tb + qh_at + 64 * b + 8 * g
                            word = np.uint64(0)
                            for q in range(8):
                                word |= np.uint64(flat[at + q]) << np.uint64(8 * q)
                            if (word >> np.uint64(4 * lane + m)) & np.uint64(1):
                                v += 16
                        w[e] = v - off
                isum = np.int32(0)
                for e in range(32):
                    isum += w[e] * np.int32(xq[i, 32 * b + e])
                dw = _half(flat, tb + d_at + 32 * b + 2 * lane)
                acc = fma_f32(dw * xd[i, b], np.float32(isum), acc)
            out[i, r] = acc


# ---------------------------------------------------------------------------------------------------------------
# The VNNI kernel
# ---------------------------------------------------------------------------------------------------------------

if HAVE_AVX512_VNNI:
    from localllm.kernels.cpu.simd import (
        address_of, cvtepi32_ps_512, cvtph_ps_512, dpbusd_epi32_512, fmadd_ps_512, keep_alive, load_u32, load_u64,
        loadu_si512, mul_ps_512, nibbles_512, or_bit4_512, prefetch, set1_epi32_512, set1_ps_512, setzero_ps_512,
        storeu_ps_512, storeu_si512,
    )

    @njit(cache=True, inline="always")
    def _weights(kind, tb, b, qh_at):
        """Block b's 8 zmm of unsigned weights (zmm g: the 16 rows' weights 4g..4g+3) from the tile at tb."""
        if kind == 0:
            a = tb + 512 * b
            return (loadu_si512(a), loadu_si512(a + 64), loadu_si512(a + 128), loadu_si512(a + 192),
                    loadu_si512(a + 256), loadu_si512(a + 320), loadu_si512(a + 384), loadu_si512(a + 448))
        a = tb + 256 * b
        v0, v1, v2, v3 = loadu_si512(a), loadu_si512(a + 64), loadu_si512(a + 128), loadu_si512(a + 192)
        w0, w1, w2, w3 = nibbles_512(v0, 0), nibbles_512(v1, 0), nibbles_512(v2, 0), nibbles_512(v3, 0)
        w4, w5, w6, w7 = nibbles_512(v0, 1), nibbles_512(v1, 1), nibbles_512(v2, 1), nibbles_512(v3, 1)
        if kind == 3:
            m = tb + qh_at + 64 * b
            w0, w1 = or_bit4_512(w0, load_u64(m)), or_bit4_512(w1, load_u64(m + 8))
            w2, w3 = or_bit4_512(w2, load_u64(m + 16)), or_bit4_512(w3, load_u64(m + 24))
            w4, w5 = or_bit4_512(w4, load_u64(m + 32)), or_bit4_512(w5, load_u64(m + 40))
            w6, w7 = or_bit4_512(w6, load_u64(m + 48)), or_bit4_512(w7, load_u64(m + 56))
        return w0, w1, w2, w3, w4, w5, w6, w7

    @njit(cache=True, inline="always")
    def _block_sums(c, w, x):
        """The 16 rows' exact signed sums of one block against the x-row's 32 bytes at x, as floats: the
        offset correction c (int32) plus 8 vpdpbusd, each with the x-row's 4 bytes broadcast."""
        w0, w1, w2, w3, w4, w5, w6, w7 = w
        a = dpbusd_epi32_512(set1_epi32_512(c), w0, set1_epi32_512(load_u32(x)))
        a = dpbusd_epi32_512(a, w1, set1_epi32_512(load_u32(x + 4)))
        a = dpbusd_epi32_512(a, w2, set1_epi32_512(load_u32(x + 8)))
        a = dpbusd_epi32_512(a, w3, set1_epi32_512(load_u32(x + 12)))
        a = dpbusd_epi32_512(a, w4, set1_epi32_512(load_u32(x + 16)))
        a = dpbusd_epi32_512(a, w5, set1_epi32_512(load_u32(x + 20)))
        a = dpbusd_epi32_512(a, w6, set1_epi32_512(load_u32(x + 24)))
        a = dpbusd_epi32_512(a, w7, set1_epi32_512(load_u32(x + 28)))
        return cvtepi32_ps_512(a)

    @njit(cache=True)
    def rows_vnni(raw, kind, xq, xd, out, r0, r1):
        """out[:, r0:r1] for a tiled weight (r0, r1 multiples of TILE): bitwise rows_portable.

        One x-row: each block's weights go from the tile straight into the products. More: a tile's weights
        are decoded once into an L1 scratch (512 bytes a block), then read by x-rows in fours (4 accumulators,
        the 8 weight zmm loaded once for the four) and the rest one by one. The next tile is prefetched while
        this one's products run, a block's share at a time (one Zen 5 core, 16 copies of Q5_0 4864x896 out of
        DRAM: n=8 146 us with it, 265 us without; a tile ahead beat two and four)."""
        literally(kind)
        n = xd.shape[0]
        rows, row_bytes = raw.shape
        stride = TILE * row_bytes
        _, blocks, qh_at, d_at, _, off = _geometry(kind, row_bytes)
        corr = np.empty((n, blocks), np.int32)  # -offset x each x-row block's byte sum
        for i in range(n):
            for b in range(blocks):
                s = 0
                for k in range(32):
                    s += np.int32(xq[i, 32 * b + k])
                corr[i, b] = -off * s
        base = address_of(raw)
        xb, xstride = address_of(xq), xq.strides[0]
        ob, ostride = address_of(out), out.strides[0]
        scratch = np.empty(512 * blocks, np.uint8)
        sb = address_of(scratch)
        chunk = (stride + blocks - 1) // blocks
        group = n - n % 4
        for t in range(r0 // TILE, r1 // TILE):
            tb = base + t * stride
            nxt = tb + stride
            if n == 1:
                f0 = setzero_ps_512()
                for b in range(blocks):
                    for q in range(b * chunk, (b + 1) * chunk, 64):
                        prefetch(nxt + q)
                    dw = cvtph_ps_512(tb + d_at + 32 * b)
                    f0 = fmadd_ps_512(mul_ps_512(dw, set1_ps_512(xd[0, b])),
                                      _block_sums(corr[0, b], _weights(kind, tb, b, qh_at), xb + 32 * b), f0)
                storeu_ps_512(ob + 64 * t, f0)
                continue
            for b in range(blocks):
                w0, w1, w2, w3, w4, w5, w6, w7 = _weights(kind, tb, b, qh_at)
                a = sb + 512 * b
                storeu_si512(a, w0)
                storeu_si512(a + 64, w1)
                storeu_si512(a + 128, w2)
                storeu_si512(a + 192, w3)
                storeu_si512(a + 256, w4)
                storeu_si512(a + 320, w5)
                storeu_si512(a + 384, w6)
                storeu_si512(a + 448, w7)
            for i0 in range(0, group, 4):
                f0 = f1 = f2 = f3 = setzero_ps_512()
                for b in range(blocks):
                    if i0 == 0:
                        for q in range(b * chunk, (b + 1) * chunk, 64):
                            prefetch(nxt + q)
                    w = _weights(0, sb, b, 0)
                    dw = cvtph_ps_512(tb + d_at + 32 * b)
                    x = xb + i0 * xstride + 32 * b
                    f0 = fmadd_ps_512(mul_ps_512(dw, set1_ps_512(xd[i0, b])), _block_sums(corr[i0, b], w, x), f0)
                    f1 = fmadd_ps_512(mul_ps_512(dw, set1_ps_512(xd[i0 + 1, b])),
                                      _block_sums(corr[i0 + 1, b], w, x + xstride), f1)
                    f2 = fmadd_ps_512(mul_ps_512(dw, set1_ps_512(xd[i0 + 2, b])),
                                      _block_sums(corr[i0 + 2, b], w, x + 2 * xstride), f2)
                    f3 = fmadd_ps_512(mul_ps_512(dw, set1_ps_512(xd[i0 + 3, b])),
                                      _block_sums(corr[i0 + 3, b], w, x + 3 * xstride), f3)
                o = ob + i0 * ostride + 64 * t
                storeu_ps_512(o, f0)
                storeu_ps_512(o + ostride, f1)
                storeu_ps_512(o + 2 * ostride, f2)
                storeu_ps_512(o + 3 * ostride, f3)
            for i in range(group, n):
                f0 = setzero_ps_512()
                for b in range(blocks):
                    if group == 0:
                        for q in range(b * chunk, (b + 1) * chunk, 64):
                            prefetch(nxt + q)
                    dw = cvtph_ps_512(tb + d_at + 32 * b)
                    f0 = fmadd_ps_512(mul_ps_512(dw, set1_ps_512(xd[i, b])),
                                      _block_sums(corr[i, b], _weights(0, sb, b, 0), xb + i * xstride + 32 * b), f0)
                storeu_ps_512(ob + i * ostride + 64 * t, f0)
        keep_alive(scratch, corr, corr)

    rows_fast = rows_vnni
else:
    rows_fast = rows_portable


forget_stale_cache(__file__, rows_portable._cache.cache_path, [simd.__file__])
