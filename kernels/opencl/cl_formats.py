"""The OpenCL backend's kernel table: for each format of the backend-neutral table (`kernels/formats.py`), the
names of its kernels in `formats.cl`, as ggml's per-backend kernel tables sit beside `type_traits`.

`DeviceWeight` uploads a weight matrix once: a quantized format re-laid for the kernels (`relayout`: per chunk
of 32 elements, float32 scales and aligned uint quants; numpy, once per load), a float format as stored. The
products run in one of two shapes, chosen from the device (`shape_for`): "rows" (one weight row per work-item,
no barriers: CPU devices such as PoCL) or "lanes" (16 work-items per row, 4 rows per work-group: GPUs). Each
x row's sum is accumulated in the same order whatever the number of x rows, so a row's result is bit for bit
the same in a decode step (n = 1) and in a prompt or a speculative verify (n > 1).

`dequantize_rows` and `matvec` read their results back (tests call them with host arrays); `ops.py` runs the
same kernels on device arrays (`Ops.embed`, `Ops.matmul`) through `enqueue_dequantize` and `enqueue_matmul`.
"""

from __future__ import annotations

import os

from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np
from gguf import GGMLQuantizationType

from localllm.kernels import formats as _neutral
from localllm.kernels.opencl.device import Device

# Work-group size of the float formats' matvec (GGUF layout, one work-group per row): a power of two within
# every device's limit we target (Apple: 256).
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


# x rows per work-group of the float formats' matmul and of the "lanes" shape's (prompts, verifies, batches):
# W is read once per MATMUL_NT tokens; 8 keeps 8 sums per work-item and 8 * 4 * 64 = 2 KiB of local memory.
MATMUL_NT = 8

# ---- the re-laid layout of the quantized formats (formats.cl, "the quantized formats, re-laid at upload") ----

@dataclass(frozen=True)
class Layout:
    low_bits: int  # L: bits of each code in `lo` (8, 4 or 2)
    high_bits: int  # H: bits of each code in `hi` (0, 1 or 2)
    scales: int  # S: scales per chunk of 32 (2 for the 16-element sub-blocks of Q2_K, Q3_K, Q6_K)
    has_min: bool  # y = s * (u - offset) - m, else without m
    offset: int


_T = GGMLQuantizationType
LAYOUTS: dict[GGMLQuantizationType, Layout] = {
    _T.Q8_0: Layout(8, 0, 1, False, 128),
    _T.Q4_0: Layout(4, 0, 1, False, 8),
    _T.Q4_1: Layout(4, 0, 1, True, 0),
    _T.Q5_0: Layout(4, 1, 1, False, 16),
    _T.Q5_1: Layout(4, 1, 1, True, 0),
    _T.Q2_K: Layout(2, 0, 2, True, 0),
    _T.Q3_K: Layout(2, 1, 2, False, 4),
    _T.Q4_K: Layout(4, 0, 1, True, 0),
    _T.Q5_K: Layout(4, 1, 1, True, 0),
    _T.Q6_K: Layout(4, 2, 2, False, 32),
}


def device_nbytes(qtype, n_elements: int) -> int:
    """Bytes a weight of n_elements takes on the device: the re-laid arrays, or the GGUF bytes of a float
    format (check_fits counts these, not the file's)."""
    fmt = format_of(qtype)
    lay = LAYOUTS.get(fmt.format.qtype)
    if lay is None:
        return n_elements // fmt.format.block_size * fmt.format.type_size
    return n_elements // 32 * 4 * (lay.scales * (2 if lay.has_min else 1) + lay.low_bits + lay.high_bits)


