"""The OpenCL backend: weights, activations and the KV cache on an OpenCL device (kernels/opencl/), the forward
of localllm/architectures/transformer.py run op by op there.

What crosses to the device per forward: the token ids, the positions, the RoPE rows of those positions, and per
layer group the KV storage columns of the new tokens and of the keys attention reads (the block table spelled
out; small ints, uploaded once per group, not per layer); what comes back: only the logits rows asked for
(`to_host`). Weights are uploaded once, the quantized ones re-laid for the device's kernels
(kernels/opencl/cl_formats.py `relayout`: aligned quants, float32 scales), the float ones as stored. A decode step
of one sequence runs instead from a prepared launch list (`whole_forward`, kernels/opencl/plan.py): one upload of
a small step buffer (token, position, RoPE row, KV columns and block tables) and the logits' download a token.

KV storage is the pool's blocks in device arrays (n_kv, columns, dim), float32, or for `kv_type` q8_0 int8 with
float32 scales (n_kv, columns, dim / 32), quantized on the device into the CPU backend's bytes; the pool's
bookkeeping (block tables, prefix names, LRU) stays on the host as integers, so prefix reuse, speculative rollback
and sliding windows work as on the CPU. Every op computes each row alone (batch invariance within this backend); results
differ from the CPU backend's in the last bits (float32 accumulation order), within the tolerances of
tests/test_backend_ops.py.
"""

from __future__ import annotations

import numpy as np

from localllm.backends.interface import Backend, KVStorage
from localllm.runtime.kv_cache import BLOCK
from localllm.errors import LocalLLMError


class OpenCLKVStorage(KVStorage):
    """KV blocks in device arrays: float32, or q8_0 (int8 values and float32 scales, each an array of its own,
    written by ops.cl's kv_write_q8 / rope_kv_q8 as the CPU backend writes them). Growth and block copies are
    byte copies of either, so prefix reuse, copy-on-write and forks need nothing of their own."""

    kv_types = ("f32", "q8_0")

    def __init__(self, ops):
        self.ops = ops
        self.cl = ops.dev.cl

    def new(self, n_kv, dim, dtype):
        return self.ops.empty((n_kv, 0, dim), np.dtype(dtype))

    def grown(self, old, columns):
        n_kv, cols, dim = old.shape
        new = self.ops.empty((n_kv, columns, dim), old.dtype)
        row = old.dtype.itemsize * dim
        if old.size and new.size:
            for h in range(n_kv):  # each head's columns are one run of bytes in both
                self.cl.enqueue_copy(self.ops.dev.queue, new.data, old.data, byte_count=cols * row,
                                     src_offset=h * cols * row, dst_offset=h * columns * row)
        return new

    def copy_columns(self, arr, src, dst, n):
        n_kv, cols, dim = arr.shape
        row = arr.dtype.itemsize * dim
        if arr.size and n:
            for h in range(n_kv):
                self.cl.enqueue_copy(self.ops.dev.queue, arr.data, arr.data, byte_count=n * row,
                                     src_offset=(h * cols + src) * row, dst_offset=(h * cols + dst) * row)

    def write_rows(self, store, scales, cols, x):
        if store.size == 0 or len(cols) == 0:
            return
        x = self.ops.to_device(x) if isinstance(x, np.ndarray) else x
        self.ops.kv_write(store, x, cols=np.asarray(cols, np.int32), scales=_scales(store, scales))

    def read_rows(self, store, scales, cols):
        if store.size == 0:
            return np.empty((store.shape[0], len(cols), store.shape[2]), np.float32)
        rows = np.take(store.get(), cols, axis=1)  # sessions and tests only: one download of the layer
        if store.dtype == np.float32:
            return rows
        # q8_0: the CPU backend's read_rows, value times its block's scale in float32
        return rows.astype(np.float32) * np.repeat(np.take(scales.get(), cols, axis=1), 32, axis=2)

    def move_columns(self, arr, src, dst):
        if arr.size == 0:
            return
        host = arr.get()  # a context shift (rare): through the host
        host[:, dst] = host[:, src].copy()
        arr.set(np.ascontiguousarray(host))


def _scales(store, scales):
    """The scale array of an int8 (q8_0) store, None for a float32 one (whose scale array is empty)."""
    return scales if store.dtype == np.int8 else None


def _first_device_that_builds(cl_device):
    for info in cl_device.list_devices():
        try:
            dev = cl_device.Device(info.spec)
            dev.check_compiler()
            return dev
        except cl_device.OpenCLUnavailable:
            continue
    return None


