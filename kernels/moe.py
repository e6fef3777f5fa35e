"""Mixture-of-experts routing, backend-neutral (host numpy on the router's logits): which experts each token
takes, with which weights, and the tokens grouped by expert so that each expert's weights stream once per step.
The CPU backend routes with the same rules compiled (kernels/cpu/moe_kernels.py route_row), which its fused forward shares.

The math is llama.cpp's build_moe_ffn with softmax gating (transformers' Qwen3MoeTopKRouter computes the same):
probabilities p = softmax(logits) over every expert; the k largest, in descending order; their weights p_j, or,
with `normalize` (norm_topk_prob), p_j / sum of the k. Since softmax is monotonic the top k are the k largest
logits, and exp(l_j - max) over the sum of the chosen k's is the renormalised weight: the other experts'
exponentials are needed only without renormalisation.

Each row is computed alone, by elementwise operations and reductions along its own row (numpy reduces a
C-contiguous row the same way whatever the number of rows), so a token's experts and weights are bitwise the
same whatever else is in the batch.
"""

from __future__ import annotations

import numpy as np


def route(logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """(ids, weights) of each row's k chosen experts, best first: int64 and float32 (n, k). Ties go to the lower
    expert index; a NaN logit is never preferred to a number."""
    logits = np.asarray(logits).astype(np.float64)
    n, n_expert = logits.shape
    if not 1 <= k <= n_expert:
        raise ValueError(f"cannot choose {k} of {n_expert} experts")
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]  # NaN sorts last
    top = logits[np.arange(n)[:, None], ids]
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(top - top[:, :1])
        if normalize:
            total = e[:, 0].copy()
            for j in range(1, k):  # in rank order, as ggml_sum_rows over the k chosen
                total += e[:, j]
        else:
            total = np.exp(logits - top[:, :1]).sum(axis=1)
        weights = (e / total[:, None]).astype(np.float32)
    np.copyto(weights, 0.0, where=np.isnan(weights))
    return ids.astype(np.int64), weights


def by_expert(ids: np.ndarray, n_expert: int) -> list[tuple[int, np.ndarray]]:
    """The (token, slot) pairs each expert serves: [(expert, flat indices token * k + slot, ascending)] for the
    experts at least one token chose, in expert order."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=n_expert)
    groups, start = [], 0
    for e in np.flatnonzero(counts).tolist():
        stop = start + int(counts[e])
        groups.append((e, order[start:stop]))
        start = stop
    return groups
