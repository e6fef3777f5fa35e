"""Portable fused dequantize-and-multiply kernels: out (n, rows) = x (n, cols) @ W.T for a quantized W.

This is the path for CPUs without AVX2 integer dot products and the oracle for the faster integer path
(`quant_dot.py`): no float32 copy of W is ever made. Each kernel walks its share of the output rows (`prange`
over chunks of rows); for each weight block it decodes the block once into a small float32 buffer, with the
same exact decoder as `dequant.py`, and applies it to all n rows of x.

Accumulation: each (x row, output row) pair has LANES float32 partial sums; block element k adds into lane
k % LANES, and the lanes are summed in order at the end of the row. The adds are independent across lanes, so
LLVM vectorizes them with plain (ymm) FMAs without being allowed to reassociate (`fastmath={"contract"}` only),
and the order of operations for one x row does not depend on n or on the other rows: batch invariance is by
construction, not by luck.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from localllm.kernels.cpu.dequant import (
    QK,
    QK_K,
    decode_bf16,
    decode_f16,
    decode_f32,
    decode_q2_k,
    decode_q3_k,
    decode_q4_0,
    decode_q4_1,
    decode_q4_k,
    decode_q5_0,
    decode_q5_1,
    decode_q5_k,
    decode_q6_k,
    decode_q8_0,
)

LANES = 32  # partial sums per (x row, output row): four ymm registers of float32
ROW_CHUNK = 16  # output rows per prange iteration: scratch buffers are allocated once per chunk, not per row
FLOAT_SPAN = 256  # float weights (F32/F16/BF16) are decoded this many elements at a time

# Only contraction into FMA: no reassociation, so the summation order is fixed (see the module docstring).
_FMA_ONLY = {"contract"}


@njit(cache=True, fastmath=_FMA_ONLY)
def accumulate_block(buf, length, x, col0, acc):
    """acc[i, k] += buf[k] * x[i, col0 + k] for k < length, for every row i of x.

    `length` must not be a compile-time constant (see the module docstring)."""
    for i in range(x.shape[0]):
        # Slices first: indexing x[i, col0 + k] would make Numba emit a negative-index wraparound select per
        # element (col0 could be negative as far as LLVM knows), which blocks vectorization.
        xs = x[i, col0 : col0 + length]
        lanes = acc[i]
        for k in range(length):
            lanes[k] += buf[k] * xs[k]


@njit(cache=True)
def store_row_sums(acc, out, r):
    """out[i, r] = sum of the lanes of acc[i], in lane order; then clear acc for the next output row."""
    for i in range(acc.shape[0]):
        total = np.float32(0.0)
        for lane in range(acc.shape[1]):
            total += acc[i, lane]
            acc[i, lane] = 0.0
        out[i, r] = total


# ---- float weights: decoded FLOAT_SPAN elements at a time ---------------------------------------------------


@njit(cache=True, parallel=True)
def matmul_f32(raw, x, out, n16):
    rows, cols = raw.shape[0], x.shape[1]
    for chunk in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        buf = np.empty(FLOAT_SPAN, np.float32)
        acc = np.zeros((x.shape[0], FLOAT_SPAN), np.float32)
        for r in range(chunk * ROW_CHUNK, min(rows, (chunk + 1) * ROW_CHUNK)):
            row = raw[r]
            for c0 in range(0, cols, FLOAT_SPAN):
                span = min(FLOAT_SPAN, cols - c0)
                for k in range(span):
                    decode_f32(row, (c0 + k) * 4, buf, k, n16)
                accumulate_block(buf, span, x, c0, acc)
            store_row_sums(acc, out, r)


@njit(cache=True, parallel=True)
def matmul_f16(raw, x, out, n16):
    rows, cols = raw.shape[0], x.shape[1]
    for chunk in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        buf = np.empty(FLOAT_SPAN, np.float32)
        acc = np.zeros((x.shape[0], FLOAT_SPAN), np.float32)
        for r in range(chunk * ROW_CHUNK, min(rows, (chunk + 1) * ROW_CHUNK)):
            row = raw[r]
            for c0 in range(0, cols, FLOAT_SPAN):
                span = min(FLOAT_SPAN, cols - c0)
                for k in range(span):
                    decode_f16(row, (c0 + k) * 2, buf, k, n16)
                accumulate_block(buf, span, x, c0, acc)
            store_row_sums(acc, out, r)


@njit(cache=True, parallel=True)
def matmul_bf16(raw, x, out, n16):
    rows, cols = raw.shape[0], x.shape[1]
    for chunk in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        buf = np.empty(FLOAT_SPAN, np.float32)
        acc = np.zeros((x.shape[0], FLOAT_SPAN), np.float32)
        for r in range(chunk * ROW_CHUNK, min(rows, (chunk + 1) * ROW_CHUNK)):
            row = raw[r]
            for c0 in range(0, cols, FLOAT_SPAN):
                span = min(FLOAT_SPAN, cols - c0)
                for k in range(span):
                    decode_bf16(row, (c0 + k) * 2, buf, k, n16)
                accumulate_block(buf, span, x, c0, acc)
            store_row_sums(acc, out, r)


# ---- block formats: one decoded block at a time ------------------------------------------------------------
# One kernel per format around its decoder; a generic kernel taking the decoder as an argument would not be
# cached by Numba (see dequant.py).


@njit(cache=True, parallel=True)
def matmul_q8_0(raw, x, out, n16):
    rows, n_blocks = raw.shape[0], x.shape[1] // QK
    for chunk in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        buf = np.empty(QK, np.float32)
        acc = np.zeros((x.shape[0], buf.shape[0]), np.float32)
        for r in range(chunk * ROW_CHUNK, min(rows, (chunk + 1) * ROW_CHUNK)):
            row = raw[r]
            for b in range(n_blocks):
                decode_q8_0(row, b * 34, buf, 0, n16)
                accumulate_block(buf, 2 * n16, x, b * QK, acc)
            store_row_sums(acc, out, r)


@njit(cache=True, parallel=True)
def matmul_q4_0(raw, x, out, n16):
    rows, n_blocks = raw.shape[0], x.shape[1] // QK
    for chunk in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        buf = np.empty(QK, np.float32)
        acc = np.zeros((x.shape[0], buf.shape[0]), np.float32)
        for r in range(chunk * ROW_CHUNK, min(rows, (chunk + 1) * ROW_CHUNK)):
            row = raw[r]
            for b in range(n_blocks):
                decode_q4_0(row, b * 18, buf, 0, n16)
                accumulate_block(buf, 2 * n16, x, b * QK, acc)
            store_row_sums(acc, out, r)


@njit(cache=True, parallel=True)
def matmul_q4_1(raw, x, out, n16):
    rows, n_blocks = raw.shape[0], x.shape[1] // QK
    for chunk in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        buf = np.empty(QK, np.float32)
        acc = np.zeros((x.shape[0], buf.shape[0]), np.float32)
        for r in range(chunk * ROW_CHUNK, min(rows, (chunk + 1) * ROW_CHUNK)):
            row = raw[r]
            for b in range(n_blocks):
                decode_q4_1(row, b * 20, buf, 0, n16)
                accumulate_block(buf, 2 * n16, x, b * QK, acc)
            store_row_sums(acc, out, r)


@njit(cache=True, parallel=True)
def matmul_q5_0(raw, x, out, n16):
    rows, n_blocks = raw.shape[0], x.shape[1] // QK
    for chunk in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        buf = np.empty(QK, np.float32)
        acc = np.zeros((x.shape[0], buf.shape[0]), np.float32)
        for r in range(chunk * ROW_CHUNK, min(rows, (chunk + 1) * ROW_CHUNK)):
            row = raw[r]
            for b in range(n_blocks):
                decode_q5_0(row, b * 22, buf, 0, n16)
                accumulate_block(buf, 2 * n16, x, b * QK, acc)
            store_row_sums(acc, out, r)


@njit(cache=True, parallel=True)
def matmul_q5_1(raw, x, out, n16):
    rows, n_blocks = raw.shape[0], x.shape[1] // QK
    for chunk in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        buf = np.empty(QK, np.float32)
        acc = np.zeros((x.shape[0], buf.shape[0]), np.float32)
        for r in range(chunk * ROW_CHUNK, min(rows, (chunk + 1) * ROW_CHUNK)):
            row = raw[r]
            for b in range(n_blocks):
                decode_q5_1(row, b * 24, buf, 0, n16)
                accumulate_block(buf, 2 * n16, x, b * QK, acc)
            store_row_sums(acc, out, r)


@njit(cache=True, parallel=True)
def matmul_q2_k(raw, x, out, n16):
    rows, n_blocks = raw.shape[0], x.shape[1] // QK_K
    for chunk in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        buf = np.empty(QK_K, np.float32)
        acc = np.zeros((x.shape[0], buf.shape[0]), np.float32)
        for r in range(chunk * ROW_CHUNK, min(rows, (chunk + 1) * ROW_CHUNK)):
            row = raw[r]
            for b in range(n_blocks):
                decode_q2_k(row, b * 84, buf, 0, n16)
                accumulate_block(buf, 16 * n16, x, b * QK_K, acc)
            store_row_sums(acc, out, r)


@njit(cache=True, parallel=True)
def matmul_q3_k(raw, x, out, n16):
    rows, n_blocks = raw.shape[0], x.shape[1] // QK_K
    for chunk in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        buf = np.empty(QK_K, np.float32)
        acc = np.zeros((x.shape[0], buf.shape[0]), np.float32)
        for r in range(chunk * ROW_CHUNK, min(rows, (chunk + 1) * ROW_CHUNK)):
            row = raw[r]
            for b in range(n_blocks):
                decode_q3_k(row, b * 110, buf, 0, n16)
                accumulate_block(buf, 16 * n16, x, b * QK_K, acc)
            store_row_sums(acc, out, r)


@njit(cache=True, parallel=True)
def matmul_q4_k(raw, x, out, n16):
    rows, n_blocks = raw.shape[0], x.shape[1] // QK_K
    for chunk in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        buf = np.empty(QK_K, np.float32)
        acc = np.zeros((x.shape[0], buf.shape[0]), np.float32)
        for r in range(chunk * ROW_CHUNK, min(rows, (chunk + 1) * ROW_CHUNK)):
            row = raw[r]
            for b in range(n_blocks):
                decode_q4_k(row, b * 144, buf, 0, n16)
                accumulate_block(buf, 16 * n16, x, b * QK_K, acc)
            store_row_sums(acc, out, r)


@njit(cache=True, parallel=True)
def matmul_q5_k(raw, x, out, n16):
    rows, n_blocks = raw.shape[0], x.shape[1] // QK_K
    for chunk in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        buf = np.empty(QK_K, np.float32)
        acc = np.zeros((x.shape[0], buf.shape[0]), np.float32)
        for r in range(chunk * ROW_CHUNK, min(rows, (chunk + 1) * ROW_CHUNK)):
            row = raw[r]
            for b in range(n_blocks):
                decode_q5_k(row, b * 176, buf, 0, n16)
                accumulate_block(buf, 16 * n16, x, b * QK_K, acc)
            store_row_sums(acc, out, r)


@njit(cache=True, parallel=True)
def matmul_q6_k(raw, x, out, n16):
    rows, n_blocks = raw.shape[0], x.shape[1] // QK_K
    for chunk in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        buf = np.empty(QK_K, np.float32)
        acc = np.zeros((x.shape[0], buf.shape[0]), np.float32)
        for r in range(chunk * ROW_CHUNK, min(rows, (chunk + 1) * ROW_CHUNK)):
            row = raw[r]
            for b in range(n_blocks):
                decode_q6_k(row, b * 210, buf, 0, n16)
                accumulate_block(buf, 16 * n16, x, b * QK_K, acc)
            store_row_sums(acc, out, r)
