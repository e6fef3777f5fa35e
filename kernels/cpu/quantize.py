"""Numba quantizers: float32 rows -> GGML blocks, byte for byte what llama-quantize writes.

Ported from ggml's reference quantizers in ggml/src/ggml-quants.c (llama.cpp, MIT License, Copyright (c) 2023-2024
The ggml authors): `quantize_row_q4_0_ref` ... `quantize_row_q8_0_ref`, `quantize_row_q2_K_ref` ...
`quantize_row_q6_K_ref` and their helpers `nearest_int`, `make_qx_quants`, `make_q3_quants`, `make_qkx2_quants`,
and `GGML_FP32_TO_FP16` / `ggml_compute_fp32_to_bf16` from ggml-impl.h.

Which functions: llama-quantize calls `ggml_quantize_chunk`, which without an importance matrix calls
`quantize_q4_K(..., quant_weights=NULL)` and the like; every one of those (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and the
legacy formats) then runs the `_ref` function on the whole chunk (ggml-quants.c, llama.cpp as vendored in
llama-cpp-python 0.3.36). So the `_ref` functions are what is ported here.

Exactness: ggml-quants.c is compiled into ggml-base without -march flags, i.e. plain SSE2 float32 with no FMA
contraction and no reassociation. These kernels do the same operations in the same order in float32: every
constant is an `np.float32`, every int operand is converted to float32 first (Numba would otherwise promote
float32 * int64 to float64), no fastmath, so LLVM neither fuses nor reorders. `nearest_int` is ggml's
magic-number trick bit for bit, and fp16 rounding is ggml's software `ggml_compute_fp32_to_fp16`.

Calling convention: `quantize_rows_<fmt>(x, out)` with x float32 (rows, cols) and out uint8 (rows, row_bytes);
parallel over rows (each row's blocks depend on that row alone, as in ggml).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from localllm.kernels.cpu.dequant import _bits_to_f32, f16_to_f32

F32 = np.float32
QK = 32
QK_K = 256
GROUP_MAX_EPS = F32(1e-15)
_SCALE_TO_INF = F32(2.0**112)  # 0x1.0p+112f
_SCALE_TO_ZERO = F32(2.0**-110)  # 0x1.0p-110f
_MAGIC = F32(12582912.0)  # 1.5 * 2**23: adding it leaves round-to-nearest-even(x) in the low mantissa bits


@intrinsic
def _f32_to_bits(typingctx, value):
    """The IEEE bits of a float32 as a uint32 (a C memcpy)."""
    if not isinstance(value, types.Float):
        return None

    def codegen(context, builder, signature, args):
        as_f32 = context.cast(builder, args[0], signature.args[0], types.float32)
        return builder.bitcast(as_f32, ir.IntType(32))

    return types.uint32(value), codegen


@njit(cache=True)
def f32_bits(f):
    return np.int64(_f32_to_bits(f))


@njit(cache=True)
def nearest_int(fval):
    # ggml: float val = fval + 12582912.f; memcpy(&i, &val, 4); return (i & 0x007fffff) - 0x00400000;
    val = F32(fval) + _MAGIC
    return (f32_bits(val) & 0x007FFFFF) - 0x00400000


@njit(cache=True)
def f32_to_f16_bits(f):
    """ggml_compute_fp32_to_fp16 (the software path ggml-base uses): round to nearest even, NaN -> 0x7E00."""
    base = (abs(f) * _SCALE_TO_INF) * _SCALE_TO_ZERO
    w = f32_bits(f)
    shl1_w = (w + w) & 0xFFFFFFFF
    sign = w & 0x80000000
    bias = shl1_w & 0xFF000000
    if bias < 0x71000000:
        bias = 0x71000000
    base = _bits_to_f32((bias >> 1) + 0x07800000) + base
    bits = f32_bits(base)
    exp_bits = (bits >> 13) & 0x00007C00
    mantissa_bits = bits & 0x00000FFF
    nonsign = exp_bits + mantissa_bits
    if shl1_w > 0xFF000000:
        return (sign >> 16) | 0x7E00
    return (sign >> 16) | nonsign


@njit(cache=True)
def _put_f16(out, off, f):
    """Store GGML_FP32_TO_FP16(f) little-endian at out[off:off+2]; return its float32 value (GGML_FP16_TO_FP32)."""
    h = f32_to_f16_bits(f)
    lo = np.uint8(h & 0xFF)
    hi = np.uint8((h >> 8) & 0xFF)
    out[off] = lo
    out[off + 1] = hi
    return f16_to_f32(lo, hi)


@njit(cache=True)
def _sqrtf(v):
    # sqrtf: the float64 square root rounded to float32 is the correctly rounded float32 root (53 >= 2*24 + 2)
    return F32(np.sqrt(np.float64(v)))


@njit(cache=True)
def _roundf(v):
    # C roundf: half away from zero. |v| + 0.5 is exact in float64 for any float32 v.
    a = np.floor(np.float64(abs(v)) + 0.5)
    return -a if v < 0 else a


# ---- float formats -------------------------------------------------------------------------------------------


@njit(cache=True, parallel=True)
def quantize_rows_f32(x, out):
    for r in prange(x.shape[0]):
        for j in range(x.shape[1]):
            b = f32_bits(x[r, j])
            for k in range(4):
                out[r, 4 * j + k] = np.uint8((b >> (8 * k)) & 0xFF)


@njit(cache=True, parallel=True)
def quantize_rows_f16(x, out):
    for r in prange(x.shape[0]):
        for j in range(x.shape[1]):
            h = f32_to_f16_bits(x[r, j])
            out[r, 2 * j] = np.uint8(h & 0xFF)
            out[r, 2 * j + 1] = np.uint8(h >> 8)


@njit(cache=True, parallel=True)
def quantize_rows_bf16(x, out):
    # ggml_compute_fp32_to_bf16: NaN forced quiet, otherwise round to nearest even
    for r in prange(x.shape[0]):
        for j in range(x.shape[1]):
            u = f32_bits(x[r, j])
            if (u & 0x7FFFFFFF) > 0x7F800000:
                h = (u >> 16) | 64
            else:
                h = ((u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFFFFFF) >> 16
            out[r, 2 * j] = np.uint8(h & 0xFF)
            out[r, 2 * j + 1] = np.uint8((h >> 8) & 0xFF)


# ---- legacy 32-element blocks --------------------------------------------------------------------------------


@njit(cache=True)
def _absmax_signed(x, o, n):
    amax = F32(0.0)
    mx = F32(0.0)
    for j in range(n):
        v = x[o + j]
        if amax < abs(v):
            amax = abs(v)
            mx = v
    return mx


@njit(cache=True)
def _q4_0_row(x, y):
    for i in range(x.shape[0] // QK):
        o = i * QK
        b = i * 18
        mx = _absmax_signed(x, o, QK)
        d = mx / F32(-8.0)
        idd = F32(1.0) / d if d != 0 else F32(0.0)
        _put_f16(y, b, d)
        for j in range(16):
            x0 = x[o + j] * idd
            x1 = x[o + 16 + j] * idd
            xi0 = min(15, np.int64(np.int8(np.int32(x0 + F32(8.5)))))
            xi1 = min(15, np.int64(np.int8(np.int32(x1 + F32(8.5)))))
            y[b + 2 + j] = np.uint8((xi0 | (xi1 << 4)) & 0xFF)


@njit(cache=True)
def _q4_1_row(x, y):
    for i in range(x.shape[0] // QK):
        o = i * QK
        b = i * 20
        mn = F32(3.4028234663852886e38)
        mx = F32(-3.4028234663852886e38)
        for j in range(QK):
            v = x[o + j]
            if v < mn:
                mn = v
            if v > mx:
                mx = v
        d = (mx - mn) / F32(15.0)
        idd = F32(1.0) / d if d != 0 else F32(0.0)
        _put_f16(y, b, d)
        _put_f16(y, b + 2, mn)
        for j in range(16):
            x0 = (x[o + j] - mn) * idd
            x1 = (x[o + 16 + j] - mn) * idd
            xi0 = min(15, np.int64(np.int8(np.int32(x0 + F32(0.5)))))
            xi1 = min(15, np.int64(np.int8(np.int32(x1 + F32(0.5)))))
            y[b + 4 + j] = np.uint8((xi0 | (xi1 << 4)) & 0xFF)


@njit(cache=True)
def _q5_0_row(x, y):
    for i in range(x.shape[0] // QK):
        o = i * QK
        b = i * 22
        mx = _absmax_signed(x, o, QK)
        d = mx / F32(-16.0)
        idd = F32(1.0) / d if d != 0 else F32(0.0)
        _put_f16(y, b, d)
        qh = 0
        for j in range(16):
            x0 = x[o + j] * idd
            x1 = x[o + 16 + j] * idd
            xi0 = min(31, np.int64(np.int8(np.int32(x0 + F32(16.5))))) & 0xFF
            xi1 = min(31, np.int64(np.int8(np.int32(x1 + F32(16.5))))) & 0xFF
            y[b + 6 + j] = np.uint8((xi0 & 0x0F) | ((xi1 & 0x0F) << 4))
            qh |= ((xi0 & 0x10) >> 4) << j
            qh |= ((xi1 & 0x10) >> 4) << (j + 16)
        for k in range(4):
            y[b + 2 + k] = np.uint8((qh >> (8 * k)) & 0xFF)


@njit(cache=True)
def _q5_1_row(x, y):
    for i in range(x.shape[0] // QK):
        o = i * QK
        b = i * 24
        mn = F32(3.4028234663852886e38)
        mx = F32(-3.4028234663852886e38)
        for j in range(QK):
            v = x[o + j]
            if v < mn:
                mn = v
            if v > mx:
                mx = v
        d = (mx - mn) / F32(31.0)
        idd = F32(1.0) / d if d != 0 else F32(0.0)
        _put_f16(y, b, d)
        _put_f16(y, b + 2, mn)
        qh = 0
        for j in range(16):
            x0 = (x[o + j] - mn) * idd
            x1 = (x[o + 16 + j] - mn) * idd
            xi0 = np.int64(np.uint8(np.int32(x0 + F32(0.5)) & 0xFF))
            xi1 = np.int64(np.uint8(np.int32(x1 + F32(0.5)) & 0xFF))
            y[b + 8 + j] = np.uint8((xi0 & 0x0F) | ((xi1 & 0x0F) << 4))
            qh |= ((xi0 & 0x10) >> 4) << j
            qh |= ((xi1 & 0x10) >> 4) << (j + 16)
        for k in range(4):
            y[b + 4 + k] = np.uint8((qh >> (8 * k)) & 0xFF)


@njit(cache=True)
def _q8_0_row(x, y):
    for i in range(x.shape[0] // QK):
        o = i * QK
        b = i * 34
        amax = F32(0.0)
        for j in range(QK):
            amax = max(amax, abs(x[o + j]))
        d = amax / F32(127.0)
        idd = F32(1.0) / d if d != 0 else F32(0.0)
        _put_f16(y, b, d)
        for j in range(QK):
            y[b + 2 + j] = np.uint8(np.int64(_roundf(x[o + j] * idd)) & 0xFF)


# ---- k-quant helpers (ggml-quants.c) -------------------------------------------------------------------------


@njit(cache=True)
def make_qx_quants(n, nmax, x, L, rmse_type, qw, use_qw):
    """ggml make_qx_quants for rmse_type 1 (the one the k-quants use): weights qw[i] if use_qw else x[i]^2.
    L receives values in [0, 2*nmax)."""
    mx = F32(0.0)
    amax = F32(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    fnmax = F32(nmax)
    iscale = -fnmax / mx
    if rmse_type == 0:
        for i in range(n):
            li = nearest_int(iscale * x[i])
            L[i] = nmax + max(-nmax, min(nmax - 1, li))
        return F32(1.0) / iscale
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        li = nearest_int(iscale * x[i])
        li = max(-nmax, min(nmax - 1, li))
        L[i] = li + nmax
        w = qw[i] if use_qw else x[i] * x[i]
        fl = F32(li)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    scale = sumlx / suml2 if suml2 != 0 else F32(0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fnmax + F32(0.1) * F32(step)) / mx
        sumlx = F32(0.0)
        suml2 = F32(0.0)
        for i in range(n):
            li = nearest_int(iscale * x[i])
            li = max(-nmax, min(nmax - 1, li))
            w = qw[i] if use_qw else x[i] * x[i]
            fl = F32(li)
            sumlx += w * x[i] * fl
            suml2 += w * fl * fl
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                li = nearest_int(iscale * x[i])
                L[i] = nmax + max(-nmax, min(nmax - 1, li))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True)
def make_q3_quants(n, nmax, x, L, do_rmse):
    """ggml make_q3_quants; L receives values in [0, 2*nmax)."""
    mx = F32(0.0)
    amax = F32(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    iscale = -F32(nmax) / mx
    if do_rmse:
        sumlx = F32(0.0)
        suml2 = F32(0.0)
        for i in range(n):
            li = nearest_int(iscale * x[i])
            li = max(-nmax, min(nmax - 1, li))
            L[i] = li
            w = x[i] * x[i]
            sumlx += w * x[i] * F32(li)
            suml2 += w * F32(li) * F32(li)
        for _itry in range(5):
            n_changed = 0
            for i in range(n):
                w = x[i] * x[i]
                fli = F32(L[i])
                slx = sumlx - w * x[i] * fli
                if slx > 0:
                    sl2 = suml2 - w * fli * fli
                    new_l = nearest_int(x[i] * sl2 / slx)
                    new_l = max(-nmax, min(nmax - 1, new_l))
                    if new_l != L[i]:
                        fnl = F32(new_l)
                        slx += w * x[i] * fnl
                        sl2 += w * fnl * fnl
                        if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                            L[i] = new_l
                            sumlx = slx
                            suml2 = sl2
                            n_changed += 1
            if n_changed == 0:
                break
        for i in range(n):
            L[i] += nmax
        return sumlx / suml2 if suml2 > 0 else F32(0.0)
    for i in range(n):
        li = nearest_int(iscale * x[i])
        li = max(-nmax, min(nmax - 1, li))
        L[i] = li + nmax
    return F32(1.0) / iscale


@njit(cache=True)
def make_qkx2_quants(n, nmax, x, weights, L, Laux, rmin, rdelta, nstep, use_mad):
    """ggml make_qkx2_quants; returns (scale, the_min) where the_min is ggml's *the_min (= -min >= 0)."""
    mn = x[0]
    mx = x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        w = weights[i]
        sum_w += w
        sum_x += w * x[i]
    if mn > 0:
        mn = F32(0.0)
    if mx == mn:
        for i in range(n):
            L[i] = 0
        return F32(0.0), -mn
    fnmax = F32(nmax)
    iscale = fnmax / (mx - mn)
    scale = F32(1.0) / iscale
    best_error = F32(0.0)
    for i in range(n):
        li = nearest_int(iscale * (x[i] - mn))
        L[i] = max(0, min(nmax, li))
        diff = scale * F32(L[i]) + mn - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += weights[i] * diff
    if nstep < 1:
        return scale, -mn
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F32(step) + fnmax) / (mx - mn)
        sum_l = F32(0.0)
        sum_l2 = F32(0.0)
        sum_xl = F32(0.0)
        for i in range(n):
            li = nearest_int(iscale * (x[i] - mn))
            li = max(0, min(nmax, li))
            Laux[i] = li
            w = weights[i]
            fl = F32(li)
            sum_l += w * fl
            sum_l2 += w * fl * fl
            sum_xl += w * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F32(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = F32(0.0)
            for i in range(n):
                diff = this_scale * F32(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += weights[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


# ---- k-quant rows (the _ref functions, one row of nb super-blocks) -------------------------------------------


@njit(cache=True)
def _q2_k_row(x, y):
    L = np.zeros(QK_K, np.int64)
    Laux = np.zeros(16, np.int64)
    weights = np.zeros(16, np.float32)
    mins = np.zeros(16, np.float32)
    scales = np.zeros(16, np.float32)
    q4scale = F32(15.0)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K : (i + 1) * QK_K]
        yb = y[i * 84 : (i + 1) * 84]  # scales[16], qs[64], d, dmin
        max_scale = F32(0.0)
        max_min = F32(0.0)
        for j in range(16):
            for l in range(16):
                weights[l] = abs(xb[16 * j + l])
            s, m = make_qkx2_quants(16, 3, xb[16 * j : 16 * j + 16], weights, L[16 * j : 16 * j + 16], Laux,
                                    F32(-0.5), F32(0.1), 15, True)
            scales[j] = s
            mins[j] = m
            if s > max_scale:
                max_scale = s
            if m > max_min:
                max_min = m
        if max_scale > 0:
            iscale = q4scale / max_scale
            for j in range(16):
                yb[j] = np.uint8(nearest_int(iscale * scales[j]) & 0xFF)
            d = _put_f16(yb, 80, max_scale / q4scale)
        else:
            for j in range(16):
                yb[j] = 0
            d = _put_f16(yb, 80, F32(0.0))
        if max_min > 0:
            iscale = q4scale / max_min
            for j in range(16):
                yb[j] = np.uint8((np.int64(yb[j]) | (nearest_int(iscale * mins[j]) << 4)) & 0xFF)
            dmin = _put_f16(yb, 82, max_min / q4scale)
        else:
            dmin = _put_f16(yb, 82, F32(0.0))
        for j in range(16):
            sc = np.int64(yb[j])
            dd = d * F32(sc & 0xF)
            if dd == 0:
                continue
            dm = dmin * F32(sc >> 4)
            for ii in range(16):
                li = nearest_int((xb[16 * j + ii] + dm) / dd)
                L[16 * j + ii] = max(0, min(3, li))
        for j in range(0, QK_K, 128):
            for l in range(32):
                yb[16 + j // 4 + l] = np.uint8(
                    (L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6)) & 0xFF)


@njit(cache=True)
def _q3_k_scale(yb, j):
    # the signed 6-bit scale j as the _ref function reads it back from its own packing (scales at byte 96)
    if j < 8:
        sc = np.int64(yb[96 + j]) & 0xF
    else:
        sc = np.int64(yb[96 + j - 8]) >> 4
    return (sc | (((np.int64(yb[96 + 8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32


@njit(cache=True)
def _q3_k_row(x, y):
    L = np.zeros(QK_K, np.int64)
    scales = np.zeros(16, np.float32)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K : (i + 1) * QK_K]
        yb = y[i * 110 : (i + 1) * 110]  # hmask[32], qs[64], scales[12], d
        max_scale = F32(0.0)
        amax = F32(0.0)
        for j in range(16):
            s = make_q3_quants(16, 4, xb[16 * j : 16 * j + 16], L[16 * j : 16 * j + 16], True)
            scales[j] = s
            if abs(s) > amax:
                amax = abs(s)
                max_scale = s
        for k in range(12):
            yb[96 + k] = 0
        if max_scale != 0:
            iscale = F32(-32.0) / max_scale
            for j in range(16):
                li = np.int64(np.int8(nearest_int(iscale * scales[j]) & 0xFF))  # int8_t l = nearest_int(...)
                li = max(-32, min(31, li)) + 32
                if j < 8:
                    yb[96 + j] = np.uint8(li & 0xF)
                else:
                    yb[96 + j - 8] = np.uint8(np.int64(yb[96 + j - 8]) | ((li & 0xF) << 4))
                li >>= 4
                yb[96 + 8 + j % 4] = np.uint8((np.int64(yb[96 + 8 + j % 4]) | (li << (2 * (j // 4)))) & 0xFF)
            d_all = _put_f16(yb, 108, F32(1.0) / iscale)
        else:
            d_all = _put_f16(yb, 108, F32(0.0))
        for j in range(16):
            d = d_all * F32(_q3_k_scale(yb, j))
            if d == 0:
                continue
            for ii in range(16):
                li = nearest_int(xb[16 * j + ii] / d)
                L[16 * j + ii] = max(-4, min(3, li)) + 4
        for k in range(32):
            yb[k] = 0
        m = 0
        hm = 1
        for j in range(QK_K):
            if L[j] > 3:
                yb[m] = np.uint8(np.int64(yb[m]) | hm)
                L[j] -= 4
            m += 1
            if m == QK_K // 8:
                m = 0
                hm <<= 1
        for j in range(0, QK_K, 128):
            for l in range(32):
                yb[32 + j // 4 + l] = np.uint8(
                    (L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6)) & 0xFF)


@njit(cache=True)
def _pack_scale_min_k4(yb, q, j, ls, lm):
    # the 6-bit scale and min of sub-block j into the 12 bytes at yb[q:] (inverse of get_scale_min_k4)
    if j < 4:
        yb[q + j] = np.uint8(ls)
        yb[q + j + 4] = np.uint8(lm)
    else:
        yb[q + j + 4] = np.uint8((ls & 0xF) | ((lm & 0xF) << 4))
        yb[q + j - 4] = np.uint8((np.int64(yb[q + j - 4]) | ((ls >> 4) << 6)) & 0xFF)
        yb[q + j] = np.uint8((np.int64(yb[q + j]) | ((lm >> 4) << 6)) & 0xFF)


@njit(cache=True)
def _get_scale_min_k4(yb, q, j):
    if j < 4:
        return np.int64(yb[q + j]) & 63, np.int64(yb[q + j + 4]) & 63
    sc = (np.int64(yb[q + j + 4]) & 0xF) | ((np.int64(yb[q + j - 4]) >> 6) << 4)
    m = (np.int64(yb[q + j + 4]) >> 4) | ((np.int64(yb[q + j]) >> 6) << 4)
    return sc, m


@njit(cache=True)
def _qk_k_scales_ref(xb, L, Laux, weights, scales, mins, nmax, rmin, rdelta, nstep):
    """The first pass of quantize_row_q4_K_ref / q5_K_ref: per 32-element sub-block scale and min."""
    max_scale = F32(0.0)
    max_min = F32(0.0)
    for j in range(8):
        sum_x2 = F32(0.0)
        for l in range(32):
            sum_x2 += xb[32 * j + l] * xb[32 * j + l]
        av_x = _sqrtf(sum_x2 / F32(32.0))
        for l in range(32):
            weights[l] = av_x + abs(xb[32 * j + l])
        s, m = make_qkx2_quants(32, nmax, xb[32 * j : 32 * j + 32], weights, L[32 * j : 32 * j + 32], Laux,
                                rmin, rdelta, nstep, False)
        scales[j] = s
        mins[j] = m
        if s > max_scale:
            max_scale = s
        if m > max_min:
            max_min = m
    return max_scale, max_min


@njit(cache=True)
def _qk_k_pack_scales(yb, q, scales, mins, max_scale, max_min):
    """Quantize the 8 sub-block scales and mins to 6 bits (uint8_t ls = nearest_int(...); MIN(63, ls)), pack
    them at yb[q:], and write d and dmin at yb[0:4]; return d, dmin as the fp16 values read back."""
    inv_scale = F32(63.0) / max_scale if max_scale > 0 else F32(0.0)
    inv_min = F32(63.0) / max_min if max_min > 0 else F32(0.0)
    for j in range(8):
        ls = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
        lm = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        _pack_scale_min_k4(yb, q, j, ls, lm)
    d = _put_f16(yb, 0, max_scale / F32(63.0))
    dmin = _put_f16(yb, 2, max_min / F32(63.0))
    return d, dmin


@njit(cache=True)
def _q4_k_row(x, y):
    L = np.zeros(QK_K, np.int64)
    Laux = np.zeros(32, np.int64)
    weights = np.zeros(32, np.float32)
    mins = np.zeros(8, np.float32)
    scales = np.zeros(8, np.float32)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K : (i + 1) * QK_K]
        yb = y[i * 144 : (i + 1) * 144]  # d, dmin, scales[12], qs[128]
        for k in range(12):
            yb[4 + k] = 0
        max_scale, max_min = _qk_k_scales_ref(xb, L, Laux, weights, scales, mins, 15, F32(-1.0), F32(0.1), 20)
        d_all, dmin_all = _qk_k_pack_scales(yb, 4, scales, mins, max_scale, max_min)
        for j in range(8):
            sc, m = _get_scale_min_k4(yb, 4, j)
            d = d_all * F32(sc)
            if d == 0:
                continue
            dm = dmin_all * F32(m)
            for ii in range(32):
                li = nearest_int((xb[32 * j + ii] + dm) / d)
                L[32 * j + ii] = max(0, min(15, li))
        for j in range(0, QK_K, 64):
            for l in range(32):
                yb[16 + j // 2 + l] = np.uint8(L[j + l] | (L[j + l + 32] << 4))


@njit(cache=True)
def _q5_k_row(x, y):
    L = np.zeros(QK_K, np.int64)
    Laux = np.zeros(32, np.int64)
    weights = np.zeros(32, np.float32)
    mins = np.zeros(8, np.float32)
    scales = np.zeros(8, np.float32)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K : (i + 1) * QK_K]
        yb = y[i * 176 : (i + 1) * 176]  # d, dmin, scales[12], qh[32], qs[128]
        for k in range(12):
            yb[4 + k] = 0
        max_scale, max_min = _qk_k_scales_ref(xb, L, Laux, weights, scales, mins, 31, F32(-0.5), F32(0.1), 15)
        d_all, dmin_all = _qk_k_pack_scales(yb, 4, scales, mins, max_scale, max_min)
        for j in range(8):
            sc, m = _get_scale_min_k4(yb, 4, j)
            d = d_all * F32(sc)
            if d == 0:
                continue
            dm = dmin_all * F32(m)
            for ii in range(32):
                li = nearest_int((xb[32 * j + ii] + dm) / d)
                L[32 * j + ii] = max(0, min(31, li))
        _q5_k_pack(yb, L)


@njit(cache=True)
def _q5_k_pack(yb, L):
    for k in range(32):
        yb[16 + k] = 0
    m1 = 1
    m2 = 2
    for n in range(0, QK_K, 64):
        for j in range(32):
            l1 = L[n + j]
            if l1 > 15:
                l1 -= 16
                yb[16 + j] = np.uint8(np.int64(yb[16 + j]) | m1)
            l2 = L[n + j + 32]
            if l2 > 15:
                l2 -= 16
                yb[16 + j] = np.uint8(np.int64(yb[16 + j]) | m2)
            yb[48 + n // 2 + j] = np.uint8(l1 | (l2 << 4))
        m1 <<= 2
        m2 <<= 2


@njit(cache=True)
def _q6_k_row(x, y):
    L = np.zeros(QK_K, np.int64)
    scales = np.zeros(16, np.float32)
    dummy = np.zeros(1, np.float32)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K : (i + 1) * QK_K]
        yb = y[i * 210 : (i + 1) * 210]  # ql[128], qh[64], scales[16], d
        max_scale = F32(0.0)
        max_abs_scale = F32(0.0)
        for ib in range(16):
            s = make_qx_quants(16, 32, xb[16 * ib : 16 * ib + 16], L[16 * ib : 16 * ib + 16], 1, dummy, False)
            scales[ib] = s
            if abs(s) > max_abs_scale:
                max_abs_scale = abs(s)
                max_scale = s
        if max_abs_scale < GROUP_MAX_EPS:
            for k in range(210):
                yb[k] = 0
            continue
        iscale = F32(-128.0) / max_scale
        d_all = _put_f16(yb, 208, F32(1.0) / iscale)
        for ib in range(16):
            yb[192 + ib] = np.uint8(min(127, nearest_int(iscale * scales[ib])) & 0xFF)
        for j in range(16):
            d = d_all * F32(np.int8(yb[192 + j]))
            if d == 0:
                continue
            for ii in range(16):
                li = nearest_int(xb[16 * j + ii] / d)
                L[16 * j + ii] = max(-32, min(31, li)) + 32
        _q6_k_pack(yb, L)


@njit(cache=True)
def _q6_k_pack(yb, L):
    for j in range(0, QK_K, 128):
        ql = j // 2
        qh = 128 + j // 4
        for l in range(32):
            q1 = L[j + l] & 0xF
            q2 = L[j + l + 32] & 0xF
            q3 = L[j + l + 64] & 0xF
            q4 = L[j + l + 96] & 0xF
            yb[ql + l] = np.uint8(q1 | (q3 << 4))
            yb[ql + l + 32] = np.uint8(q2 | (q4 << 4))
            yb[qh + l] = np.uint8((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4)
                                  | ((L[j + l + 96] >> 4) << 6))


# ---- the row-parallel entry points ---------------------------------------------------------------------------


@njit(cache=True, parallel=True)
def quantize_rows_q8_0(x, out):
    for r in prange(x.shape[0]):
        _q8_0_row(x[r], out[r])


@njit(cache=True, parallel=True)
def quantize_rows_q4_0(x, out):
    for r in prange(x.shape[0]):
        _q4_0_row(x[r], out[r])


@njit(cache=True, parallel=True)
def quantize_rows_q4_1(x, out):
    for r in prange(x.shape[0]):
        _q4_1_row(x[r], out[r])


@njit(cache=True, parallel=True)
def quantize_rows_q5_0(x, out):
    for r in prange(x.shape[0]):
        _q5_0_row(x[r], out[r])


@njit(cache=True, parallel=True)
def quantize_rows_q5_1(x, out):
    for r in prange(x.shape[0]):
        _q5_1_row(x[r], out[r])


@njit(cache=True, parallel=True)
def quantize_rows_q2_k(x, out):
    for r in prange(x.shape[0]):
        _q2_k_row(x[r], out[r])


@njit(cache=True, parallel=True)
def quantize_rows_q3_k(x, out):
    for r in prange(x.shape[0]):
        _q3_k_row(x[r], out[r])


@njit(cache=True, parallel=True)
def quantize_rows_q4_k(x, out):
    for r in prange(x.shape[0]):
        _q4_k_row(x[r], out[r])


@njit(cache=True, parallel=True)
def quantize_rows_q5_k(x, out):
    for r in prange(x.shape[0]):
        _q5_k_row(x[r], out[r])


@njit(cache=True, parallel=True)
def quantize_rows_q6_k(x, out):
    for r in prange(x.shape[0]):
        _q6_k_row(x[r], out[r])


# ---- with an importance matrix (ggml's quantize_row_*_impl, used when llama-quantize gets --imatrix) ---------
#
# qw is the row's importance: one float32 per column (llama.cpp's imatrix entry of the tensor, sums / counts).


@njit(cache=True)
def make_qkx3_quants(n, nmax, x, weights, L, Laux, rmin, rdelta, nstep, use_mad):
    """ggml make_qkx3_quants with weights given; returns (scale, the_min) with the_min = -min >= 0."""
    mn = x[0]
    mx = x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        w = weights[i]
        sum_w += w
        sum_x += w * x[i]
    if mn > 0:
        mn = F32(0.0)
    if mx <= mn:
        for i in range(n):
            L[i] = 0
        return F32(0.0), -mn
    fnmax = F32(nmax)
    iscale = fnmax / (mx - mn)
    scale = F32(1.0) / iscale
    best_mad = F32(0.0)
    for i in range(n):
        li = nearest_int(iscale * (x[i] - mn))
        L[i] = max(0, min(nmax, li))
        diff = scale * F32(L[i]) + mn - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_mad += weights[i] * diff
    if nstep < 1:
        return scale, -mn
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F32(step) + fnmax) / (mx - mn)
        sum_l = F32(0.0)
        sum_l2 = F32(0.0)
        sum_xl = F32(0.0)
        for i in range(n):
            li = nearest_int(iscale * (x[i] - mn))
            li = max(0, min(nmax, li))
            Laux[i] = li
            w = weights[i]
            fl = F32(li)
            sum_l += w * fl
            sum_l2 += w * fl * fl
            sum_xl += w * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F32(0.0)
                this_scale = sum_xl / sum_l2
            mad = F32(0.0)
            for i in range(n):
                diff = this_scale * F32(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                mad += weights[i] * diff
            if mad < best_mad:
                for i in range(n):
                    L[i] = Laux[i]
                best_mad = mad
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(cache=True)
def make_qp_quants(n, nmax, x, L, quant_weights):
    """ggml make_qp_quants. L is uint8 in C: stores wrap (& 0xFF), the running sums use the unwrapped ints."""
    mx = F32(0.0)
    for i in range(n):
        mx = max(mx, x[i])
    if mx < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    fnmax = F32(nmax)
    iscale = fnmax / mx
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 0xFF
    scale = F32(1.0) / iscale
    best_mse = F32(0.0)
    for i in range(n):
        diff = x[i] - scale * F32(L[i])
        best_mse += quant_weights[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (F32(0.1) * F32(step) + fnmax) / mx
        scale_is = F32(1.0) / iscale_is
        mse = F32(0.0)
        for i in range(n):
            li = min(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * F32(li)
            mse += quant_weights[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        li = min(nmax, nearest_int(iscale * x[i]))
        L[i] = li & 0xFF
        w = quant_weights[i]
        sumlx += w * x[i] * F32(li)
        suml2 += w * F32(li) * F32(li)
    for _itry in range(5):
        n_changed = 0
        for i in range(n):
            w = quant_weights[i]
            fli = F32(L[i])
            slx = sumlx - w * x[i] * fli
            sl2 = suml2 - w * fli * fli
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    fnl = F32(new_l)
                    slx += w * x[i] * fnl
                    sl2 += w * fnl * fnl
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else F32(0.0)


@njit(cache=True)
def _q2_k_row_imatrix(x, qw, y):
    L = np.zeros(QK_K, np.int64)
    Laux = np.zeros(16, np.int64)
    weight = np.zeros(16, np.float32)
    mins = np.zeros(16, np.float32)
    scales = np.zeros(16, np.float32)
    sw = np.zeros(16, np.float32)
    Ls = np.zeros(16, np.int64)
    Lm = np.zeros(16, np.int64)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K : (i + 1) * QK_K]
        yb = y[i * 84 : (i + 1) * 84]
        for j in range(16):
            sw[j] = 0
        sumx2 = F32(0.0)
        for j in range(QK_K):
            sumx2 += xb[j] * xb[j]
        sigma2 = sumx2 / F32(QK_K)
        for j in range(16):
            for l in range(16):
                weight[l] = qw[QK_K * i + 16 * j + l] * _sqrtf(sigma2 + xb[16 * j + l] * xb[16 * j + l])
            for l in range(16):
                sw[j] += weight[l]
            s, m = make_qkx3_quants(16, 3, xb[16 * j : 16 * j + 16], weight, L[16 * j : 16 * j + 16], Laux,
                                    F32(-0.9), F32(0.05), 36, False)
            scales[j] = s
            mins[j] = m
        dm = make_qp_quants(16, 15, scales, Ls, sw)
        mm = make_qp_quants(16, 15, mins, Lm, sw)
        dm = _put_f16(yb, 80, dm)
        mm = _put_f16(yb, 82, mm)
        for j in range(16):
            yb[j] = np.uint8((Ls[j] | (Lm[j] << 4)) & 0xFF)
        for j in range(16):
            sc = np.int64(yb[j])
            d = dm * F32(sc & 0xF)
            if d == 0:
                continue
            m = mm * F32(sc >> 4)
            for ii in range(16):
                li = nearest_int((xb[16 * j + ii] + m) / d)
                L[16 * j + ii] = max(0, min(3, li))
        for j in range(0, QK_K, 128):
            for l in range(32):
                yb[16 + j // 4 + l] = np.uint8(
                    (L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6)) & 0xFF)


@njit(cache=True)
def _q3_k_row_imatrix(x, qw, y):
    L = np.zeros(QK_K, np.int64)
    scales = np.zeros(16, np.float32)
    weight = np.zeros(16, np.float32)
    sw = np.zeros(16, np.float32)
    Ls = np.zeros(16, np.int64)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K : (i + 1) * QK_K]
        yb = y[i * 110 : (i + 1) * 110]
        sumx2 = F32(0.0)
        for j in range(QK_K):
            sumx2 += xb[j] * xb[j]
        sigma2 = F32(2.0) * sumx2 / F32(QK_K)
        for j in range(16):
            for l in range(16):
                weight[l] = qw[QK_K * i + 16 * j + l] * _sqrtf(sigma2 + xb[16 * j + l] * xb[16 * j + l])
            sumw = F32(0.0)
            for l in range(16):
                sumw += weight[l]
            sw[j] = sumw
            scales[j] = make_qx_quants(16, 4, xb[16 * j : 16 * j + 16], L[16 * j : 16 * j + 16], 1, weight, True)
        for k in range(12):
            yb[96 + k] = 0
        d_block = make_qx_quants(16, 32, scales, Ls, 1, sw, True)
        for j in range(16):
            li = Ls[j]
            if j < 8:
                yb[96 + j] = np.uint8(li & 0xF)
            else:
                yb[96 + j - 8] = np.uint8(np.int64(yb[96 + j - 8]) | ((li & 0xF) << 4))
            li >>= 4
            yb[96 + 8 + j % 4] = np.uint8((np.int64(yb[96 + 8 + j % 4]) | (li << (2 * (j // 4)))) & 0xFF)
        d_all = _put_f16(yb, 108, d_block)
        for j in range(16):
            d = d_all * F32(_q3_k_scale(yb, j))
            if d == 0:
                continue
            for ii in range(16):
                li = nearest_int(xb[16 * j + ii] / d)
                L[16 * j + ii] = max(-4, min(3, li)) + 4
        for k in range(32):
            yb[k] = 0
        m = 0
        hm = 1
        for j in range(QK_K):
            if L[j] > 3:
                yb[m] = np.uint8(np.int64(yb[m]) | hm)
                L[j] -= 4
            m += 1
            if m == QK_K // 8:
                m = 0
                hm <<= 1
        for j in range(0, QK_K, 128):
            for l in range(32):
                yb[32 + j // 4 + l] = np.uint8(
                    (L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6)) & 0xFF)


@njit(cache=True)
def _qk_k_row_imatrix(x, qw, y, nmax, bs, clamp63):
    """quantize_row_q4_K_impl (nmax 15, 144-byte blocks) and q5_K_impl (nmax 31, 176-byte blocks)."""
    L = np.zeros(QK_K, np.int64)
    Laux = np.zeros(32, np.int64)
    Ls = np.zeros(8, np.int64)
    Lm = np.zeros(8, np.int64)
    weights = np.zeros(32, np.float32)
    sw = np.zeros(8, np.float32)
    mins = np.zeros(8, np.float32)
    scales = np.zeros(8, np.float32)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K : (i + 1) * QK_K]
        yb = y[i * bs : (i + 1) * bs]
        sum_x2 = F32(0.0)
        for l in range(QK_K):
            sum_x2 += xb[l] * xb[l]
        sigma2 = F32(2.0) * sum_x2 / F32(QK_K)
        for j in range(8):
            for l in range(32):
                weights[l] = qw[QK_K * i + 32 * j + l] * _sqrtf(sigma2 + xb[32 * j + l] * xb[32 * j + l])
            sumw = F32(0.0)
            for l in range(32):
                sumw += weights[l]
            sw[j] = sumw
            s, m = make_qkx3_quants(32, nmax, xb[32 * j : 32 * j + 32], weights, L[32 * j : 32 * j + 32], Laux,
                                    F32(-0.9), F32(0.05), 36, False)
            scales[j] = s
            mins[j] = m
        d_block = make_qp_quants(8, 63, scales, Ls, sw)
        m_block = make_qp_quants(8, 63, mins, Lm, sw)
        for k in range(12):
            yb[4 + k] = 0
        for j in range(8):
            ls = Ls[j]
            lm = Lm[j]
            if clamp63:
                ls = min(63, ls)
                lm = min(63, lm)
            _pack_scale_min_k4(yb, 4, j, ls, lm)
        d_all = _put_f16(yb, 0, d_block)
        dmin_all = _put_f16(yb, 2, m_block)
        for j in range(8):
            sc, m = _get_scale_min_k4(yb, 4, j)
            d = d_all * F32(sc)
            if d == 0:
                continue
            dm = dmin_all * F32(m)
            for ii in range(32):
                li = nearest_int((xb[32 * j + ii] + dm) / d)
                L[32 * j + ii] = max(0, min(nmax, li))
        if nmax == 15:
            for j in range(0, QK_K, 64):
                for l in range(32):
                    yb[16 + j // 2 + l] = np.uint8(L[j + l] | (L[j + l + 32] << 4))
        else:
            _q5_k_pack(yb, L)


@njit(cache=True)
def _q6_k_row_imatrix(x, qw, y):
    L = np.zeros(QK_K, np.int64)
    scales = np.zeros(16, np.float32)
    for i in range(x.shape[0] // QK_K):
        xb = x[i * QK_K : (i + 1) * QK_K]
        yb = y[i * 210 : (i + 1) * 210]
        max_scale = F32(0.0)
        max_abs_scale = F32(0.0)
        for ib in range(16):
            o = QK_K * i + 16 * ib
            s = make_qx_quants(16, 32, xb[16 * ib : 16 * ib + 16], L[16 * ib : 16 * ib + 16], 1, qw[o : o + 16],
                               True)
            scales[ib] = s
            if abs(s) > max_abs_scale:
                max_abs_scale = abs(s)
                max_scale = s
        if max_abs_scale < GROUP_MAX_EPS:
            for k in range(210):
                yb[k] = 0
            continue
        iscale = F32(-128.0) / max_scale
        d_all = _put_f16(yb, 208, F32(1.0) / iscale)
        for ib in range(16):
            yb[192 + ib] = np.uint8(min(127, nearest_int(iscale * scales[ib])) & 0xFF)
        for j in range(16):
            d = d_all * F32(np.int8(yb[192 + j]))
            if d == 0:
                continue
            for ii in range(16):
                li = nearest_int(xb[16 * j + ii] / d)
                L[16 * j + ii] = max(-32, min(31, li)) + 32
        _q6_k_pack(yb, L)


@njit(cache=True)
def _row_sigma2(x):
    sum_x2 = F32(0.0)
    for j in range(x.shape[0]):
        sum_x2 += x[j] * x[j]
    return sum_x2 / F32(x.shape[0])


@njit(cache=True)
def _legacy_row_imatrix(x, qw, y, kind):
    """quantize_row_q4_0_impl (kind 0), q4_1 (1), q5_0 (2), q5_1 (3): one importance-weighted fit per block."""
    weight = np.zeros(QK, np.float32)
    L = np.zeros(QK, np.int64)
    Laux = np.zeros(QK, np.int64)
    sigma2 = _row_sigma2(x)
    bs = (18, 20, 22, 24)[kind]
    for ib in range(x.shape[0] // QK):
        xb = x[QK * ib : QK * (ib + 1)]
        b = ib * bs
        for j in range(QK):
            weight[j] = qw[QK * ib + j] * _sqrtf(sigma2 + xb[j] * xb[j])
        if kind == 0 or kind == 2:
            d = make_qx_quants(QK, 8 if kind == 0 else 16, xb, L, 1, weight, True)
            _put_f16(y, b, d)
            q = b + 2
        else:
            d, mn = make_qkx3_quants(QK, 15 if kind == 1 else 31, xb, weight, L, Laux, F32(-0.9), F32(0.05), 36,
                                     False)
            _put_f16(y, b, d)
            _put_f16(y, b + 2, -mn)
            q = b + 4
        if kind <= 1:
            for j in range(16):
                y[q + j] = np.uint8((L[j] | (L[j + 16] << 4)) & 0xFF)
        else:
            qh = 0
            for j in range(16):
                xi0 = L[j] & 0xFF
                xi1 = L[j + 16] & 0xFF
                y[q + 4 + j] = np.uint8((xi0 & 0x0F) | ((xi1 & 0x0F) << 4))
                qh |= ((xi0 & 0x10) >> 4) << j
                qh |= ((xi1 & 0x10) >> 4) << (j + 16)
            for k in range(4):
                y[q + k] = np.uint8((qh >> (8 * k)) & 0xFF)


# Entry points: quantize_rows_<fmt>_imatrix(x, qw, out), qw float32 (cols,) shared by all rows.


@njit(cache=True, parallel=True)
def quantize_rows_q2_k_imatrix(x, qw, out):
    for r in prange(x.shape[0]):
        _q2_k_row_imatrix(x[r], qw, out[r])


@njit(cache=True, parallel=True)
def quantize_rows_q3_k_imatrix(x, qw, out):
    for r in prange(x.shape[0]):
        _q3_k_row_imatrix(x[r], qw, out[r])


@njit(cache=True, parallel=True)
def quantize_rows_q4_k_imatrix(x, qw, out):
    for r in prange(x.shape[0]):
        _qk_k_row_imatrix(x[r], qw, out[r], 15, 144, False)


@njit(cache=True, parallel=True)
def quantize_rows_q5_k_imatrix(x, qw, out):
    for r in prange(x.shape[0]):
        _qk_k_row_imatrix(x[r], qw, out[r], 31, 176, True)


@njit(cache=True, parallel=True)
def quantize_rows_q6_k_imatrix(x, qw, out):
    for r in prange(x.shape[0]):
        _q6_k_row_imatrix(x[r], qw, out[r])


@njit(cache=True, parallel=True)
def quantize_rows_q4_0_imatrix(x, qw, out):
    for r in prange(x.shape[0]):
        _legacy_row_imatrix(x[r], qw, out[r], 0)


@njit(cache=True, parallel=True)
def quantize_rows_q4_1_imatrix(x, qw, out):
    for r in prange(x.shape[0]):
        _legacy_row_imatrix(x[r], qw, out[r], 1)


@njit(cache=True, parallel=True)
def quantize_rows_q5_0_imatrix(x, qw, out):
    for r in prange(x.shape[0]):
        _legacy_row_imatrix(x[r], qw, out[r], 2)


@njit(cache=True, parallel=True)
def quantize_rows_q5_1_imatrix(x, qw, out):
    for r in prange(x.shape[0]):
        _legacy_row_imatrix(x[r], qw, out[r], 3)
