"""The KV cache: keys and values of every layer for the tokens a sequence has processed.

Narrow interface, so the storage can change (paged blocks, prefix sharing, 8-bit) without the model knowing:
`reserve(n)` before a forward of n tokens, `write(layer, k, v)` for those tokens, `keys(layer)` / `values(layer)`
for attention over everything up to and including them, `commit(n)` after the forward, `truncate(n)` to roll
back (speculative decoding). Storage grows in chunks as tokens arrive: nothing is preallocated up to the
context size.
"""

from __future__ import annotations

import numpy as np

GROWTH_CHUNK = 256  # tokens


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, value_dim: int, max_tokens: int):
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.value_dim = value_dim
        self.max_tokens = max_tokens
        self.length = 0  # committed tokens
        self._pending = 0  # tokens written by the forward in progress
        self.capacity = 0
        self._k = [np.empty((n_kv_heads, 0, head_dim), np.float32) for _ in range(n_layers)]
        self._v = [np.empty((n_kv_heads, 0, value_dim), np.float32) for _ in range(n_layers)]

    def reserve(self, n: int) -> None:
        need = self.length + n
        if need > self.max_tokens:
            raise ValueError(f"KV cache holds at most {self.max_tokens} tokens, {need} requested")
        if need > self.capacity:
            # Grow geometrically (amortised O(1) per token) in whole chunks, never past the limit.
            new_cap = min(self.max_tokens, max(need, 2 * self.capacity, GROWTH_CHUNK))
            new_cap = min(self.max_tokens, -(-new_cap // GROWTH_CHUNK) * GROWTH_CHUNK)
            for store, dim in ((self._k, self.head_dim), (self._v, self.value_dim)):
                for layer, old in enumerate(store):
                    grown = np.empty((self.n_kv_heads, new_cap, dim), np.float32)
                    grown[:, : self.length] = old[:, : self.length]
                    store[layer] = grown
            self.capacity = new_cap
        self._pending = n

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """k: (n, n_kv_heads, head_dim), v: (n, n_kv_heads, value_dim) for the n reserved tokens."""
        end = self.length + self._pending
        self._k[layer][:, self.length : end] = k.transpose(1, 0, 2)
        self._v[layer][:, self.length : end] = v.transpose(1, 0, 2)

    def keys(self, layer: int) -> np.ndarray:
        return self._k[layer][:, : self.length + self._pending]

    def values(self, layer: int) -> np.ndarray:
        return self._v[layer][:, : self.length + self._pending]

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a {self.length}-token cache to {n}")
        self.length = n
        self._pending = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._k) + sum(a.nbytes for a in self._v)
