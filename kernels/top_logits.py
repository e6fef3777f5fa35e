"""A logits row reduced to what a sampler needs when its chain starts with top-k: the type a backend's device
sampling reduction returns (kernels/opencl/plan.py) and the sampler takes (localllm/chat/sampling.py), with its
numpy reference. numpy only: every start imports it (gguf-py's quants, which kernels/reference.py needs, would
cost a start its import time)."""

from __future__ import annotations

import numpy as np

# The most candidates a device reduces a logits row to (TopLogits): llama.cpp's default top_k is 40.
TOP_LOGITS_MAX = 64


class TopLogits:
    """A logits row reduced to what a sampler whose chain starts with top-k needs (a backend's device sampling
    reduction, or `top_logits` here): the k largest logits `vals` (float32) with their token `ids` (int64),
    by decreasing logit then increasing id (numpy's and the host sampler's order); the row's `max` and log-sum-exp
    `lse` (for log-probabilities); `nans`, how many of its logits were NaN; `vocab`, the row's length."""

    __slots__ = ("ids", "vals", "max", "lse", "nans", "vocab")

    def __init__(self, ids, vals, max_: float, lse: float, nans: int, vocab: int):
        self.ids, self.vals = np.asarray(ids, np.int64), np.asarray(vals, np.float32)
        self.max, self.lse, self.nans, self.vocab = float(max_), float(lse), int(nans), int(vocab)

    def __len__(self) -> int:
        return len(self.ids)


def top_logits(x: np.ndarray, k: int) -> TopLogits:
    """The reference reduction: the k largest of a logits row (NaNs left out and counted), in TopLogits' order;
    the log-sum-exp in float64."""
    x = np.asarray(x, np.float32).ravel()
    ok = ~np.isnan(x)
    ids = np.flatnonzero(ok)
    order = np.lexsort((ids, -x[ids]))[:k]  # by decreasing value, then increasing id
    ids = ids[order]
    finite = x[ok]
    m = float(finite.max()) if finite.size else -np.inf
    lse = m + float(np.log(np.exp(finite.astype(np.float64) - m).sum())) if np.isfinite(m) else m
    return TopLogits(ids, x[ids], m, lse, int((~ok).sum()), x.size)
