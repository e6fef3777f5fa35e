"""The backend interface the model's forward is written against (ggml's backends are the model).

A backend owns device tensors (opaque handles: numpy arrays on the CPU, device buffers on a GPU) and the
operations a decoder needs. `Transformer.forward_batch` (localllm/architectures/transformer.py) calls only these,
so a backend that implements them runs every architecture; a backend may also offer a whole-forward override
(the CPU's fused forward), which must give bitwise the logits of the op-by-op forward on the same backend
(tests/test_fused_forward.py).

Conventions every backend keeps:
* Activations are float32 (rows, width) tensors; `reshape` views them as (rows, heads, head_dim) without copy.
* Ops that say "in place" write into their first argument; the others return a new tensor.
* Each op computes each row alone, so a row's result never depends on the other rows in the call (batch
  invariance: a sequence's logits are the same, bit for bit, whatever else is in the batch).
* Only `to_host` moves data to the host; KV writes and attention go through the backend too.

The ops are a table (`OPS`). A backend runs an op on kernels of its own by overriding its method; every op it
does not override runs the numpy reference (kernels/reference.py) on the host, its tensors moved with
`to_host` / `from_host` (and `assign` for the ops that work in place), its weights kept as `HostMatrix`.
`supports(op, formats)` says which: own kernels (for weights of those formats), or the fallback. So a new backend
runs every architecture once it has `to_host`, `from_host`, `assign` and `kv_storage` (the reference backend has
nothing more), and grows op by op; a new op is a row of the table, a reference function, and its call in the
forward, and runs on every backend from the start.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from localllm.kernels.formats import FORMATS, row_range


class _Reference:
    """kernels/reference.py, imported on first use (it loads gguf-py's quants: start-up pays for it only where a
    fallback runs)."""

    def __getattr__(self, name):
        from localllm.kernels import reference as module

        return getattr(module, name)


reference = _Reference()

Tensor = Any  # a backend's device tensor
Matrix = Any  # a backend's weight matrix (any format of kernels/formats.py), uploaded once


# The ops a forward calls, each with a default that runs the numpy reference on the host (Backend below).
OPS: dict[str, str] = {
    "embed": "rows of a weight matrix, dequantized",
    "matmul": "x @ w.T",
    "group_matmul": "[x @ w.T for w in group]",
    "moe_ffn": "a mixture-of-experts FFN",
    "add": "a + b",
    "add_bias": "x += bias (in place)",
    "scale": "x *= s (in place)",
    "rms_norm": "RMSNorm times a weight",
    "rope": "rotary position embedding (in place)",
    "gated_activation": "act(gate) * up",
    "reshape": "a view with another shape",
    "rows": "x[rows]",
    "slice_rows": "x[start:stop]",
    "concat_rows": "rows of several tensors one after another",
    "empty": "an uninitialised tensor",
    "kv_write": "append keys and values to a KV cache",
    "attention": "causal grouped-query attention over a KV cache",
}
# Ops that take weights: `supports(op, formats)` asks about their formats too.
WEIGHT_OPS = ("embed", "matmul", "group_matmul", "moe_ffn")


class HostMatrix:
    """A weight as the reference ops hold it: the file's raw rows and type, dequantized to float64 on first use
    (kept: a product reads it every forward). What the base `matrix` gives, for a backend without `matmul` of its
    own or without a kernel for this format."""

    def __init__(self, raw: np.ndarray, qtype):
        self.raw, self.qtype = raw, qtype
        fmt = FORMATS[qtype]
        self.rows, self.cols = raw.shape[0], raw.shape[1] // fmt.type_size * fmt.block_size
        self._dense = None

    @property
    def dense(self) -> np.ndarray:
        if self._dense is None:
            self._dense = reference.dequantize(self.raw, self.qtype).astype(np.float64)
        return self._dense


class Backend(ABC):
    name: str = "?"
    # Whether the op-by-op kernels compile one by one on first use (Numba's, which warmup.py compiles ahead in
    # its own calls), so a model without a whole-forward override has no forward of its own to warm up
    ops_compile_alone: bool = False
    # How the warm-up names this backend's compiles ("" for the host CPU, whose kernels serve every device), and
    # where it says they run
    warm_up_label: str = ""

    @property
    def device_label(self) -> str:
        return self.name
    # From this many rows on, `precise=True` products take a path the whole-forward override does not have (the
    # CPU: tiled BLAS with float32 activations), so such a forward runs op by op.
    precise_min_rows: int = 1 << 30

    # -- the table: which ops run on this backend's own kernels -------------------------------------------
    # The weight formats this backend's weight ops have kernels for (None: every format of the table).
    kernel_formats: frozenset | None = None

    def supports(self, op: str, formats=()) -> bool:
        """Whether `op` (a key of OPS) runs on this backend's own kernels, for weights of every type in
        `formats` (GGML types); False: the numpy reference runs it on the host (the base class's method)."""
        if op not in OPS:
            raise KeyError(f"no op {op!r} in the table (there is: {', '.join(OPS)})")
        if getattr(type(self), op) is getattr(Backend, op):
            return False
        return self.kernel_formats is None or all(f in self.kernel_formats for f in formats)

    # -- moving tensors (what the fallback needs of every backend; host tensors by default) ------------------
    def to_host(self, x: Tensor) -> np.ndarray:
        """x as a host float32 array (the one transfer a decode step ends with: the logits it needs)."""
        return x

    def from_host(self, x: np.ndarray) -> Tensor:
        """A host float32 array as this backend's tensor."""
        return np.ascontiguousarray(x, dtype=np.float32)

    def assign(self, x: Tensor, values: np.ndarray) -> None:
        """x's elements replaced by the host array `values` (same shape): an in-place op run on the host."""
        x[...] = values

    def _host(self, x) -> np.ndarray:
        return np.asarray(self.to_host(x), dtype=np.float32)

    # -- weights ------------------------------------------------------------------------------------------
    def matrix(self, gguf_file, name: str, rows: tuple[int, int] | None = None) -> Matrix:
        """The GGUF tensor `name` (rows, cols in any format of the table), uploaded once; `.rows`/`.cols`/`.qtype`.

        `rows` = (lo, hi): only those rows of the tensor seen as 2-D (every dimension but the innermost folded
        into rows), as a matrix of its own: one part of a fused tensor (Phi-3's attn_qkv, ffn_up as gate and
        up) or one expert of a stacked tensor (blk.N.ffn_*_exps: expert e is rows e*n_ff to (e+1)*n_ff).
        Default: a HostMatrix, for the reference ops."""
        return HostMatrix(row_range(gguf_file.raw(name), rows, name), gguf_file.tensor_info(name).qtype)

    def vector(self, values: np.ndarray) -> Tensor:
        """A float32 vector (norm weights, biases), uploaded once."""
        return self.from_host(values)

    def group(self, matrices: Sequence[Matrix]) -> Any:
        """Matrices that always take the same input (Q/K/V, gate/up), for `group_matmul`."""
        return tuple(matrices)

    # -- operations (the table; each default is the reference on the host) --------------------------------
    def embed(self, w: Matrix, ids: np.ndarray) -> Tensor:
        """Rows `ids` of `w`, dequantized: (len(ids), cols)."""
        return self.from_host(w.dense[np.asarray(ids, np.int64)])

    def matmul(self, w: Matrix, x: Tensor, precise: bool = False) -> Tensor:
        """x @ w.T: (n, rows). `precise`: float32 activations (scoring), may give up batch invariance."""
        return self.from_host(self._host(x).astype(np.float64) @ w.dense.T)

    def group_matmul(self, group, x: Tensor, precise: bool = False) -> list[Tensor]:
        """[x @ w.T for w in group], bitwise what separate `matmul` calls give."""
        return [self.matmul(w, x, precise) for w in group]

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        """a + b (the residual stream)."""
        return self.from_host(self._host(a) + self._host(b))

    def add_bias(self, x: Tensor, bias: Tensor) -> None:
        """x += bias, broadcast over rows, in place."""
        self.assign(x, self._host(x) + self._host(bias))

    def scale(self, x: Tensor, s: float) -> None:
        """x *= s (float32), in place."""
        self.assign(x, self._host(x) * np.float32(s))

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMSNorm over the last axis (any leading shape), times `weight`."""
        return self.from_host(reference.rms_norm(self._host(x), self._host(weight), eps))

    def rope(self, x: Tensor, cos: np.ndarray, sin: np.ndarray, rope_dim: int, neox: bool) -> None:
        """Rotate x (n, heads, head_dim) in place; cos/sin (n, rope_dim // 2) from the host's table."""
        self.assign(x, reference.rope(self._host(x), cos, sin, rope_dim, neox))

    def gated_activation(self, gate: Tensor, up: Tensor, kind: str) -> Tensor:
        """act(gate) * up; kind "silu" or "gelu_tanh"."""
        act = reference.silu if kind == "silu" else reference.gelu_tanh
        return self.from_host(act(self._host(gate)) * self._host(up))

    def experts(self, router: Matrix, gate: Sequence[Matrix], up: Sequence[Matrix], down: Sequence[Matrix]) -> Any:
        """One layer's mixture of experts for `moe_ffn`: the router (n_expert, n_embd) and each expert's gate and
        up (n_ff_exp, n_embd) and down (n_embd, n_ff_exp) matrices (`matrix` with `rows`: one expert of a stacked
        tensor each)."""
        return Experts(router, [self.group([g, u]) for g, u in zip(gate, up)], list(down))

    def moe_ffn(self, x: Tensor, experts, n_used: int, normalize: bool, kind: str, precise: bool = False) -> Tensor:
        """A mixture-of-experts FFN (kernels/reference.py moe_ffn): per row, the router's softmax, its `n_used`
        most probable experts (kernels/moe.py route: weights renormalised with `normalize`), and the sum, in that
        order, of their act(gate) * up products through down, each times its weight. The rows are grouped by
        expert, so each chosen expert's weights stream once per call whatever the number of rows, and the
        experts no row chose are not read (decode reads n_used of them per layer). (n, n_embd)."""
        out = reference.moe_ffn(self._host(x), experts.router.dense, [g.dense for g, _ in experts.gate_up],
                                [u.dense for _, u in experts.gate_up], [d.dense for d in experts.down], n_used,
                                normalize, kind)
        return self.from_host(out)

    def reshape(self, x: Tensor, shape: tuple[int, ...]) -> Tensor:
        """A view of x with another shape (same elements, same order)."""
        return x.reshape(shape)

    def rows(self, x: Tensor, rows: np.ndarray) -> Tensor:
        """x[rows], contiguous."""
        return self.from_host(self._host(x)[np.asarray(rows, np.int64)])

    def slice_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """x[start:stop] (a view where the backend can)."""
        return self.from_host(self._host(x)[start:stop])

    def concat_rows(self, parts: Sequence[Tensor]) -> Tensor:
        """The parts' rows one after another (each sequence's attention output, in batch order)."""
        return self.from_host(np.concatenate([self._host(p) for p in parts]))

    def empty(self, shape: tuple[int, ...]) -> Tensor:
        """An uninitialised float32 tensor."""
        return self.from_host(np.empty(shape, np.float32))

    def kv_write(self, cache, layer: int, k: Tensor, v: Tensor) -> None:
        """Append k (n, n_head_kv, head_dim) and v to `cache`'s storage for `layer` (reserved beforehand)."""
        cache.write(layer, self._host(k), self._host(v))

    def attention(self, q: Tensor, cache, layer: int, positions: np.ndarray, window: int, scale: float,
                  softcap: float = 0.0) -> Tensor:
        """Causal grouped-query attention of q (n, n_head, head_dim) at `positions` over `cache`'s keys and
        values for `layer`; window > 0 limits each query to the last `window` positions; softcap > 0 caps each
        scaled score to tanh(s / softcap) * softcap before the softmax (gemma2). (n, n_head*value_dim)."""
        out = reference.attention(self._host(q).astype(np.float64), cache.keys(layer).astype(np.float64),
                                  cache.values(layer).astype(np.float64), np.asarray(positions), scale, window,
                                  cache.start(layer), softcap)
        return self.from_host(out)

    def kv_storage(self) -> "KVStorage":
        """Where this backend keeps KV blocks (a KVPool made for a model on this backend stores through it).
        Default: host arrays of float32."""
        return _HOST_STORAGE

    def weight_bytes(self, info) -> int:
        """Bytes a tensor of the file (a gguf_file.TensorInfo) takes in this backend's memory (default: as
        stored)."""
        return info.n_bytes

    def check_fits(self, weight_bytes: int, kv_bytes: int) -> None:
        """Raise a LocalLLMError with the numbers when a model's weights and KV cache cannot fit this backend's
        memory (default: no limit known)."""

    # -- life cycle ---------------------------------------------------------------------------------------
    def begin_load(self, gguf_file, config) -> None:
        """Called before a model's weights are read from `gguf_file` (its ModelConfig `config`): a backend may
        start work they do not wait for (the CPU's: compiling its fused forward's products and attention in
        child processes)."""

    def whole_forward(self, model) -> Callable | None:
        """An optional override of the op-by-op forward (None: none): called as fused(tokens, cache, output_rows)
        for one sequence; where it has `batch(segments)`, that runs a step over several sequences too."""
        return None

    def warm_up_calls(self, weights, kv_type: str | None = None) -> list[tuple[str, Callable[[], None]]]:
        """(label, thunk) pairs compiling and warming the kernels these weights need (`prepare()` runs them
        with progress: localllm/runtime/warmup.py); `kv_type`: only that KV cache type's kernels (None: every type)."""
        return []


@dataclass
class Experts:
    """A layer's mixture of experts as `Backend.experts` holds it: the router, per expert its gate/up group
    (`Backend.group`) and its down matrix."""
    router: Matrix
    gate_up: list
    down: list
    # Whatever the backend derives once from them (the CPU: the router as float32 for its row-invariant kernel).
    cache: dict = field(default_factory=dict)

    @property
    def n_expert(self) -> int:
        return len(self.down)


class KVStorage(ABC):
    """Where a KV pool's blocks live: the backend's memory. The pool's bookkeeping (localllm/runtime/kv_cache.py: block
    tables, names, refcounts, LRU) is integers only and calls these for every change to the stored values.

    Per layer one array (n_kv_heads, columns, dim) of keys and one of values, and for a quantized element type
    one of scales each (n_kv_heads, columns, dim // 32); float32 storage has scale arrays whose last axis is 0.
    Column c of block b is b * BLOCK + c. `cols` are int64 host arrays of columns."""

    kv_types: tuple[str, ...] = ("f32",)

    @abstractmethod
    def new(self, n_kv: int, dim: int, dtype) -> Any:
        """An array (n_kv, 0, dim) of `dtype` (np.float32, or np.int8 for q8_0 values)."""

    @abstractmethod
    def grown(self, old, columns: int) -> Any:
        """A new array of `columns` columns holding old's columns at the start."""

    @abstractmethod
    def copy_columns(self, arr, src: int, dst: int, n: int) -> None:
        """arr[:, dst:dst+n] = arr[:, src:src+n] (a block copied on write, or part of one)."""

    @abstractmethod
    def write_rows(self, store, scales, cols: np.ndarray, x) -> None:
        """Store rows x (n, n_kv, dim), float32 (host, or the backend's tensor), at columns cols (quantizing
        for an int8 store)."""

    @abstractmethod
    def read_rows(self, store, scales, cols: np.ndarray) -> np.ndarray:
        """float32 host (n_kv, len(cols), dim): the stored rows at cols, dequantized."""

    @abstractmethod
    def move_columns(self, arr, src: np.ndarray, dst: np.ndarray) -> None:
        """arr[:, dst] = arr[:, src] as stored (the ranges may overlap: a context shift)."""

    @staticmethod
    def kernel_tables(cache) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For a compiled forward over every layer (after `cache.reserve`): per layer group, the block table from
        the first held block (rows padded to one width), that block, and the storage columns of the tokens being
        written. (The CPU's fused forward and OpenCL's decode plan both read these.)"""
        arrays = cache.block_arrays
        width = max(len(t) for t in arrays)
        tables = np.zeros((len(arrays), max(width, 1)), np.int64)
        for gi, t in enumerate(arrays):
            tables[gi, : len(t)] = t
        return tables, np.asarray(cache.first, np.int64), np.stack(cache.write_cols)


class HostKVStorage(KVStorage):
    """KV blocks in host float32 arrays, written and read with numpy: the storage of a backend that has none of
    its own (the reference backend), and the CPU's, whose kernels add q8_0."""

    kv_types = ("f32",)

    def new(self, n_kv, dim, dtype):
        return np.empty((n_kv, 0, dim), dtype)

    def grown(self, old, columns):
        new = np.empty((old.shape[0], columns, old.shape[2]), old.dtype)
        new[:, : old.shape[1]] = old
        return new

    def copy_columns(self, arr, src, dst, n):
        arr[:, dst : dst + n] = arr[:, src : src + n]

    def write_rows(self, store, scales, cols, x):
        store[:, cols] = np.asarray(x, np.float32).transpose(1, 0, 2)

    def read_rows(self, store, scales, cols):
        # np.take gathers along the token axis about twice as fast as fancy indexing store[:, cols].
        return np.take(store, cols, axis=1)

    def move_columns(self, arr, src, dst):
        arr[:, dst] = arr[:, src].copy()  # source and destination may overlap


_HOST_STORAGE = HostKVStorage()
