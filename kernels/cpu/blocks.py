"""Small transformer operations as compiled kernels: RMSNorm, RoPE and the gated FFN activation.

In numpy each is a handful of temporary arrays and ufunc calls, 20-40 us per call on a 576-wide vector; a decode
step makes ~150 of them (smollm2), as much time as its matrix products. Compiled, each is a few microseconds.
Semantics are those of the numpy versions in kernels/reference.py (RMSNorm accumulates in float64, as ggml does).
"""

from __future__ import annotations

import numpy as np
from numba import njit


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


@njit(cache=True)
def gated_activation(gate, up, kind, out):
    """out = act(gate) * up elementwise (2-D float32 arrays): SiLU (kind 0) or the tanh GELU (kind 1, ggml_gelu),
    one pass instead of numpy's four temporaries."""
    rows, d = gate.shape
    for r in range(rows):
        for i in range(d):
            x = gate[r, i]
            if kind == GATE_SILU:
                a = x / (np.float32(1.0) + np.exp(-x))
            else:
                a = np.float32(0.5) * x * (np.float32(1.0) + np.tanh(_GELU_C * x * (np.float32(1.0)
                                                                                   + np.float32(0.044715) * x * x)))
            out[r, i] = a * up[r, i]
