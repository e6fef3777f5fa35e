"""The kernel backends' operations against the CPU backend and `kernels/reference.py`, on random inputs, every
format of the table, as llama.cpp's tests/test-backend-ops.cpp checks each backend against the CPU.

The OpenCL backend runs on PoCL's CPU device (installed with the project on Linux x86_64, so `make test` and
CI run these there; elsewhere on the preferred device, Apple's OpenCL on a Mac), and every op test runs again
on Intel's CPU runtime where it is registered (a dev dependency on Linux x86_64: another compiler, and fp16,
sub-groups and integer dot products for the optional paths); LOCALLLM_TEST_OPENCL=PLATFORM:DEVICE picks one
device instead (`localllm devices` lists them). The tests are skipped only where there is no
OpenCL at all: pyopencl not installed, or no runtime and no PoCL wheel for the platform. Shapes are small:
PoCL compiles each kernel with LLVM at its first launch, then caches it under ~/.cache/localllm/pocl: the
whole file takes 96 s with an empty PoCL cache on 2 cores at a load of 8 (both kernel shapes of the weight
products are tested, "rows" and "lanes", whatever the device), 13 s warm.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from localllm.kernels import reference
from localllm.kernels.cpu import cpu_formats
from localllm.kernels.formats import FORMATS

pytest.importorskip("pyopencl", reason="pyopencl is not installed (it is a dependency: `make setup` installs it)")

from localllm.kernels.opencl import device as cl_device  # noqa: E402
from localllm.kernels.opencl import cl_formats  # noqa: E402
from conftest import (INTEL_CPU_PLATFORM, POCL_INSTALLED, POCL_SPEC, POCL_UNKNOWN_CPU, intel_cpu_spec,  # noqa: E402
                      opencl_test_spec, pocl_problem)

ALL_FORMATS = list(FORMATS)
FLOAT_TYPES = {T.F32, T.F16, T.BF16}

# Normalized mean squared error bounds of the dequantize-matvec against reference.matmul (float64), per format.
# They are alike because the device's dequantization is bit-equal to the CPU's (tested below) and x is not
# quantized: what is left is float32 accumulation in another order, measured at 6e-15 to 3e-14 for every format
# on these shapes (0.5 to 2 ulp of the output). 1e-11 leaves a margin of ~300x and still fails a single
# wrong sub-block scale or element order, which gives NMSE of 1e-3 or more. llama.cpp's test-backend-ops allows
# 5e-4 for mul_mat because its kernels round x to 8 bits; an integer-dot path here will need that bound.
MATVEC_NMSE = {q: 1e-11 for q in ALL_FORMATS}


INTEL_INSTALLED = bool(cl_device.python_runtime_libraries().get("intel-cpu.icd"))


def _devices_of_interest() -> list[tuple[str, str | None]]:
    """(test id, spec) of each device the op tests run on: LOCALLLM_TEST_OPENCL alone where it is set; else PoCL
    where it is installed (else the preferred device: Apple's on a Mac), and Intel's CPU runtime where it is
    registered (a dev dependency on Linux x86_64: a second compiler and the optional features PoCL lacks). Where
    PoCL cannot compile for this CPU (conftest.opencl_test_spec), Intel's runtime alone."""
    if os.environ.get("LOCALLLM_TEST_OPENCL"):
        return [("env", os.environ["LOCALLLM_TEST_OPENCL"])]
    first = opencl_test_spec()
    devices = [("pocl", first) if first == POCL_SPEC else ("intel-cpu", first) if first else ("default", None)]
    intel = intel_cpu_spec() if INTEL_INSTALLED else None
    if intel and intel != first:
        devices.append(("intel-cpu", intel))
    return devices


def test_pocl_builds_kernels_here_unless_its_llvm_does_not_know_this_cpu():
    """PoCL is the device `make test` promises; the one failure accepted is its LLVM 14 not knowing the CPU (then
    the OpenCL tests run on Intel's CPU runtime, which must be there). Any other build failure is ours."""
    if not POCL_INSTALLED or os.environ.get("LOCALLLM_TEST_OPENCL"):
        pytest.skip("PoCL is not the test device here")
    problem = pocl_problem()
    assert problem is None or POCL_UNKNOWN_CPU in problem, problem
    if problem:
        assert intel_cpu_spec() and opencl_test_spec() == intel_cpu_spec()


DEVICES = _devices_of_interest()
_opened: dict[str | None, cl_device.Device] = {}


def _open(spec: str | None) -> cl_device.Device:
    """One Device per spec for the whole module: fixtures share its context and built programs."""
    if spec not in _opened:
        try:
            _opened[spec] = cl_device.Device(spec)
        except cl_device.OpenCLUnavailable as err:
            if spec is None:
                pytest.skip(f"no OpenCL runtime here, and PoCL is not installed (no wheel for this platform): {err}")
            raise  # PoCL is installed, or a device was asked for: not finding it is a failure
    return _opened[spec]


@pytest.fixture(scope="module", params=[spec for _, spec in DEVICES], ids=[i for i, _ in DEVICES])
def dev(request):
    """Each device of interest in turn (the op tests run on all): PoCL, and Intel's CPU runtime where present."""
    return _open(request.param)


@pytest.fixture(scope="module")
def base_dev():
    """The first device of interest alone (PoCL on Linux x86_64), for tests of the device layer itself."""
    return _open(DEVICES[0][1])


def _finite_f16_bits(rng, shape) -> np.ndarray:
    """Random fp16 bit patterns, all finite: exponent 31 (inf/NaN) becomes 0 (subnormal), so about one in 16
    is subnormal, half are negative, and the full range of exponents appears."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint32)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits ^ 0x7C00, bits)
    return bits.astype(np.uint16)


def random_blocks(qtype: T, rows: int, cols: int, seed: int, moderate_scales: bool = False) -> np.ndarray:
    """Random raw rows of a format. Every fp16 field holds a finite value: with moderate_scales, small ones
    (|d| < 0.05, a real file's range, for the matvec's error to mean something); otherwise any finite half,
    with row 0's scales all subnormal, row 1's all negative and row 2's all zero (of either sign)."""
    rng = np.random.default_rng(seed)
    fmt = FORMATS[qtype]
    if qtype == T.F32:
        if moderate_scales:
            return rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
        bits = rng.integers(0, 1 << 32, (rows, cols), dtype=np.uint64).astype(np.uint32)
        bits = np.where((bits & 0x7F800000) == 0x7F800000, bits ^ 0x7F800000, bits)  # finite, some subnormal
        return bits.view(np.uint8)
    if qtype == T.BF16:
        bits = rng.integers(0, 1 << 16, (rows, cols), dtype=np.uint32)
        if moderate_scales:
            bits = (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16)
        bits = np.where((bits & 0x7F80) == 0x7F80, bits ^ 0x7F80, bits)
        return bits.astype(np.uint16).view(np.uint8)
    n_blocks = cols // fmt.block_size
    blocks = rng.integers(0, 256, (rows, n_blocks, fmt.type_size), dtype=np.uint8)
    for off in fmt.f16_offsets:
        if moderate_scales:
            halves = (rng.uniform(-1, 1, (rows, n_blocks)) * 0.05).astype(np.float16).view(np.uint16)
        else:
            halves = _finite_f16_bits(rng, (rows, n_blocks))
            halves[0] &= 0x83FF  # subnormal (or zero), either sign
            halves[1:2] |= 0x8000  # negative
            halves[2:3] &= 0x8000  # +0 or -0
        blocks[:, :, off : off + 2] = halves.view(np.uint8).reshape(rows, n_blocks, 2)
    return blocks.reshape(rows, n_blocks * fmt.type_size)


def cols_for(qtype: T) -> int:
    # 72 chunks of 32 (or 300 floats) per row: more than the matvec's 64 work-items, so each strides its row
    return 300 if qtype in FLOAT_TYPES else 2304


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    want = np.asarray(want, np.float64)
    return float(np.sum((got.astype(np.float64) - want) ** 2) / np.sum(want**2))


def product_reference(dev, raw, qtype, x, shape: str | None = None) -> np.ndarray:
    """reference.matmul (float64) of what the device's product computes (in `shape`, default the device's): W
    times x, or times x rounded to 8 bits per 32 values (kernels.cpu's quantize_q8_0) where the device runs the
    integer-dot path of Q8_0 and Q4_0 in that shape: the format's float bound then holds either way."""
    shape = shape or cl_formats.shape_for(dev)
    if (qtype in cl_formats.INTEGER_DOT_FORMATS and shape in cl_formats.INTEGER_DOT_SHAPES
            and cl_formats.integer_dot(cl_formats.build_options(dev))):
        x = q8_rounded(x)
    return reference.matmul(raw, qtype, x)


def q8_rounded(x: np.ndarray) -> np.ndarray:
    """x as its Q8_0 quantization holds it: int8 quants times the fp16 scale of their 32 (exact in float32)."""
    from localllm.kernels.cpu.quant_dot import quantize_q8_0

    q, d = quantize_q8_0(np.ascontiguousarray(x, np.float32))
    return (q.reshape(len(x), -1, 32).astype(np.float32) * d[..., None]).reshape(x.shape)


# ---- dequantization ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda q: q.name)
def test_opencl_dequantize_is_bit_equal_to_the_cpu_backend(dev, qtype):
    raw = random_blocks(qtype, 9, cols_for(qtype), seed=1)
    w = cl_formats.DeviceWeight(dev, raw, qtype)  # quantized formats: through the re-laid layout
    assert w.nbytes == cl_formats.device_nbytes(qtype, 9 * w.cols)  # what check_fits counts
    ids = np.array([3, 0, 8, 1, 1, 2, 7], np.int64)  # reordered and repeated, as an embedding lookup asks
    got = cl_formats.dequantize_rows(w, ids)
    want = np.empty_like(got)
    cpu_formats.FORMATS[qtype].dequantize_rows(raw, ids, want, 16)
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, (f"{bad.size} of {got.size} values differ; first at {np.unravel_index(bad[0], got.shape)}: "
                           f"{got.flat[bad[0]]!r} vs {want.flat[bad[0]]!r}")


def test_opencl_dequantize_of_no_rows_is_empty_and_bad_ids_are_refused(dev):
    raw = random_blocks(T.Q4_K, 2, 256, seed=2)
    w = cl_formats.DeviceWeight(dev, raw, T.Q4_K)
    assert cl_formats.dequantize_rows(w, np.array([], np.int64)).shape == (0, 256)
    with pytest.raises(ValueError, match="row ids"):
        cl_formats.dequantize_rows(w, np.array([2]))


# ---- dequantize-matvec (decode) -------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda q: q.name)
def test_opencl_matvec_matches_the_reference_within_its_format_tolerance(dev, qtype):
    raw = random_blocks(qtype, 37, cols_for(qtype), seed=3, moderate_scales=True)
    w = cl_formats.DeviceWeight(dev, raw, qtype)
    x = np.random.default_rng(4).standard_normal((3, w.cols)).astype(np.float32)
    got = cl_formats.matvec(w, x)
    want = product_reference(dev, raw, qtype, x)
    assert got.shape == (3, 37)
    assert nmse(got, want) <= MATVEC_NMSE[qtype], f"NMSE {nmse(got, want):.3g}"


# One format per decoding path of the re-laid layout (8/4/2 low bits, 0/1/2 high bits, 1 or 2 scales per chunk,
# with and without mins), and a row narrower than the "lanes" shape's 16 work-items (256 columns: 8 chunks).
@pytest.mark.parametrize("shape", cl_formats.SHAPES)
@pytest.mark.parametrize("qtype,cols", [(T.Q8_0, 2304), (T.Q4_1, 2304), (T.Q5_0, 256), (T.Q3_K, 2304),
                                        (T.Q6_K, 256), (T.Q2_K, 2304)], ids=lambda v: getattr(v, "name", v))
def test_opencl_matvec_of_every_kernel_shape_matches_the_reference(dev, shape, qtype, cols):
    # the device picks its shape ("rows" on a CPU, "lanes" on a GPU); both run here, on whatever device this is
    raw = random_blocks(qtype, 37, cols, seed=3, moderate_scales=True)
    w = cl_formats.DeviceWeight(dev, raw, qtype)
    x = np.random.default_rng(4).standard_normal((2, w.cols)).astype(np.float32)
    got, want = cl_formats.matvec(w, x, shape=shape), product_reference(dev, raw, qtype, x, shape)
    assert nmse(got, want) <= MATVEC_NMSE[qtype], f"NMSE {nmse(got, want):.3g}"


def test_opencl_matvec_refuses_a_wrong_width(dev):
    w = cl_formats.DeviceWeight(dev, random_blocks(T.Q8_0, 4, 64, seed=5), T.Q8_0)
    with pytest.raises(ValueError, match=r"\(n, 64\)"):
        cl_formats.matvec(w, np.zeros((1, 32), np.float32))
    with pytest.raises(ValueError, match="whole number of Q8_0 blocks"):
        cl_formats.DeviceWeight(dev, np.zeros((2, 35), np.uint8), T.Q8_0)


# ---- the decoder's other operations (kernels/opencl/cl_ops.py), on device arrays ---------------------------------

# NMSE bounds of the ops with a reduction or a transcendental function, against kernels/reference.py; the
# others (RoPE, add, bias, scale, embed) are asserted bit-equal, since they do the reference's float32
# arithmetic in its order (FP_CONTRACT off: no FMA contraction).
# - rms_norm: float32 sum of squares in a strided-then-tree order where the reference sums in float64; measured
#   NMSE 0 to 4.4e-15 (about 1 ulp) on the shapes below. 1e-12 is ~200x that, and a norm off by one element
#   of d=1000 (or a wrong eps) gives NMSE 1e-6 or more.
# - gated activations: OpenCL's exp and tanh may be off by 3 and 5 ulp (OpenCL 1.2 s7.4); measured 2e-16
#   (silu) and 8e-16 (gelu_tanh). 1e-12 allows the spec's worst case on every element with room.
# - attention: float32 dot products of up to 256 terms, scaled scores through exp (an absolute error of the
#   score is a relative one of its weight), online softmax against the reference's two passes; measured
#   1.6e-14 to 4.5e-13. 1e-10 is ~200x that, and one key wrongly masked or unmasked among 100 gives ~1e-3.
# llama.cpp's test-backend-ops uses 1e-7 for most float ops because its backends may run them in fp16.
OPS_NMSE = {"rms_norm": 1e-12, "gated": 1e-12, "attention": 1e-10}


@pytest.fixture(scope="module")
def ops(dev):
    from localllm.kernels.opencl import cl_ops

    return cl_ops.Ops(dev)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda q: q.name)
