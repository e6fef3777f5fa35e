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
