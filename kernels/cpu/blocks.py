"""Small transformer operations as compiled kernels: RMSNorm, RoPE and the gated FFN activation.

In numpy each is a handful of temporary arrays and ufunc calls, 20-40 us per call on a 576-wide vector; a decode
step makes ~150 of them (smollm2), as much time as its matrix products. Compiled, each is a few microseconds.
Semantics are those of the numpy versions in kernels/reference.py (RMSNorm accumulates in float64, as ggml does).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from localllm.kernels.cpu.simd import bits_to_float


@njit(cache=True)
def rms_norm_rows(x, weight, eps, out):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for each row r of the 2-D arrays x and out."""
    rows, d = x.shape
    for r in range(rows):
        acc = 0.0  # float64
        for i in range(d):
            v = np.float64(x[r, i])
            acc += v * v
        scale = np.float32(1.0 / np.sqrt(acc / d + eps))
        for i in range(d):
            out[r, i] = (x[r, i] * scale) * weight[i]


@njit(cache=True)
def rope_rows(x, cos, sin, rope_dim, neox):
    """Rotate x (n, heads, head_dim) in place by position p's angles, cos/sin (n, rope_dim // 2).

    neox pairs element i with i + rope_dim/2; otherwise adjacent elements (2i, 2i+1) are paired.
    """
    n, heads, _ = x.shape
    half = rope_dim // 2
    for t in range(n):
        for h in range(heads):
            for i in range(half):
                c = cos[t, i]
                s = sin[t, i]
                if neox:
                    a = x[t, h, i]
                    b = x[t, h, i + half]
                    x[t, h, i] = a * c - b * s
                    x[t, h, i + half] = a * s + b * c
                else:
                    a = x[t, h, 2 * i]
                    b = x[t, h, 2 * i + 1]
                    x[t, h, 2 * i] = a * c - b * s
                    x[t, h, 2 * i + 1] = a * s + b * c


GATE_SILU, GATE_GELU_TANH = 0, 1
_GELU_C = np.float32(np.sqrt(2.0 / np.pi))
_GELU_A = np.float32(0.044715)
_F1 = np.float32(1.0)

# exp(x) for float32 in plain arithmetic (Cephes expf: x = n ln2 + r, |r| <= ln2/2, a degree-7 polynomial for e^r,
# 2^n from the exponent bits), so that LLVM vectorizes the activation loop: np.exp/np.tanh are scalar libm calls,
# and were 27% of gemma3-270m's prompt time (GELU, 240 of 903 ms for 512 tokens) and 8-10% of the Qwen models'
# (SiLU). Within 2 ulp of exp over the clamped range (tests/test_blocks.py).
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MAX = np.float32(88.3762626647949)
_EXP_MIN = np.float32(-87.3365478515625)  # e^x above the smallest normal float: 2^n stays a normal number
_INF = np.float32(np.inf)
_ROUND = np.float32(12582912.0)  # 1.5 * 2**23: adding it rounds a float32 below 2**22 to an integer
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)


@njit(cache=True)
def exp_f32(x):
    """e^x for a float32 x: inf above 88.38, the smallest normal float (1.2e-38, not 0) below -87.34."""
    c = min(max(x, _EXP_MIN), _EXP_MAX)
    n = (c * _LOG2E + _ROUND) - _ROUND
    r = (c - n * _LN2_HI) - n * _LN2_LO
    p = ((((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5) * r) * r + r + _F1
    e = p * bits_to_float((np.int32(n) + np.int32(127)) << 23)
    return _INF if x > _EXP_MAX else e


@njit(cache=True, error_model="numpy")  # no ZeroDivisionError branch: it kept the loop scalar
def gated_activation_part(gate, up, kind, out, r0, r1, c0, c1):
    """out = act(gate) * up elementwise over rows r0:r1, columns c0:c1 of 2-D float32 arrays: SiLU (kind 0,
    x * sigmoid(x)) or the tanh GELU (kind 1, ggml_gelu: 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715
    x^3), computed as x * sigmoid(2u), the same function). Whole arrays and bounds rather than slices: a column
    slice has an unknown inner stride to the compiler, and its loop stayed scalar (the fused forward's activation
    phase took 274 ms of qwen2.5-coder-1.5b's 512-token prompt; vectorized, see the commit)."""
    # unsigned indices: no negative-index wraparound for the compiler to keep (with it the loop stayed scalar)
    for r in range(np.uint64(r0), np.uint64(r1)):
        for i in range(np.uint64(c0), np.uint64(c1)):
            x = gate[r, i]
            if kind == GATE_SILU:
                t = -x
            else:
                t = np.float32(-2.0) * _GELU_C * x * (_F1 + _GELU_A * x * x)
            out[r, i] = (x / (_F1 + exp_f32(t))) * up[r, i]


@njit(cache=True)
def gated_activation(gate, up, kind, out):
    """out = act(gate) * up elementwise (2-D float32 arrays), one vectorized pass instead of numpy's four
    temporaries (gated_activation_part)."""
    gated_activation_part(gate, up, kind, out, 0, gate.shape[0], 0, gate.shape[1])
