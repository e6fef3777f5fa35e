"""Plain numpy reference of every kernel operation, for tests: slow, obviously right.

Dequantization is gguf-py's own (`gguf.quants.dequantize`, a numpy port of ggml's dequantize_row_*); matmul is
done in float64 on the dequantized matrix.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 (rows, cols) from raw uint8 (rows, row_bytes)."""
    return np.asarray(_gguf_dequantize(np.asarray(raw, dtype=np.uint8), qtype), dtype=np.float32)


def matmul(raw: np.ndarray, qtype: GGMLQuantizationType, x: np.ndarray) -> np.ndarray:
    """float64 (n, rows) = x @ W.T with W dequantized, every product and sum in float64."""
    return np.asarray(x, dtype=np.float64) @ dequantize(raw, qtype).astype(np.float64).T


def embed(raw: np.ndarray, qtype: GGMLQuantizationType, ids: np.ndarray) -> np.ndarray:
    return dequantize(raw, qtype)[np.asarray(ids, dtype=np.int64)]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, the mean of squares accumulated in float64 (as ggml does)."""
    ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    return (x * (1.0 / np.sqrt(ms + eps)).astype(np.float32)) * weight


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_dim: int, neox: bool) -> np.ndarray:
    """x (n, heads, head_dim) rotated by cos/sin (n, rope_dim/2): NeoX halves or adjacent pairs."""
    x = x.copy()
    c, s = cos[:, None, :], sin[:, None, :]
    if neox:
        half = rope_dim // 2
        a, b = x[..., :half].copy(), x[..., half:rope_dim].copy()
        x[..., :half], x[..., half:rope_dim] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0:rope_dim:2].copy(), x[..., 1:rope_dim:2].copy()
        x[..., 0:rope_dim:2], x[..., 1:rope_dim:2] = a * c - b * s, a * s + b * c
    return x


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, q_positions: np.ndarray, scale: float,
              window: int, key_start: int = 0, softcap: float = 0.0) -> np.ndarray:
    """Grouped-query attention of n queries over T cached tokens (positions key_start..key_start+T-1: a
    sliding-window layer's cache drops keys no query can see any more).

    q: (n, n_head, d); keys: (n_kv, T, d); values: (n_kv, T, dv). Query head h reads KV head h // group, as
    ggml's broadcasting does. Causal; with `window` > 0 a query at p sees only keys at p - window < j <= p.
    softcap > 0: scores become tanh(s / softcap) * softcap before the mask (gemma2). Returns (n, n_head * dv).
    """
    if window > 0:
        # Start at the first key any query can see: the result is then the same, to the bit, whether the cache
        # still holds older keys or dropped them (masked keys would still shift the float summation order).
        lo = int(q_positions[0]) - window + 1 - key_start
        if lo > 0:
            keys, values, key_start = keys[:, lo:], values[:, lo:], key_start + lo
    n, n_head, d = q.shape
    n_kv, t, dv = values.shape
    group = n_head // n_kv
    qg = q.reshape(n, n_kv, group, d).transpose(1, 2, 0, 3).reshape(n_kv, group * n, d)
    scores = np.matmul(qg, keys.transpose(0, 2, 1)).reshape(n_kv, group, n, t)
    scores *= scale
    if softcap > 0:
        scores = np.tanh(scores / softcap) * softcap
    key_pos = np.arange(key_start, key_start + t)
    masked = key_pos[None, :] > q_positions[:, None]
    if window > 0:
        masked |= key_pos[None, :] <= q_positions[:, None] - window
    if masked.any():
        scores[:, :, masked] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores.reshape(n_kv, group * n, t), values)  # (n_kv, group*n, dv)
    return out.reshape(n_kv, group, n, dv).transpose(2, 0, 1, 3).reshape(n, n_head * dv)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    # ggml_gelu: the tanh approximation, as GeGLU models were trained with.
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * x * (1.0 + 0.044715 * x * x)))


def moe_ffn(x: np.ndarray, router: np.ndarray, gates, ups, downs, k: int, normalize: bool,
            kind: str = "silu") -> np.ndarray:
    """A mixture-of-experts FFN as transformers' Qwen3MoeSparseMoeBlock computes it, in float64, token by token:
    softmax over the router's logits (router (n_expert, d)), the k most probable experts, their probabilities
    (renormalised to sum to 1 with `normalize`) weighting each chosen expert's act(x gate^T) * (x up^T) down^T.
    gates/ups/downs: one float matrix per expert, (n_ff, d) and (d, n_ff). Returns (n, d)."""
    act = silu if kind == "silu" else gelu_tanh
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(router, np.float64).T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    out = np.zeros((x.shape[0], np.asarray(downs[0]).shape[0]))
    for t in range(x.shape[0]):
        chosen = np.argsort(-p[t], kind="stable")[:k]
        w = p[t, chosen] / (p[t, chosen].sum() if normalize else 1.0)
        for e, we in zip(chosen, w):
            h = act(np.asarray(gates[e], np.float64) @ x[t]) * (np.asarray(ups[e], np.float64) @ x[t])
            out[t] += we * (np.asarray(downs[e], np.float64) @ h)
    return out