def test_opencl_embed_gives_the_cpu_backends_dequantized_rows_bit_for_bit(dev, ops, qtype):
    raw = random_blocks(qtype, 9, cols_for(qtype), seed=11)
    w = cl_formats.DeviceWeight(dev, raw, qtype)
    ids = np.array([8, 0, 3, 3, 1, 2], np.int64)  # a prompt's tokens: reordered and repeated
    got = ops.to_host(ops.embed(w, ids))
    want = np.empty_like(got)
    cpu_formats.FORMATS[qtype].dequantize_rows(raw, ids, want, 16)
    assert np.array_equal(_bits(got), _bits(want))
    # ids already on the device (the token sampled by argmax) give the same rows
    assert np.array_equal(_bits(ops.to_host(ops.embed(w, ops.to_device(ids[:2], np.int64)))), _bits(want[:2]))


@pytest.mark.parametrize("shape", cl_formats.SHAPES)
@pytest.mark.parametrize("qtype", [T.F16, T.Q8_0, T.Q4_1, T.Q5_0, T.Q3_K, T.Q4_K, T.Q6_K], ids=lambda q: q.name)
def test_opencl_matmul_of_any_row_count_gives_each_row_the_matvec_bits(dev, ops, qtype, shape):
    # the tiled kernels (several x rows per work-item) for n > 1: every row's sum in matvec's order, so a token's
    # result does not depend on how many others share its forward or where its tile starts (batch invariance)
    raw = random_blocks(qtype, 37, cols_for(qtype), seed=17, moderate_scales=True)
    w = cl_formats.DeviceWeight(dev, raw, qtype)
    x = np.random.default_rng(18).standard_normal((19, w.cols)).astype(np.float32)
    one = cl_formats.matvec(w, x, shape=shape)  # one launch per x row: the decode kernel
    ops.shape = shape
    try:
        for n in (1, 3, 8, 9, 19):
            got = ops.to_host(ops.matmul(w, ops.to_device(x[:n])))
            assert np.array_equal(_bits(got), _bits(one[:n])), n
        got = ops.to_host(ops.matmul(w, ops.to_device(x[5:16])))  # tiles that start elsewhere
        assert np.array_equal(_bits(got), _bits(one[5:16]))
    finally:
        ops.shape = cl_formats.shape_for(dev)
    assert nmse(one, product_reference(dev, raw, qtype, x, shape)) <= MATVEC_NMSE[qtype]


# ---- the optional paths (formats.cl: sub-group reductions, 8-bit x with integer dot products) ------------------

# An integer-dot product rounds x to 8 bits per 32 values (as the CPU backend and llama.cpp do): against the
# float path it differs by that rounding, measured NMSE 3.0e-5 (Q8_0) and 3.3e-5 (Q4_0) on Intel's CPU runtime;
# llama.cpp's test-backend-ops allows 5e-4 for mul_mat on quantized x. Against the product with the quantized x
# itself it is exact up to float32 accumulation, so the format's float bound (1e-11) holds there.
INTEGER_DOT_NMSE = 5e-4


def _capability_macros(options) -> set[str]:
    names = {o[2:].split("=")[0] for o in options if o.startswith("-D")}
    return {name for name in names if _CAPABILITY_MACRO.fullmatch(name)}


def test_opencl_weight_kernels_are_built_with_the_optional_paths_the_device_offers_and_the_floor_elsewhere(dev):
    """formats.cl's build options carry the device's capability macros (PoCL: none, OpenCL C 1.2; Intel's CPU
    runtime: sub-groups and integer dot); `optional_paths` off builds the floor; the integer-dot kernels exist
    in a program exactly where its macro is on."""
    options = cl_formats.build_options(dev)
    dev.optional_paths = False
    try:
        floor_options = cl_formats.build_options(dev)
    finally:
        dev.optional_paths = True
    assert not _capability_macros(floor_options) and "-cl-std=CL1.2" in floor_options
    caps = dev.capabilities
    want = set()
    if caps.subgroups == "intel" and cl_formats.SUBGROUP_SIZE in caps.subgroup_sizes:
        want |= {"LOCALLLM_SUBGROUPS", "LOCALLLM_SUBGROUPS_INTEL"}
    if caps.integer_dot == "khr" and caps.opencl_c >= (2, 0):
        want.add("LOCALLLM_INTEGER_DOT")
    if caps.fp16:
        want.add("LOCALLLM_FP16")  # defined, though no kernel has a half-arithmetic path yet
    assert _capability_macros(options) == want, options
    names = {k.function_name for k in dev.program(cl_formats.source(), options).all_kernels()}
    assert ("matvec_rows_q8_0_q8" in names) == ("LOCALLLM_INTEGER_DOT" in want)
    from localllm.kernels.opencl import cl_ops

    assert _capability_macros(cl_ops.build_options(dev)) == want  # ops.cl (RMSNorm's sub-group sum) alike
    if dev.is_pocl:  # the project's baseline device: the floor is what it runs
        assert options == floor_options and not any(n.endswith("_q8") for n in names)
        assert "-cl-std=CL1.2" in cl_ops.build_options(dev)
    if "Intel" in dev.info.platform:  # the runtime the optional paths are tested on must offer them
        assert {"LOCALLLM_SUBGROUPS_INTEL", "LOCALLLM_INTEGER_DOT"} <= want


