"""The CPU backend: numpy arrays as tensors, Numba kernels (`kernels/ops.py`, `kernels/cpu/`) as operations,
and the fused whole-forward (`kernels/cpu/fused_forward.py`) as its override for one sequence."""

from __future__ import annotations

import math

import numpy as np

from localllm.runtime import kv_cache
from localllm.backends.interface import Backend, HostKVStorage
from localllm.kernels import ops
from localllm.kernels.cpu import attention as _attention

# The pool's block geometry is the attention kernels' (they index columns as block * BLOCK + offset).
assert _attention.BLOCK == kv_cache.BLOCK and _attention.QBLOCK == kv_cache.Q8_BLOCK

_F32 = np.float32


class CpuBackend(Backend):
    name = "cpu"
    ops_compile_alone = True
    device_label = "this CPU"
    precise_min_rows = ops.BLAS_MIN_N

    # The kernel module, for the few callers that need CPU-only features (threads, bandwidth figures).
    ops = ops

    @staticmethod
    def tiles(name: str) -> bool:
        """Whether the tensor `name` goes into 16-row tiles where the tiled kernel runs (kernels/cpu/tiled.py):
        dense weights do; the experts of a mixture keep the file's layout (their kernels cut rows anywhere)."""
        return "_exps." not in name

    def matrix(self, gguf_file, name, rows=None):
        return ops.Weight.from_gguf(gguf_file, name, rows, tile=self.tiles(name))

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

    def moe_ffn(self, x, experts, n_used, normalize, kind, precise=False):
        return ops.moe_ffn(experts, x, n_used, normalize, kind, precise=precise)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def rows(self, x, rows):
        return np.ascontiguousarray(x[rows], dtype=_F32)

    def slice_rows(self, x, start, stop):
        return x[start:stop]

    def concat_rows(self, parts):
        return np.concatenate(parts)

    def empty(self, shape):
        return np.empty(shape, _F32)

    def kv_write(self, cache, layer, k, v):
        cache.write(layer, k, v)

    def attention(self, q, cache, layer, positions, window, scale, softcap=0.0):
        return ops.attention(q, _STORAGE.attention_inputs(cache, layer), positions, cache.start(layer), window, scale,
                             softcap)

    def kv_storage(self):
        return _STORAGE

    def begin_load(self, gguf_file, config):
        if ops.FusedForward.unsupported(config.traits) is None:
            ops.FusedForward.start_compiling(gguf_file, self.tiles)

    def whole_forward(self, model):
        """The fused forward (one compiled call per step for one sequence); `.available` is False where some
        weight's format has no integer kernel."""
        return _WholeForward(model)

    def warm_up_calls(self, weights, kv_type=None):
        return ops.warm_up_calls(weights, kv_type)


class CpuKVStorage(HostKVStorage):
    """KV blocks in host numpy arrays, float32 or q8_0, written and read by kernels/cpu/attention.py (its
    attention reads them in place through the block tables)."""

    kv_types = ("f32", "q8_0")

    def write_rows(self, store, scales, cols, x):
        _attention.write_rows(store, scales, cols, x)

    def read_rows(self, store, scales, cols):
        if store.dtype == np.float32:
            return super().read_rows(store, scales, cols)
        out = np.empty((store.shape[0], len(cols), store.shape[2]), np.float32)
        _attention.read_rows(store, scales, cols, out)
        return out

    @staticmethod
    def attention_inputs(cache, layer: int) -> tuple:
        """What kernels/cpu/attention.py reads for `layer` during a forward: (keys, key scales, values, value
        scales, block table from the first held block, that block's index)."""
        gi, slot = cache.pool.where[layer]
        g = cache.pool.groups[gi]
        return g.k[slot], g.k_scale[slot], g.v[slot], g.v_scale[slot], cache.block_arrays[gi], cache.first[gi]

    def layer_arrays(self, pool) -> tuple:
        """Per layer, in layer order: (keys, key scales, values, value scales) as Numba typed lists, for the
        fused forward that visits every layer in one call. Rebuilt only when storage grew."""
        versions = tuple(g.version for g in pool.groups)
        cached = getattr(pool, "_cpu_layer_lists", None)
        if cached is None or cached[0] != versions:
            from localllm.kernels.cpu.typed_lists import typed_list

            per_layer = [pool.groups[gi].stores for gi, _ in (pool.where[i] for i in range(len(pool.where)))]
            slots = [pool.where[i][1] for i in range(len(pool.where))]
            lists = tuple(typed_list([stores[s][slot] for stores, slot in zip(per_layer, slots)])
                          for s in range(4))
            cached = pool._cpu_layer_lists = (versions, lists)
        return cached[1]


_STORAGE = CpuKVStorage()


