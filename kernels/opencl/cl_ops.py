"""The decoder's operations on an OpenCL device, activations kept there: thin wrappers over the kernels of
`ops.cl` (and `formats.cl` for the embedding lookup and the weight matmul), each taking and returning
`pyopencl.array.Array`s of float32 that never leave the device. Nothing here reads device memory back except
`to_host`: a forward made of these calls downloads only what its caller asks for (the logits, or just the
argmax's token ids).

Shapes follow the CPU backend (`kernels/ops.py`) and the reference (`kernels/reference.py`): rows on the first
axes, the operated-on axis last, C order. Integer inputs that come from the host anyway (token ids, query
positions, RoPE's cos/sin tables) may be numpy arrays: they are uploaded (host to device), never read back.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import numpy as np

from localllm.kernels.opencl import cl_formats as _formats
from localllm.kernels.opencl.device import Device

# Work-group sizes (powers of two within every device's limit we target; Apple: 256). 64 fits the narrowest
# rows the catalog models normalise (head_dim 64, qk-norm) without idle work-items, and the attention tile
# is as many keys.
ROW_WG = 64
ATT_WG = 64
# The widest head attention takes (key and value dims): twice the catalog's widest (gemma3-270m: 256). Each
# work-item has ATT_MAX_D / ATT_WG = 8 output sums in registers and uses as many as the head needs (1 for 64).
ATT_MAX_D = 512

_OPTIONS = (f"-DROW_WG={ROW_WG}", f"-DATT_WG={ATT_WG}", f"-DATT_MAX_D={ATT_MAX_D}", "-cl-std=CL1.2")

GATES = ("silu", "gelu_tanh")


@cache
def source() -> str:
    """ops.cl after rows.cl (the row sum of squares it shares with the decode plan's products)."""
    here = resources.files("localllm.kernels.opencl")
    return here.joinpath("rows.cl").read_text() + here.joinpath("ops.cl").read_text()


def rows_source() -> str:
    return resources.files("localllm.kernels.opencl").joinpath("rows.cl").read_text()


def build_options(dev: Device) -> tuple[str, ...]:
    """ops.cl's build options on a device (_build_options), computed once per setting of its switches."""
    return dev.options("ops", _build_options)


def _build_options(dev: Device) -> tuple[str, ...]:
    """ops.cl's constants and the device's capability macros (formats.capability_options: the same sub-group
    rule as the weight kernels'), -cl-std=CL1.2 where it has none; rows.cl's multiply-add as the formats'."""
    return (tuple(o for o in _OPTIONS if not o.startswith("-cl-std")) + _formats.capability_options(dev)
            + tuple(_formats.fma_options(dev)))


def kernel(dev: Device, name: str):
    return dev.kernel(source(), build_options(dev), name)


def _array():
    import pyopencl.array as cl_array  # imported with pyopencl, when a device is in use

    return cl_array


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for s in reversed(shape):
        strides.append(step)
        step *= max(1, s)
    return tuple(reversed(strides))


def _c_contiguous(a) -> bool:
    """a.flags.c_contiguous without pyopencl's flags object (made per array with numpy calls: 20 us each)."""
    return a.strides == _c_strides(a.shape, a.dtype.itemsize) or a.size <= 1 or a.flags.c_contiguous


def _check(a, what: str, ndim: int | None = None):
    if isinstance(a, np.ndarray):
        raise ValueError(f"{what} is a host array; activations are device arrays (Ops.to_device uploads one)")
    if a.dtype != np.float32 or (ndim is not None and a.ndim != ndim) or not _c_contiguous(a) or a.offset:
        want = f"{ndim}-D " if ndim is not None else ""
        raise ValueError(f"{what} must be a {want}C-contiguous float32 device array, not {a.dtype} {a.shape}")


def _check_kv(a, scales, what: str) -> bool:
    """A KV cache array: float32 (True: no), or int8 with float32 scales (n_kv, capacity, d / 32) (a q8_0 one)."""
    if isinstance(a, np.ndarray) or a.dtype != np.int8:
        _check(a, what, 3)
        return False
    if a.ndim != 3 or not _c_contiguous(a) or a.offset or a.shape[2] % 32:
        raise ValueError(f"{what} must be a 3-D C-contiguous device array, rows a multiple of 32, not {a.shape}")
    if scales is None or isinstance(scales, np.ndarray) or scales.dtype != np.float32 or \
            scales.shape != a.shape[:2] + (a.shape[2] // 32,) or not _c_contiguous(scales) or scales.offset:
        raise ValueError(f"int8 {what} {a.shape} need their float32 scales {a.shape[:2] + (a.shape[2] // 32,)}")
    return True


def _fast_arrays() -> bool:
    import inspect

    try:
        return "_fast" in inspect.signature(_array().Array.__init__).parameters
    except (ImportError, ValueError, TypeError):
        return False


_FAST_ARRAYS = None  # set on the first Ops (pyopencl is imported only when a device is in use)


def _groups(count: int, wg: int = 256) -> tuple[int]:
    return (-(-count // wg) * wg,)


class Ops:
    """The operations on one device: `Ops(dev).rms_norm(x, w, eps)`; arrays are pyopencl arrays on
    dev.queue (in-order, so each op sees the previous one's writes without a wait)."""

    def __init__(self, dev: Device):
        import pyopencl.tools as cl_tools

        global _FAST_ARRAYS
        if _FAST_ARRAYS is None:
            _FAST_ARRAYS = _fast_arrays()
        self.dev = dev
        self.shape = _formats.shape_for(dev)  # the weight kernels' shape ("rows" on CPUs, "lanes" on GPUs)
        # Buffers of dropped arrays are kept for the next array of the same size class, not released and
        # created again per op. Safe on the one in-order queue: a buffer's next user is enqueued after every
        # kernel that used it before.
        self.allocator = cl_tools.MemoryPool(cl_tools.ImmediateAllocator(dev.queue))
        self._in_flight: list[np.ndarray] = []  # host arrays of uploads not yet known to be done (to_device)

    def _kernel(self, name: str):
        return kernel(self.dev, name)

    # ---- transfers ---------------------------------------------------------------------------------------------

    def to_device(self, a: np.ndarray, dtype=np.float32):
        """A device copy of a host array (C-contiguous, `dtype`), enqueued without waiting for it: the host copy
        is kept until the next `to_host`, which the in-order queue runs after the upload. (A blocking upload
        waited for every kernel enqueued before it: a forward's uploads of positions and columns stalled the
        host once per layer group.)"""
        host = np.ascontiguousarray(a, dtype=dtype)
        out = self.empty(host.shape, host.dtype)
        if host.size:
            self.dev.cl.enqueue_copy(self.dev.queue, out.data, host, is_blocking=False)
            self._in_flight.append(host)
        return out

    def to_host(self, a) -> np.ndarray:
        """The device array's values on the host: the one read-back of this module (it waits for the queue, so
        the uploads enqueued before it are done and their host copies may go)."""
        out = a.get()
        self._in_flight.clear()
        return out

    def empty(self, shape, dtype=np.float32):
        """A new C-contiguous device array. Made through pyopencl's own fast constructor (what its
        _new_with_changes uses), which skips re-deriving size and strides with numpy: the general one took 19 us
        per array, 7 ms of each smollm2 token on a GPU's host side (394 arrays per token)."""
        shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        size = 1
        for s in shape:
            size *= s
        if size and _FAST_ARRAYS:
            return _array().Array(None, shape, dtype, allocator=self.allocator, strides=_c_strides(shape, dtype.itemsize),
                                  _fast=True, _size=size, _context=self.dev.context, _queue=self.dev.queue)
        return _array().empty(self.dev.queue, shape, dtype, allocator=self.allocator)

    def _input(self, a, dtype):
        """A device array of `dtype`: uploaded if `a` is a host array."""
        if isinstance(a, np.ndarray):
            return self.to_device(a, dtype)
        if a.dtype != dtype or not a.flags.c_contiguous or a.offset:
            raise ValueError(f"expected a C-contiguous {np.dtype(dtype).name} device array, "
                             f"not {a.dtype} {a.shape}")
        return a

    # ---- operations --------------------------------------------------------------------------------------------

    def embed(self, w: _formats.DeviceWeight, ids) -> object:
        """float32 (len(ids), cols): rows `ids` of the weight, decoded by formats.cl's dequantize kernels
        (bit-equal to the CPU's dequantization)."""
        if w.dev is not self.dev:
            raise ValueError("the weight was uploaded to another device")
        if isinstance(ids, np.ndarray):
            ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
            if ids.size and (ids.min() < 0 or ids.max() >= w.rows):
                raise ValueError(f"token ids must lie in [0, {w.rows}), got {ids.min()}..{ids.max()}")
        ids_d = self._input(ids, np.int64)
        out = self.empty((ids_d.size, w.cols))
        if ids_d.size:
            _formats.enqueue_dequantize(w, ids_d.data, ids_d.size, out.data)
        return out

    def matmul(self, w: _formats.DeviceWeight, x):
        """float32 (n, rows) = x (n, cols) @ W.T: formats.cl's dequantize-matvec (float32 accumulation), each
        row's bits those `formats.matvec` gives it alone, on a device x and into a device array."""
        if w.dev is not self.dev:
            raise ValueError("the weight was uploaded to another device")
        _check(x, "x", 2)
        if x.shape[1] != w.cols:
            raise ValueError(f"x must be (n, {w.cols}), not {x.shape}")
        out = self.empty((x.shape[0], w.rows))
        _formats.enqueue_matmul(w, x.data, x.shape[0], out.data, self.shape)
        return out

    def rms_norm(self, x, weight, eps: float):
        """RMSNorm over the last axis (any leading shape), with a weight of that axis's length; a new array."""
        _check(x, "x")
        dev = self.dev
        d = x.shape[-1]
        w = self._input(weight, np.float32)
        if w.size != d:
            raise ValueError(f"the norm weight has {w.size} elements, the rows {d}")
        out = self.empty(x.shape)
        rows = x.size // d if d else 0
        if rows:
            self._kernel("rms_norm")(dev.queue, (rows * ROW_WG,), (ROW_WG,), x.data, w.data, out.data, np.uint32(d),
                                    np.float32(eps))
        return out

    def rope(self, x, cos, sin, rope_dim: int, neox: bool) -> None:
        """Rotate x (n, heads, head_dim) in place by cos/sin (n, rope_dim // 2) of each row's position: NeoX
        halves or adjacent pairs; elements from rope_dim on are left as they are."""
        _check(x, "x", 3)
        dev = self.dev
        n, heads, head_dim = x.shape
        if rope_dim % 2 or not 0 < rope_dim <= head_dim:
            raise ValueError(f"rope_dim {rope_dim} must be even and within the head ({head_dim})")
        c, s = self._input(cos, np.float32), self._input(sin, np.float32)
        if c.shape != (n, rope_dim // 2) or s.shape != c.shape:
            raise ValueError(f"cos/sin must be ({n}, {rope_dim // 2}), not {c.shape} and {s.shape}")
        if n * heads:
            self._kernel("rope")(dev.queue, (n * heads, rope_dim // 2), None, x.data, c.data, s.data, np.uint32(heads),
                                np.uint32(head_dim), np.uint32(rope_dim), np.uint32(bool(neox)))

    def gated_activation(self, gate, up, kind: str):
        """act(gate) * up elementwise, act SiLU ("silu") or the tanh GELU ("gelu_tanh"); a new array."""
        if kind not in GATES:
            raise ValueError(f"unknown gate {kind!r} (there is: {', '.join(GATES)})")
        _check(gate, "gate")
        _check(up, "up")
        if gate.shape != up.shape:
            raise ValueError(f"gate {gate.shape} and up {up.shape} differ")
        dev = self.dev
        out = self.empty(gate.shape)
        if gate.size:
            self._kernel(f"gated_{kind}")(dev.queue, _groups(gate.size), (256,), gate.data, up.data, out.data,
                                         np.uint32(gate.size))
        return out

    def add(self, a, b, out=None):
        """a + b, b either of a's shape (the residual) or a row vector of a's last axis (a bias), broadcast over
        the rows; into `out` (which may be a) or a new array."""
        _check(a, "a")
        dev = self.dev
        b = self._input(b, np.float32)
        if b.shape != a.shape and not (b.size == a.shape[-1] and b.ndim == 1):
            raise ValueError(f"cannot add {b.shape} to {a.shape} (same shape, or a row of {a.shape[-1]})")
        out = self.empty(a.shape) if out is None else out
        if a.size:
            self._kernel("add")(dev.queue, _groups(a.size), (256,), a.data, b.data, out.data, np.uint32(a.size),
                               np.uint32(b.size))
        return out

    def scale(self, x, s: float, out=None):
        """x * s, into `out` (which may be x) or a new array."""
        _check(x, "x")
        dev = self.dev
        out = self.empty(x.shape) if out is None else out
        if x.size:
            self._kernel("scale")(dev.queue, _groups(x.size), (256,), x.data, out.data, np.uint32(x.size),
                                 np.float32(s))
        return out

    def kv_write(self, cache, x, at: int | None = None, cols=None, scales=None) -> None:
        """Store x (n, n_kv, d), a K or V projection's rows, into a cache (n_kv, capacity, d), the layout
        `attention` reads: at rows at .. at + n - 1, or at storage columns `cols` (n ints, host or device: the
        KV pool's blocks). An int8 cache is a q8_0 one: its float32 `scales` (n_kv, capacity, d / 32) are written
        beside it, the bytes those of the CPU backend's write_rows (kernels/cpu/attention.py) for the same rows."""
        q8 = _check_kv(cache, scales, "cache")
        _check(x, "x", 3)
        n_kv, cap, d = cache.shape
        n = x.shape[0]
        if cols is None:
            if at is None or not 0 <= at <= cap - n:
                raise ValueError(f"cannot write {x.shape} at row {at} of a cache {cache.shape}")
            cols = np.arange(at, at + n, dtype=np.int32)
        elif isinstance(cols, np.ndarray) and cols.size and (cols.min() < 0 or cols.max() >= cap):
            raise ValueError(f"storage columns must lie in [0, {cap}), got {cols.min()}..{cols.max()}")
        cols_d = self._input(cols, np.int32)
        if x.shape[1:] != (n_kv, d) or cols_d.size != n:
            raise ValueError(f"cannot write {x.shape} to {cols_d.size} columns of a cache {cache.shape}")
        if x.size and q8:
            blocks = x.size // 32
            self._kernel("kv_write_q8")(self.dev.queue, _groups(blocks, 64), (64,), x.data, cache.data, scales.data,
                                        cols_d.data, np.uint32(n_kv), np.uint32(cap), np.uint32(d), np.uint32(blocks))
        elif x.size:
            self._kernel("kv_write")(self.dev.queue, _groups(x.size), (256,), x.data, cache.data, cols_d.data,
                                     np.uint32(n_kv), np.uint32(cap), np.uint32(d), np.uint32(x.size))

    def gather_rows(self, x, idx):
        """x[idx] for a 2-D x and row indices (host or device ints): a new array."""
        _check(x, "x", 2)
        idx_d = self._input(idx, np.int32)
        out = self.empty((idx_d.size, x.shape[1]))
        if out.size:
            self._kernel("gather_rows")(self.dev.queue, _groups(out.size), (256,), x.data, idx_d.data, out.data,
                                        np.uint32(x.shape[1]), np.uint32(out.size))
        return out

    def attention(self, q, keys, values, q_positions, scale: float, window: int, key_start: int = 0,
                  length: int | None = None, cols=None, softcap: float = 0.0, k_scales=None, v_scales=None):
        """Causal grouped-query attention (`kernels/reference.py` attention): q (n, n_head, d) at q_positions
        (n ints, host or device int32) over the first `length` (default: all) rows of keys (n_kv, capacity, d)
        and values (n_kv, capacity, dv), at positions key_start .. key_start + length - 1; window > 0: a query
        at p sees only keys after p - window. `cols` (host or device ints): key t's storage column, for a
        paged cache (`length` is then len(cols)); by default key t is row t. softcap > 0: each scaled score
        becomes tanh(s / softcap) * softcap (gemma2). int8 keys and values are a q8_0 cache, read with their
        float32 `k_scales` (n_kv, capacity, d / 32) and `v_scales` (kv_write). Returns (n, n_head * dv)."""
        _check(q, "q", 3)
        q8 = _check_kv(keys, k_scales, "keys")
        if _check_kv(values, v_scales, "values") != q8:
            raise ValueError(f"keys {keys.dtype} and values {values.dtype} are not of one KV cache type")
        dev = self.dev
        n, n_head, d = q.shape
        n_kv, cap, dv = values.shape
        if cols is not None:
            t = len(cols) if isinstance(cols, np.ndarray) else cols.size
            if isinstance(cols, np.ndarray) and t and (cols.min() < 0 or cols.max() >= cap):
                raise ValueError(f"storage columns must lie in [0, {cap}), got {cols.min()}..{cols.max()}")
        else:
            t = cap if length is None else int(length)
            if not 0 <= t <= cap:
                raise ValueError(f"{t} keys in use of a cache of {cap}")
            cols = np.arange(t, dtype=np.int32)
        if keys.shape != (n_kv, cap, d) or n_kv == 0 or n_head % n_kv or not 0 <= t <= cap:
            raise ValueError(f"keys {keys.shape} and values {values.shape} do not fit q {q.shape} "
                             f"(n_kv heads dividing n_head, as many keys as values, {t} of them in use)")
        if max(d, dv) > ATT_MAX_D:
            raise ValueError(f"heads wider than {ATT_MAX_D} are not supported by the OpenCL attention ({d}, {dv})")
        cols_d = self._input(cols, np.int32) if t else None
        pos = self._input(q_positions, np.int32)
        if pos.size != n:
            raise ValueError(f"{pos.size} positions for {n} queries")
        out = self.empty((n, n_head * dv))
        if n:
            kv = (keys.data, k_scales.data, values.data, v_scales.data) if q8 else (keys.data, values.data)
            self._kernel("attention_q8" if q8 else "attention")(
                dev.queue, (n_head * ATT_WG, n), (ATT_WG, 1), q.data, *kv, pos.data, cols_d.data if t else pos.data,
                out.data, np.uint32(n_head), np.uint32(n_kv), np.uint32(t), np.uint32(cap), np.uint32(d),
                np.uint32(dv), np.int32(key_start), np.int32(window), np.float32(scale), np.float32(softcap))
        return out

    def argmax(self, x):
        """int32 (rows,): the index of each row's largest value (the first on ties; NaNs passed over), on the
        device: greedy sampling downloads one int per row, not the logits."""
        _check(x, "x", 2)
        dev = self.dev
        rows, cols = x.shape
        out = self.empty((rows,), np.int32)
        if rows and cols:
            self._kernel("argmax")(dev.queue, (rows * ROW_WG,), (ROW_WG,), x.data, out.data, np.uint32(cols))
        return out



    def scale_rows_to(self, y, rows, weights, out) -> None:
        """out[rows[r]] = y[r] * weights[r] for each row r of y (n, d); rows and weights (n,) host or device
        arrays (int32, float32); out (m, d), m > every row index."""
        _check(y, "y", 2)
        _check(out, "out", 2)
        n, d = y.shape
        if isinstance(rows, np.ndarray) and rows.size and (rows.min() < 0 or rows.max() >= out.shape[0]):
            raise ValueError(f"rows must lie in [0, {out.shape[0]}), got {rows.min()}..{rows.max()}")
        rows_d, w_d = self._input(rows, np.int32), self._input(weights, np.float32)
        if out.shape[1] != d or rows_d.size != n or w_d.size != n:
            raise ValueError(f"cannot scale {y.shape} by {w_d.size} weights into {rows_d.size} rows of {out.shape}")
        if y.size:
            self._kernel("scale_rows_to")(self.dev.queue, _groups(y.size), (256,), y.data, rows_d.data, w_d.data,
                                          out.data, np.uint32(d), np.uint32(y.size))

    def sum_slots(self, slots, k: int):
        """(n, d): each row's k consecutive rows of slots (n * k, d) added in order."""
        _check(slots, "slots", 2)
        if k < 1 or slots.shape[0] % k:
            raise ValueError(f"{slots.shape[0]} slot rows are not a whole number of groups of {k}")
        n, d = slots.shape[0] // k, slots.shape[1]
        out = self.empty((n, d))
        if out.size:
            self._kernel("sum_slots")(self.dev.queue, _groups(out.size), (256,), slots.data, out.data, np.uint32(k),
                                      np.uint32(d), np.uint32(out.size))
        return out