def _integer_dot_on(dev) -> bool:
    """Whether the device runs the integer-dot kernels: natively where it reports them, else emulated (plain
    byte products, the same kernels otherwise) for the length of a test."""
    return cl_formats.integer_dot(cl_formats.build_options(dev))


@pytest.fixture()
def int_dev(dev, monkeypatch):
    """The device with the integer-dot kernels on, in both shapes (the "rows" shape's are built but not chosen):
    its own where it has them, else emulated."""
    monkeypatch.setattr(cl_formats, "INTEGER_DOT_SHAPES", set(cl_formats.SHAPES))
    emulated = not _integer_dot_on(dev)
    dev.emulate_integer_dot = emulated
    try:
        yield dev
    finally:
        dev.emulate_integer_dot = False


def test_opencl_quantizes_x_to_8_bits_as_the_cpu_backend_does_bit_for_bit(int_dev):
    from localllm.kernels.cpu.quant_dot import quantize_q8_0

    dev, cl = int_dev, int_dev.cl
    rng = np.random.default_rng(41)
    x = (rng.standard_normal((5, 256)) * np.array([[1], [1e3], [1e-3], [0], [1]])).astype(np.float32)
    x[4, 32:64] = 0.0  # an all-zero block: scale 0, quants 0
    x[4, 64] = 127.5  # ties of the rounding
    x[4, 65:96] = rng.integers(-127, 128, 31) + 0.5
    mf = cl.mem_flags
    xb = cl.Buffer(dev.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
    xq, xd = np.empty((5, 256), np.int8), np.empty((5, 8), np.float32)
    qb, db = cl.Buffer(dev.context, mf.WRITE_ONLY, xq.nbytes), cl.Buffer(dev.context, mf.WRITE_ONLY, xd.nbytes)
    cl_formats.kernel(dev, "quantize_q8_0")(dev.queue, (8, 5), None, xb, qb, db, np.uint32(256))
    cl.enqueue_copy(dev.queue, xq, qb)
    cl.enqueue_copy(dev.queue, xd, db)
    want_q, want_d = quantize_q8_0(x)
    assert np.array_equal(xq, want_q) and np.array_equal(_bits(xd), _bits(want_d))


@pytest.mark.parametrize("shape", cl_formats.SHAPES)
@pytest.mark.parametrize("qtype", cl_formats.INTEGER_DOT_FORMATS, ids=lambda q: q.name)
def test_opencl_integer_dot_products_match_the_float_path_within_8_bit_rounding_and_are_batch_invariant(
        int_dev, ops, qtype, shape):
    dev = int_dev
    raw = random_blocks(qtype, 37, 2304, seed=43, moderate_scales=True)
    w = cl_formats.DeviceWeight(dev, raw, qtype)
    x = np.random.default_rng(44).standard_normal((19, w.cols)).astype(np.float32)
    one = cl_formats.matvec(w, x, shape=shape)  # the integer-dot decode kernel, one launch per x row
    dev.emulate_integer_dot, emulated = False, dev.emulate_integer_dot
    dev.optional_paths = False
    try:
        floor = cl_formats.matvec(w, x, shape=shape)
    finally:
        dev.optional_paths, dev.emulate_integer_dot = True, emulated
    want = reference.matmul(raw, qtype, q8_rounded(x))
    assert nmse(one, want) <= MATVEC_NMSE[qtype], f"NMSE {nmse(one, want):.3g} against the product with 8-bit x"
    assert nmse(one, floor) <= INTEGER_DOT_NMSE, f"NMSE {nmse(one, floor):.3g} against the float path"
    ops.shape = shape
    try:
        for n in (3, 9, 19):
            got = ops.to_host(ops.matmul(w, ops.to_device(x[:n])))
            assert np.array_equal(_bits(got), _bits(one[:n])), n
        assert np.array_equal(_bits(ops.to_host(ops.matmul(w, ops.to_device(x[5:16])))), _bits(one[5:16]))
    finally:
        ops.shape = cl_formats.shape_for(dev)


@pytest.mark.parametrize("shape", cl_formats.SHAPES)
@pytest.mark.parametrize("qtype", [T.F16, T.Q4_1, T.Q5_0, T.Q6_K], ids=lambda q: q.name)
def test_opencl_subgroup_reductions_agree_with_the_floor_and_keep_batch_invariance(dev, ops, qtype, shape):
    """Where the device offers sub-groups (Intel's CPU runtime), the products reduce with sub_group_reduce_add
    (the float formats' work-group, the "lanes" shape's 16 lanes of a row): within the format's bound of the
    floor built on the same device, and each row's bits the same for one x row or many."""
    if "LOCALLLM_SUBGROUPS_INTEL" not in _capability_macros(cl_formats.build_options(dev)):
        pytest.skip(f"{dev.info.spec} offers no sub-groups of 16: it runs the floor (the build test checks it)")
    raw = random_blocks(qtype, 37, cols_for(qtype), seed=45, moderate_scales=True)
    w = cl_formats.DeviceWeight(dev, raw, qtype)
    x = np.random.default_rng(46).standard_normal((11, w.cols)).astype(np.float32)
    one = cl_formats.matvec(w, x, shape=shape)
    dev.optional_paths = False
    try:
        floor = cl_formats.matvec(w, x, shape=shape)
    finally:
        dev.optional_paths = True
    assert nmse(one, floor) <= MATVEC_NMSE[qtype] and nmse(one, reference.matmul(raw, qtype, x)) <= MATVEC_NMSE[qtype]
    ops.shape = shape
    try:
        got = ops.to_host(ops.matmul(w, ops.to_device(x)))
        assert np.array_equal(_bits(got), _bits(one))
    finally:
        ops.shape = cl_formats.shape_for(dev)


def test_opencl_rms_norm_with_subgroup_sums_agrees_with_the_floor(dev, ops):
    from localllm.kernels.opencl import cl_ops

    if "LOCALLLM_SUBGROUPS_INTEL" not in _capability_macros(cl_ops.build_options(dev)):
        pytest.skip(f"{dev.info.spec} offers no sub-groups of 16: it runs the floor (the build test checks it)")
    rng = np.random.default_rng(47)
    x = rng.standard_normal((5, 1000)).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(1000)).astype(np.float32)
    got = ops.to_host(ops.rms_norm(ops.to_device(x), w, 1e-6))
    dev.optional_paths = False
    try:
        floor = ops.to_host(ops.rms_norm(ops.to_device(x), w, 1e-6))
    finally:
        dev.optional_paths = True
    want = reference.rms_norm(x, w, 1e-6)
    assert nmse(got, floor) <= OPS_NMSE["rms_norm"] and nmse(got, want) <= OPS_NMSE["rms_norm"]


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 128), (2, 256), (4, 576), (3, 1000), (1, 1536)])
def test_opencl_rms_norm_matches_the_reference_on_rows_of_any_width(ops, shape):
    rng = np.random.default_rng(shape[-1])
    x = rng.standard_normal(shape).astype(np.float32)
    x[0] *= 1e3  # rows of very different magnitudes: the normalisation, not the input scale, sets the result
    x[-1] *= 1e-3
    w = (1 + 0.5 * rng.standard_normal(shape[-1])).astype(np.float32)
    got = ops.to_host(ops.rms_norm(ops.to_device(x), w, 1e-6))
    want = reference.rms_norm(x, w, 1e-6)
    assert got.shape == shape and nmse(got, want) <= OPS_NMSE["rms_norm"], f"NMSE {nmse(got, want):.3g}"


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "adjacent-pairs"])
@pytest.mark.parametrize("head_dim,rope_dim", [(64, 64), (128, 128), (256, 256), (128, 64), (80, 32)])
def test_opencl_rope_rotates_in_place_bit_equal_to_the_reference(ops, neox, head_dim, rope_dim):
    rng = np.random.default_rng(head_dim + rope_dim)
    x = rng.standard_normal((3, 5, head_dim)).astype(np.float32)
    angles = rng.uniform(0, 100, (3, rope_dim // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    xd = ops.to_device(x)
    assert ops.rope(xd, cos, sin, rope_dim, neox) is None
    # elements past rope_dim are left as they are (the reference's copy of them)
    assert np.array_equal(_bits(ops.to_host(xd)), _bits(reference.rope(x, cos, sin, rope_dim, neox)))


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("shape", [(1, 1536), (7, 333), (2, 4864)])
def test_opencl_gated_activation_matches_the_reference(ops, kind, shape):
    rng = np.random.default_rng(shape[1])
    gate = (rng.standard_normal(shape) * 4).astype(np.float32)
    gate[0, :4] = [-100.0, 100.0, -30.0, 0.0]  # exp(-x) overflowing to inf must give -0, not NaN
    up = rng.standard_normal(shape).astype(np.float32)
    got = ops.to_host(ops.gated_activation(ops.to_device(gate), ops.to_device(up), kind))
    with np.errstate(over="ignore"):
        want = {"silu": reference.silu, "gelu_tanh": reference.gelu_tanh}[kind](gate) * up
    assert np.isfinite(got).all()
    assert nmse(got, want) <= OPS_NMSE["gated"], f"NMSE {nmse(got, want):.3g}"


def test_opencl_add_and_scale_are_bit_equal_to_numpy_for_residuals_biases_and_in_place(ops):
    rng = np.random.default_rng(12)
    a = rng.standard_normal((3, 5, 77)).astype(np.float32)
    b = rng.standard_normal((3, 5, 77)).astype(np.float32)
    bias = rng.standard_normal(77).astype(np.float32)
    ad = ops.to_device(a)
    assert np.array_equal(_bits(ops.to_host(ops.add(ad, ops.to_device(b)))), _bits(a + b))
    assert np.array_equal(_bits(ops.to_host(ops.add(ad, bias))), _bits(a + bias))
    s = np.float32(np.sqrt(640))  # gemma's embedding scale, sqrt(n_embd)
    assert np.array_equal(_bits(ops.to_host(ops.scale(ad, s))), _bits(a * s))
    assert ops.add(ad, bias, out=ad) is ad and ops.scale(ad, s, out=ad) is ad
    assert np.array_equal(_bits(ops.to_host(ad)), _bits((a + bias) * s))


# (n queries, n_head, n_kv, d, dv, T cached, window, key_start): the catalog models' head geometries
# (smollm2-135m 9/3 x 64, qwen2.5 0.5b 14/2 x 64, qwen2.5 1.5b 12/2 x 128, gemma3-270m 4/1 x 256 with its
# sliding window), caches of more than one 64-key tile and not a multiple of it, and head dims that are not a
# multiple of the work-group (80), with values narrower than keys.
ATTENTION_CASES = [
    (1, 9, 3, 64, 64, 100, 0, 0),  # decode, GQA group 3
    (5, 14, 2, 64, 64, 70, 0, 0),  # a prompt chunk at the end of the cache, group 7
    (3, 12, 2, 128, 128, 130, 0, 0),
    (4, 4, 1, 256, 256, 150, 40, 20),  # sliding window over a cache that dropped its first 20 keys
    (7, 4, 1, 256, 256, 7, 3, 0),  # a prompt from position 0 with a window: the first query sees one key
    (2, 4, 4, 80, 48, 65, 0, 0),  # no GQA; d, dv not multiples of the work-group
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "n{}-h{}-kv{}-d{}-dv{}-T{}-w{}-s{}".format(*c))
def test_opencl_attention_matches_the_reference(ops, case):
    n, n_head, n_kv, d, dv, t, window, key_start = case
    rng = np.random.default_rng(sum(case))
    q = (rng.standard_normal((n, n_head, d)) * 2).astype(np.float32)  # peaked and flat softmaxes both
    keys = rng.standard_normal((n_kv, t, d)).astype(np.float32)
    values = rng.standard_normal((n_kv, t, dv)).astype(np.float32)
    positions = np.arange(key_start + t - n, key_start + t)
    scale = d**-0.5
    got = ops.to_host(ops.attention(ops.to_device(q), ops.to_device(keys), ops.to_device(values), positions, scale,
                                    window, key_start))
    want = reference.attention(q, keys, values, positions, scale, window, key_start)
    assert got.shape == (n, n_head * dv)
    assert nmse(got, want) <= OPS_NMSE["attention"], f"NMSE {nmse(got, want):.3g}"


@pytest.mark.parametrize("window", [0, 40])
def test_opencl_attention_soft_caps_its_scores_as_the_reference(ops, window):
    """gemma2's attention logit soft-cap: tanh(s / cap) * cap on each scaled score, before the softmax (a cap of
    1 changes these scores of about unit size, so the uncapped output is far off)."""
    rng = np.random.default_rng(11)
    q = (rng.standard_normal((5, 4, 64)) * 2).astype(np.float32)
    keys = rng.standard_normal((2, 90, 64)).astype(np.float32)
    values = rng.standard_normal((2, 90, 64)).astype(np.float32)
    positions = np.arange(85, 90)
    got = ops.to_host(ops.attention(ops.to_device(q), ops.to_device(keys), ops.to_device(values), positions, 0.125,
                                    window, softcap=1.0))
    want = reference.attention(q, keys, values, positions, 0.125, window, softcap=1.0)
    assert nmse(got, want) <= OPS_NMSE["attention"], f"NMSE {nmse(got, want):.3g}"
    assert nmse(want, reference.attention(q, keys, values, positions, 0.125, window)) > 100 * OPS_NMSE["attention"]


def test_opencl_kv_write_fills_a_cache_that_attention_reads_up_to_its_length(ops):
    rng = np.random.default_rng(19)
    n_kv, cap, d, n_head = 2, 40, 64, 6
    k_rows = rng.standard_normal((30, n_kv, d)).astype(np.float32)  # the projections' layout (t, n_kv, d)
    v_rows = rng.standard_normal((30, n_kv, d)).astype(np.float32)
    keys, values = ops.to_device(np.full((n_kv, cap, d), np.nan, np.float32)), ops.empty((n_kv, cap, d))
    for a, b in ((0, 1), (1, 25), (25, 30)):  # a decode step, a prompt chunk, another chunk
        ops.kv_write(keys, ops.to_device(k_rows[a:b]), a)
        ops.kv_write(values, ops.to_device(v_rows[a:b]), a)
    cached = ops.to_host(keys)
    assert np.array_equal(cached[:, :30], k_rows.transpose(1, 0, 2)) and np.isnan(cached[:, 30:]).all()
    q = rng.standard_normal((3, n_head, d)).astype(np.float32)
    positions = np.arange(27, 30)
    got = ops.to_host(ops.attention(ops.to_device(q), keys, values, positions, 0.125, 0, length=30))
    want = reference.attention(q, k_rows.transpose(1, 0, 2).copy(), v_rows.transpose(1, 0, 2).copy(), positions,
                               0.125, 0)
    assert nmse(got, want) <= OPS_NMSE["attention"]  # the rows past `length` (NaN) are never read
    with pytest.raises(ValueError, match="cannot write"):
        ops.kv_write(keys, ops.to_device(k_rows[:11]), 30)
    # a query before the cache's first key (which a caller should not ask) gets zeros, not NaN from 0/0
    early = ops.to_host(ops.attention(ops.to_device(q[:1]), keys, values, np.array([9]), 0.125, 0, key_start=10,
                                      length=30))
    assert np.array_equal(early, np.zeros_like(early))


def test_opencl_attention_reads_a_paged_cache_through_its_column_map_as_a_contiguous_one(ops):
    # the KV pool's blocks of 16 columns in any order (fragmented tables), a sliding window over a trimmed start
    rng = np.random.default_rng(23)
    n_kv, n_head, d, t, key_start, window = 2, 6, 64, 45, 16, 20
    blocks = rng.permutation(8)[:3]  # 3 blocks of 16 for 45 keys, out of a storage of 8 blocks
    cols = (blocks[:, None] * 16 + np.arange(16)).ravel()[:t]
    k_rows = rng.standard_normal((t, n_kv, d)).astype(np.float32)
    v_rows = rng.standard_normal((t, n_kv, d)).astype(np.float32)
    keys, values = (ops.to_device(np.full((n_kv, 128, d), np.nan, np.float32)) for _ in range(2))
    for a, b in ((0, 40), (40, 44), (44, 45)):  # a prompt, a verify of 4, a decode step
        ops.kv_write(keys, ops.to_device(k_rows[a:b]), cols=cols[a:b])
        ops.kv_write(values, ops.to_device(v_rows[a:b]), cols=cols[a:b])
    q = rng.standard_normal((5, n_head, d)).astype(np.float32)
    positions = np.arange(key_start + t - 5, key_start + t)
    got = ops.to_host(ops.attention(ops.to_device(q), keys, values, positions, 0.125, window, key_start, cols=cols))
    want = reference.attention(q, k_rows.transpose(1, 0, 2).copy(), v_rows.transpose(1, 0, 2).copy(), positions,
                               0.125, window, key_start)
    assert nmse(got, want) <= OPS_NMSE["attention"]  # the NaN columns of other blocks are never read
    with pytest.raises(ValueError, match="storage columns"):
        ops.kv_write(keys, ops.to_device(k_rows[:1]), cols=np.array([128]))


def test_opencl_gather_rows_takes_the_rows_asked_for(ops):
    x = np.arange(5 * 7, dtype=np.float32).reshape(5, 7)
    idx = np.array([4, 0, 4, 2])
    assert np.array_equal(ops.to_host(ops.gather_rows(ops.to_device(x), idx)), x[idx])


def test_opencl_argmax_finds_the_first_largest_value_of_each_row(ops):
    rng = np.random.default_rng(13)
    x = rng.standard_normal((5, 50001)).astype(np.float32)  # a vocabulary, not a multiple of the work-group
    x[1, [7, 40000, 40001]] = 50.0  # a tie: the first index wins, as numpy's argmax
    x[2, 50000] = 50.0  # the last column
    x[3, :] = -np.inf  # a row masked entirely: index 0, as numpy
    x[4, [0, 9]] = np.nan, 50.0  # NaNs are passed over (numpy would return the NaN's index)
    got = ops.to_host(ops.argmax(ops.to_device(x)))
    assert got.dtype == np.int32 and got.tolist() == [int(np.argmax(x[0])), 7, 50000, 0, 9]


def test_a_chain_of_opencl_ops_reads_nothing_back_until_to_host(dev, ops, monkeypatch):
    """A one-layer decoder step, embed -> norm -> Q/K/V matmuls -> qk-norm -> rope -> KV-cache write ->
    attention -> output matmul -> residual -> gated FFN -> residual -> norm -> logits -> argmax: uploads of
    host inputs only, then one read of the token ids, which are the numpy reference's."""
    import pyopencl

    reads = []
    real_copy = pyopencl.enqueue_copy

    def counting_copy(queue, dest, src, **kwargs):
        if isinstance(dest, np.ndarray) and not isinstance(src, np.ndarray):
            reads.append(dest.shape)
        return real_copy(queue, dest, src, **kwargs)

    monkeypatch.setattr(pyopencl, "enqueue_copy", counting_copy)
    rng = np.random.default_rng(14)
    n, n_head, n_kv, hd, n_embd, n_ff, vocab = 4, 4, 2, 64, 256, 512, 300
    mats = {name: random_blocks(T.Q8_0, rows, cols, seed=i, moderate_scales=True) for i, (name, rows, cols) in
            enumerate([("embd", vocab, n_embd), ("q", n_head * hd, n_embd), ("k", n_kv * hd, n_embd),
                       ("v", n_kv * hd, n_embd), ("o", n_embd, n_head * hd), ("gate", n_ff, n_embd),
                       ("up", n_ff, n_embd), ("down", n_embd, n_ff)])}
    ids = np.array([3, 17, 17, 42])
    norm_w = (1 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32)
    qk_w = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
    angles = np.arange(n)[:, None] * 10000.0 ** (-np.arange(0, hd, 2) / hd)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    ws = {name: cl_formats.DeviceWeight(dev, raw, T.Q8_0) for name, raw in mats.items()}
    reads.clear()

    x = ops.embed(ws["embd"], ids)
    h = ops.rms_norm(x, norm_w, 1e-6)
    q = ops.rms_norm(ops.matmul(ws["q"], h).reshape(n, n_head, hd), qk_w, 1e-6)
    k = ops.rms_norm(ops.matmul(ws["k"], h).reshape(n, n_kv, hd), qk_w, 1e-6)
    v = ops.matmul(ws["v"], h).reshape(n, n_kv, hd)
    ops.rope(q, cos, sin, hd, True)
    ops.rope(k, cos, sin, hd, True)
    keys, values = ops.empty((n_kv, 16, hd)), ops.empty((n_kv, 16, hd))  # a cache with room for 16 tokens
    ops.kv_write(keys, k, 0)
    ops.kv_write(values, v, 0)
    attn = ops.attention(q, keys, values, np.arange(n), hd**-0.5, 0, length=n)
    ops.add(x, ops.matmul(ws["o"], attn), out=x)
    h = ops.rms_norm(x, norm_w, 1e-6)
    act = ops.gated_activation(ops.matmul(ws["gate"], h), ops.matmul(ws["up"], h), "silu")
    ops.add(x, ops.matmul(ws["down"], act), out=x)
    tokens = ops.argmax(ops.matmul(ws["embd"], ops.rms_norm(x, norm_w, 1e-6)))
    assert reads == []
    got = ops.to_host(tokens)
    assert reads == [(n,)]

    def mm(name, a):
        return product_reference(dev, mats[name], T.Q8_0, a).astype(np.float32)

    xr = reference.embed(mats["embd"], T.Q8_0, ids)
    hr = reference.rms_norm(xr, norm_w, 1e-6)
    qr = reference.rope(reference.rms_norm(mm("q", hr).reshape(n, n_head, hd), qk_w, 1e-6), cos, sin, hd, True)
    kr = reference.rope(reference.rms_norm(mm("k", hr).reshape(n, n_kv, hd), qk_w, 1e-6), cos, sin, hd, True)
    vr = mm("v", hr).reshape(n, n_kv, hd)
    attn_r = reference.attention(qr, kr.transpose(1, 0, 2).copy(), vr.transpose(1, 0, 2).copy(), np.arange(n),
                                 hd**-0.5, 0)
    xr = xr + mm("o", attn_r)
    hr = reference.rms_norm(xr, norm_w, 1e-6)
    with np.errstate(over="ignore"):  # exp(-x) of large negative gates: inf, and silu -0, as intended
        xr = xr + mm("down", reference.silu(mm("gate", hr)) * mm("up", hr))
    logits = mm("embd", reference.rms_norm(xr, norm_w, 1e-6))
    assert got.tolist() == np.argmax(logits, axis=1).tolist()
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0] > 1e-3 * np.abs(top2[:, 1])).all()  # not decided by rounding


