"""Tests of the quantized matmul (kernels/cpu/quant_dot.py) and its AVX2 primitives (kernels/cpu/simd.py).

Accuracy bound. The kernels quantize each row of x to 8 bits (blocks of 32, or 256 for the K-quants) and are
otherwise exact up to float32 rounding, so against the float64 product of x with gguf's dequantized weights the
error of output element (i, r) is bounded by

    sum_e |W[r, e]| * step[i, e] / 2                      rounding x[i, e] to a multiple of its block's step
  + 2**-9 * sum_e (|W[r, e]| + max|W[r]|) * |x[i, e]|       fp16 storage of the activation scale and block sum
  + 1e-6 * sum_e |W[r, e] * x[i, e]|                       float32 accumulation

where step = amax(block of x) / 127. The first term is the one that matters (about 0.4% of |W|.|x| per element at
worst); the test asserts this bound for every output element.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from localllm.kernels.cpu import quant_dot, simd
from localllm.gguf_file import GGUFFile
from conftest import model_file

Q = GGMLQuantizationType
# Priority order of the brief: what the catalog models use first.
FORMATS = [Q.Q8_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.Q4_0, Q.Q5_1, Q.Q5_K, Q.Q3_K, Q.Q2_K]
# Byte offsets of each block's fp16 fields: random bytes there could be inf/nan or absurd magnitudes.
HALF_FIELDS = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}  # fmt: skip
needs_avx2 = pytest.mark.skipif(not simd.HAVE_AVX2, reason="this CPU (as Numba targets it) has no AVX2+FMA+F16C")


def random_weights(qtype: Q, rows: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks: every quant bit random, fp16 scale fields replaced by finite values in [-0.05, 0.05]."""
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (rows, blocks * block_bytes), dtype=np.uint8)
    view = raw.reshape(rows, blocks, block_bytes)
    for offset in HALF_FIELDS[qtype]:
        halves = rng.uniform(-0.05, 0.05, (rows, blocks)).astype(np.float16)
        view[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(rows, blocks, 2)
    return raw


def random_x(n: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    # heavy-ish tails, like transformer activations, so block maxima vary
    return (rng.standard_normal((n, cols)) * rng.uniform(0.1, 3.0, (n, cols))).astype(np.float32)


def columns(qtype: Q, blocks: int) -> int:
    return GGML_QUANT_SIZES[qtype][0] * blocks


def run(matmul, raw: np.ndarray, qtype: Q, x: np.ndarray) -> np.ndarray:
    out = np.full((x.shape[0], raw.shape[0]), np.nan, np.float32)
    matmul(raw, qtype, x, out)
    return out


def error_bound(weights: np.ndarray, qtype: Q, x: np.ndarray) -> np.ndarray:
    """The bound of the module docstring, per output element (n, rows)."""
    block = 256 if GGML_QUANT_SIZES[qtype][0] == 256 else 32
    x64 = x.astype(np.float64)
    n, cols = x.shape
    step = np.repeat(np.abs(x64).reshape(n, cols // block, block).max(axis=2) / 127.0, block, axis=1)
    w_abs = np.abs(weights)
    rounding = (step / 2) @ w_abs.T
    scales = 2.0**-9 * (np.abs(x64) @ w_abs.T + np.abs(x64).sum(axis=1, keepdims=True) * w_abs.max(axis=1)[None, :])
    accumulation = 1e-6 * (np.abs(x64) @ w_abs.T)
    return rounding + scales + accumulation


def assert_within_bound(out: np.ndarray, raw: np.ndarray, qtype: Q, x: np.ndarray) -> None:
    weights = dequantize(raw, qtype).astype(np.float64).reshape(raw.shape[0], -1)
    reference = x.astype(np.float64) @ weights.T
    bound = error_bound(weights, qtype, x)
    excess = np.abs(out - reference) - bound
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert np.all(np.isfinite(out))
    assert excess.max() <= 0, (
        f"{qtype.name}: |out - ref| = {abs(out - reference)[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    )


# ---------------------------------------------------------------------------------------------------------------
# fp16 conversions (they decide the block scales, so they must match IEEE / numpy exactly)
# ---------------------------------------------------------------------------------------------------------------


def test_half_to_float_matches_numpy_for_every_half():
    from numba import njit

    @njit
    def convert_all(bits):
        out = np.empty(bits.size, np.float32)
        for k in range(bits.size):
            out[k] = quant_dot.half_bits_to_float(bits[k])
        return out

    bits = np.arange(65536, dtype=np.uint16)
    ours = convert_all(bits).view(np.uint32)
    expected = bits.view(np.float16).astype(np.float32).view(np.uint32)
    nan = np.isnan(bits.view(np.float16))
    assert np.array_equal(ours[~nan], expected[~nan])
    assert np.all(np.isnan(ours[nan].view(np.float32)))


def test_float_to_half_rounds_like_numpy():
    from numba import njit

    @njit
    def convert_all(values):
        out = np.empty(values.size, np.uint16)
        for k in range(values.size):
            out[k] = quant_dot.float_to_half_bits(values[k])
        return out

    rng = np.random.default_rng(1)
    # all magnitudes from fp16-subnormal to overflow, plus exact ties (half-way between two fp16 values)
    values = (rng.choice([-1, 1], 200_000) * 2.0 ** rng.uniform(-30, 17, 200_000)).astype(np.float32)
    halves = np.arange(0, 0x7BFF, dtype=np.uint16).view(np.float16).astype(np.float32)
    ties = ((halves[:-1].astype(np.float64) + halves[1:]) / 2).astype(np.float32)
    values = np.concatenate([values, ties, -ties, [0.0, -0.0, np.inf, -np.inf, 65504.0, 65520.0]]).astype(np.float32)
    with np.errstate(over="ignore"):  # numpy warns on the values that round to inf, which we include on purpose
        expected = values.astype(np.float16).view(np.uint16)
    assert np.array_equal(convert_all(values), expected)


# ---------------------------------------------------------------------------------------------------------------
# Activation quantization
# ---------------------------------------------------------------------------------------------------------------


def test_q8_0_and_q8_1_quantization():
    rng = np.random.default_rng(2)
    x = random_x(3, 256, rng)
    x[1, :32] = 0.0  # an all-zero block: scale 0, quants 0
    qs, d = quant_dot.quantize_q8_0(x)
    qs1, d1, s1 = quant_dot.quantize_q8_1(x)
    assert np.array_equal(qs, qs1) and np.array_equal(d, d1)
    blocks = x.reshape(3, 8, 32)
    amax = np.abs(blocks).max(axis=2)
    assert np.array_equal(d, (amax / np.float32(127)).astype(np.float16).astype(np.float32))
    assert np.abs(qs).max() <= 127
    # each value is its block's nearest multiple of amax/127 (rounded with the unrounded reciprocal, as ggml)
    step = (amax / 127.0)[:, :, None]
    assert np.all(np.abs(qs.reshape(3, 8, 32) * step - blocks) <= step / 2 * (1 + 1e-5))
    assert np.all(qs[1, :32] == 0) and d[1, 0] == 0
    expected_s = ((amax / np.float32(127)) * qs.reshape(3, 8, 32).sum(axis=2).astype(np.float32)).astype(np.float16)
    assert np.array_equal(s1, expected_s.astype(np.float32))


def test_q8_k_quantization():
    rng = np.random.default_rng(3)
    x = random_x(2, 512, rng)
    x[1, 256:] = 0.0
    qs, d, bsums = quant_dot.quantize_q8_K(x)
    blocks = x.reshape(2, 2, 256)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
    # scale set by the largest-magnitude element, which maps to -127 (quantize_row_q8_K_ref)
    assert np.allclose(d[0], extreme[0] / -127.0, rtol=1e-6)
    assert np.abs(qs).max() <= 127
    assert np.array_equal(bsums, qs.reshape(2, 32, 16).sum(axis=2).astype(np.int16).reshape(2, 32))
    assert d[1, 1] == 0 and np.all(qs[1, 256:] == 0) and np.all(bsums[1, 16:] == 0)
    step = np.abs(d)[:, :, None]
    assert np.all(np.abs(qs.reshape(2, 2, 256) * d[:, :, None] - blocks) <= step / 2 * (1 + 1e-5))


def test_q8_k_scale_comes_from_the_first_of_two_equal_magnitudes():
    # the vectorized quantizer finds the extreme from the block's max and min; on a tie (+a and -a both present)
    # the first in the block decides the sign, as ggml's scan does
    x = np.zeros((4, 256), np.float32)
    x[0, [3, 9, 20]] = [1.0, 7.0, -7.0]   # +7 first
    x[1, [3, 9, 20]] = [1.0, -7.0, 7.0]   # -7 first
    x[2, [3, 9]] = [-2.0, -0.5]           # only negatives
    x[3, :] = -0.0                        # an all-zero block (negative zeros)
    qs, d, bsums = quant_dot.quantize_q8_K(x)
    assert d[0, 0] == np.float32(7.0 / -127.0) and qs[0, 9] == -127 and qs[0, 20] == 127
    assert d[1, 0] == np.float32(-7.0 / -127.0) and qs[1, 9] == -127 and qs[1, 20] == 127
    assert d[2, 0] == np.float32(1.0) / np.float32(-127.0 / -2.0) and qs[2, 3] == -127
    assert d[3, 0] == 0 and not qs[3].any() and not bsums[3].any()


# ---------------------------------------------------------------------------------------------------------------
# The matmul
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_matches_float64_reference_within_activation_quantization_bound(qtype):
    rng = np.random.default_rng(int(qtype))
    blocks = 3 if GGML_QUANT_SIZES[qtype][0] == 256 else 7
    raw = random_weights(qtype, 37, blocks, rng)
    x = random_x(5, columns(qtype, blocks), rng)
    assert_within_bound(run(quant_dot.matmul, raw, qtype, x), raw, qtype, x)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_portable_matches_reference(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    blocks = 2 if GGML_QUANT_SIZES[qtype][0] == 256 else 5
    raw = random_weights(qtype, 19, blocks, rng)
    x = random_x(3, columns(qtype, blocks), rng)
    assert_within_bound(run(quant_dot.matmul_portable, raw, qtype, x), raw, qtype, x)


@needs_avx2
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_avx2_equals_portable_bitwise(qtype):
    """Same integer lanes, same float operations in the same order: identical bits, for every n."""
    rng = np.random.default_rng(200 + int(qtype))
    blocks = 3 if GGML_QUANT_SIZES[qtype][0] == 256 else 9
    raw = random_weights(qtype, 29, blocks, rng)
    for n in (1, 2, 3, 4, 5, 8):
        x = random_x(n, columns(qtype, blocks), rng)
        simd_out = run(quant_dot.matmul_avx2, raw, qtype, x)
        portable_out = run(quant_dot.matmul_portable, raw, qtype, x)
        assert np.array_equal(simd_out.view(np.uint32), portable_out.view(np.uint32)), f"n={n}"


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_batch_invariance(qtype):
    """A row of x gets bit-identical outputs whatever else is in the batch and wherever it sits in it."""
    rng = np.random.default_rng(300 + int(qtype))
    blocks = 2 if GGML_QUANT_SIZES[qtype][0] == 256 else 8
    cols = columns(qtype, blocks)
    rows = quant_dot.SERIAL_BELOW_WEIGHTS // cols + 13  # enough work for the threaded path, split unevenly
    raw = random_weights(qtype, rows, blocks, rng)
    x = random_x(8, cols, rng)
    full = run(quant_dot.matmul, raw, qtype, x)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)  # the same rows computed by one thread instead of split over several
    try:
        assert np.array_equal(run(quant_dot.matmul, raw, qtype, x), full)
    finally:
        numba.set_num_threads(threads)
    for n in range(1, 9):
        assert np.array_equal(run(quant_dot.matmul, raw, qtype, x[:n]), full[:n]), f"first {n} rows"
    for i in range(8):
        assert np.array_equal(run(quant_dot.matmul, raw, qtype, x[i : i + 1])[0], full[i]), f"row {i} alone"
    order = rng.permutation(8)
    assert np.array_equal(run(quant_dot.matmul, raw, qtype, x[order]), full[order])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_odd_shapes(qtype):
    """Row counts that do not split evenly over threads (or are smaller than the thread count), n = 1..16."""
    rng = np.random.default_rng(400 + int(qtype))
    block_size = GGML_QUANT_SIZES[qtype][0]
    threaded_rows = quant_dot.SERIAL_BELOW_WEIGHTS // 512 + 1  # 512 columns: the last shape takes the threaded path
    for rows, blocks in ((1, 1), (3, 2), (257, 1), (threaded_rows, 512 // block_size)):
        raw = random_weights(qtype, rows, blocks, rng)
        x = random_x(16, columns(qtype, blocks), rng)
        full = run(quant_dot.matmul, raw, qtype, x)
        assert_within_bound(full, raw, qtype, x)
        for n in range(1, 17):
            assert np.array_equal(run(quant_dot.matmul, raw, qtype, x[:n]), full[:n]), f"{rows}x{blocks} n={n}"
        if simd.HAVE_AVX2:
            assert np.array_equal(run(quant_dot.matmul_portable, raw, qtype, x), full)


def test_zero_activations_and_zero_scales():
    rng = np.random.default_rng(5)
    for qtype in FORMATS:
        blocks = 1 if GGML_QUANT_SIZES[qtype][0] == 256 else 4
        raw = random_weights(qtype, 8, blocks, rng)
        x = np.zeros((2, columns(qtype, blocks)), np.float32)
        assert np.array_equal(run(quant_dot.matmul, raw, qtype, x), np.zeros((2, 8), np.float32)), qtype.name


def test_contract_checks():
    rng = np.random.default_rng(6)
    raw = random_weights(Q.Q8_0, 4, 2, rng)
    x = random_x(1, 64, rng)
    assert quant_dot.SUPPORTED == frozenset(FORMATS)
    with pytest.raises(ValueError):
        quant_dot.matmul(raw, Q.Q8_0, random_x(1, 96, rng), np.empty((1, 4), np.float32))  # wrong width
    with pytest.raises(ValueError):
        quant_dot.matmul(raw, Q.Q8_0, x, np.empty((1, 5), np.float32))  # wrong out shape
    with pytest.raises(ValueError):
        quant_dot.matmul(raw, Q.IQ4_NL, x, np.empty((1, 4), np.float32))  # unsupported format
    # a writable raw and a read-only one give the same result (raw is only ever read)
    out_writable = run(quant_dot.matmul, raw, Q.Q8_0, x)
    readonly = raw.view()
    readonly.flags.writeable = False
    assert np.array_equal(run(quant_dot.matmul, readonly, Q.Q8_0, x), out_writable)


@needs_avx2
def test_kernels_compile_to_vpmaddubsw_and_vpmaddwd():
    """The point of simd.py: the integer dot products are vpmaddubsw + vpmaddwd, not scalar loops.

    Kernels loaded from Numba's disk cache carry no assembly text, so we compile fresh (uncached) copies of a
    32-block kernel (Q8_0, one x-row) and of the Q4_K kernel for the argument types `matmul` gives them.
    """
    from numba import njit, typeof, types

    rng = np.random.default_rng(7)
    raw = random_weights(Q.Q4_K, 4, 1, rng)
    raw.flags.writeable = False
    xq, xd, bsums = quant_dot.quantize_q8_K(random_x(1, 256, rng))
    out = np.empty((1, 4), np.float32)
    i64 = types.int64
    q4_k_signature = (typeof(raw), typeof(xq), typeof(xd), typeof(bsums), typeof(out), i64, i64)
    # w, kind = Q8_0, block bytes, blocks, xq, xd, xs, out, r, i, count = 1, decoded (address or 0)
    q8_0_signature = (i64, types.literal(0), i64, i64, typeof(xq), typeof(xd), typeof(xd), typeof(out), i64, i64)
    q8_0_signature += (types.literal(1), i64)
    for kernel, signature in ((quant_dot._group_32_avx2, q8_0_signature), (quant_dot._rows_q4_k_avx2, q4_k_signature)):
        fresh = njit(kernel.py_func)
        fresh.compile(signature)
        assembly = fresh.inspect_asm(signature)
        for instruction in ("vpmaddubsw", "vpmaddwd", "vfmadd"):
            assert instruction in assembly, f"{kernel.__name__}: no {instruction}"


GENERIC_CPU_SCRIPT = """
import sys
import numpy as np
from localllm.kernels.cpu import quant_dot, simd
assert not simd.HAVE_AVX2 and not quant_dot.USES_AVX2, "NUMBA_CPU_NAME=generic must select the portable kernels"
inputs = np.load(sys.argv[1])
results = {}
for name in ("Q8_0", "Q4_K"):
    raw, x = inputs[name + "_raw"], inputs[name + "_x"]
    out = np.empty((x.shape[0], raw.shape[0]), np.float32)
    quant_dot.matmul(raw, quant_dot.Q[name], x, out)
    results[name] = out
np.savez(sys.argv[2], **results)
"""


def test_cpu_without_avx2_selects_portable_kernels_with_identical_results(tmp_path):
    """A process whose Numba targets a baseline x86-64 CPU (no AVX2, no FMA: fma becomes a library call) takes
    the portable path and still produces the bits this process produces."""
    import os
    import subprocess
    import sys

    rng = np.random.default_rng(9)
    inputs, expected = {}, {}
    for qtype in (Q.Q8_0, Q.Q4_K):
        blocks = 2 if qtype == Q.Q4_K else 16
        raw, x = random_weights(qtype, 40, blocks, rng), random_x(3, columns(qtype, blocks), rng)
        inputs[qtype.name + "_raw"], inputs[qtype.name + "_x"] = raw, x
        expected[qtype.name] = run(quant_dot.matmul, raw, qtype, x)
    np.savez(tmp_path / "inputs.npz", **inputs)
    # Numba's cache keys entries on the target CPU, so the generic build shares the kernel cache directory.
    env = dict(os.environ, NUMBA_CPU_NAME="generic")
    args = [sys.executable, "-c", GENERIC_CPU_SCRIPT, str(tmp_path / "inputs.npz"), str(tmp_path / "out.npz")]
    subprocess.run(args, env=env, check=True, cwd=os.path.dirname(os.path.dirname(__file__)), timeout=600)
    results = np.load(tmp_path / "out.npz")
    for name, out in expected.items():
        assert np.array_equal(results[name].view(np.uint32), out.view(np.uint32)), name


CACHE_CHECK_SCRIPT = """
import numpy as np
from localllm.kernels.cpu import quant_dot
raw = np.zeros((8, 34), np.uint8)
x = np.ones((1, 32), np.float32)
out = np.empty((1, 8), np.float32)
quant_dot.matmul(raw, quant_dot.Q.Q8_0, x, out)
quant_dot.matmul_portable(raw, quant_dot.Q.Q8_0, x, out)
entries = [quant_dot._matmul_32_portable] + ([quant_dot._matmul_q8_0_avx2] if quant_dot.USES_AVX2 else [])
print(sum(sum(entry.stats.cache_misses.values()) for entry in entries))
"""


def test_second_process_loads_kernels_from_the_disk_cache():
    """Every kernel must be cacheable (a kernel Numba refuses to cache, e.g. one using dynamic globals, would
    be compiled again at every start, seconds per format)."""
    import os
    import subprocess
    import sys

    args = [sys.executable, "-c", CACHE_CHECK_SCRIPT]
    root = os.path.dirname(os.path.dirname(__file__))
    subprocess.run(args, check=True, cwd=root, timeout=600, capture_output=True)  # fills the cache if needed
    second = subprocess.run(args, check=True, cwd=root, timeout=600, capture_output=True, text=True)
    assert second.stdout.strip() == "0", f"cache misses in a second process: {second.stdout} {second.stderr}"


# ---------------------------------------------------------------------------------------------------------------
# Real tensors of the catalog models
# ---------------------------------------------------------------------------------------------------------------

REAL_TENSORS = [
    ("qwen2.5-coder-0.5b-instruct", "blk.0.ffn_down.weight", Q.Q6_K),
    ("qwen2.5-coder-0.5b-instruct", "blk.0.ffn_gate.weight", Q.Q5_0),
    ("qwen2.5-coder-0.5b-instruct", "blk.11.ffn_down.weight", Q.Q4_K),
    ("qwen2.5-coder-0.5b-instruct", "output.weight", Q.Q8_0),
    ("smollm2-135m-instruct", "blk.0.ffn_down.weight", Q.Q4_1),
    ("smollm2-135m-instruct", "blk.0.attn_q.weight", Q.Q4_1),
]


@pytest.mark.parametrize("model,name,qtype", REAL_TENSORS, ids=[f"{m}:{t}" for m, t, _ in REAL_TENSORS])
def test_real_model_tensor(model, name, qtype):
    with GGUFFile(model_file(model)) as gguf:
        assert gguf.tensor_info(name).qtype == qtype
        raw = gguf.raw(name)
        assert not raw.flags.writeable  # a view of the memory map, used in place
        rows = raw[:1024]  # enough rows for the threaded path; the float64 reference of all 151936 is too big
        rng = np.random.default_rng(8)
        x = random_x(4, gguf.tensor_info(name).shape[1], rng)
        out = run(quant_dot.matmul, rows, qtype, x)
        assert_within_bound(out, rows, qtype, x)
        weights = dequantize(rows, qtype).astype(np.float64)
        reference = x.astype(np.float64) @ weights.T
        relative = np.linalg.norm(out - reference) / np.linalg.norm(reference)
        # 8-bit activations cost ~0.6-0.9% here (heavy-tailed x: a block's step is set by its largest value)
        assert relative < 0.02, f"relative error {relative:.4f}"
        if simd.HAVE_AVX2:
            assert np.array_equal(run(quant_dot.matmul_portable, rows, qtype, x), out)
