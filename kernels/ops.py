"""The one backend interface the engine calls: `Weight`, `matmul`, `embed`, `dequantize`.

`matmul` picks a path per call:

* Quantized weights whose format has an integer SIMD kernel (`kernels.cpu.quant_dot`), any n: activations
  rounded to 8 bits per block, integer dot products, as llama.cpp does for decode and prompts alike. Each
  output row depends only on its own x row, bit for bit, whatever n is (batch invariance): a prompt split into
  two evaluations (prefix reuse, a saved session), a speculative verify of k tokens and a server batch all give
  exactly what one token at a time gives. x is fed in passes of quant_dot.rows_per_pass rows (16-64 by
  format) so a pass's 8-bit activations stay in L1/L2 while every weight row streams past them (measured: 1.5-2x
  faster than whole-x passes at n = 512, and with 2 threads faster than the float path below on every format).
* `precise=True`, n >= BLAS_MIN_N (scoring against a float reference): dequantize W in tiles of rows, each
  tile once, into a reused float32 scratch buffer, and let BLAS do `x @ tile.T` with float32 activations.
  BLAS is not row-invariant (its kernels depend on the number of rows), so generation never takes this path.
* Formats without an integer kernel (F16, BF16): the portable fused kernel for small n, tiled BLAS above.
* F32 weights are plain numpy: a gemv per x row on the small-n path, one gemm otherwise.

Per-call overhead matters (hundreds of calls per token), so everything that can be decided once is decided
in `Weight.__init__`, and `out=` lets callers reuse their buffers.
"""

from __future__ import annotations

import dataclasses

import threading

import numba
import numpy as np

from localllm.gguf_constants import GGMLQuantizationType
from localllm.kernels.cpu import attention as _attention
from localllm.kernels.cpu import process_settings as _runtime
from localllm.kernels.cpu import blocks as _blocks
from localllm.kernels.cpu.format_set import FormatSet
from localllm.kernels.cpu.cpu_formats import FORMATS, CpuFormat, format_of
from localllm.kernels.cpu.typed_lists import length, typed_list
from localllm.kernels.formats import row_range

try:  # the integer SIMD fast path, written separately; the portable path stands alone without it
    from localllm.kernels.cpu import quant_dot as _quant_dot
    from localllm.kernels.cpu import tiled as _tiled

    _QUANT_DOT_SUPPORTED = frozenset(_quant_dot.SUPPORTED)
except ImportError:
    _quant_dot = _tiled = None
    _QUANT_DOT_SUPPORTED = frozenset()
from localllm.kernels.cpu import moe_kernels as _moe
from localllm.kernels.cpu import tile_cache as _tile_cache

try:
    from localllm.kernels.cpu import fused_forward as _fused
except ImportError:
    _fused = None

# From this many rows of x on, tiled dequantize + BLAS for weights without an integer kernel (or with
# precise=True): dequantizing a tile costs about as much as 2-4 rows through the portable fused kernel
# (`python -m localllm.kernels.kernel_bench`, crossover table, Zen 3), but n <= 8 (speculative verify, small server batches)
# stays on the row-invariant fused kernel.
BLAS_MIN_N = 9
# Rows per dequantized tile on the BLAS path: about this many float32 bytes, so a tile stays in L2/L3.
TILE_BYTES = 1 << 20
# Work shares per thread in each phase of the fused forward: more than one, so a thread that finishes early (or
# was descheduled) does not leave the other waiting on a half-size share.
FUSED_TASKS_PER_THREAD = 2
# The integer 16, handed to the kernels at run time (see kernels/cpu/dequant.py).
_N16 = 16

_F32 = np.dtype(np.float32)
_scratch = threading.local()


class _TiledFormat:
    """A CpuFormat seen through the tiled layout: dequantize_rows and the portable matmul untile the rows they
    read first (embedding lookups, `dequantize`, the precise path); the integer kernels read the tiles."""

    def __init__(self, fmt: CpuFormat):
        self.inner = fmt
        self.format, self.quantize, self.quantize_imatrix = fmt.format, fmt.quantize, fmt.quantize_imatrix
        self.qtype, self.name, self.block_size, self.type_size = fmt.qtype, fmt.name, fmt.block_size, fmt.type_size

    def row_bytes(self, cols: int) -> int:
        return self.inner.row_bytes(cols)

    def dequantize_rows(self, raw, ids, out, n16):
        ids = np.asarray(ids, np.int64)
        self.inner.dequantize_rows(_tiled.untile_rows(raw, self.qtype, ids), _row_ids(len(ids))[: len(ids)], out,
                                   n16)

    def matmul(self, raw, x, out, n16):  # (the oracle's and benchmarks' path: a tiled weight has integer kernels)
        self.inner.matmul(_tiled.untile_rows(raw, self.qtype, _row_ids(raw.shape[0])[: raw.shape[0]]), x, out, n16)