def test_opencl_ops_refuse_mismatched_shapes_with_a_clear_message(dev, ops):
    x = ops.to_device(np.zeros((2, 3, 64), np.float32))
    with pytest.raises(ValueError, match="even and within the head"):
        ops.rope(x, np.zeros((2, 33), np.float32), np.zeros((2, 33), np.float32), 66, True)
    with pytest.raises(ValueError, match=r"cos/sin must be \(2, 16\)"):
        ops.rope(x, np.zeros((1, 16), np.float32), np.zeros((1, 16), np.float32), 32, True)
    with pytest.raises(ValueError, match="norm weight has 32 elements"):
        ops.rms_norm(x, np.ones(32, np.float32), 1e-6)
    with pytest.raises(ValueError, match="unknown gate 'relu'"):
        ops.gated_activation(x, x, "relu")
    with pytest.raises(ValueError, match="do not fit q"):
        kv = ops.to_device(np.zeros((2, 5, 64), np.float32))
        ops.attention(x, kv, kv, np.arange(2), 1.0, 0)  # 3 query heads over 2 KV heads
    wide = ops.to_device(np.zeros((1, 1, 576), np.float32))
    with pytest.raises(ValueError, match="wider than 512"):
        ops.attention(wide, wide, wide, np.arange(1), 1.0, 0)
    with pytest.raises(ValueError, match="x is a host array"):
        ops.rms_norm(np.zeros((1, 64), np.float32), np.ones(64, np.float32), 1e-6)
    with pytest.raises(ValueError, match="float32 device array"):
        ops.scale(ops.to_device(np.zeros(4, np.int32), np.int32), 2.0)
    w = cl_formats.DeviceWeight(dev, random_blocks(T.Q8_0, 4, 64, seed=16), T.Q8_0)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 4\)"):
        ops.embed(w, np.array([4]))


