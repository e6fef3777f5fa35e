"""The CPU backend: numpy arrays as tensors, Numba kernels (`kernels/ops.py`, `kernels/cpu/`) as operations,
and the fused whole-forward (`kernels/cpu/fused_forward.py`) as its override for one sequence."""

from __future__ import annotations

import numpy as np

from localllm.backends.base import Backend
from localllm.kernels import ops

_F32 = np.float32


class CpuBackend(Backend):
    name = "cpu"
    precise_min_rows = ops.BLAS_MIN_N

    # The kernel module, for the few callers that need CPU-only features (threads, bandwidth figures).
    ops = ops

    def matrix(self, gguf_file, name):
        return ops.Weight.from_gguf(gguf_file, name)

    def vector(self, values):
        return values

    def group(self, matrices):
        return ops.WeightGroup(list(matrices))

    def embed(self, w, ids):
        return ops.embed(w, ids)

    def matmul(self, w, x, precise=False):
        return ops.matmul(w, x, precise=precise)

    def group_matmul(self, group, x, precise=False):
        return group(x, precise=precise)

    def add(self, a, b):
        return a + b

    def add_bias(self, x, bias):
        x += bias

    def scale(self, x, s):
        x *= _F32(s)

    def rms_norm(self, x, weight, eps):
        return ops.rms_norm(x, weight, eps)

    def rope(self, x, cos, sin, rope_dim, neox):
        ops.rope(x, cos, sin, rope_dim, neox)

    def gated_activation(self, gate, up, kind):
        return ops.gated_activation(gate, up, kind)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def rows(self, x, rows):
        return np.ascontiguousarray(x[rows], dtype=_F32)

    def slice_rows(self, x, start, stop):
        return x[start:stop]

    def empty(self, shape):
        return np.empty(shape, _F32)

    def kv_write(self, cache, layer, k, v):
        cache.write(layer, k, v)

    def attention(self, q, cache, layer, positions, window, scale, out=None):
        a = ops.attention(q, cache.attention_inputs(layer), positions, cache.start(layer), window, scale)
        if out is None:
            return a
        out[...] = a
        return out

    def to_host(self, x):
        return x

    def whole_forward(self, model):
        """The fused forward (one compiled call per step for one sequence); `.available` is False where some
        weight's format has no integer kernel."""
        c, tr = model.config, model.config.traits
        return ops.FusedForward(
            [[L.wq, L.wk, L.wv, L.wo, L.ffn_gate, L.ffn_up, L.ffn_down] for L in model.layers], model.output,
            [[L.attn_norm, L.ffn_norm, L.bq, L.bk, L.bv, L.q_norm, L.k_norm, L.attn_post_norm, L.ffn_post_norm]
             for L in model.layers], model.output_norm,
            (c.n_layers, c.n_head, c.n_head_kv, c.head_dim, c.value_dim, c.rope_dim, c.n_embd, c.n_ff,
             c.vocab_size),
            (tr.rope_style == "neox", tr.qk_norm, tr.post_norms, ops.GATES[tr.activation]), c.rms_eps,
            c.attention_scale)

    def warm_up_calls(self, weights):
        return ops.warm_up_calls(weights)