class Weight:
    """A 2-D weight matrix in any format, as stored: `raw` is a read-only uint8 view (rows, row_bytes), in the
    file's layout or (`tiled`) in kernels/cpu/tiled.py's 16-row tiles of the same bytes."""

    __slots__ = (
        "raw", "qtype", "rows", "cols", "format", "tiled", "kernel_type",
        "_dense", "_fused", "_use_quant_dot", "_bound", "_tile_rows", "_pass",
    )

    def __init__(self, raw: np.ndarray, qtype: GGMLQuantizationType, tiled: bool = False):
        """`tiled`: raw is already in kernels/cpu/tiled.py's 16-row tiles (`Weight.from_gguf(..., tile=True)`)."""
        _ensure_runtime()  # before any kernel runs; a model's first weight comes before its first call
        fmt: CpuFormat = format_of(qtype)
        if raw.dtype != np.uint8 or raw.ndim != 2 or not raw.flags.c_contiguous:
            raise ValueError(f"a weight's raw data must be a C-contiguous 2-D uint8 array, not {raw.dtype} {raw.shape}")
        if raw.shape[1] % fmt.type_size:
            raise ValueError(f"{raw.shape[1]} bytes per row is not a whole number of {fmt.name} blocks")
        # Always a read-only view: the kernels then see one array type (one compiled specialisation), and
        # nothing can write through a weight into the model file's memory map.
        view = raw.view()
        view.flags.writeable = False
        self.raw = view
        self.qtype = fmt.qtype
        self.tiled = bool(tiled)
        if self.tiled and not _tiled_here(fmt.qtype, raw.shape[0], True):
            raise ValueError(f"a {fmt.name} weight of {raw.shape[0]} rows cannot be tiled on this CPU")
        self.kernel_type = _kernel_type(fmt.qtype, self.tiled)
        self.format = _TiledFormat(fmt) if self.tiled else fmt
        self.rows = int(raw.shape[0])
        self.cols = int(raw.shape[1] // fmt.type_size * fmt.block_size)
        self._dense = view.view(np.float32) if fmt.qtype == GGMLQuantizationType.F32 else None
        self._fused = fmt.matmul
        self._use_quant_dot = fmt.qtype in _QUANT_DOT_SUPPORTED
        # x-rows per integer-kernel call (quant_dot.rows_per_pass); only the integer path reads it
        self._pass = _quant_dot.rows_per_pass.py_func(int(fmt.qtype)) if self._use_quant_dot else None
        self._bound = None  # quant_dot.bind's kernel, on first use: the fused forward never asks (211 weights of
        # smollm2 bound at load were 60 ms of a 1-second warm start)
        self._tile_rows = max(1, min(self.rows, TILE_BYTES // (4 * max(self.cols, 1))))

    @property
    def _quant_dot(self):
        """`kernel(x, out, n_threads)` for this weight (quant_dot.bind), or None where quant_dot has no kernel."""
        if self._bound is None and self._use_quant_dot:
            bind = _quant_dot.bind_tiled if self.tiled else _quant_dot.bind
            self._bound = bind(self.raw, self.qtype)
        return self._bound

    @classmethod
    def from_gguf(cls, gguf_file, name: str, rows: tuple[int, int] | None = None, tile: bool = False) -> "Weight":
        """The tensor `name` (rows: a row range of it) read in place from the file's memory map; `tile`: repacked
        into 16-row tiles where this CPU has the tiled kernel (kernels/cpu/tiled.py), a copy of the same size
        (mapped from the tile cache, or made into it: kernels/cpu/tile_cache.py) whose file pages are then dropped
        from this process (the file is read once, not kept twice)."""
        info = gguf_file.tensor_info(name)
        raw = row_range(gguf_file.raw(name), rows, name)
        if _tiled_here(info.qtype, raw.shape[0], tile):
            # (a GGUFFile drops the file pages it tiled; stand-ins for one may not map a file)
            tiled = _tile_cache.tiled(gguf_file, name, rows, info.qtype, raw, _tiled.tile,
                                      release=getattr(gguf_file, "release", None))
            return cls(tiled, info.qtype, tiled=True)
        return cls(raw, info.qtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the matrix as stored (what a product reads)."""
        return self.raw.nbytes

    def __repr__(self) -> str:
        return f"Weight({self.format.name}, rows={self.rows}, cols={self.cols})"


def _tiled_here(qtype, rows: int, tile: bool) -> bool:
    """Whether Weight.from_gguf(..., tile=tile) repacks a weight of this format and row count into tiles."""
    return tile and _tiled is not None and _tiled.can_tile(qtype, rows)


def _kernel_type(qtype, tiled: bool) -> int:
    """What the integer kernels dispatch on: the GGML type, or its tiled twin (kernels/cpu/tiled.py)."""
    return _tiled.kernel_type(qtype) if tiled else int(qtype)


# Threads for the parallel kernels, read once on first use: numba.get_num_threads() costs microseconds per call,
# and starts OpenMP, whose settings must be in place first (kernels/cpu/process_settings.py). 0: not yet read.
_threads = [0]


def _ensure_runtime() -> None:
    if not _threads[0]:
        _runtime.configure()
        _threads[0] = numba.get_num_threads()


def threads() -> int:
    """Threads the parallel kernels use."""
    _ensure_runtime()
    return _threads[0]


def set_threads(n: int) -> None:
    """Use n threads in the kernels (at most the cores Numba was started with)."""
    _ensure_runtime()
    numba.set_num_threads(n)
    _threads[0] = n


def matmul(w: Weight, x: np.ndarray, out: np.ndarray | None = None, precise: bool = False) -> np.ndarray:
    """out (n, rows) = x (n, cols) @ W.T, float32. x must be float32 and C-contiguous. `precise`: float32
    activations for large n (scoring), at the price of batch invariance."""
    n, cols = x.shape
    if cols != w.cols or x.dtype is not _F32 and x.dtype != _F32 or not x.flags.c_contiguous:
        raise ValueError(f"x must be C-contiguous float32 (n, {w.cols}), got {x.dtype} {x.shape}")
    if out is None:
        out = np.empty((n, w.rows), _F32)
    elif out.shape != (n, w.rows) or out.dtype != _F32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 ({n}, {w.rows}), got {out.dtype} {out.shape}")
    if w._dense is not None:
        if n < BLAS_MIN_N:
            for i in range(n):  # one gemv per row: bitwise independent of the other rows
                np.dot(w._dense, x[i], out=out[i])
        else:
            np.matmul(x, w._dense.T, out=out)
    elif w._use_quant_dot and not (precise and n >= BLAS_MIN_N):
        step = w._pass
        if n <= step:
            w._quant_dot(x, out, _threads[0])
        else:
            for i in range(0, n, step):
                w._quant_dot(x[i : i + step], out[i : i + step], _threads[0])
    elif n < BLAS_MIN_N:
        w._fused(w.raw, x, out, _N16)
    else:
        _matmul_tiled_blas(w, x, out)
    return out


class WeightGroup:
    """Weights that are always applied to the same x (attention's Q, K and V; the FFN's gate and up).

    When they share a format with an integer kernel, one call quantizes x once and computes all of them in one
    parallel region (kernels.cpu.quant_dot.bind_many); otherwise it is one `matmul` per weight. Either way the
    outputs are bitwise what separate `matmul` calls give.
    """

    def __init__(self, weights: list[Weight]):
        self.weights = list(weights)
        fusable = (all(w._use_quant_dot for w in self.weights) and len({w.kernel_type for w in self.weights}) == 1
                   and len({w.cols for w in self.weights}) == 1)
        bind_many = _quant_dot.bind_many_tiled if self.weights[0].tiled else _quant_dot.bind_many
        self._many = bind_many([w.raw for w in self.weights], self.weights[0].qtype) if fusable else None

    def __call__(self, x: np.ndarray, precise: bool = False) -> list[np.ndarray]:
        n = x.shape[0]
        if self._many is None or (precise and n >= BLAS_MIN_N):
            return [matmul(w, x, precise=precise) for w in self.weights]
        if x.shape[1] != self.weights[0].cols or x.dtype != _F32 or not x.flags.c_contiguous:
            raise ValueError(f"x must be C-contiguous float32 (n, {self.weights[0].cols}), got {x.dtype} {x.shape}")
        outs = [np.empty((n, w.rows), _F32) for w in self.weights]
        step = self.weights[0]._pass
        for i in range(0, n, step):
            self._many(x[i : i + step], tuple(out[i : i + step] for out in outs), _threads[0])
        return outs


def matmul_fused(w: Weight, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The portable fused kernel whatever n is (the oracle for the other paths, and for benchmarks)."""
    if out is None:
        out = np.empty((x.shape[0], w.rows), _F32)
    w.format.matmul(w.raw, np.ascontiguousarray(x, dtype=_F32), out, _N16)
    return out


def _row_ids(stop: int) -> np.ndarray:
    ids = getattr(_scratch, "row_ids", None)
    if ids is None or ids.shape[0] < stop:
        ids = _scratch.row_ids = np.arange(max(stop, 1 << 16), dtype=np.int64)
    return ids


def _tile_buffer(size: int) -> np.ndarray:
    # Reused across calls: a fresh multi-megabyte np.empty is an mmap, and its page faults cost more than the
    # dequantization.
    buf = getattr(_scratch, "tile", None)
    if buf is None or buf.shape[0] < size:
        buf = _scratch.tile = np.empty(size, _F32)
    return buf


def _matmul_tiled_blas(w: Weight, x: np.ndarray, out: np.ndarray) -> None:
    tile_rows = w._tile_rows
    flat = _tile_buffer(tile_rows * w.cols)
    ids = _row_ids(w.rows)
    dequantize_rows = w.format.dequantize_rows
    for r0 in range(0, w.rows, tile_rows):
        r1 = min(r0 + tile_rows, w.rows)
        tile = flat[: (r1 - r0) * w.cols].reshape(r1 - r0, w.cols)
        dequantize_rows(w.raw, ids[r0:r1], tile, _N16)
        np.matmul(x, tile.T, out=out[:, r0:r1])


def embed(w: Weight, ids: np.ndarray) -> np.ndarray:
    """float32 (len(ids), cols): the dequantized rows `ids` (token embedding lookup)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= w.rows):
        raise ValueError(f"row ids must lie in [0, {w.rows}), got {ids.min()}..{ids.max()}")
    if w._dense is not None:
        return w._dense[ids]
    out = np.empty((ids.shape[0], w.cols), _F32)
    w.format.dequantize_rows(w.raw, ids, out, _N16)
    return out


def dequantize(w: Weight) -> np.ndarray:
    """The whole matrix as float32 (rows, cols): a copy (the model file's bytes are never modified)."""
    if w._dense is not None:
        return w._dense.copy()
    out = np.empty((w.rows, w.cols), _F32)
    w.format.dequantize_rows(w.raw, _row_ids(w.rows)[: w.rows], out, _N16)
    return out


def _warm_blocks() -> None:
    x = np.ones((1, 2, 4), _F32)
    rms_norm(x, np.ones(4, _F32), 1e-6)
    for neox in (False, True):
        rope(x, np.ones((1, 2), _F32), np.zeros((1, 2), _F32), 4, neox)
    for kind in GATES:
        gated_activation(x[0], x[0], kind)


def _warm_attention(kv_type: str) -> None:
    """One KV storage type (f32: float32, q8_0: int8 with scales): writing rows, reading them back, attending."""
    q = np.ones((1, 2, 32), _F32)
    table, cols = np.zeros(1, np.int64), np.zeros(1, np.int64)
    for dtype, n_scales in {"f32": [(_F32, 0)], "q8_0": [(np.int8, 1)]}[kv_type]:
        k, scales = np.zeros((1, 16, 32), dtype), np.ones((1, 16, n_scales), _F32)
        _attention.write_rows(k, scales, cols, q[:, :1])
        _attention.read_rows(k, scales, cols, np.empty((1, 1, 32), _F32))
        for parallel in (False, True):
            out = np.empty((1, 64), _F32)
            args = (q, k, scales, k, scales, table, 0, np.zeros(1, np.int64), 0, 0, np.float32(1.0), np.float32(0.0),
                    out)
            _attention.attend_parallel(*args, 2) if parallel else _attention.attend(*args)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis of a float32 array (any leading shape); returns a new array."""
    x2 = np.ascontiguousarray(x, dtype=_F32).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    _blocks.rms_norm_rows(x2, weight, eps, out)
    return out.reshape(x.shape)


GATES = {"silu": _blocks.GATE_SILU, "gelu_tanh": _blocks.GATE_GELU_TANH}


def gated_activation(gate: np.ndarray, up: np.ndarray, kind: str) -> np.ndarray:
    """act(gate) * up for the gated FFN (kind "silu" or "gelu_tanh"); float32 (n, d) arrays, C-contiguous."""
    out = np.empty_like(gate)
    _blocks.gated_activation(gate, up, GATES[kind], out)
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_dim: int, neox: bool) -> None:
    """Rotate x (n, heads, head_dim), C-contiguous float32, in place; cos/sin are (n, rope_dim // 2)."""
    _blocks.rope_rows(x, cos, sin, rope_dim, neox)


def attention(q: np.ndarray, cache_inputs: tuple, q_positions: np.ndarray, key_start: int, window: int,
              scale: float, softcap: float = 0.0) -> np.ndarray:
    """Causal grouped-query attention of q (n, n_head, head_dim), C-contiguous float32, at positions
    q_positions (ascending) over a paged KV cache (`CpuKVStorage.attention_inputs(cache, layer)`, whose first
    key sits at key_start). window > 0: a query at p sees only keys after p - window. softcap > 0: scores soft-capped,
    tanh(s / softcap) * softcap (gemma2). Returns (n, n_head * value_dim)."""
    k, k_scale, v, v_scale, table, first_block = cache_inputs
    _ensure_runtime()
    out = np.empty((q.shape[0], q.shape[1] * v.shape[2]), _F32)
    work = q.shape[0] * q.shape[1] * (int(q_positions[-1]) - key_start + 1) * q.shape[2]
    if _threads[0] > 1 and work >= _attention.PARALLEL_MIN_WORK:
        _attention.attend_parallel(q, k, k_scale, v, v_scale, table, first_block, q_positions, key_start, window,
                                   np.float32(scale), np.float32(softcap), out, _threads[0])
    else:
        _attention.attend(q, k, k_scale, v, v_scale, table, first_block, q_positions, key_start, window,
                          np.float32(scale), np.float32(softcap), out)
    return out


def warm_up_calls(weights, kv_type: str | None = None) -> list[tuple[str, object]]:
    """(label, thunk) pairs that call every kernel variant these weights will use, once, on tiny inputs.

    Numba compiles a kernel on its first call (several seconds each); running these up front lets a front end
    show progress instead of freezing on the first token. Thunks use slices of the real weights, so the
    compiled signatures (read-only memory-mapped uint8 rows) are exactly those used later.
    """
    calls, seen = [("norm and rope", _warm_blocks)], set()
    for kv in ("f32", "q8_0") if kv_type is None else (kv_type,):
        calls.append((f"attention {kv}", lambda kv=kv: _warm_attention(kv)))
    for w in weights:
        if w._dense is not None:
            continue
        small = Weight(w.raw[: min(w.rows, 64)], w.qtype, tiled=w.tiled)
        variants = [("decode", w, 1), ("prompt", small, 16), ("embed", small, 0)]  # (any n > 1 is the prompt code)
        if w._use_quant_dot:
            for count in (2, 3):  # the Q/K/V and gate/up groups
                variants.append((f"group of {count}", WeightGroup([small] * count), 1))
        for kind, target, n in variants:
            # quant_dot's serial/threaded split (groups: the threads wake either way)
            serial = isinstance(target, Weight) and target.rows * target.cols < 256 * 1024
            key = (w.kernel_type, kind, serial)
            if key in seen:
                continue
            seen.add(key)
            if kind == "embed":
                calls.append((f"{w.format.name} rows", lambda t=target: embed(t, np.zeros(1, np.int64))))
            elif isinstance(target, WeightGroup):
                x = np.zeros((n, small.cols), _F32)
                calls.append((f"{w.format.name} {kind}", lambda t=target, x=x: t(x)))
            else:
                x = np.zeros((n, target.cols), _F32)
                calls.append((f"{w.format.name} {kind}", lambda t=target, x=x: matmul(t, x)))
    return calls


__all__ = ["Weight", "WeightGroup", "FusedForward", "matmul", "matmul_fused", "embed", "dequantize", "rms_norm", "rope", "gated_activation", "attention", "set_threads",
           "warm_up_calls", "FORMATS", "BLAS_MIN_N"]


class FusedForward:
    """A whole forward pass over one sequence's new tokens as one compiled call with one parallel region
    (kernels/cpu/fused_forward.py): decode steps, speculative verifies and prompt chunks, where per-call Python
    overhead and thread wake-ups would otherwise cost as much as a small model's kernels.

    Built once per model from its weights; `available` is False where some weight has no integer kernel or the
    CPU lacks AVX2 (callers then keep the per-kernel path, which computes the same values).

    A mixture of experts: `experts` (per layer a backends.base.Experts of this module's weights) with `n_used`
    experts per token, weights renormalised with `normalize`, in place of the dense FFN, whose three matrices
    are then None in `layer_mats`."""

    # Each layer's weights by role, in the order the compiled forward reads them (kernels/cpu/fused_forward.py)
    MATRIX_ROLES = getattr(_fused, "MATRIX_ROLES", ())
    VECTOR_ROLES = getattr(_fused, "VECTOR_ROLES", ())
    # The architecture traits (architectures/traits.py ArchTraits) this forward implements, and the values it
    # implements of each (ANY: every value; the loader has already applied it to the weights or the tables). A
    # trait not named here, or a value not listed, leaves the model to the op-by-op forward (`unsupported`).
    ANY = None
    IMPLEMENTS = {"rope_style": {"normal", "neox"}, "activation": set(GATES), "scale_embeddings": ANY,
                  "qk_norm": ANY, "post_norms": ANY, "swa_pattern": ANY, "swa_all_layers": ANY, "swa_rope_base": ANY,
                  "rope_freq_factors": ANY, "fused_qkv": ANY, "fused_gate_up": ANY, "longrope": ANY,
                  "sliding_window_ignored": ANY, "soft_caps": ANY, "nope_interval": ANY, "moe": ANY}

    @classmethod
    def unsupported(cls, traits) -> str | None:
        """Why this forward cannot run an architecture with `traits` (None: it can)."""
        for f in dataclasses.fields(traits):
            if f.name not in cls.IMPLEMENTS:
                return f"the fused forward does not implement the trait {f.name}"
            values = cls.IMPLEMENTS[f.name]
            if values is not cls.ANY and getattr(traits, f.name) not in values:
                return f"the fused forward does not implement {f.name} = {getattr(traits, f.name)!r}"
        return None


    def __init__(self, layer_mats: list[list[Weight]], output: Weight, layer_vecs: list[list], output_norm,
                 dims: tuple, flags: tuple, eps: float, attention_scale: float, attention_softcap: float = 0.0,
                 experts: list | None = None, n_used: int = 0, normalize: bool = True):
        stacked = [] if experts is None else [
            [[g.weights[0] for g in ex.gate_up], [g.weights[1] for g in ex.gate_up], list(ex.down)] for ex in experts]
        everything = [w for mats in layer_mats for w in mats if w is not None] + [output]
        self.available = (_fused is not None and _quant_dot.USES_AVX2
                          and all(w._use_quant_dot for w in everything)
                          and all(w._use_quant_dot for layer in stacked for mats in layer for w in mats)
                          and all(len({w.kernel_type for w in mats}) == 1 for layer in stacked for mats in layer))
        if not self.available:
            return
        # A mixture of experts' layers have no dense FFN: an empty matrix holds its places (never read).
        hole = _read_only(np.empty((0, 0), np.uint8))
        first = everything[0]
        mats = [w.raw if w is not None else hole for mats in layer_mats for w in mats] + [output.raw]
        kinds = [w if w is not None else first for mats in layer_mats for w in mats] + [output]
        self.mats = typed_list(mats)
        self.mat_types = np.array([w.kernel_type for w in kinds], np.int64)
        # what the compiled forward dispatches on: one compile (and cache entry) per set of formats
        self.formats = FormatSet({w.kernel_type for w in everything}
                                 | {w.kernel_type for layer in stacked for mats in layer for w in mats})
        self.mat_families = np.array([_quant_dot.activation_family(w.qtype) for w in kinds], np.int64)
        self.moe = None
        if experts is not None:
            n_expert, n_ff_exp = experts[0].n_expert, stacked[0][2][0].cols
            if not 1 <= n_used <= n_expert:
                raise ValueError(f"cannot choose {n_used} of {n_expert} experts")
            self.moe = (typed_list(router_f32(ex) for ex in experts),
                        typed_list(w.raw for layer in stacked for mats in layer for w in mats),
                        np.array([int(mats[0].qtype) for layer in stacked for mats in layer], np.int64),
                        np.array([_quant_dot.activation_family(mats[0].qtype) for layer in stacked for mats in layer],
                                 np.int64),
                        np.array([n_expert, n_used, int(bool(normalize)), n_ff_exp], np.int64))
        empty = np.empty(0, _F32)
        vecs = [_read_only(empty if a is None else np.ascontiguousarray(a, _F32))
                for row in layer_vecs for a in row] + [_read_only(np.ascontiguousarray(output_norm, _F32))]
        self.vecs = typed_list(vecs)
        self.dims = np.array(dims, np.int64)
        self.flags = np.array(flags, np.int64)
        self.eps, self.scale = float(eps), np.float32(attention_scale)
        self.softcap = np.float32(attention_softcap)  # gemma2's attention logit soft-cap; 0: none
        self._compiled: dict = {}
        self._n_layers, self._n_embd = int(dims[0]), int(dims[6])
        if length(self.mats) != _fused.MATS_PER_LAYER * self._n_layers + 1:
            raise ValueError("fused forward: the weights do not match the layer count")
        self._checked_kv, self._checked_layers, self._max_group = None, None, -1

    @staticmethod
    def predicted_formats(gguf_file, tile) -> FormatSet | None:
        """The formats (`formats`) a fused forward of this file's weights will have, read from its tensors before
        they are loaded: the layers' matrices and the output head, each tiled as Weight.from_gguf tiles it when
        asked to where `tile(name)` (the backend's choice per tensor); None where there will be no fused forward
        (`available`)."""
        if _fused is None or not _quant_dot.USES_AVX2:
            return None
        tensors = gguf_file.tensors
        head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
        kinds = set()
        for name, info in tensors.items():
            if name != head and not (name.startswith("blk.") and len(info.shape) >= 2
                                     and not name.endswith("ffn_gate_inp.weight")):
                continue
            if info.qtype not in _QUANT_DOT_SUPPORTED:
                return None
            rows = int(np.prod(info.shape[:-1], dtype=np.int64))
            kinds.add(_kernel_type(info.qtype, _tiled_here(info.qtype, rows, tile(name))))
        return FormatSet(kinds) if kinds else None

    @classmethod
    def start_compiling(cls, gguf_file, tile) -> None:
        """Before a model's weights are read: start compiling the products and the attention of the fused forward
        they will need, in child processes on a cold start (fused_forward.start_compiling), while this one reads and
        tiles them."""
        formats = cls.predicted_formats(gguf_file, tile)
        if formats is not None:
            _fused.start_compiling(formats)

    def __call__(self, x: np.ndarray, kv: tuple, layer_group: np.ndarray, layer_window: np.ndarray,
                 layer_rope: np.ndarray, tables: np.ndarray, first_blocks: np.ndarray, write_cols: np.ndarray,
                 positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, out_rows: np.ndarray,
                 seg_bounds: np.ndarray | None = None) -> np.ndarray:
        """Logits (len(out_rows), vocab); x (n, n_embd) is the embedded tokens (overwritten). kv: per-layer typed
        lists (keys, key scales, values, value scales) of the pool; the rest as in fused_forward.py. One sequence:
        tables (groups, width), first_blocks (groups), seg_bounds None; several: tables (seqs, groups, width),
        first_blocks (seqs, groups), seg_bounds their row ranges [0, n1, n1 + n2, ..., n]."""
        n = len(x)
        if seg_bounds is None:
            tables, first_blocks = tables[None], first_blocks[None]
            seg_bounds = np.array([0, n], np.int64)
        elif seg_bounds[0] != 0 or seg_bounds[-1] != n or np.any(np.diff(seg_bounds) < 1):
            raise ValueError("fused forward: the sequences' row ranges do not cover the rows in order")
        # Checked here because the compiled workers must not fail: one that raised would leave the others
        # waiting for its tasks. What belongs to the model and its KV lists is checked once per object (a decode
        # step of a small model is ~4 ms, and every Python operation after a step's weights went through the
        # caches costs several times its cold-cache price).
        n_layers = self._n_layers
        if kv is not self._checked_kv:
            if any(length(lst) != n_layers for lst in kv):
                raise ValueError("fused forward: the KV lists do not have one array per layer")
            self._checked_kv = kv
        checked = self._checked_layers
        if checked is None or checked[0] is not layer_group or checked[1] is not layer_window \
                or checked[2] is not layer_rope:
            if not len(layer_group) == len(layer_window) == len(layer_rope) == n_layers:
                raise ValueError("fused forward: the per-layer tables do not have one entry per layer")
            self._checked_layers = (layer_group, layer_window, layer_rope)
            self._max_group = int(layer_group.max()) if n_layers else -1
        seqs = len(seg_bounds) - 1
        if (x.shape[1] != self._n_embd or len(positions) != n or write_cols.shape[1] != n or seqs < 1
                or tables.ndim != 3 or tables.shape[0] != seqs or tables.shape[:2] != first_blocks.shape
                or write_cols.shape[0] != tables.shape[1] or n_layers and self._max_group >= tables.shape[1]
                or len(out_rows) and not 0 <= out_rows.min() <= out_rows.max() < n):
            raise ValueError("fused forward: the model, its cache and the inputs do not match")
        threads = _threads[0]
        i64, f32 = np.int64, _F32
        args = (FUSED_TASKS_PER_THREAD * threads, self.formats, self.dims, self.flags, self.eps, self.scale,
                self.softcap, self.mats, self.mat_types, self.mat_families, self.vecs, kv[0], kv[1], kv[2], kv[3],
                _plain(layer_group, i64), _plain(layer_window, i64), _plain(layer_rope, i64), _plain(tables, i64),
                _plain(first_blocks, i64), _plain(seg_bounds, i64), _plain(write_cols, i64), _plain(positions, i64),
                _plain(cos, f32), _plain(sin, f32), _plain(x, f32), _plain(out_rows, i64), self._moe_step(len(x)))
        # the compiled worker, by the types of what varies between calls (the KV lists' element types)
        key = tuple(lst._list_type for lst in kv)
        k = self._compiled.get(key)
        if k is None:
            k = self._compiled[key] = _fused.compiled(args)
        return _fused.forward(threads, k.worker, k.products, k.attend, *args)

    def _moe_step(self, n: int):
        """The experts' weights and this step's buffers for n tokens (fused_forward._moe_ffn), or None."""
        if self.moe is None:
            return None
        n_expert, k, _, n_ff_exp = (int(v) for v in self.moe[4])
        d = int(self.dims[6])
        rows = n * k
        return self.moe + (np.empty((n, n_expert), _F32), np.empty((n, k), np.int64), np.empty((n, k), _F32),
                           np.empty(n_expert + 1, np.int64), np.empty(n_expert + 1, np.int64),
                           np.empty(rows, np.int64), np.empty(rows, _F32), np.empty((rows, d), _F32),
                           np.empty((rows, n_ff_exp), _F32), np.empty((rows, n_ff_exp), _F32),
                           np.empty((rows, n_ff_exp), _F32), np.empty((rows, d), _F32))


def _plain(a: np.ndarray, dtype) -> np.ndarray:
    """a as a writable C-ordered array of dtype (itself when it is one): the one type per argument that the
    fused forward's compiled worker takes."""
    if a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable:
        return a
    return np.array(a, dtype, order="C")


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def router_f32(experts) -> np.ndarray:
    """The router as read-only float32 (n_expert, d), derived once (converted files keep it float32: then a view of
    the file, no copy); one array type for every caller of the router kernel."""
    router = experts.cache.get("router")
    if router is None:
        w = experts.router
        router = experts.cache["router"] = _read_only(
            np.ascontiguousarray(w._dense if w._dense is not None else dequantize(w)))
    return router


def moe_ffn(experts, x: np.ndarray, k: int, normalize: bool, kind: str, precise: bool = False) -> np.ndarray:
    """A mixture-of-experts FFN over x (n, d) (backends.base.Backend.moe_ffn; `experts` a backends.base.Experts
    of this module's weights): the router's logits and each row's k experts and weights (kernels/cpu/moe_kernels.py: the
    routing of kernels/moe.py route, compiled, as the fused forward computes it), then per chosen expert its
    rows gathered and put through gate/up (one WeightGroup call), the activation and down once, each result times
    its weight into the row's slot; the slots summed in rank order. Every step computes each row alone (the
    integer kernels' rows are batch invariant), so a row's output is bitwise the same whatever else is in the
    batch."""
    from localllm.kernels import moe as _routing

    router = router_f32(experts)
    x = np.ascontiguousarray(x, dtype=_F32)
    n = x.shape[0]
    logits = np.empty((n, experts.n_expert), _F32)
    _moe.router_logits(router, x, logits)
    if not 1 <= k <= experts.n_expert:
        raise ValueError(f"cannot choose {k} of {experts.n_expert} experts")
    ids, weights = np.empty((n, k), np.int64), np.empty((n, k), _F32)
    _moe.route_rows(logits, k, normalize, ids, weights)
    flat_weights = weights.reshape(-1)
    d_out = experts.down[0].rows
    slots = np.empty((n * k, d_out), _F32)
    if n == 1:  # decode: each chosen expert serves the one row (the same products as below, less numpy around them)
        for j, e in enumerate(ids[0].tolist()):
            gate, up = experts.gate_up[e](x, precise=precise)
            y = matmul(experts.down[e], gated_activation(gate, up, kind), out=slots[j : j + 1], precise=precise)
            y *= flat_weights[j]
    else:
        for e, sel in _routing.by_expert(ids, experts.n_expert):
            xs = x[sel // k]  # contiguous: the rows this expert serves
            gate, up = experts.gate_up[e](xs, precise=precise)
            y = matmul(experts.down[e], gated_activation(gate, up, kind), precise=precise)
            y *= flat_weights[sel][:, None]
            slots[sel] = y
    slots = slots.reshape(n, k, d_out)
    out = slots[:, 0].copy()
    for j in range(1, k):
        out += slots[:, j]
    return out