class _WholeForward:
    """Transformer.forward_batch for one sequence as one compiled call (kernels/cpu/fused_forward.py), bitwise
    the same logits: fused(tokens, cache, output_rows)."""

    def __init__(self, model):
        plan = model.plan
        c, tr = plan.config, plan.config.traits
        self.model, self.plan = model, plan
        # An architecture whose traits the fused forward does not declare runs op by op (Transformer.forward_batch)
        self.unsupported = ops.FusedForward.unsupported(tr)
        if self.unsupported is not None:
            self.available = False
            return
        self.kernel = ops.FusedForward(
            [[getattr(L, role) for role in ops.FusedForward.MATRIX_ROLES] for L in plan.layers], plan.output,
            [[getattr(L, role) for role in ops.FusedForward.VECTOR_ROLES] for L in plan.layers], plan.output_norm,
            # n_ff 0 with experts: no dense FFN buffers
            (c.n_layers, c.n_head, c.n_head_kv, c.head_dim, c.value_dim, c.rope_dim, c.n_embd,
             0 if c.n_expert else c.n_ff, c.vocab_size),
            (tr.rope_style == "neox", tr.qk_norm, tr.post_norms, ops.GATES[tr.activation]), c.rms_eps,
            c.attention_scale, c.attn_softcap,
            experts=[L.experts for L in plan.layers] if c.n_expert else None, n_used=c.n_expert_used,
            normalize=c.expert_weights_norm)
        self.available = self.kernel.available

    def __call__(self, tokens, cache, output_rows) -> np.ndarray:
        """One sequence's step: batch() of one segment without its joining and splitting (every numpy call
        here costs several microseconds: the step's weights have just gone through the caches)."""
        plan = self.plan
        n = len(tokens)
        positions = np.arange(cache.length, cache.length + n)
        rows = np.array([n - 1]) if output_rows is None else np.asarray(output_rows, np.int64).reshape(-1)
        x = self._embedded(list(tokens))
        cos, sin = plan.rope_angles(positions)
        cache.reserve(n)
        tables, firsts, cols = _STORAGE.kernel_tables(cache)
        logits = self.kernel(x, _STORAGE.layer_arrays(cache.pool), cache.pool.layer_group, plan.layer_window,
                             plan.layer_rope, tables, firsts, cols, positions, cos, sin, rows.astype(np.int64))
        cache.commit()
        return logits

    def _embedded(self, ids) -> np.ndarray:
        plan = self.plan
        x = ops.embed(plan.token_embd, np.asarray(ids, dtype=np.int64))
        if plan.config.traits.scale_embeddings:
            x *= np.float32(math.sqrt(plan.config.n_embd))
        return np.ascontiguousarray(x, dtype=np.float32)

    def batch(self, segments) -> list[np.ndarray]:
        """The logits of each segment (tokens, cache, output_rows or None: the last row), for sequences of one
        KV pool, in one compiled call: the server's step over several sequences, each one's logits bitwise
        those of its sequence alone."""
        plan = self.plan
        pool = segments[0][1].pool
        if any(cache.pool is not pool for _, cache, _ in segments):
            raise ValueError("fused forward: the sequences of one step must share a KV pool")
        ids, bounds, positions, rows, row_counts = [], [0], [], [], []
        for tokens, cache, output_rows in segments:
            n = len(tokens)
            ids.extend(int(t) for t in tokens)
            positions.append(np.arange(cache.length, cache.length + n))
            r = np.array([n - 1]) if output_rows is None else np.asarray(output_rows, np.int64).reshape(-1)
            rows.append(r + bounds[-1])
            row_counts.append(len(r))
            bounds.append(bounds[-1] + n)
        positions = np.concatenate(positions)
        x = self._embedded(ids)
        cos, sin = plan.rope_angles(positions)
        tables, firsts, cols = [], [], []
        for tokens, cache, _ in segments:
            cache.reserve(len(tokens))
            t, f, w = _STORAGE.kernel_tables(cache)
            tables.append(t)
            firsts.append(f)
            cols.append(w)
        if len(segments) == 1:
            tables, firsts, bounds = tables[0], firsts[0], None
        else:
            width = max(t.shape[1] for t in tables)
            padded = np.zeros((len(tables), tables[0].shape[0], width), np.int64)
            for s, t in enumerate(tables):
                padded[s, :, : t.shape[1]] = t
            tables, firsts, bounds = padded, np.stack(firsts), np.asarray(bounds, np.int64)
        logits = self.kernel(x, _STORAGE.layer_arrays(pool), pool.layer_group, plan.layer_window, plan.layer_rope,
                             tables, firsts, np.concatenate(cols, axis=1), positions, cos, sin,
                             np.concatenate(rows).astype(np.int64), bounds)
        for _, cache, _ in segments:
            cache.commit()
        return np.split(logits, np.cumsum(row_counts)[:-1])
