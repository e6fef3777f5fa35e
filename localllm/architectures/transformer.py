"""The decoder-only transformer every supported architecture is: weights from GGUF, and one forward pass.

Shared blocks live here once (RMSNorm, RoPE in both pairings, grouped-query attention with causal and
sliding-window masks, gated FFN); an architecture's `ArchTraits` switch between their variants. Matrix
products go through `kernels.ops`, which picks the kernel for each weight's quant format and shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from localllm.kernels import ops
from localllm.architectures.base import ModelConfig
from localllm.errors import ModelFileError
from localllm.gguf_file import GGUFFile
from localllm.kv_cache import KVCache, KVPool

# ---- blocks ----------------------------------------------------------------------------------------------
# RMSNorm, RoPE and the gated activation are compiled kernels (kernels.ops; numpy references in
# kernels/reference.py): in numpy they cost as much per decode step as the matrix products of a small model.
rms_norm = ops.rms_norm


class RopeTable:
    """cos/sin of every position for one (base, scale), grown on demand."""

    def __init__(self, rope_dim: int, base: float, scale: float):
        # ggml_rope: theta_i = pos * scale * base^(-2i/d)
        self.inv_freq = scale * base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
        self.cos = np.empty((0, rope_dim // 2), np.float32)
        self.sin = self.cos

    def get(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        end = int(positions[-1]) + 1
        if end > len(self.cos):
            n = max(end, 2 * len(self.cos), 1024)
            angles = np.arange(n, dtype=np.float64)[:, None] * self.inv_freq[None, :]
            self.cos, self.sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        return self.cos[positions], self.sin[positions]


# ---- weights ---------------------------------------------------------------------------------------------

# Each layer's weight matrices (GGUF names blk.N.<name>.weight), in the order the forward multiplies by them.
MATMULS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass
class LayerWeights:
    attn_norm: np.ndarray
    wq: ops.Weight
    wk: ops.Weight
    wv: ops.Weight
    wo: ops.Weight
    ffn_norm: np.ndarray
    ffn_gate: ops.Weight
    ffn_up: ops.Weight
    ffn_down: ops.Weight
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    attn_post_norm: np.ndarray | None = None
    ffn_post_norm: np.ndarray | None = None

    def __post_init__(self):
        # Matrices that always read the same input: one kernel call each group (kernels.ops.WeightGroup).
        self.qkv = ops.WeightGroup([self.wq, self.wk, self.wv])
        self.gate_up = ops.WeightGroup([self.ffn_gate, self.ffn_up])


def _vector(g: GGUFFile, name: str, length: int) -> np.ndarray:
    info = g.tensor_info(name)
    if info.qtype.name != "F32" or info.n_elements != length:
        raise ModelFileError(f"{g.path}: tensor {name!r} should be {length} F32 values, is {info.qtype.name} "
                             f"{info.shape}")
    return g.raw(name).view(np.float32).reshape(length)


def _matrix(g: GGUFFile, name: str, rows: int, cols: int) -> ops.Weight:
    try:
        w = ops.Weight.from_gguf(g, name)
    except ModelFileError as e:
        if str(g.path) in str(e):
            raise
        raise ModelFileError(f"{g.path}: tensor {name!r}: {e}") from None
    if (w.rows, w.cols) != (rows, cols):
        raise ModelFileError(f"{g.path}: tensor {name!r} has shape ({w.rows}, {w.cols}), expected ({rows}, {cols})")
    return w


class Transformer:
    """Weights of a decoder-only model (views into the GGUF file) and its forward pass."""

    def __init__(self, g: GGUFFile, config: ModelConfig):
        self.config = c = config
        tr = c.traits
        q_dim, kv_dim, v_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim, c.n_head_kv * c.value_dim
        self.token_embd = _matrix(g, "token_embd.weight", c.vocab_size, c.n_embd)
        # Tied embeddings (no output.weight, e.g. SmolLM2, Gemma): the embedding matrix is the output head.
        self.output = _matrix(g, "output.weight", c.vocab_size, c.n_embd) if "output.weight" in g.tensors \
            else self.token_embd
        self.output_norm = _vector(g, "output_norm.weight", c.n_embd)
        self.output_name = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
        # The GGUF name of each layer's matrices, in the order forward_batch multiplies by them.
        self.matmul_names = [tuple(f"blk.{i}.{m}.weight" for m in MATMULS) for i in range(c.n_layers)]

        def optional_vector(name: str, length: int):
            return _vector(g, name, length) if name in g.tensors else None

        self.layers = []
        for i in range(c.n_layers):
            p = f"blk.{i}."
            layer = LayerWeights(
                attn_norm=_vector(g, p + "attn_norm.weight", c.n_embd),
                wq=_matrix(g, p + "attn_q.weight", q_dim, c.n_embd),
                wk=_matrix(g, p + "attn_k.weight", kv_dim, c.n_embd),
                wv=_matrix(g, p + "attn_v.weight", v_dim, c.n_embd),
                wo=_matrix(g, p + "attn_output.weight", c.n_embd, c.n_head * c.value_dim),
                ffn_norm=_vector(g, p + "ffn_norm.weight", c.n_embd),
                ffn_gate=_matrix(g, p + "ffn_gate.weight", c.n_ff, c.n_embd),
                ffn_up=_matrix(g, p + "ffn_up.weight", c.n_ff, c.n_embd),
                ffn_down=_matrix(g, p + "ffn_down.weight", c.n_embd, c.n_ff),
                bq=optional_vector(p + "attn_q.bias", q_dim),
                bk=optional_vector(p + "attn_k.bias", kv_dim),
                bv=optional_vector(p + "attn_v.bias", v_dim),
            )
            if tr.qk_norm:
                layer.q_norm = _vector(g, p + "attn_q_norm.weight", c.head_dim)
                layer.k_norm = _vector(g, p + "attn_k_norm.weight", c.head_dim)
            if tr.post_norms:
                layer.attn_post_norm = _vector(g, p + "post_attention_norm.weight", c.n_embd)
                layer.ffn_post_norm = _vector(g, p + "post_ffw_norm.weight", c.n_embd)
            self.layers.append(layer)

        self._rope = {}
        self.layer_rope = []
        for i in range(c.n_layers):
            key = (c.layer_rope_base(i), c.layer_rope_scale(i))
            if key not in self._rope:
                self._rope[key] = RopeTable(c.rope_dim, *key)
            self.layer_rope.append(self._rope[key])
        self.layer_window = [c.sliding_window if c.layer_is_sliding(i) else 0 for i in range(c.n_layers)]
        self._ropes = list(self._rope.values())
        self._layer_rope_index = np.array([self._ropes.index(t) for t in self.layer_rope], np.int64)
        self._layer_window = np.array(self.layer_window, np.int64)
        # The same forward as one compiled call, for one sequence (decode, speculative verify, prompt chunks).
        self.fused = ops.FusedForward(
            [[L.wq, L.wk, L.wv, L.wo, L.ffn_gate, L.ffn_up, L.ffn_down] for L in self.layers], self.output,
            [[L.attn_norm, L.ffn_norm, L.bq, L.bk, L.bv, L.q_norm, L.k_norm, L.attn_post_norm, L.ffn_post_norm]
             for L in self.layers], self.output_norm,
            (c.n_layers, c.n_head, c.n_head_kv, c.head_dim, c.value_dim, c.rope_dim, c.n_embd, c.n_ff,
             c.vocab_size),
            (tr.rope_style == "neox", tr.qk_norm, tr.post_norms, ops.GATES[tr.activation]), c.rms_eps,
            c.attention_scale)

    def weights(self) -> list[ops.Weight]:
        """Every weight matrix (for kernel warm-up and accounting)."""
        mats = [self.token_embd, self.output]
        for L in self.layers:
            mats += [L.wq, L.wk, L.wv, L.wo, L.ffn_gate, L.ffn_up, L.ffn_down]
        return mats

    def warm_up_calls(self, kv_type: str) -> list:
        """(label, thunk) compiling the fused forward for this KV type (one compile serves every model)."""
        if not self.fused.available:
            return []

        def run():
            self.forward([0], KVPool.for_model(self.config, kv_type=kv_type).new_cache(4))

        return [(f"whole forward {kv_type}", run)]

    def new_cache(self, max_tokens: int) -> KVCache:
        """A cache with a pool of its own (the engine shares one pool between its sequences instead)."""
        return KVPool.for_model(self.config).new_cache(max_tokens)

    @property
    def can_shift(self) -> bool:
        """Whether a context shift is possible: sliding-window layers (gemma3) keep only their window, so the
        tokens kept at the start (n_keep) are already gone from them."""
        return not any(self.layer_window)

    def shift_cache(self, cache: KVCache, n_keep: int, n_discard: int) -> None:
        """Context shift (llama.cpp's llama_memory_seq_add with a RoPE shift): drop n_discard tokens after the
        first n_keep. Cached keys are post-RoPE and RoPE is a rotation, so rotating them by the position delta
        gives exactly the keys those tokens would have at their new positions."""
        neox = self.config.traits.rope_style == "neox"

        def rotate(layer: int, keys: np.ndarray, delta: int) -> None:
            angles = delta * self.layer_rope[layer].inv_freq
            cos = np.broadcast_to(np.cos(angles).astype(np.float32), (len(keys), len(angles))).copy()
            sin = np.broadcast_to(np.sin(angles).astype(np.float32), (len(keys), len(angles))).copy()
            ops.rope(keys, cos, sin, self.config.rope_dim, neox)

        cache.shift(n_keep, n_discard, rotate)

    def forward(self, tokens, cache: KVCache, output_rows: np.ndarray | None = None,
                precise: bool = False, observe=None) -> np.ndarray:
        """Process `tokens` (appended after the cache's contents); return logits (len(output_rows), vocab).

        output_rows selects which of the new tokens get logits (default: the last one only), so a prompt does
        not pay for a vocabulary-sized matmul per token. `precise`: float32 activations in the matrix products
        of many rows (scoring against a float reference); generation never uses it, since it gives up batch
        invariance (see kernels.ops). `observe`: see forward_batch.
        """
        return self.forward_batch([(tokens, cache, output_rows)], precise, observe)[0]

    def _forward_fused(self, tokens, cache: KVCache, output_rows) -> np.ndarray:
        """forward_batch for one sequence, as one compiled call (kernels.ops.FusedForward): bitwise the same
        logits."""
        c = self.config
        tokens = np.asarray(tokens, dtype=np.int64)
        n = len(tokens)
        positions = np.arange(cache.length, cache.length + n)
        cache.reserve(n)
        x = ops.embed(self.token_embd, tokens)
        if c.traits.scale_embeddings:
            x *= np.float32(math.sqrt(c.n_embd))
        x = np.ascontiguousarray(x, dtype=np.float32)
        angles = [table.get(positions) for table in self._ropes]
        cos = np.stack([a[0] for a in angles])
        sin = np.stack([a[1] for a in angles])
        rows = np.array([n - 1]) if output_rows is None else np.asarray(output_rows, np.int64).reshape(-1)
        pool = cache.pool
        tables, first_blocks, write_cols = cache.kernel_tables()
        logits = self.fused(x, pool.layer_arrays(), pool.layer_group, self._layer_window, self._layer_rope_index,
                            tables, first_blocks, write_cols, positions, cos, sin, rows.astype(np.int64))
        cache.commit()
        return logits

    def forward_batch(self, segments: list, precise: bool = False, observe=None) -> list[np.ndarray]:
        """One forward for several sequences: segments are (tokens, cache, output_rows or None). The matrix
        products run once over all rows (each weight read once per step, whatever the batch); RoPE, the cache
        writes and attention are per sequence. Every kernel computes each row alone, so a sequence's logits
        are bitwise the same whatever else is in the batch.

        `observe(names, x)`, when given, sees the input x (rows, cols) of every product by a weight matrix
        before it is multiplied, with the GGUF names of the weights that take it (Q, K and V share one x): what
        an importance matrix is made of (localllm/imatrix.py). It runs this op-by-op path, never the fused one,
        so a forward without it pays nothing for the hook."""
        if (observe is None and len(segments) == 1 and self.fused.available and len(segments[0][0]) > 0
                and not (precise and len(segments[0][0]) >= ops.BLAS_MIN_N)):
            return [self._forward_fused(*segments[0])]
        c = self.config
        tr = c.traits
        neox = tr.rope_style == "neox"
        ids, bounds, seg_positions = [], [0], []
        for tokens, cache, _ in segments:
            tokens = np.asarray(tokens, dtype=np.int64)
            seg_positions.append(np.arange(cache.length, cache.length + len(tokens)))
            cache.reserve(len(tokens))
            ids.append(tokens)
            bounds.append(bounds[-1] + len(tokens))
        positions = np.concatenate(seg_positions)
        n = bounds[-1]
        angles = {id(table): table.get(positions) for table in self._rope.values()}  # once per forward

        x = ops.embed(self.token_embd, np.concatenate(ids))
        if tr.scale_embeddings:
            x *= np.float32(math.sqrt(c.n_embd))
        for i, L in enumerate(self.layers):
            h = rms_norm(x, L.attn_norm, c.rms_eps)
            if observe is not None:
                observe(self.matmul_names[i][:3], h)
            q, k, v = L.qkv(h, precise=precise)
            if L.bq is not None:
                q += L.bq
            if L.bk is not None:
                k += L.bk
            if L.bv is not None:
                v += L.bv
            q = q.reshape(n, c.n_head, c.head_dim)
            k = k.reshape(n, c.n_head_kv, c.head_dim)
            v = v.reshape(n, c.n_head_kv, c.value_dim)
            if tr.qk_norm:
                q = rms_norm(q, L.q_norm, c.rms_eps)
                k = rms_norm(k, L.k_norm, c.rms_eps)
            cos, sin = angles[id(self.layer_rope[i])]
            ops.rope(q, cos, sin, c.rope_dim, neox)
            ops.rope(k, cos, sin, c.rope_dim, neox)
            if len(segments) == 1:
                cache = segments[0][1]
                cache.write(i, k, v)
                attn = ops.attention(q, cache.attention_inputs(i), positions, cache.start(i), self.layer_window[i],
                                     c.attention_scale)
            else:
                attn = np.empty((n, c.n_head * c.value_dim), np.float32)
                for (_, cache, _), a, b, pos in zip(segments, bounds, bounds[1:], seg_positions):
                    cache.write(i, k[a:b], v[a:b])
                    attn[a:b] = ops.attention(q[a:b], cache.attention_inputs(i), pos, cache.start(i),
                                              self.layer_window[i], c.attention_scale)
            if observe is not None:
                observe(self.matmul_names[i][3:4], attn)
            o = ops.matmul(L.wo, attn, precise=precise)
            if tr.post_norms:
                o = rms_norm(o, L.attn_post_norm, c.rms_eps)
            x = x + o

            h = rms_norm(x, L.ffn_norm, c.rms_eps)
            if observe is not None:
                observe(self.matmul_names[i][4:6], h)
            gate, up = L.gate_up(h, precise=precise)
            act = ops.gated_activation(gate, up, tr.activation)
            if observe is not None:
                observe(self.matmul_names[i][6:], act)
            d = ops.matmul(L.ffn_down, act, precise=precise)
            if tr.post_norms:
                d = rms_norm(d, L.ffn_post_norm, c.rms_eps)
            x = x + d
        for _, cache, _ in segments:
            cache.commit()

        rows = np.concatenate([a + (np.array([b - a - 1]) if out_rows is None else np.asarray(out_rows, np.int64))
                               for (_, _, out_rows), a, b in zip(segments, bounds, bounds[1:])])
        if len(rows) == 0:
            logits = np.empty((0, c.vocab_size), np.float32)
        else:
            out = np.ascontiguousarray(rms_norm(x[rows], self.output_norm, c.rms_eps), dtype=np.float32)
            if observe is not None:
                observe((self.output_name,), out)
            logits = ops.matmul(self.output, out, precise=precise)
        counts = [1 if out_rows is None else len(out_rows) for _, _, out_rows in segments]
        return np.split(logits, np.cumsum(counts)[:-1])
