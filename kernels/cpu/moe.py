"""The mixture-of-experts router's product as a compiled kernel (the routing itself is kernels/moe.py, the experts'
products the ordinary weight kernels).

The router (ffn_gate_inp) is float32 in every converted file (llama.cpp never quantizes it); numpy's float32
product would be a gemv per row for few rows and BLAS for many, which sum in different orders, so a token's
experts could change with the batch around it. Here every row takes the same compiled loop.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, fastmath=True)
def router_logits(w, x, out):
    """out[r, e] = x[r] . w[e] in float32, w (n_expert, d), x (n, d). fastmath lets LLVM sum each dot in vector
    lanes; the compiled order depends on d alone, so a row's logits are bitwise the same whatever the rows
    around it."""
    n, d = x.shape
    n_expert = w.shape[0]
    for r in range(n):
        for e in range(n_expert):
            acc = np.float32(0.0)
            for i in range(d):
                acc += w[e, i] * x[r, i]
            out[r, e] = acc