class OpenCLBackend(Backend):
    def __init__(self, spec: str | None = None):
        from localllm.kernels.opencl import device as cl_device
        from localllm.kernels.opencl.cl_ops import Ops

        try:
            self.dev = cl_device.Device(spec or None)
            self.dev.check_compiler()
        except cl_device.OpenCLUnavailable as e:
            # plain "opencl": the preferred device whose compiler works (PoCL lists a device on CPUs its LLVM
            # cannot compile for)
            self.dev = None if spec else _first_device_that_builds(cl_device)
            if self.dev is None:
                raise LocalLLMError(f"OpenCL: {e}") from None
        self.name = f"opencl:{self.dev.info.spec}"
        self.warm_up_label = f"{self.name} "
        self.ops = Ops(self.dev)
        self._storage = OpenCLKVStorage(self.ops)
        # Host arrays the forward passes to every layer (positions, RoPE rows, column maps), uploaded once:
        # id -> (the host array, kept alive so its id stays unique, its device copy).
        self._uploads: dict[int, tuple] = {}
        self._plans: list = []  # decode plans made by whole_forward (their op-by-op kernels warmed up too)

    def _remember(self, key, host, device) -> None:
        """Keep an upload, forgetting the least recently used past 64. (Clearing them all at once, as before,
        could fall in the middle of a step and upload that step's arrays twice: whether it did depended on
        what earlier forwards had left, and a test that counts a step's copies failed in some test orders.)"""
        self._uploads[key] = (host, device)
        while len(self._uploads) > 64:
            del self._uploads[next(iter(self._uploads))]

    def _recall(self, key):
        hit = self._uploads.pop(key, None)
        if hit is not None:
            self._uploads[key] = hit  # most recently used last
        return hit

    def _upload(self, a: np.ndarray, dtype):
        hit = self._recall(id(a))
        if hit is not None and hit[0] is a:
            return hit[1]
        d = self.ops.to_device(a, dtype)
        self._remember(id(a), a, d)
        return d

    def _columns(self, cache, layer: int, which: str):
        """The device copy of this layer group's storage columns, uploaded once per step: "read", of the keys
        attention reads (positions from the group's first held block to the tokens being written: the block table
        spelled out), or "write", of the tokens being written."""
        gi = cache.pool.where[layer][0]
        cols = (cache.column_array(gi, cache.first[gi] * BLOCK, cache.length + cache.pending) if which == "read"
                else cache.write_cols[gi])
        key = (id(cache), gi, which)
        hit = self._recall(key)
        if hit is not None and hit[0].shape == cols.shape and np.array_equal(hit[0], cols):
            return hit[1]
        d = self.ops.to_device(cols, np.int32)
        self._remember(key, cols, d)
        return d

    def weight_bytes(self, info):
        from localllm.kernels.opencl.cl_formats import device_nbytes

        if len(info.shape) == 1:
            return info.n_elements * 4  # vectors are uploaded as float32
        return device_nbytes(info.qtype, info.n_elements)  # the re-laid layout: +6% (Q8_0) to +33% (Q4_K)

    def check_fits(self, weight_bytes, kv_bytes):
        have = self.dev.info.global_mem_bytes
        if weight_bytes + kv_bytes > have:
            raise LocalLLMError(
                f"the model does not fit {self.dev.info.name}: {weight_bytes / 2**30:.2f} GiB of weights and "
                f"{kv_bytes / 2**30:.2f} GiB of KV cache at this context, {have / 2**30:.2f} GiB of device memory "
                "(use a smaller quantization or --ctx, or --device cpu)")

    # -- weights --
    def matrix(self, gguf_file, name, rows=None):
        from localllm.kernels.formats import row_range
        from localllm.kernels.opencl.cl_formats import DeviceWeight

        info = gguf_file.tensor_info(name)
        return DeviceWeight(self.dev, row_range(gguf_file.raw(name), rows, name), info.qtype)

    def vector(self, values):
        return self.ops.to_device(np.ascontiguousarray(values, np.float32))

    def group(self, matrices):
        return tuple(matrices)

    # -- operations --
    def embed(self, w, ids):
        return self.ops.embed(w, np.asarray(ids, np.int64))

    def matmul(self, w, x, precise=False):
        return self.ops.matmul(w, x)

    def group_matmul(self, group, x, precise=False):
        return [self.ops.matmul(w, x) for w in group]

    def add(self, a, b):
        return self.ops.add(a, b)

    def add_bias(self, x, bias):
        self.ops.add(x, bias, out=x)

    def scale(self, x, s):
        self.ops.scale(x, s, out=x)

    def rms_norm(self, x, weight, eps):
        return self.ops.rms_norm(x, weight, eps)

    def rope(self, x, cos, sin, rope_dim, neox):
        if isinstance(x, np.ndarray):  # a context shift rotates host keys
            from localllm.kernels import reference

            x[...] = reference.rope(x, cos, sin, rope_dim, neox)
            return
        self.ops.rope(x, self._upload(cos, np.float32), self._upload(sin, np.float32), rope_dim, neox)

    def gated_activation(self, gate, up, kind):
        return self.ops.gated_activation(gate, up, kind)

    def moe_ffn(self, x, experts, n_used, normalize, kind, precise=False):
        """The router's logits come to the host (n x n_expert floats) for the routing (kernels/moe.py); the rows
        are gathered, multiplied and scattered on the device, one expert at a time."""
        from localllm.kernels import moe as routing

        ops = self.ops
        n, k = x.shape[0], n_used
        ids, weights = routing.route(ops.to_host(ops.matmul(experts.router, x)), k, normalize)
        flat_weights = weights.reshape(-1)
        slots = ops.empty((n * k, experts.down[0].rows))
        for e, sel in routing.by_expert(ids, experts.n_expert):
            xs = ops.gather_rows(x, (sel // k).astype(np.int32))
            gate, up = (ops.matmul(w, xs) for w in experts.gate_up[e])
            y = ops.matmul(experts.down[e], ops.gated_activation(gate, up, kind))
            ops.scale_rows_to(y, sel.astype(np.int32), flat_weights[sel], slots)
        return ops.sum_slots(slots, k)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def rows(self, x, rows):
        return self.ops.gather_rows(x, np.asarray(rows, np.int32))

    def slice_rows(self, x, start, stop):
        flat = x.reshape(x.shape[0], -1)
        return self.ops.gather_rows(flat, np.arange(start, stop, dtype=np.int32)).reshape((stop - start,) + x.shape[1:])

    def concat_rows(self, parts):
        out = self.ops.empty((sum(p.shape[0] for p in parts),) + parts[0].shape[1:])
        offset = 0
        for p in parts:
            if p.size:
                self.dev.cl.enqueue_copy(self.dev.queue, out.data, p.data, byte_count=p.nbytes, dst_offset=offset)
            offset += p.nbytes
        return out

    def empty(self, shape):
        return self.ops.empty(shape)

    def kv_write(self, cache, layer, k, v):
        gi, slot = cache.pool.where[layer]
        g = cache.pool.groups[gi]
        cols = self._columns(cache, layer, "write")
        self.ops.kv_write(g.k[slot], k, cols=cols, scales=_scales(g.k[slot], g.k_scale[slot]))
        self.ops.kv_write(g.v[slot], v, cols=cols, scales=_scales(g.v[slot], g.v_scale[slot]))

    def attention(self, q, cache, layer, positions, window, scale, softcap=0.0):
        gi, slot = cache.pool.where[layer]
        g = cache.pool.groups[gi]
        return self.ops.attention(q, g.k[slot], g.v[slot], self._upload(positions, np.int32), scale, window,
                                  cache.start(layer), cols=self._columns(cache, layer, "read"), softcap=softcap,
                                  k_scales=_scales(g.k[slot], g.k_scale[slot]),
                                  v_scales=_scales(g.v[slot], g.v_scale[slot]))

    def to_host(self, x):
        return self.ops.to_host(x)

    def from_host(self, x):  # what an op without a kernel here (the reference, on the host) gives back
        return self.ops.to_device(np.ascontiguousarray(x, np.float32))

    def assign(self, x, values):  # the result of an in-place op run on the host
        x.set(np.ascontiguousarray(values, np.float32))

    def warm_up_calls(self, weights, kv_type=None):
        """One product per weight format, of 1 row (decode's kernel) and of 9 (the tiled one, a full tile and a
        partial one): PoCL compiles a kernel at its first launch (~1-3 s each on 2 cores), so a cold first
        forward would otherwise sit silent for tens of seconds."""
        calls, seen = [], set()
        for w in weights:
            if w.qtype in seen:
                continue
            seen.add(w.qtype)

            def run(w=w):
                for n in (1, 9):
                    self.ops.to_host(self.ops.matmul(w, self.ops.to_device(np.zeros((n, w.cols), np.float32))))

            calls.append((f"{self.name} matmul {w.qtype.name}", run))
        for plan in self._plans:
            if plan.model.weights() and weights and plan.model.weights()[0] is weights[0]:
                # the model's own warm-up runs the plan (one token); prompts run op by op: compile those too
                calls.append((f"{self.name} op-by-op forward {plan.model.config.architecture}",
                              lambda plan=plan: plan.warm_op_by_op(kv_type)))
        return calls

    def kv_storage(self):
        return self._storage

    def whole_forward(self, model):
        """A decode step as a prepared launch list (kernels/opencl/plan.py): one sequence's one-token forward,
        8 launches a layer with their arguments bound once, bit for bit the op-by-op forward's logits; every
        other forward runs op by op. None where the model has what the plan does not cover (experts, a final
        soft-cap) or LOCALLLM_OPENCL_PLAN=0."""
        from localllm.kernels.opencl.plan import DecodePlan

        if not DecodePlan.supports(model):
            return None
        plan = DecodePlan(self, model)
        self._plans.append(plan)
        return plan