# ---- static limits and the device layer ------------------------------------------------------------------------


_CAPABILITY_MACRO = re.compile(r"\b(" + "|".join(cl_device.Capabilities.MACROS) + r")\b")


def floor_source(source: str) -> str:
    """The source a device without any optional feature compiles: comments dropped, and each block under a
    capability macro (`#ifdef LOCALLLM_FP16`, `#if defined(LOCALLLM_SUBGROUPS)`, ... up to its #else, #elif or
    #endif) removed, its `#ifndef` / #else side kept. Other conditionals are kept whole, every branch of them."""
    src = re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", source), flags=re.S)

    def branch(word, cond):  # (kept, certainly the branch taken) with every capability macro undefined
        if not _CAPABILITY_MACRO.search(cond):
            return True, False  # not ours to decide: scanned
        negated = word == "ifndef" or re.search(r"!\s*defined", cond) is not None
        return negated, negated

    out, stack = [], []  # per open conditional: [current branch kept, an earlier or this branch certainly taken]
    for line in src.splitlines():
        m = re.match(r"\s*#\s*(ifdef|ifndef|if|elif|else|endif)\b(.*)", line)
        if not m:
            if all(kept for kept, _ in stack):
                out.append(line)
            continue
        word, cond = m.groups()
        if word in ("ifdef", "ifndef", "if"):
            stack.append(list(branch(word, cond)))
        elif word == "elif" and stack:
            stack[-1] = [False, True] if stack[-1][1] else list(branch(word, cond))
        elif word == "else" and stack:
            stack[-1] = [not stack[-1][1], True]
        elif word == "endif" and stack:
            stack.pop()
    return "\n".join(out)


def test_the_floor_source_drops_exactly_the_optional_paths():
    src = """a
#ifdef LOCALLLM_FP16
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
half h;
#else
float f;  // half
#endif
#if defined(LOCALLLM_SUBGROUPS) && WG == 64
sub_group_reduce_add(x);
#elif WG == 32
other;
#endif
#ifndef LOCALLLM_INTEGER_DOT
plain_dot;
#endif
#if WG > 16
kept_if;
#else
kept_else;
#endif
b"""
    got = [line for line in floor_source(src).splitlines() if not line.lstrip().startswith("#")]
    assert [line.strip() for line in got] == ["a", "float f;", "other;", "plain_dot;", "kept_if;", "kept_else;", "b"]


# Kernels as launched (kernels/opencl/*.py): the work-group sizes used, all within Apple's 256
def _launch_work_groups():
    from localllm.kernels.opencl import cl_ops

    return {"matvec/matmul": cl_formats.MATVEC_WG, "rms_norm/argmax": cl_ops.ROW_WG, "attention": cl_ops.ATT_WG,
            "elementwise": 256}


def test_opencl_kernels_stay_within_the_portable_floor(dev):
    """OpenCL C 1.2 with no fp64, no fp16 arithmetic, no sub-groups or integer dot products and no vectors (PoCL
    miscompiles float vectors wider than 8 here) outside the optional paths under a capability macro; as built
    on each device, with its optional features on and with them off, every kernel's local memory within 32 KiB
    and a work-group of 256 accepted (Apple's limits; the launches use at most 256: tools/opencl_oclgrind.py
    checks every launch)."""
    from localllm.kernels.opencl import cl_ops

    for source in (cl_formats.source(), cl_ops.source()):
        floor = floor_source(source)
        for pattern in (r"\bdouble\b", r"\bhalf\d*\b", r"cl_khr_fp(16|64)", r"\bsub_group_\w+", r"intel_\w+",
                        r"\bdot_(acc_sat_)?4x8packed\w*|\barm_dot\w*|\bdot\s*\(",
                        r"\b(float|int|uint|uchar|char|short|ushort|long|ulong)(2|3|4|8|16)\b"):
            found = re.search(pattern, floor)
            assert not found, f"{found.group(0)!r} outside an optional path"
    for name, wg in _launch_work_groups().items():
        assert wg <= 256 and wg & (wg - 1) == 0, name
    cl = dev.cl
    for source, options in ((cl_formats.source(), cl_formats._OPTIONS), (cl_ops.source(), cl_ops._OPTIONS)):
        # as the ops build them, and with every optional feature of the device on (its -cl-std instead of
        # CL1.2): where it has none (PoCL), the second build would only define the limits' macros
        builds = [options]
        caps = dev.capabilities
        if caps.build_options() != caps.floor().build_options():
            builds.append(tuple(o for o in options if not o.startswith("-cl-std")) + caps.build_options())
        for opts in builds:
            kernels = dev.program(source, opts).all_kernels()
            assert kernels
            for k in kernels:
                local = k.get_work_group_info(cl.kernel_work_group_info.LOCAL_MEM_SIZE, dev.device)
                assert local <= 32 * 1024, (k.function_name, local)
                assert k.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, dev.device) >= 256


