"""The mixture-of-experts router's product and routing as compiled kernels (the experts' products are the
ordinary weight kernels), shared by the op-by-op FFN (kernels/ops.py moe_ffn) and the fused forward
(kernels/cpu/fused_forward.py), so the two choose the same experts with bitwise the same weights.

The router (ffn_gate_inp) is float32 in every converted file (llama.cpp never quantizes it); numpy's float32
product would be a gemv per row for few rows and BLAS for many, which sum in different orders, so a token's
experts could change with the batch around it. Here every row takes the same compiled loop.

The routing is kernels/moe.py `route` (the backend-neutral numpy version, which the OpenCL backend uses) row by
row in float64: the k largest logits best first, ties to the lower index, a NaN never preferred to a number;
weights exp(l_j - l_best) over the sum of the chosen k's in rank order (`normalize`), else over the sum of every
expert's in index order. numpy's exp and its pairwise sum need not round as LLVM's loop does, so both CPU paths
take this kernel rather than one each.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, fastmath=True)
def router_row(w, x, r, out):
    """out[r, e] = x[r] . w[e] in float32, w (n_expert, d), x (n, d). fastmath lets LLVM sum each dot in vector
    lanes; the compiled order depends on d alone, so a row's logits are bitwise the same whatever the rows
    around it, and whichever caller (the op-by-op path or a worker of the fused forward) computes it."""
    d = x.shape[1]
    for e in range(w.shape[0]):
        acc = np.float32(0.0)
        for i in range(d):
            acc += w[e, i] * x[r, i]
        out[r, e] = acc


@njit(cache=True)
def router_logits(w, x, out):
    """out (n, n_expert) = the router's logits of every row of x (n, d)."""
    for r in range(x.shape[0]):
        router_row(w, x, r, out)


@njit(cache=True)
def _better(a, b):
    """Whether logit a beats b (a NaN never does, a number always beats a NaN); equal ones: neither."""
    if np.isnan(a):
        return False
    return np.isnan(b) or a > b


@njit(cache=True)
def route_row(logits, r, k, normalize, ids, weights):
    """Row r's k experts, best first (ids[r], int64) and their weights (weights[r], float32): as kernels/moe.py
    route computes them (see the module docstring). Reads logits[r] only."""
    n_expert = logits.shape[1]
    taken = np.zeros(n_expert, np.bool_)
    for j in range(k):
        best = -1
        for e in range(n_expert):  # in index order, replaced only by a strictly better one: ties to the lower index
            if not taken[e] and (best < 0 or _better(np.float64(logits[r, e]), np.float64(logits[r, best]))):
                best = e
        taken[best] = True
        ids[r, j] = best
    top = np.float64(logits[r, ids[r, 0]])
    total = 0.0
    if normalize:
        for j in range(k):  # in rank order, as ggml_sum_rows over the k chosen
            total += np.exp(np.float64(logits[r, ids[r, j]]) - top)
    else:
        for e in range(n_expert):
            total += np.exp(np.float64(logits[r, e]) - top)
    for j in range(k):
        w = np.float32(np.exp(np.float64(logits[r, ids[r, j]]) - top) / total)
        weights[r, j] = np.float32(0.0) if np.isnan(w) else w


@njit(cache=True)
def route_rows(logits, k, normalize, ids, weights):
    """route_row for every row: ids (n, k) int64, weights (n, k) float32."""
    for r in range(logits.shape[0]):
        route_row(logits, r, k, normalize, ids, weights)