def _f16(blocks: np.ndarray, off: int) -> np.ndarray:
    """The fp16 field at byte `off` of each block, as float32 (exact, as the CPU's f16_to_f32)."""
    return np.ascontiguousarray(blocks[..., off:off + 2]).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: byte j's low nibble is element j, its high nibble element j + 16 (ggml's Q4_0)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """4 bytes (a little-endian u32) -> its 32 bits, bit j for element j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _scale_min_k4(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for the 8 sub-blocks at once: 12 packed bytes -> 6-bit scales and mins."""
    p = p.astype(np.int32)
    sc = np.concatenate([p[..., 0:4] & 63, (p[..., 8:12] & 15) | ((p[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([p[..., 4:8] & 63, (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def _codes(qtype, b: np.ndarray):
    """GGUF blocks (rows, nb, type_size) -> codes (rows, chunks, 32) uint8, scales and mins (rows, chunks, S)
    float32: per element y = s * (u - offset) - m, the CPU's arithmetic (kernels/cpu/dequant.py)."""
    r, nb = b.shape[:2]
    if qtype == _T.Q8_0:
        return b[..., 2:34] ^ np.uint8(0x80), _f16(b, 0)[..., None], None
    if qtype == _T.Q4_0:
        return _nibbles(b[..., 2:18]), _f16(b, 0)[..., None], None
    if qtype == _T.Q4_1:
        return _nibbles(b[..., 4:20]), _f16(b, 0)[..., None], -_f16(b, 2)[..., None]
    if qtype == _T.Q5_0:
        return _nibbles(b[..., 6:22]) | (_bits32(b[..., 2:6]) << 4), _f16(b, 0)[..., None], None
    if qtype == _T.Q5_1:
        return _nibbles(b[..., 8:24]) | (_bits32(b[..., 4:8]) << 4), _f16(b, 0)[..., None], -_f16(b, 2)[..., None]
    if qtype == _T.Q2_K:  # element 128h + 32s + 16g + l: bits 2s of qs[32h + 16g + l]; scale byte 8h + 2s + g
        qs = b[..., 16:80].reshape(r, nb, 2, 1, 2, 16)
        u = (qs >> (2 * np.arange(4, dtype=np.uint8))[:, None, None]) & 3
        sc = b[..., 0:16].reshape(r, nb * 8, 2)
        d, dmin = _f16(b, 80).repeat(8, axis=1)[..., None], _f16(b, 82).repeat(8, axis=1)[..., None]
        return u.reshape(r, nb * 8, 32), d * (sc & 15).astype(np.float32), dmin * (sc >> 4).astype(np.float32)
    if qtype == _T.Q3_K:  # element 128h + 32s + 16g + l (i = 16g + l): bits 2s of qs[32h + i], bit 4h + s of hmask[i]
        qs = b[..., 32:96].reshape(r, nb, 2, 1, 32)
        low = (qs >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        hbit = (b[..., None, 0:32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        u = (low | (hbit.reshape(r, nb, 2, 4, 32) << 2)).reshape(r, nb * 8, 32)
        p = b[..., 96:108].astype(np.int32)
        j = np.arange(16)
        low_s = np.where(j < 8, p[..., j % 8] & 15, p[..., j % 8] >> 4)
        high_s = (p[..., 8 + (j & 3)] >> (2 * (j >> 2))) & 3
        scale = ((low_s | (high_s << 4)) - 32).astype(np.float32).reshape(r, nb * 8, 2)
        return u, _f16(b, 108).repeat(8, axis=1)[..., None] * scale, None
    if qtype in (_T.Q4_K, _T.Q5_K):  # chunk j: the low (j even) or high nibbles of qs[32 (j // 2) ..]
        q0 = 16 if qtype == _T.Q4_K else 48
        qs = b[..., q0:q0 + 128].reshape(r, nb, 4, 1, 32)
        u = ((qs >> np.array([0, 4], np.uint8)[:, None]) & 15).reshape(r, nb, 8, 32)
        if qtype == _T.Q5_K:  # bit j of qh[l] is element 32j + l's 5th bit
            u = u | (((b[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
        sc, m = _scale_min_k4(b[..., 4:16])
        d1 = _f16(b, 0)[..., None] * sc
        m1 = _f16(b, 2)[..., None] * m
        return u.reshape(r, nb * 8, 32), d1.reshape(r, nb * 8, 1), m1.reshape(r, nb * 8, 1)
    if qtype == _T.Q6_K:  # element 128h + 32t + 16g + l (i = 16g + l): nibble t // 2 of ql[64h + 32 (t & 1) + i],
        ql = b[..., 0:128].reshape(r, nb, 2, 1, 2, 32)  # bits 2t of qh[32h + i]; scale int8 8h + 2t + g
        low = (ql >> np.array([0, 4], np.uint8)[:, None, None]) & 15
        qh = b[..., 128:192].reshape(r, nb, 2, 1, 32)
        high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        u = (low.reshape(r, nb, 2, 4, 32) | (high << 4)).reshape(r, nb * 8, 32)
        scale = b[..., 192:208].view(np.int8).astype(np.float32).reshape(r, nb * 8, 2)
        return u, _f16(b, 208).repeat(8, axis=1)[..., None] * scale, None
    raise ValueError(f"{qtype.name} has no re-laid layout")


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """32 bytes whose low nibbles are one chunk and high nibbles the next (Q4_K, Q6_K) -> the two chunks'
    packed bytes (..., 2, 16), byte j = u[j] | u[j + 16] << 4."""
    a, b = q[..., :16], q[..., 16:]
    return np.stack([(a & 15) | (b << 4), (a >> 4) | (b & 0xF0)], axis=-2)


def _packed(qtype, b: np.ndarray):
    """The formats whose GGUF quants map onto `lo`/`hi` bytewise, without going through per-element codes:
    (lo, hi, scales, mins) as `relayout` stores them, or None. 5 to 10 times faster than the codes path."""
    r, nb = b.shape[:2]
    if qtype == _T.Q8_0:
        return b[..., 2:34] ^ np.uint8(0x80), None, _f16(b, 0)[..., None], None
    if qtype in (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1):  # GGUF's qs bytes are the layout's, qh its word
        q0 = {_T.Q4_0: 2, _T.Q4_1: 4, _T.Q5_0: 6, _T.Q5_1: 8}[qtype]
        hi = b[..., q0 - 4:q0] if qtype in (_T.Q5_0, _T.Q5_1) else None
        m = -_f16(b, 2)[..., None] if qtype in (_T.Q4_1, _T.Q5_1) else None
        return b[..., q0:q0 + 16], hi, _f16(b, 0)[..., None], m
    if qtype == _T.Q4_K:
        lo = _nibble_pairs(b[..., 16:144].reshape(r, nb, 4, 32)).reshape(r, nb * 8, 16)
        sc, m = _scale_min_k4(b[..., 4:16])
        d1 = (_f16(b, 0)[..., None] * sc).reshape(r, nb * 8, 1)
        return lo, None, d1, (_f16(b, 2)[..., None] * m).reshape(r, nb * 8, 1)
    if qtype == _T.Q6_K:  # chunk 4h + t: nibble t // 2 of ql[64h + 32 (t & 1) ..], bits 2t of qh[32h ..]
        pairs = _nibble_pairs(b[..., 0:128].reshape(r, nb, 2, 2, 32))  # (h, t & 1, t // 2, 16)
        lo = np.swapaxes(pairs, 3, 4).reshape(r, nb * 8, 16)
        qh = b[..., 128:192].reshape(r, nb, 2, 8, 4)  # (h, byte b, m): element 4b + m of the chunk (as _pack2)
        hi = np.stack([((qh[..., 0] >> 2 * t) & 3) | (((qh[..., 1] >> 2 * t) & 3) << 2)
                       | (((qh[..., 2] >> 2 * t) & 3) << 4) | (((qh[..., 3] >> 2 * t) & 3) << 6)
                       for t in range(4)], axis=3).reshape(r, nb * 8, 8)
        scale = b[..., 192:208].view(np.int8).astype(np.float32).reshape(r, nb * 8, 2)
        return lo, hi, _f16(b, 208).repeat(8, axis=1)[..., None] * scale, None
    return None


def _pack2(v: np.ndarray) -> np.ndarray:
    """2-bit codes (..., 32) -> 8 bytes: v[j] at bits 2 (j % 16) of little-endian uint j // 16, i.e. byte b
    holds v[4b .. 4b + 3] at bits 0, 2, 4, 6."""
    v = v.reshape(v.shape[:-1] + (8, 4))
    return (v[..., 0] | (v[..., 1] << 2) | (v[..., 2] << 4) | (v[..., 3] << 6)).astype(np.uint8)


def relayout(raw: np.ndarray, qtype, rows_per_step: int = 4096) -> dict[str, np.ndarray]:
    """GGUF rows (rows, row_bytes) of a quantized format -> the arrays formats.cl reads: `sc` and `mn`
    (float32), `lo` and `hi` (uint32; None where the format has no mins or high bits), each chunk's fields
    contiguous and in row order. In steps of rows, so that the temporaries stay a few MB whatever the
    matrix."""
    fmt = format_of(qtype)
    lay = LAYOUTS[fmt.format.qtype]
    rows = raw.shape[0]
    nb = raw.shape[1] // fmt.format.type_size
    nc = nb * fmt.format.block_size // 32
    sc = np.empty((rows, nc, lay.scales), np.float32)
    mn = np.empty((rows, nc, lay.scales), np.float32) if lay.has_min else np.zeros(1, np.float32)
    lo = np.empty((rows, nc, lay.low_bits * 4), np.uint8)
    hi = np.empty((rows, nc, lay.high_bits * 4), np.uint8) if lay.high_bits else np.zeros(4, np.uint8)
    for r0 in range(0, rows, rows_per_step):
        r1 = min(rows, r0 + rows_per_step)
        b = np.ascontiguousarray(raw[r0:r1]).reshape(r1 - r0, nb, fmt.format.type_size)
        direct = _packed(fmt.format.qtype, b)
        if direct is not None:
            lo[r0:r1], h, sc[r0:r1], m = direct
            if lay.high_bits:
                hi[r0:r1] = h
            if lay.has_min:
                mn[r0:r1] = m
            continue
        u, s, m = _codes(fmt.format.qtype, b)
        sc[r0:r1] = s
        if lay.has_min:
            mn[r0:r1] = m
        low = u & np.uint8((1 << lay.low_bits) - 1) if lay.low_bits < 8 else u
        if lay.low_bits == 8:
            lo[r0:r1] = low
        elif lay.low_bits == 4:
            lo[r0:r1] = low[..., :16] | (low[..., 16:] << 4)
        else:
            lo[r0:r1] = _pack2(low)
        if lay.high_bits == 1:
            hi[r0:r1] = np.packbits((u >> lay.low_bits) & 1, axis=-1, bitorder="little")
        elif lay.high_bits == 2:
            hi[r0:r1] = _pack2((u >> lay.low_bits) & 3)
    return {"sc": sc.reshape(-1), "mn": mn.reshape(-1) if lay.has_min else None,
            "lo": lo.reshape(-1).view(np.uint32), "hi": hi.reshape(-1).view(np.uint32) if lay.high_bits else None}


# ---- kernel shapes -------------------------------------------------------------------------------------------
# "rows": one weight row per work-item, ROWS_LS rows per work-group: for CPU devices, where PoCL runs a
#   work-group as a loop over its work-items and every barrier splits it (the old one-work-group-per-row
#   matvec, 64 work-items and a tree, left 46 of them idle on 576 columns). Work-groups of 4 to 64 rows timed
#   alike on PoCL (Q8_0 49152x576 and Q4_1 1536x576, 1 and 32 x rows: within the noise of a shared machine);
#   ROWS_NT x rows per work-item in a matmul share each chunk's decode: 8 against 4 took 6.5 / 9.8 / 10.6 ms
#   against 6.8 / 11.6 / 13.5 for 32 x rows on Q8_0 576x1536, Q4_1 1536x576, Q6_K 1536x768 (2 took 12-23).
# "lanes": LANES_LPR work-items per row, LANES_RPG rows per work-group, a tree in local memory: for GPUs.
ROWS_LS = 32
ROWS_NT = 8
LANES_LPR = 16
LANES_RPG = 4
SHAPES = ("rows", "lanes")
_OPTIONS = (f"-DWG={MATVEC_WG}", f"-DNT={MATMUL_NT}", f"-DROWS_NT={ROWS_NT}", f"-DLPR={LANES_LPR}",
            f"-DRPG={LANES_RPG}", "-cl-std=CL1.2")


# The optional paths of formats.cl (its top comment): sub-group reductions where the device takes a required
# sub-group size of 16 (Intel's extension: the reduction order must not depend on a size the compiler picks, or
# matvec and matmul could differ), 8-bit activations with integer dot products for these formats.
SUBGROUP_SIZE = 16
INTEGER_DOT_FORMATS = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0)
# The kernel shapes whose products take the integer-dot path where a device has it: "lanes" (GPUs), not "rows"
# (CPU devices): on Intel's CPU runtime (this EPYC: AVX2, no VNNI) the rows shape's 8-bit kernels took 17.5 ms
# against 9.9 for the float ones (Q8_0 4096x1536, one x row; 379 against 201 ms for 32), the packed dot
# products running as byte arithmetic in each work-item (tools/opencl_kernels_bench.py, at a load of 5-7 on 2
# cores). Its kernels stay built and tested (the tests add "rows" here).
INTEGER_DOT_SHAPES = {"lanes"}


INTEL_CPU_PLATFORM = "Intel(R) OpenCL"  # Intel's CPU runtime (its GPU driver's platform is "Intel(R) OpenCL Graphics")


def build_options(dev: Device) -> tuple[str, ...]:
    """formats.cl's build options on a device (_build_options), computed once per setting of its switches."""
    return dev.options("formats", _build_options)


def _build_options(dev: Device) -> tuple[str, ...]:
    """The options formats.cl is built with on a device: the shapes' constants, and the device's capability
    macros (Capabilities.build_options, its -cl-std in place of CL1.2) of the optional paths formats.cl has;
    the floor's alone where the device has none of them, or with `dev.optional_paths` off."""
    opts = list(capability_options(dev))
    if dev.emulate_integer_dot:
        opts.append("-DLOCALLLM_INTEGER_DOT_EMULATED=1")
    opts += fma_options(dev)
    if integer_dot(opts) and dev.device.single_fp_config & dev.cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT:
        # quantize_q8_0's amax / 127 and 127 / amax as numpy and the CPU backend round them (OpenCL's
        # division may be 2.5 ulp off otherwise)
        opts.append("-cl-fp32-correctly-rounded-divide-sqrt")
    return tuple(o for o in _OPTIONS if not o.startswith("-cl-std")) + tuple(opts)


def fma_options(dev: Device) -> list[str]:
    """-DLOCALLLM_FMA on Intel's CPU runtime, whose fma() is the CPU's instruction: formats.cl's MAC and rows.cl's
    ROW_MAC use it there (see formats.cl)."""
    return ["-DLOCALLLM_FMA=1"] if dev.info.platform == INTEL_CPU_PLATFORM and dev.info.type == "CPU" else []


def capability_options(dev: Device) -> tuple[str, ...]:
    """-cl-std and the capability macros the kernels of formats.cl and ops.cl are built with on a device: its
    own (Capabilities.build_options), less the sub-groups where it cannot be asked for sub-groups of
    SUBGROUP_SIZE; the floor's with `dev.optional_paths` off."""
    caps = dev.capabilities if dev.optional_paths else dev.capabilities.floor()
    opts = caps.build_options()
    if caps.subgroups and not (caps.subgroups == "intel" and SUBGROUP_SIZE in caps.subgroup_sizes):
        opts = tuple(o for o in opts if not o.startswith("-DLOCALLLM_SUBGROUPS"))  # no size to require: the tree
    return opts


def integer_dot(options) -> bool:
    """Whether a build of formats.cl with these options has the integer-dot kernels (`*_q8`, quantize_q8_0)."""
    return "-DLOCALLLM_INTEGER_DOT=1" in options or "-DLOCALLLM_INTEGER_DOT_EMULATED=1" in options


def kernel(dev: Device, name: str):
    """A kernel of formats.cl built for a device (once per process; from the build caches after the first)."""
    return dev.kernel(source(), build_options(dev), name)


def shape_for(dev: Device) -> str:
    """The kernel shape of a device: "rows" on a CPU device, "lanes" elsewhere; LOCALLLM_OPENCL_SHAPE=rows or
    lanes overrides it (a GPU's kernels on a CPU device: their bits and the host's cost with them)."""
    forced = os.environ.get("LOCALLLM_OPENCL_SHAPE", "")
    if forced in ("rows", "lanes"):
        return forced
    return "rows" if dev.info.type == "CPU" else "lanes"


class DeviceWeight:
    """A 2-D weight in any format of the table, uploaded to the device once: the quantized formats re-laid
    (`relayout`), the float ones as stored."""

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
        cl = dev.cl
        flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
        self.relaid = self.qtype in LAYOUTS
        if self.relaid:
            arrays = relayout(raw, self.qtype)
            # One buffer holds the four arrays (`packed`, at `offsets` in bytes: the decode plan's kernels take it
            # and the offsets, one memory object where four cost the runtime four to track on every launch:
            # Intel's CPU runtime, 12 buffer arguments 5.5 us a launch against 3.0 for 3); the op-by-op kernels
            # take sub-buffers of it. An array a format lacks (mins, high bits) is a view of the scales, unread.
            align = max(128, dev.device.mem_base_addr_align // 8)
            offsets, total = {}, 0
            for k in ("sc", "mn", "lo", "hi"):
                if arrays[k] is not None:
                    offsets[k] = total
                    total += -(-arrays[k].nbytes // align) * align
            host = np.zeros(max(total, align), np.uint8)
            for k, off in offsets.items():
                host[off:off + arrays[k].nbytes] = arrays[k].reshape(-1).view(np.uint8)
            self.packed = cl.Buffer(dev.context, flags, hostbuf=host)
            sizes = {k: max(4, arrays[k].nbytes) if arrays[k] is not None else 4 for k in offsets}
            self.offsets = tuple(offsets.get(k, offsets["sc"]) for k in ("sc", "mn", "lo", "hi"))
            self.buffers = tuple(self.packed.get_sub_region(offsets.get(k, offsets["sc"]), sizes.get(k, 4))
                                 for k in ("sc", "mn", "lo", "hi"))
            self.nbytes = sum(a.nbytes for a in arrays.values() if a is not None)  # what a product reads
        else:
            self.buffers = (cl.Buffer(dev.context, flags, hostbuf=np.ascontiguousarray(raw)),)
            self.nbytes = self.rows * self.row_bytes


def enqueue_dequantize(w: DeviceWeight, ids_buf, n_ids: int, out_buf) -> None:
    """out (n_ids, cols) = rows ids of W, decoded on the device (ids: a device int64 buffer)."""
    dev = w.dev
    k = kernel(dev, f"dequantize_rows_{w.format.suffix}")
    if w.relaid:
        k(dev.queue, (w.cols // 32, n_ids), None, *w.buffers, ids_buf, out_buf, np.uint32(w.cols))
    else:
        k(dev.queue, (w.cols // w.format.chunk, n_ids), None, w.buffers[0], ids_buf, out_buf,
          np.uint32(w.row_bytes), np.uint32(w.cols))


def enqueue_matmul(w: DeviceWeight, x_buf, n: int, out_buf, shape: str | None = None) -> None:
    """out (n, rows) = x (n, cols) @ W.T on device buffers; each x row's bits are those it gets alone."""
    dev = w.dev
    if n == 0 or w.rows == 0:
        return
    suffix = w.format.suffix
    if not w.relaid:  # the float formats, GGUF layout: one work-group per row
        wg = MATVEC_WG
        if n == 1:
            kernel(dev, f"matvec_{suffix}")(dev.queue, (w.rows * wg, 1), (wg, 1), w.buffers[0], x_buf, out_buf,
                                            np.uint32(w.row_bytes), np.uint32(w.cols), np.uint32(w.rows))
        else:
            kernel(dev, f"matmul_{suffix}")(dev.queue, (w.rows * wg, -(-n // MATMUL_NT)), (wg, 1), w.buffers[0],
                                            x_buf, out_buf, np.uint32(w.row_bytes), np.uint32(w.cols),
                                            np.uint32(w.rows), np.uint32(n))
        return
    shape = shape or shape_for(dev)
    if w.qtype in INTEGER_DOT_FORMATS and shape in INTEGER_DOT_SHAPES and integer_dot(build_options(dev)):
        # x to 8 bits per 32 values on the device (kernels.cpu's quantize_q8_0), then the integer-dot products
        nb = w.cols // 32
        xq, xd = dev.scratch("q8_quants", n * w.cols), dev.scratch("q8_scales", n * nb * 4)
        kernel(dev, "quantize_q8_0")(dev.queue, (nb, n), None, x_buf, xq, xd, np.uint32(w.cols))
        args = (*w.buffers, xq, xd, out_buf, np.uint32(w.cols), np.uint32(w.rows), np.uint32(n))
        suffix += "_q8"
    else:
        args = (*w.buffers, x_buf, out_buf, np.uint32(w.cols), np.uint32(w.rows), np.uint32(n))
    which = "matvec" if n == 1 else "matmul"
    if shape == "rows":
        nt = 1 if n == 1 else ROWS_NT
        ls = ROWS_LS
        kernel(dev, f"{which}_rows_{suffix}")(dev.queue, (-(-w.rows // ls) * ls, -(-n // nt)), (ls, 1), *args)
    elif shape == "lanes":
        nt = 1 if n == 1 else MATMUL_NT
        wg = LANES_LPR * LANES_RPG
        groups = -(-w.rows // LANES_RPG)
        kernel(dev, f"{which}_lanes_{suffix}")(dev.queue, (groups * wg, -(-n // nt)), (wg, 1), *args)
    else:
        raise ValueError(f"unknown kernel shape {shape!r} (there is: {', '.join(SHAPES)})")


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
    enqueue_dequantize(w, ids_buf, ids.size, out_buf)
    cl.enqueue_copy(dev.queue, out, out_buf)
    return out


def matvec(w: DeviceWeight, x: np.ndarray, shape: str | None = None) -> np.ndarray:
    """float32 (n, rows) = x (n, cols) @ W.T, W decoded on the device, float32 accumulation (fma); each x row
    alone (the decode kernel, n launches of one row), `shape` the device's unless given."""
    dev, cl = w.dev, w.dev.cl
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.cols:
        raise ValueError(f"x must be (n, {w.cols}) float32, not {x.shape}")
    n = x.shape[0]
    out = np.empty((n, w.rows), np.float32)
    if n == 0 or w.rows == 0:
        return out
    mf = cl.mem_flags
    for k in range(n):
        x_buf = cl.Buffer(dev.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x[k])
        out_buf = cl.Buffer(dev.context, mf.WRITE_ONLY, out[k].nbytes)
        enqueue_matmul(w, x_buf, 1, out_buf, shape)
        cl.enqueue_copy(dev.queue, out[k], out_buf)
    return out