# One kernel with each optional path beside its floor version, built with the device's capability macros: flags
# say which paths were compiled, and each optional result must equal the floor's (exact: halves that are exact,
# integer sums, integer dot products).
_PROBE = """
#ifdef LOCALLLM_FP16
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
#endif
#ifdef LOCALLLM_SUBGROUPS_KHR
#pragma OPENCL EXTENSION cl_khr_subgroups : enable
#endif
kernel void probe(global const float *x, global const int *a, global const int *b, global float *half_out,
                  global int *sum_out, global int *dot_out, global int *flags) {
    local int part[64];
    uint i = get_global_id(0), lid = get_local_id(0);
    // the floor: float arithmetic, a tree in local memory, byte products
    float h = x[i] * 0.5f;
    part[lid] = a[i];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint s = 32; s > 0; s >>= 1) {
        if (lid < s) part[lid] += part[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    int sum = part[0], d = 0, f = 0;
    for (int k = 0; k < 4; k++) d += (int)(char)(a[i] >> (8 * k)) * (int)(char)(b[i] >> (8 * k));
#ifdef LOCALLLM_FP16
    h = (float)((half)x[i] * (half)0.5f);
    f |= 1;
#endif
#ifdef LOCALLLM_SUBGROUPS
    local int sg_part[64];  // the work-group's sum from its sub-groups' sums
    int sg = sub_group_reduce_add(a[i]);
    if (get_sub_group_local_id() == 0) sg_part[get_sub_group_id()] = sg;
    barrier(CLK_LOCAL_MEM_FENCE);
    sum = 0;
    for (uint g = 0; g < get_num_sub_groups(); g++) sum += sg_part[g];
    f |= 2;
#endif
#ifdef LOCALLLM_INTEGER_DOT
    d = dot(as_char4(a[i]), as_char4(b[i]));
    f |= 4;
#endif
    half_out[i] = h;
    sum_out[i] = sum;
    dot_out[i] = d;
    if (i == 0) flags[0] = f;
}
"""


def test_optional_paths_agree_with_the_floor_where_offered_and_stay_off_where_not(dev):
    """The capability record's macros: each optional path (fp16 arithmetic, sub-group reductions, integer dot
    products) builds and runs exactly where the device reports it, gives the floor's result there, and is
    compiled out elsewhere (PoCL: none of the three; Intel's CPU runtime: all three)."""
    cl, caps = dev.cl, dev.capabilities
    rng = np.random.default_rng(31)
    x = rng.standard_normal(128).astype(np.float16).astype(np.float32)  # exact in half, and so is x / 2
    a = rng.integers(-(2**31), 2**31, 128, dtype=np.int64).astype(np.int32)
    b = rng.integers(-(2**31), 2**31, 128, dtype=np.int64).astype(np.int32)
    want_dot = (a.view(np.int8).reshape(-1, 4).astype(np.int32) * b.view(np.int8).reshape(-1, 4)).sum(axis=1)
    want_sum = a.astype(np.int64).reshape(2, 64).sum(axis=1).astype(np.int32)  # int32 wrap-around, as the device
    for options in (caps.floor().build_options(), caps.build_options()):
        probe = dev.program(_PROBE, options).probe
        mf = cl.mem_flags
        bufs = [cl.Buffer(dev.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=v) for v in (x, a, b)]
        outs = [np.empty(128, np.float32), np.empty(128, np.int32), np.empty(128, np.int32), np.empty(1, np.int32)]
        obufs = [cl.Buffer(dev.context, mf.WRITE_ONLY, o.nbytes) for o in outs]
        probe(dev.queue, (128,), (64,), *bufs, *obufs)
        for o, ob in zip(outs, obufs):
            cl.enqueue_copy(dev.queue, o, ob)
        half_out, sum_out, dot_out, flags = outs
        on = "-DLOCALLLM_FP16=1" in options, "-DLOCALLLM_SUBGROUPS=1" in options, "-DLOCALLLM_INTEGER_DOT=1" in options
        assert int(flags[0]) == on[0] | on[1] << 1 | on[2] << 2, (options, int(flags[0]))
        assert np.array_equal(half_out, x * np.float32(0.5))
        assert np.array_equal(sum_out, np.repeat(want_sum, 64))
        assert np.array_equal(dot_out, want_dot)
    assert ("-DLOCALLLM_FP16=1" in caps.build_options()) == ("cl_khr_fp16" in dev.info.extensions)
    if dev.is_pocl:  # the project's baseline device offers none of them: the floor is what it runs
        assert caps.build_options() == caps.floor().build_options()


def test_devices_are_found_by_name_and_a_wrong_name_lists_what_there_is(base_dev):
    infos = cl_device.list_devices()
    assert infos and all(i.opencl_c_version for i in infos)
    first = infos[0]
    assert cl_device.find_device(f"{first.platform.upper()}:{first.name.lower()}").name.strip() == first.name
    with pytest.raises(cl_device.OpenCLUnavailable) as err:
        cl_device.find_device("no-such-platform:no-such-device")
    assert "no-such-platform" in str(err.value) and first.name in str(err.value)
    warned = []
    assert cl_device.open_device("no-such-platform:", warn=warned.append) is None
    assert len(warned) == 1 and "no OpenCL device matches" in warned[0]


def test_pocl_device_reports_opencl_c_1_2():
    if not POCL_INSTALLED:
        pytest.skip("PoCL has no wheel for this platform")
    pocl = [i for i in cl_device.list_devices() if i.spec.startswith(POCL_SPEC)]  # listed even where it cannot build
    assert pocl, "PoCL is installed but pyopencl does not list its device"
    assert pocl[0].opencl_c_version.startswith("OpenCL C 1.2")
    assert "cl_khr_fp16" not in pocl[0].extensions


