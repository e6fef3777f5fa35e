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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

Tensor = Any  # a backend's device tensor
Matrix = Any  # a backend's weight matrix (any format of kernels/formats.py), uploaded once


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

    # -- weights ------------------------------------------------------------------------------------------
    @abstractmethod
    def matrix(self, gguf_file, name: str, rows: tuple[int, int] | None = None) -> Matrix:
        """The GGUF tensor `name` (rows, cols in any format of the table), uploaded once; `.rows`/`.cols`.

        `rows` = (lo, hi): only those rows of the tensor seen as 2-D (every dimension but the innermost folded
        into rows), as a matrix of its own: one part of a fused tensor (Phi-3's attn_qkv, ffn_up as gate and
        up) or one expert of a stacked tensor (blk.N.ffn_*_exps: expert e is rows e*n_ff to (e+1)*n_ff)."""

    @abstractmethod
    def vector(self, values: np.ndarray) -> Tensor:
        """A float32 vector (norm weights, biases), uploaded once."""

    @abstractmethod
    def group(self, matrices: Sequence[Matrix]) -> Any:
        """Matrices that always take the same input (Q/K/V, gate/up), for `group_matmul`."""

    # -- operations ---------------------------------------------------------------------------------------
    @abstractmethod
    def embed(self, w: Matrix, ids: np.ndarray) -> Tensor:
        """Rows `ids` of `w`, dequantized: (len(ids), cols)."""

    @abstractmethod
    def matmul(self, w: Matrix, x: Tensor, precise: bool = False) -> Tensor:
        """x @ w.T: (n, rows). `precise`: float32 activations (scoring), may give up batch invariance."""

    @abstractmethod
    def group_matmul(self, group, x: Tensor, precise: bool = False) -> list[Tensor]:
        """[x @ w.T for w in group], bitwise what separate `matmul` calls give."""

    @abstractmethod
    def add(self, a: Tensor, b: Tensor) -> Tensor:
        """a + b (the residual stream)."""

    @abstractmethod
    def add_bias(self, x: Tensor, bias: Tensor) -> None:
        """x += bias, broadcast over rows, in place."""

    @abstractmethod
    def scale(self, x: Tensor, s: float) -> None:
        """x *= s (float32), in place."""

    @abstractmethod
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMSNorm over the last axis (any leading shape), times `weight`."""

    @abstractmethod
    def rope(self, x: Tensor, cos: np.ndarray, sin: np.ndarray, rope_dim: int, neox: bool) -> None:
        """Rotate x (n, heads, head_dim) in place; cos/sin (n, rope_dim // 2) from the host's table."""

    @abstractmethod
    def gated_activation(self, gate: Tensor, up: Tensor, kind: str) -> Tensor:
        """act(gate) * up; kind "silu" or "gelu_tanh"."""

    def experts(self, router: Matrix, gate: Sequence[Matrix], up: Sequence[Matrix], down: Sequence[Matrix]) -> Any:
        """One layer's mixture of experts for `moe_ffn`: the router (n_expert, n_embd) and each expert's gate and
        up (n_ff_exp, n_embd) and down (n_embd, n_ff_exp) matrices (`matrix` with `rows`: one expert of a stacked
        tensor each)."""
        return Experts(router, [self.group([g, u]) for g, u in zip(gate, up)], list(down))

    @abstractmethod
    def moe_ffn(self, x: Tensor, experts, n_used: int, normalize: bool, kind: str, precise: bool = False) -> Tensor:
        """A mixture-of-experts FFN (kernels/reference.py moe_ffn): per row, the router's softmax, its `n_used`
        most probable experts (kernels/moe.py route: weights renormalised with `normalize`), and the sum, in that
        order, of their act(gate) * up products through down, each times its weight. The rows are grouped by
        expert, so each chosen expert's weights stream once per call whatever the number of rows, and the
        experts no row chose are not read (decode reads n_used of them per layer). (n, n_embd)."""

    @abstractmethod
    def reshape(self, x: Tensor, shape: tuple[int, ...]) -> Tensor:
        """A view of x with another shape (same elements, same order)."""

    @abstractmethod
    def rows(self, x: Tensor, rows: np.ndarray) -> Tensor:
        """x[rows], contiguous."""

    @abstractmethod
    def slice_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """x[start:stop] (a view where the backend can)."""

    @abstractmethod
    def concat_rows(self, parts: Sequence[Tensor]) -> Tensor:
        """The parts' rows one after another (each sequence's attention output, in batch order)."""

    @abstractmethod
    def empty(self, shape: tuple[int, ...]) -> Tensor:
        """An uninitialised float32 tensor."""

    @abstractmethod
    def kv_write(self, cache, layer: int, k: Tensor, v: Tensor) -> None:
        """Append k (n, n_head_kv, head_dim) and v to `cache`'s storage for `layer` (reserved beforehand)."""

    @abstractmethod
    def attention(self, q: Tensor, cache, layer: int, positions: np.ndarray, window: int, scale: float,
                  softcap: float = 0.0) -> Tensor:
        """Causal grouped-query attention of q (n, n_head, head_dim) at `positions` over `cache`'s keys and
        values for `layer`; window > 0 limits each query to the last `window` positions; softcap > 0 caps each
        scaled score to tanh(s / softcap) * softcap before the softmax (gemma2). (n, n_head*value_dim)."""

    @abstractmethod
    def to_host(self, x: Tensor) -> np.ndarray:
        """x as a host float32 array (the one transfer a decode step ends with: the logits it needs)."""

    @abstractmethod
    def kv_storage(self) -> "KVStorage":
        """Where this backend keeps KV blocks (a KVPool made for a model on this backend stores through it)."""

    def weight_bytes(self, info) -> int:
        """Bytes a tensor of the file (a gguf_file.TensorInfo) takes in this backend's memory (default: as
        stored)."""
        return info.n_bytes

    def check_fits(self, weight_bytes: int, kv_bytes: int) -> None:
        """Raise a LocalLLMError with the numbers when a model's weights and KV cache cannot fit this backend's
        memory (default: no limit known)."""

    # -- life cycle ---------------------------------------------------------------------------------------
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
