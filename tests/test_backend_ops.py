"""The kernel backends' operations against the CPU backend and `kernels/reference.py`, on random inputs, every
format of the table, as llama.cpp's tests/test-backend-ops.cpp checks each backend against the CPU.

The OpenCL backend runs on PoCL's CPU device (installed with the project on Linux x86_64, so `make test` and
CI run these there; elsewhere on the preferred device, Apple's OpenCL on a Mac); LOCALLLM_TEST_OPENCL=
PLATFORM:DEVICE picks another (`localllm devices` lists them). The tests are skipped only where there is no
OpenCL at all: pyopencl not installed, or no runtime and no PoCL wheel for the platform. Shapes are small:
PoCL compiles each kernel with LLVM at its first launch (26 kernels: 6-8 s on 2 loaded cores, then cached
under ~/.cache/localllm/pocl: 0.4 s).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from localllm.kernels import reference
from localllm.kernels.cpu import formats as cpu_formats
from localllm.kernels.formats import FORMATS

pytest.importorskip("pyopencl", reason="pyopencl is not installed (it is a dependency: `make setup` installs it)")

from localllm.kernels.opencl import device as cl_device  # noqa: E402
from localllm.kernels.opencl import formats as cl_formats  # noqa: E402

ALL_FORMATS = list(FORMATS)
FLOAT_TYPES = {T.F32, T.F16, T.BF16}

# Normalized mean squared error bounds of the dequantize-matvec against reference.matmul (float64), per format.
# They are alike because the device's dequantization is bit-equal to the CPU's (tested below) and x is not
# quantized: what is left is float32 accumulation in another order, measured at 6e-15 to 3e-14 for every format
# on these shapes (0.5 to 2 ulp of the output). 1e-11 leaves a margin of ~300x and still fails a single
# wrong sub-block scale or element order, which gives NMSE of 1e-3 or more. llama.cpp's test-backend-ops allows
# 5e-4 for mul_mat because its kernels round x to 8 bits; an integer-dot path here will need that bound.
MATVEC_NMSE = {q: 1e-11 for q in ALL_FORMATS}


POCL_INSTALLED = importlib.util.find_spec("pocl_binary_distribution") is not None


@pytest.fixture(scope="module")
def dev():
    """PoCL where it is installed (Linux x86_64: with the project), else the preferred device (macOS: Apple's)."""
    spec = os.environ.get("LOCALLLM_TEST_OPENCL") or ("Portable Computing Language:" if POCL_INSTALLED else None)
    try:
        return cl_device.Device(spec)
    except cl_device.OpenCLUnavailable as err:
        if spec is None:
            pytest.skip(f"no OpenCL runtime here, and PoCL is not installed (no wheel for this platform): {err}")
        raise  # PoCL is installed, or a device was asked for: not finding it is a failure


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


# ---- dequantization ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda q: q.name)
def test_opencl_dequantize_is_bit_equal_to_the_cpu_backend(dev, qtype):
    raw = random_blocks(qtype, 9, cols_for(qtype), seed=1)
    w = cl_formats.DeviceWeight(dev, raw, qtype)
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
    want = reference.matmul(raw, qtype, x)
    assert got.shape == (3, 37)
    assert nmse(got, want) <= MATVEC_NMSE[qtype], f"NMSE {nmse(got, want):.3g}"
    # each x row alone gives the same bits: one work-group per (weight row, x row), no batch dependence
    assert np.array_equal(cl_formats.matvec(w, x[1:2]).view(np.uint32), got[1:2].view(np.uint32))


def test_opencl_matvec_refuses_a_wrong_width(dev):
    w = cl_formats.DeviceWeight(dev, random_blocks(T.Q8_0, 4, 64, seed=5), T.Q8_0)
    with pytest.raises(ValueError, match=r"\(n, 64\)"):
        cl_formats.matvec(w, np.zeros((1, 32), np.float32))
    with pytest.raises(ValueError, match="whole number of Q8_0 blocks"):
        cl_formats.DeviceWeight(dev, np.zeros((2, 35), np.uint8), T.Q8_0)


# ---- static limits and the device layer ------------------------------------------------------------------------


def test_opencl_kernels_stay_within_the_portable_floor(dev):
    """OpenCL C 1.2 with no fp64, no fp16 arithmetic and no vectors (PoCL miscompiles float vectors wider
    than 8 here); local memory within 32 KiB and work-groups within 256 (Apple's limits)."""
    src = re.sub(r"//[^\n]*", "", cl_formats.source())
    assert not re.search(r"\bdouble\b|\bhalf\b|cl_khr_fp(16|64)", src)
    assert not re.search(r"\b(float|int|uint|uchar|char|short|ushort)(2|3|4|8|16)\b", src)
    assert cl_formats.MATVEC_WG <= 256 and cl_formats.MATVEC_WG & (cl_formats.MATVEC_WG - 1) == 0
    cl = dev.cl
    for qtype in ALL_FORMATS:
        k = cl_formats.kernel(dev, f"matvec_{cl_formats.FORMATS[qtype].suffix}")
        assert k.get_work_group_info(cl.kernel_work_group_info.LOCAL_MEM_SIZE, dev.device) <= 32 * 1024


def test_devices_are_found_by_name_and_a_wrong_name_lists_what_there_is(dev):
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


def test_pocl_device_reports_opencl_c_1_2(dev):
    if not dev.is_pocl:
        pytest.skip("runs on PoCL only (LOCALLLM_TEST_OPENCL chose another device)")
    assert dev.info.opencl_c_version.startswith("OpenCL C 1.2")
    assert "cl_khr_fp16" not in dev.info.extensions


def test_a_failed_build_clears_the_kernel_caches_retries_once_then_says_the_cpu_is_used(dev, monkeypatch, tmp_path):
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


def test_devices_command_lists_the_cpu_and_the_opencl_devices(dev, capsys):
    from localllm.cli import main

    assert main(["devices", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["opencl_error"] is None
    cpu, *opencl = found["devices"]
    assert cpu["backend"] == "cpu" and cpu["threads"] >= 1 and cpu["memory_bytes"] > 0
    assert opencl and {"platform", "name", "global_mem_bytes", "opencl_c_version", "extensions"} <= set(opencl[0])
    assert main(["devices"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("cpu ") and opencl[0]["name"] in text and "OpenCL C" in text


def test_devices_command_without_an_opencl_runtime_says_so_in_one_line():
    code = ("import sys; sys.modules['pyopencl'] = None\n"  # as if pyopencl were not installed
            "from localllm.cli import main; sys.exit(main(['devices']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("cpu ") and len(lines) == 2
    assert lines[1].startswith("opencl  none: pyopencl is not importable") and "pip install pyopencl" in lines[1]
