"""The OpenCL backend's kernel table: for each format of the backend-neutral table (`kernels/formats.py`), the
names of its kernels in `formats.cl` and the elements each work-item decodes (`chunk`), as ggml's per-backend
kernel tables sit beside `type_traits`.

`DeviceWeight` uploads a weight matrix once (the GGUF bytes as stored); `dequantize_rows` and `matvec` run on
it. These two read their results back (tests call them with host arrays); `ops.py` runs the same kernels on
device arrays (`Ops.embed`, `Ops.matmul`), where activations stay.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np
from gguf import GGMLQuantizationType

from localllm.kernels import formats as _neutral
from localllm.kernels.opencl.device import Device

# Work-group size of matvec: a power of two within every device's limit we target (Apple: 256). 64 keeps
# a row's work-items busy on the narrow matrices of the small models (896 columns = 28 chunks of 32).
MATVEC_WG = 64


@dataclass(frozen=True)
class OpenCLFormat:
    format: _neutral.QuantFormat  # the backend-neutral entry
    suffix: str  # kernel names: dequantize_rows_<suffix>, matvec_<suffix>
    chunk: int  # consecutive elements one work-item decodes (a divisor of the block size, or 1 for floats)


FORMATS: dict[GGMLQuantizationType, OpenCLFormat] = {
    q: OpenCLFormat(format=f, suffix=q.name.lower(), chunk=1 if f.block_size == 1 else 32)
    for q, f in _neutral.FORMATS.items()
}


def format_of(qtype: GGMLQuantizationType | int) -> OpenCLFormat:
    return FORMATS[_neutral.format_of(qtype).qtype]


@cache
def source() -> str:
    return resources.files("localllm.kernels.opencl").joinpath("formats.cl").read_text()


# x rows per work-group of matmul (prompts, verifies, batches): W is read once per MATMUL_NT tokens; 8 keeps
# 8 accumulators in registers and 64 * 8 * 4 = 2 KiB of local memory.
MATMUL_NT = 8
_OPTIONS = (f"-DWG={MATVEC_WG}", f"-DNT={MATMUL_NT}", "-cl-std=CL1.2")


def kernel(dev: Device, name: str):
    """A kernel of formats.cl built for a device (once per process; from the build caches after the first)."""
    return dev.kernel(source(), _OPTIONS, name)


class DeviceWeight:
    """A 2-D weight in any format of the table, uploaded to the device once, as stored."""

    def __init__(self, dev: Device, raw: np.ndarray, qtype: GGMLQuantizationType):
        fmt = format_of(qtype)
        if raw.dtype != np.uint8 or raw.ndim != 2:
            raise ValueError(f"a weight's raw data must be a 2-D uint8 array, not {raw.dtype} {raw.shape}")
        if raw.shape[1] % fmt.format.type_size:
            raise ValueError(f"{raw.shape[1]} bytes per row is not a whole number of {fmt.format.name} blocks")
        self.dev = dev
        self.format = fmt
        self.qtype = fmt.format.qtype
        self.rows = int(raw.shape[0])
        self.row_bytes = int(raw.shape[1])
        self.cols = self.row_bytes // fmt.format.type_size * fmt.format.block_size
        self.nbytes = self.rows * self.row_bytes  # as stored: what a product reads
        cl = dev.cl
        self.buffer = cl.Buffer(dev.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                                hostbuf=np.ascontiguousarray(raw))


def dequantize_rows(w: DeviceWeight, row_ids: np.ndarray) -> np.ndarray:
    """float32 (len(row_ids), cols): the weight's rows row_ids, decoded on the device."""
    dev, cl = w.dev, w.dev.cl
    ids = np.ascontiguousarray(row_ids, dtype=np.int64)
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= w.rows)):
        raise ValueError(f"row ids must be a 1-D array within 0..{w.rows - 1}")
    out = np.empty((ids.size, w.cols), np.float32)
    if ids.size == 0:
        return out
    mf = cl.mem_flags
    ids_buf = cl.Buffer(dev.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=ids)
    out_buf = cl.Buffer(dev.context, mf.WRITE_ONLY, out.nbytes)
    kernel_ = kernel(dev, f"dequantize_rows_{w.format.suffix}")
    kernel_(dev.queue, (w.cols // w.format.chunk, ids.size), None, w.buffer, ids_buf, out_buf,
           np.uint32(w.row_bytes), np.uint32(w.cols))
    cl.enqueue_copy(dev.queue, out, out_buf)
    return out


def matvec(w: DeviceWeight, x: np.ndarray) -> np.ndarray:
    """float32 (n, rows) = x (n, cols) @ W.T, W decoded on the device, float32 accumulation (fma)."""
    dev, cl = w.dev, w.dev.cl
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.cols:
        raise ValueError(f"x must be (n, {w.cols}) float32, not {x.shape}")
    n = x.shape[0]
    out = np.empty((n, w.rows), np.float32)
    if n == 0 or w.rows == 0:
        return out
    mf = cl.mem_flags
    x_buf = cl.Buffer(dev.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
    out_buf = cl.Buffer(dev.context, mf.WRITE_ONLY, out.nbytes)
    kernel_ = kernel(dev, f"matvec_{w.format.suffix}")
    kernel_(dev.queue, (w.rows * MATVEC_WG, n), (MATVEC_WG, 1), w.buffer, x_buf, out_buf,
           np.uint32(w.row_bytes), np.uint32(w.cols), np.uint32(w.rows))
    cl.enqueue_copy(dev.queue, out, out_buf)
    return out