def test_a_failed_build_clears_the_kernel_caches_retries_once_then_says_the_cpu_is_used(base_dev, monkeypatch):
    dev = base_dev
    wiped = []
    monkeypatch.setattr(cl_device, "wipe_caches", lambda: wiped.append(1))
    with pytest.raises(cl_device.OpenCLUnavailable) as err:
        dev.program("kernel void broken(global float *x) { x[0] = undefined_name; }")
    assert wiped == [1]
    assert "failed to build" in str(err.value) and "using the CPU backend" in str(err.value)
    assert "undefined_name" in str(err.value)  # the compiler's log, for a bug report

    # a cache broken by an earlier compiler abort: the first build fails, the one after the wipe succeeds
    real = dev.cl.Program
    calls = []

    class FailsOnce:
        def __init__(self, ctx, src):
            self.prg = real(ctx, src)

        def build(self, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise dev.cl.RuntimeError("clBuildProgram failed: BUILD_PROGRAM_FAILURE (simulated)")
            return self.prg.build(**kwargs)

    monkeypatch.setattr(dev.cl, "Program", FailsOnce)
    prg = dev.program("kernel void fine(global float *x) { x[0] = 1.0f; }")
    assert len(calls) == 2 and wiped == [1, 1] and hasattr(prg, "fine")


def _info(platform, name, type_, mem_gb):
    return cl_device.DeviceInfo(platform=platform, name=name, vendor="", type=type_, version="", opencl_c_version="",
                                global_mem_bytes=mem_gb << 30, local_mem_bytes=0, max_work_group_size=0,
                                compute_units=1)


def test_the_default_device_is_a_gpu_then_pocl_and_never_a_simulator():
    class FakeCl:  # pyopencl's device_type bits
        class device_type:
            CPU, GPU, ACCELERATOR = 2, 4, 8

    assert cl_device._type_name(FakeCl, 4) == "GPU" and cl_device._type_name(FakeCl, 2 | 1) == "CPU"
    assert cl_device._type_name(FakeCl, 2 | 4 | 8 | 1) == "OTHER"  # Oclgrind's CPU | GPU | ACCELERATOR | DEFAULT
    infos = [_info("Oclgrind", "Oclgrind Simulator", "OTHER", 1), _info("Intel(R) OpenCL", "AMD EPYC", "CPU", 25),
             _info("Intel(R) FPGA Emulation Platform for OpenCL(TM)", "Emulator", "ACCELERATOR", 25),
             _info("Portable Computing Language", "pthread-AMD EPYC", "CPU", 23),
             _info("NVIDIA CUDA", "RTX 3060", "GPU", 12), _info("NVIDIA CUDA", "RTX 4090", "GPU", 24)]
    order = [i.name for i in sorted(infos, key=cl_device._preference)]
    assert order == ["RTX 4090", "RTX 3060", "pthread-AMD EPYC", "AMD EPYC", "Emulator", "Oclgrind Simulator"]


def test_registering_python_installed_runtimes_writes_an_icd_naming_the_library(monkeypatch, tmp_path):
    lib = tmp_path / "lib" / "libintelocl.so"
    monkeypatch.setattr(cl_device, "python_runtime_libraries", lambda: {"intel-cpu.icd": lib})
    libs = tmp_path / "pyopencl" / ".libs"
    libs.mkdir(parents=True)
    assert cl_device.register_python_runtimes(libs) == [libs / "intel-cpu.icd"]
    assert (libs / "intel-cpu.icd").read_text() == f"{lib}\n"
    assert cl_device.register_python_runtimes(libs) == [libs / "intel-cpu.icd"]  # again: unchanged, no error
    assert sorted(f.name for f in libs.iterdir()) == ["intel-cpu.icd"]
    monkeypatch.setattr(cl_device, "python_runtime_libraries", dict)
    assert cl_device.register_python_runtimes(tmp_path / "elsewhere") == []  # nothing installed: nothing written


@pytest.mark.skipif(not (sys.platform == "linux" and os.uname().machine == "x86_64"),
                    reason="intel-opencl-rt is a dev dependency on Linux x86_64 only (its only wheels)")
def test_intel_cpu_runtime_is_listed_beside_pocl_with_fp16_subgroups_and_integer_dot():
    assert INTEL_INSTALLED, "intel-opencl-rt (a dev dependency) is not installed: `make setup-dev` (make test) installs it"
    spec = intel_cpu_spec()
    assert spec, ("intel-opencl-rt is installed but pyopencl does not list its device: `make setup-dev` registers it "
                  "(python -m localllm.kernels.opencl.device --register)")
    caps = cl_device.Device(spec).capabilities
    assert caps.fp16 and caps.subgroups == "intel" and caps.integer_dot == "khr"
    assert {8, 16} <= set(caps.subgroup_sizes) and caps.opencl_c >= (3, 0)
    assert cl_device.find_device().platform.name.strip() != INTEL_CPU_PLATFORM or not POCL_INSTALLED  # PoCL stays first


def test_wipe_caches_removes_only_directories_it_owns(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCALLLM_CACHE", str(tmp_path / "cache"))
    ours = cl_device.pocl_cache_dir()
    ours.mkdir(parents=True)
    (cl_device.opencl_cache_dir()).mkdir(parents=True)
    theirs = tmp_path / "their-pocl"
    theirs.mkdir()
    monkeypatch.setenv("POCL_CACHE_DIR", str(theirs))
    cl_device.wipe_caches()
    assert theirs.exists() and ours.exists() and not cl_device.opencl_cache_dir().exists()
    monkeypatch.setenv("POCL_CACHE_DIR", str(ours))
    cl_device.wipe_caches()
    assert not ours.exists()


# ---- `localllm devices` ----------------------------------------------------------------------------------------


def test_devices_command_lists_the_cpu_and_the_opencl_devices(base_dev, capsys):
    from localllm.cli.main import main

    assert main(["devices", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["opencl_error"] is None
    cpu, *opencl = found["devices"]
    assert cpu["backend"] == "cpu" and cpu["threads"] >= 1 and cpu["memory_bytes"] > 0
    assert opencl and {"platform", "name", "global_mem_bytes", "opencl_c_version", "extensions"} <= set(opencl[0])
    caps = opencl[0]["capabilities"]
    assert {"opencl_c", "fp16", "subgroups", "subgroup_sizes", "integer_dot", "local_mem_bytes",
            "max_work_group_size"} == set(caps) and caps["local_mem_bytes"] == opencl[0]["local_mem_bytes"]
    assert main(["devices"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("cpu ") and opencl[0]["name"] in text and "OpenCL C" in text
    assert f"local memory {caps['local_mem_bytes'] // 1024} KiB" in text and "optional: " in text
    # each device says whether its compiler builds here: the test device's does; PoCL's reason where it does not
    by_spec = {f"{d['platform']}:{d['name']}": d for d in opencl}
    assert by_spec[base_dev.info.spec]["compiler_problem"] is None
    for spec, d in by_spec.items():
        if spec.startswith(POCL_SPEC):
            assert d["compiler_problem"] == pocl_problem()
            assert (f"cannot build kernels here: {pocl_problem()}" in text) == bool(pocl_problem())


def test_devices_command_without_an_opencl_runtime_says_so_in_one_line():
    code = ("import sys; sys.modules['pyopencl'] = None\n"  # as if pyopencl were not installed
            "from localllm.cli.main import main; sys.exit(main(['devices']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("cpu ") and len(lines) == 2
    assert lines[1].startswith("opencl  none: pyopencl is not importable") and "pip install pyopencl" in lines[1]


# ---- Backend.matrix's row ranges (phi3's fused attn_qkv / ffn_up; one expert of a stacked tensor) -----------

class _OneTensorFile:
    """The two methods Backend.matrix reads of a GGUF file, for one tensor of raw rows."""

    def __init__(self, raw: np.ndarray, qtype: T):
        self._raw, self.qtype = raw, qtype
        self.shape = (raw.shape[0], raw.shape[1] // FORMATS[qtype].type_size * FORMATS[qtype].block_size)

    def tensor_info(self, name):
        return self

    def raw(self, name):
        return self._raw


def _backend(where: str):
    from localllm import backends

    return backends.get("cpu" if where == "cpu" else f"opencl:{DEVICES[0][1] or ''}")


@pytest.mark.parametrize("where", ["cpu", "opencl"])
@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0, T.Q4_K], ids=lambda q: q.name)
def test_a_row_range_of_a_matrix_multiplies_as_those_rows_of_the_whole_bitwise(where, qtype):
    """Q, K and V as rows 0-64, 64-96 and 96-128 of one fused tensor give the bits of the whole tensor's product
    in those rows, for a decode row and a 9-row step, on the CPU and on OpenCL (PoCL)."""
    b = _backend(where)
    cols = 256 if qtype != T.F32 else 96
    f = _OneTensorFile(random_blocks(qtype, 128, cols, seed=7, moderate_scales=True), qtype)
    whole = b.matrix(f, "blk.0.attn_qkv.weight")
    parts = [b.matrix(f, "blk.0.attn_qkv.weight", rows=r) for r in ((0, 64), (64, 96), (96, 128))]
    assert [(p.rows, p.cols) for p in parts] == [(64, cols), (32, cols), (32, cols)]
    rng = np.random.default_rng(8)
    for n in (1, 9):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        xd = x if where == "cpu" else b.ops.to_device(x)
        want = b.to_host(b.matmul(whole, xd))
        got = [b.to_host(y) for y in b.group_matmul(b.group(parts), xd)]
        for (lo, hi), part in zip(((0, 64), (64, 96), (96, 128)), got):
            assert np.array_equal(_bits(part), _bits(want[:, lo:hi]))


@pytest.mark.parametrize("where", ["cpu", "opencl"])
@pytest.mark.parametrize("rows", [(0, 129), (-1, 4), (8, 8), (100, 64)])
def test_a_row_range_outside_the_tensor_is_refused_naming_it(where, rows):
    f = _OneTensorFile(random_blocks(T.Q8_0, 128, 64, seed=9, moderate_scales=True), T.Q8_0)
    with pytest.raises(ValueError, match=rf"blk.0.ffn_up.weight: rows {rows[0]} to {rows[1]} are not within its "
                                         r"128 rows"):
        _backend(where).matrix(f, "blk.0.ffn_up.weight", rows=rows)


# ---- mixture of experts: Backend.moe_ffn on both backends ------------------------------------------------------

MOE_E, MOE_K, MOE_D, MOE_FF = 8, 2, 64, 96


def _moe_backend(name: str, dev):
    """The CPU backend, or the OpenCL backend on `dev` (the op tests' device)."""
    if name == "cpu":
        from localllm.backends.cpu_backend import CpuBackend

        return CpuBackend()
    from localllm.backends.opencl_backend import OpenCLBackend
    from localllm.kernels.opencl.cl_ops import Ops

    b = OpenCLBackend.__new__(OpenCLBackend)  # on the module's device, not a new one
    b.dev, b.ops, b.name, b._uploads = dev, Ops(dev), f"opencl:{dev.info.spec}", {}
    return b


def _moe_layer(backend, qtype: T, seed: int):
    """(the backend's experts, the float matrices the reference takes): a float32 router whose logits are far
    apart (the same top-2 on every path), and 8 experts' gate/up (96, 64) and down (64, 96) in `qtype`."""
    from localllm.kernels.formats import row_range

    rng = np.random.default_rng(seed)
    router = (rng.standard_normal((MOE_E, MOE_D)) * 0.5).astype(np.float32)
    stacked = {m: random_blocks(qtype, MOE_E * rows, cols, seed=seed + i, moderate_scales=True)
               for i, (m, rows, cols) in enumerate((("gate", MOE_FF, MOE_D), ("up", MOE_FF, MOE_D),
                                                    ("down", MOE_D, MOE_FF)))}
    if backend.name == "cpu":
        from localllm.kernels import ops as cpu_ops

        def matrix(raw, q):
            return cpu_ops.Weight(np.ascontiguousarray(raw), q)
    else:
        def matrix(raw, q):
            return cl_formats.DeviceWeight(backend.dev, np.ascontiguousarray(raw), q)
    rows = {"gate": MOE_FF, "up": MOE_FF, "down": MOE_D}
    mats = {m: [matrix(row_range(raw, (e * rows[m], (e + 1) * rows[m])), qtype) for e in range(MOE_E)]
            for m, raw in stacked.items()}
    floats = {m: [reference.dequantize(row_range(raw, (e * rows[m], (e + 1) * rows[m])), qtype)
                  for e in range(MOE_E)] for m, raw in stacked.items()}
    experts = backend.experts(matrix(router.view(np.uint8), T.F32), mats["gate"], mats["up"], mats["down"])
    return experts, (router, floats["gate"], floats["up"], floats["down"])


def _moe_run(backend, experts, x: np.ndarray, normalize: bool) -> np.ndarray:
    if backend.name == "cpu":
        return backend.moe_ffn(x, experts, MOE_K, normalize, "silu")
    return backend.to_host(backend.moe_ffn(backend.ops.to_device(x), experts, MOE_K, normalize, "silu"))


# The CPU's integer kernels round each activation row to 8 bits per block (as llama.cpp): ~1e-5 measured; float
# weights and the OpenCL kernels keep float32 activations: float32 rounding alone.
MOE_NMSE = {("cpu", T.F32): 1e-10, ("cpu", T.Q8_0): 5e-4, ("cpu", T.Q4_0): 5e-4, ("opencl", T.F32): 1e-10,
            ("opencl", T.Q8_0): 1e-10, ("opencl", T.Q4_0): 1e-10}
MOE_CASES = pytest.mark.parametrize("qtype, normalize", [(T.F32, True), (T.Q8_0, True), (T.Q8_0, False),
                                                         (T.Q4_0, True)], ids=lambda v: getattr(v, "name", str(v)))


def _check_moe_against_the_reference(backend, qtype: T, normalize: bool) -> None:
    experts, floats = _moe_layer(backend, qtype, seed=5)
    x = np.random.default_rng(6).standard_normal((13, MOE_D)).astype(np.float32)
    got = _moe_run(backend, experts, x, normalize)
    want = reference.moe_ffn(x, *floats, MOE_K, normalize)
    assert got.shape == (13, MOE_D)
    assert nmse(got, want) < MOE_NMSE[(backend.name.split(":")[0], qtype)]


@MOE_CASES
def test_cpu_moe_ffn_matches_the_reference(qtype, normalize):
    """Router softmax, top-2 of 8, optional renormalisation, each expert's SwiGLU weighted and summed: as
    reference.moe_ffn (transformers' Qwen3MoeSparseMoeBlock in float64), for 13 tokens spread over the experts."""
    _check_moe_against_the_reference(_moe_backend("cpu", None), qtype, normalize)


@MOE_CASES
def test_opencl_moe_ffn_matches_the_reference(dev, qtype, normalize):
    _check_moe_against_the_reference(_moe_backend("opencl", dev), qtype, normalize)


def _check_moe_batch_invariance(backend) -> None:
    experts, _ = _moe_layer(backend, T.Q8_0, seed=7)
    x = np.random.default_rng(8).standard_normal((13, MOE_D)).astype(np.float32)
    together = _moe_run(backend, experts, x, True)
    pair = _moe_run(backend, experts, x[3:5], True)
    for i in range(13):
        alone = _moe_run(backend, experts, x[i : i + 1], True)
        assert np.array_equal(_bits(alone[0]), _bits(together[i]))
    assert np.array_equal(_bits(pair), _bits(together[3:5]))


def test_cpu_moe_ffn_gives_each_token_its_result_alone_bitwise():
    """A token's experts see other tokens' rows beside its own (grouped by expert), yet its output is bitwise what
    it gets alone, in a batch of 2 or of 13: batch invariance, as the other ops."""
    _check_moe_batch_invariance(_moe_backend("cpu", None))


def test_opencl_moe_ffn_gives_each_token_its_result_alone_bitwise(dev):
    _check_moe_batch_invariance(_moe_backend("opencl", dev))


def test_moe_routing_picks_the_k_largest_and_renormalises_in_rank_order():
    from localllm.kernels import moe

    logits = np.array([[0.0, 3.0, 1.0, 3.0], [2.0, -1.0, np.nan, 0.5]], np.float32)
    ids, w = moe.route(logits, 2, True)
    assert ids.tolist() == [[1, 3], [0, 3]]  # ties to the lower index; a NaN is never chosen over a number
    np.testing.assert_allclose(w, [[0.5, 0.5], [1 / (1 + np.exp(-1.5)), 1 - 1 / (1 + np.exp(-1.5))]], rtol=1e-6)
    _, p = moe.route(logits[:1], 2, False)
    np.testing.assert_allclose(p, np.exp([[3.0, 3.0]]) / np.exp([0.0, 3.0, 1.0, 3.0]).sum(), rtol=1e-6)
    groups = moe.by_expert(np.array([[1, 3], [0, 3]]), 4)
    assert [(e, sel.tolist()) for e, sel in groups] == [(0, [2]), (1, [0]), (3, [1, 3])]


def test_a_device_that_cannot_build_is_refused_with_its_reason_and_plain_opencl_takes_the_next(monkeypatch):
    """As PoCL on a CPU newer than its LLVM: the device is listed, every build fails. Named, it is refused before
    a model is uploaded, with the compiler's words and what to do; plain `--device opencl` takes the next
    preferred device that builds."""
    from localllm.backends.opencl_backend import OpenCLBackend
    from localllm.errors import LocalLLMError

    listed = [i for i in cl_device.list_devices() if i.platform != "Oclgrind"]
    if len(listed) < 2:
        pytest.skip("one OpenCL device here")
    first, real = listed[0], cl_device._probe

    def probe(cl, context):
        d = context.devices[0]
        if (d.platform.name.strip(), d.name.strip()) == (first.platform, first.name):
            return "error: unknown target CPU 'generic'"
        return real(cl, context)

    monkeypatch.setattr(cl_device, "_probe", probe)
    with pytest.raises(LocalLLMError, match=r"cannot build OpenCL kernels: error: unknown target CPU .*localllm devices"):
        OpenCLBackend(first.spec)
    assert OpenCLBackend("").dev.info.spec != first.spec


@pytest.mark.parametrize("normalize", [True, False])
def test_the_cpu_routing_kernel_chooses_the_experts_of_the_numpy_routing_with_its_weights(normalize):
    """kernels/cpu/moe_kernels.py route_rows (both CPU paths: op by op and the fused forward) is kernels/moe.py route
    compiled: the same experts in the same order (ties to the lower index, NaN never preferred, -inf last but
    one), the same weights to rounding (numpy's exp and pairwise sum are not LLVM's)."""
    from localllm.kernels import moe
    from localllm.kernels.cpu import moe_kernels as cpu_moe

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 8)).astype(np.float32)
    logits[::3] = np.round(logits[::3])  # ties
    logits[1::7, 2] = np.nan
    logits[2::5, 5] = -np.inf
    logits[4] = np.nan
    for k in (1, 2, 3, 8):
        ids, weights = np.empty((64, k), np.int64), np.empty((64, k), np.float32)
        cpu_moe.route_rows(logits, k, normalize, ids, weights)
        want_ids, want_weights = moe.route(logits, k, normalize)
        assert np.array_equal(ids, want_ids)
        np.testing.assert_allclose(weights, want_weights, rtol=1e-6, atol=0)
        assert np.all(weights[4] == 0)  # every logit NaN: no weight


# ---- a q8_0 KV cache on the device (kv_type q8_0): int8 values with a float32 scale per 32, the CPU's bytes ----

def _q8_rows(rng, n, n_kv, d):
    """Rows as K/V projections give them, with the cases the rounding must agree on: a block of zeros (scale
    0), ties of x / d at .5 (x = k * amax / 254), outliers of ~150 beside values near 1 (Qwen2's first layers),
    tiny and huge magnitudes."""
    x = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    x[0, 0, :32] = 0.0
    if d >= 64:
        x[0, 0, 32:64] = np.arange(32, dtype=np.float32) * np.float32(0.5) - 8  # many exact halves of d
    x[-1, -1, :32] *= np.float32(1e-30)
    x[-1, 0, -32:] *= np.float32(3e4)
    x[n // 2, :, 5] = 150.0
    return x


def _cpu_q8(rows, cols, cap):
    from localllm.kernels.cpu import attention as cpu_attention

    n, n_kv, d = rows.shape
    store = np.zeros((n_kv, cap, d), np.int8)
    scales = np.zeros((n_kv, cap, d // 32), np.float32)
    cpu_attention.write_rows(store, scales, np.asarray(cols, np.int64), rows)
    return store, scales


def _device_q8(ops, rows, cols, cap):
    n, n_kv, d = rows.shape
    store = ops.to_device(np.zeros((n_kv, cap, d), np.int8), np.int8)
    scales = ops.to_device(np.zeros((n_kv, cap, d // 32), np.float32))
    ops.kv_write(store, ops.to_device(rows), cols=np.asarray(cols, np.int32), scales=scales)
    return store, scales


@pytest.mark.parametrize("d", [64, 128, 256])
def test_opencl_q8_0_kv_rows_are_the_cpu_backends_bytes(ops, d):
    rng = np.random.default_rng(d)
    n_kv, cap = 2, 64
    rows = _q8_rows(rng, 20, n_kv, d)
    cols = rng.permutation(cap)[:20]  # a paged cache's scattered columns
    want_q, want_s = _cpu_q8(rows, cols, cap)
    got_q, got_s = (ops.to_host(a) for a in _device_q8(ops, rows, cols, cap))
    assert np.array_equal(got_q, want_q)
    assert np.array_equal(got_s.view(np.uint32), want_s.view(np.uint32))
    with pytest.raises(ValueError, match="need their float32 scales"):
        ops.kv_write(ops.to_device(want_q, np.int8), ops.to_device(rows[:1]), cols=np.array([0]))


@pytest.mark.parametrize("case", ATTENTION_CASES[:5], ids=lambda c: "n{}-h{}-kv{}-d{}-dv{}-T{}-w{}-s{}".format(*c))
def test_opencl_attention_over_a_q8_0_cache_matches_the_cpu_backends_q8_0_attention(ops, case):
    """The same q8_0 bytes read by both backends' attention (dequantized in the kernel): as close as their float32
    attentions are to the reference, paged through a block table, windows and trimmed starts included."""
    from localllm.kernels import ops as cpu_ops

    n, n_head, n_kv, d, dv, t, window, key_start = case
    key_start = -(-key_start // 16) * 16  # the pool's caches start at a block (the CPU's table says which)
    rng = np.random.default_rng(sum(case) + 1)
    q = (rng.standard_normal((n, n_head, d)) * 2).astype(np.float32)
    blocks = rng.permutation(-(-t // 16) + 3)[: -(-t // 16)]
    cols = (blocks[:, None] * 16 + np.arange(16)).ravel()[:t]
    cap = 16 * (len(blocks) + 3)
    k_rows, v_rows = _q8_rows(rng, t, n_kv, d), _q8_rows(rng, t, n_kv, dv)
    kq, ks = _cpu_q8(k_rows, cols, cap)
    vq, vs = _cpu_q8(v_rows, cols, cap)
    positions = np.arange(key_start + t - n, key_start + t)
    scale = d**-0.5
    want = cpu_ops.attention(q, (kq, ks, vq, vs, blocks.astype(np.int64), key_start // 16), positions, key_start, window, scale)
    dk, dks = _device_q8(ops, k_rows, cols, cap)
    dvq, dvs = _device_q8(ops, v_rows, cols, cap)
    got = ops.to_host(ops.attention(ops.to_device(q), dk, dvq, positions, scale, window, key_start, cols=cols,
                                    k_scales=dks, v_scales=dvs))
    assert nmse(got, want) <= OPS_NMSE["attention"], f"NMSE {nmse(got, want):.3g}"
    # and it is attention over the dequantized values (not the float32 rows: q8_0 moves it by far more)
    deq_k = kq[:, cols].astype(np.float32) * np.repeat(ks[:, cols], 32, axis=2)
    deq_v = vq[:, cols].astype(np.float32) * np.repeat(vs[:, cols], 32, axis=2)
    ref = reference.attention(q, deq_k, deq_v, positions, scale, window, key_start)
    assert nmse(got, ref) <= OPS_NMSE["attention"]
