"""The format table, dequantization and the `kernels.ops` interface, for every format of the table.

Random blocks are random bytes with the fp16 scale fields replaced by finite, moderate values (random bytes
there would give inf/NaN scales, which real files never have and which make comparisons meaningless)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from localllm.kernels import ops, reference
from localllm.kernels.formats import FORMATS, format_of
from localllm.kernels.cpu import cpu_formats
from localllm.errors import ModelFileError
from localllm.gguf_file import GGUFFile
from conftest import model_file

ALL_FORMATS = list(FORMATS)
FLOAT_TYPES = {T.F32, T.F16, T.BF16}


def random_weight_bytes(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype == T.F32:
        return rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    if qtype == T.F16:
        return rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    if qtype == T.BF16:  # top halves of random float32s
        return (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    fmt = FORMATS[qtype]
    n_blocks = cols // fmt.block_size
    blocks = rng.integers(0, 256, (rows, n_blocks, fmt.type_size), dtype=np.uint8)
    for off in fmt.f16_offsets:
        scales = (rng.uniform(-1, 1, (rows, n_blocks)) * 0.05).astype(np.float16)
        blocks[:, :, off : off + 2] = scales.view(np.uint8).reshape(rows, n_blocks, 2)
    return blocks.reshape(rows, n_blocks * fmt.type_size)


def cols_for(qtype: T) -> int:
    # Float formats get a width that is not a multiple of the kernels' 256-element spans, to cover the tail.
    return 300 if qtype in FLOAT_TYPES else 512


def make_weight(qtype: T, rows: int = 37, seed: int = 0) -> ops.Weight:
    return ops.Weight(random_weight_bytes(qtype, rows, cols_for(qtype), seed), qtype)


# With the integer SIMD path installed, ops.matmul's small-n path quantizes x to 8 bits per block (as ggml
# does): its error is that of the activation rounding, not of float32 accumulation.
Q8_ACTIVATION_RTOL = 1e-2


def small_n_rtol(qtype: T) -> float:
    return Q8_ACTIVATION_RTOL if qtype in ops._QUANT_DOT_SUPPORTED else 2e-6


def assert_close_to_float64(got: np.ndarray, raw: np.ndarray, qtype: T, x: np.ndarray, rtol: float = 2e-6) -> None:
    """Relative to the sum of |products|: float32 accumulation error, with no cancellation luck needed."""
    want = reference.matmul(raw, qtype, x)
    scale = np.abs(x.astype(np.float64)) @ np.abs(reference.dequantize(raw, qtype).astype(np.float64)).T
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= rtol * scale + 1e-30), f"max relative error {np.max(err / (scale + 1e-30)):.3g}"


# ---- the table -----------------------------------------------------------------------------------------------


def test_table_lists_the_required_formats_with_their_geometry():
    names = {f.name for f in FORMATS.values()}
    assert names == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
    assert (FORMATS[T.Q4_K].block_size, FORMATS[T.Q4_K].type_size) == (256, 144)
    assert (FORMATS[T.Q8_0].block_size, FORMATS[T.Q8_0].type_size) == (32, 34)
    for fmt in FORMATS.values():
        assert fmt.block_dtype.itemsize == fmt.type_size, fmt.name


def test_every_format_has_cpu_kernels_and_the_same_geometry():
    assert set(cpu_formats.FORMATS) == set(FORMATS)
    for qtype, fmt in cpu_formats.FORMATS.items():
        assert fmt.format is FORMATS[qtype]
        assert (fmt.name, fmt.block_size, fmt.type_size) == (FORMATS[qtype].name, FORMATS[qtype].block_size,
                                                             FORMATS[qtype].type_size)
        assert callable(fmt.dequantize_rows) and callable(fmt.matmul) and callable(fmt.quantize)


def test_block_dtypes_place_the_fp16_fields_where_ggml_does():
    # byte offsets from ggml-common.h's block structs, written out independently of the dtypes
    want = {T.F32: (), T.F16: (0,), T.BF16: (), T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,),
            T.Q5_1: (0, 2), T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
    assert {q: f.f16_offsets for q, f in FORMATS.items()} == want


@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda q: q.name)
def test_reference_dequantize_reads_the_block_dtype_fields_as_gguf_py_does(qtype):
    # the structured view's scale fields, times the table's reference dequantize: the block's d is where
    # gguf-py reads it (a scale of 0 zeroes the block)
    fmt = FORMATS[qtype]
    raw = random_weight_bytes(qtype, 3, cols_for(qtype), seed=5)
    assert np.array_equal(fmt.dequantize(raw).view(np.uint32), reference.dequantize(raw, qtype).view(np.uint32))
    if "d" in fmt.block_dtype.names:
        blocks = fmt.blocks(raw.copy())
        blocks["d"] = 0
        if "dmin" in fmt.block_dtype.names:
            blocks["dmin"] = 0
        if "m" in fmt.block_dtype.names:
            blocks["m"] = 0
        assert not np.any(fmt.dequantize(blocks.view(np.uint8).reshape(raw.shape)))


@pytest.mark.parametrize("qtype", [q for q in ALL_FORMATS if FORMATS[q].quantize is not None], ids=lambda q: q.name)
def test_reference_quantize_matches_the_cpu_quantizer(qtype):
    x = np.random.default_rng(6).standard_normal((4, 256)).astype(np.float32)
    out = np.empty((4, FORMATS[qtype].row_bytes(256)), np.uint8)
    cpu_formats.FORMATS[qtype].quantize(x, out)
    assert np.array_equal(FORMATS[qtype].quantize(x), out)


def test_the_reference_quantizers_are_the_formats_gguf_py_quantizes():
    from gguf import quants

    from localllm.kernels.formats import REFERENCE_QUANTIZE

    def gguf_quantizes(qtype):
        try:
            quants.quantize(np.zeros((1, FORMATS[qtype].block_size), np.float32), qtype)
        except NotImplementedError:
            return False
        return True

    assert REFERENCE_QUANTIZE == {q for q in FORMATS if gguf_quantizes(q)}
    assert {q for q in FORMATS if FORMATS[q].quantize is not None} == REFERENCE_QUANTIZE


def test_model_loading_imports_gguf_py_constants_alone_and_a_later_import_gguf_shares_them():
    # localllm/gguf_constants.py: gguf-py's package (its writer, quantizers, PyYAML) stays out of a warm start
    import subprocess
    import sys

    script = """
import sys
from localllm.gguf_file import GGUFFile
from localllm.kernels import formats
assert "gguf.constants" in sys.modules and "gguf" not in sys.modules and "yaml" not in sys.modules
import gguf
from localllm.gguf_constants import GGMLQuantizationType
assert gguf.GGMLQuantizationType is GGMLQuantizationType and gguf.constants is sys.modules["gguf.constants"]
print(formats.FORMATS[gguf.GGMLQuantizationType.Q8_0].name)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["Q8_0"]


def test_unsupported_type_names_itself_and_the_supported_ones():
    with pytest.raises(ModelFileError) as err:
        format_of(T.IQ2_XXS)
    assert "IQ2_XXS" in str(err.value) and "Q4_K" in str(err.value) and "Q8_0" in str(err.value)
    with pytest.raises(ModelFileError, match="IQ2_XXS"):
        ops.Weight(np.zeros((2, 66), np.uint8), T.IQ2_XXS)


# ---- dequantization ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda q: q.name)
def test_dequantize_is_bit_exact_with_gguf_py(qtype):
    raw = random_weight_bytes(qtype, 37, cols_for(qtype), seed=1)
    got = ops.dequantize(ops.Weight(raw, qtype))
    want = reference.dequantize(raw, qtype)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_f16_and_bf16_decode_every_bit_pattern_exactly():
    every = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(1, -1)
    for qtype in (T.F16, T.BF16):
        got = ops.dequantize(ops.Weight(every, qtype))
        assert np.array_equal(got.view(np.uint32), reference.dequantize(every, qtype).view(np.uint32)), qtype.name


@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda q: q.name)
def test_embed_returns_the_dequantized_rows(qtype):
    w = make_weight(qtype, seed=2)
    ids = np.array([5, 0, 36, 5, 17])
    got = ops.embed(w, ids)
    assert np.array_equal(got, ops.dequantize(w)[ids])
    assert np.array_equal(got, reference.embed(w.raw, qtype, ids))


def test_embed_rejects_ids_out_of_range():
    w = make_weight(T.Q8_0)
    with pytest.raises(ValueError, match="row ids"):
        ops.embed(w, np.array([37]))
    with pytest.raises(ValueError, match="row ids"):
        ops.embed(w, np.array([-1]))


# ---- matmul --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda q: q.name)
def test_fused_kernel_matches_float64_matmul(qtype, n):
    w = make_weight(qtype, seed=3)
    x = np.random.default_rng(n).standard_normal((n, w.cols)).astype(np.float32)
    assert_close_to_float64(ops.matmul_fused(w, x), w.raw, qtype, x)


@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda q: q.name)
def test_ops_matmul_small_n_matches_float64_matmul(qtype):
    w = make_weight(qtype, seed=4)
    for n in (1, 2, 8):
        x = np.random.default_rng(n).standard_normal((n, w.cols)).astype(np.float32)
        assert_close_to_float64(ops.matmul(w, x), w.raw, qtype, x, rtol=small_n_rtol(qtype))


@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda q: q.name)
def test_matmul_is_batch_invariant(qtype):
    """Each output row is bitwise what n=1 gives for that x row alone: for every n on formats with an integer
    kernel (prompts, speculative verify, server batches), on the small-n path for the others."""
    w = make_weight(qtype, seed=5)
    # on the integer path: two passes of the format's x-rows (quant_dot.rows_per_pass), the second partial
    invariant_up_to = w._pass + 8 if w._use_quant_dot else ops.BLAS_MIN_N - 1
    x = np.random.default_rng(6).standard_normal((invariant_up_to, w.cols)).astype(np.float32)
    alone = np.concatenate([ops.matmul(w, x[i : i + 1]) for i in range(x.shape[0])])
    for n in range(2, x.shape[0] + 1):
        batched = ops.matmul(w, x[:n])
        assert np.array_equal(batched.view(np.uint32), alone[:n].view(np.uint32)), f"n={n}"
    # the same row in a different position of a different batch
    shuffled = np.ascontiguousarray(x[::-1][:4])
    assert np.array_equal(ops.matmul(w, shuffled).view(np.uint32), alone[::-1][:4].view(np.uint32))


@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda q: q.name)
def test_large_n_matches_float64_matmul(qtype):
    """n = 64 on the default path (the integer kernel in passes where the format has one)."""
    w = make_weight(qtype, seed=7)
    x = np.random.default_rng(8).standard_normal((64, w.cols)).astype(np.float32)
    assert_close_to_float64(ops.matmul(w, x), w.raw, qtype, x, rtol=small_n_rtol(qtype))


@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda q: q.name)
def test_tiled_blas_path_matches_float64_matmul(qtype):
    w = make_weight(qtype, seed=7)
    w._tile_rows = 10  # several tiles, the last one partial (37 rows)
    x = np.random.default_rng(8).standard_normal((64, w.cols)).astype(np.float32)
    assert_close_to_float64(ops.matmul(w, x, precise=True), w.raw, qtype, x)


def test_matmul_writes_into_out_and_checks_shapes():
    w = make_weight(T.Q4_K)
    x = np.random.default_rng(9).standard_normal((2, w.cols)).astype(np.float32)
    out = np.full((2, w.rows), np.nan, np.float32)
    assert ops.matmul(w, x, out=out) is out
    assert np.array_equal(out, ops.matmul(w, x))
    with pytest.raises(ValueError):
        ops.matmul(w, x[:, :-1].copy())
    with pytest.raises(ValueError):
        ops.matmul(w, x.astype(np.float64))
    with pytest.raises(ValueError):
        ops.matmul(w, x, out=np.empty((2, w.rows + 1), np.float32))


def test_weight_is_a_read_only_view_never_a_copy():
    raw = random_weight_bytes(T.Q6_K, 4, 256)
    w = ops.Weight(raw, T.Q6_K)
    assert np.shares_memory(w.raw, raw) and not w.raw.flags.writeable
    assert (w.rows, w.cols) == (4, 256)


# ---- real model files ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, wanted_types",
    [
        ("qwen2.5-coder-0.5b-instruct", {T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0}),
        ("smollm2-135m-instruct", {T.Q4_1}),
    ],
)
def test_real_tensors_dequantize_like_gguf_py(model, wanted_types):
    gguf = GGUFFile(model_file(model))
    seen = set()
    for info in gguf.tensors.values():
        if info.qtype not in wanted_types or info.qtype in seen or len(info.shape) != 2 or info.shape[0] > 8192:
            continue
        seen.add(info.qtype)
        w = ops.Weight.from_gguf(gguf, info.name)
        assert (w.rows, w.cols) == info.shape
        assert np.shares_memory(w.raw, gguf.raw(info.name))
        want = reference.dequantize(w.raw, info.qtype)
        assert np.array_equal(ops.dequantize(w).view(np.uint32), want.view(np.uint32)), info.name
        x = np.random.default_rng(0).standard_normal((1, w.cols)).astype(np.float32)
        assert_close_to_float64(ops.matmul(w, x), w.raw, info.qtype, x, rtol=small_n_rtol(info.qtype))
        assert_close_to_float64(ops.matmul_fused(w, x), w.raw, info.qtype, x)
    assert seen == wanted_types


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda q: q.name)
def test_weight_group_gives_bitwise_what_separate_matmuls_give(qtype):
    """Q/K/V and gate/up in one call (x quantized once, one parallel region) change nothing in the results."""
    # Different row counts, as Q (n_head rows) and K, V (n_kv_head rows) have.
    group = [ops.Weight(make_weight(qtype, seed=s).raw[:rows], qtype) for s, rows in ((11, 37), (12, 20), (13, 7))]
    fused = ops.WeightGroup(group)
    assert fused._many is not None or not group[0]._use_quant_dot or not quant_dot_has_avx2()
    for n in (1, 5, 37):
        x = np.random.default_rng(n).standard_normal((n, group[0].cols)).astype(np.float32)
        for got, w in zip(fused(x), group):
            assert np.array_equal(got.view(np.uint32), ops.matmul(w, x).view(np.uint32))


def quant_dot_has_avx2() -> bool:
    from localllm.kernels.cpu import quant_dot

    return quant_dot.USES_AVX2


def test_the_load_probe_counts_other_processes_cpu_time_not_this_ones(monkeypatch):
    # kernels/cpu/process_settings.py: the window opens at import and the engine reads the model file meanwhile; that
    # reading is this process's CPU time and must not read as a busy machine.
    from localllm.kernels.cpu import process_settings as runtime

    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(runtime.time, "sleep", lambda s: None)
    monkeypatch.setattr(runtime.time, "monotonic", lambda: 10.1)
    # 0.1 s: 20 ticks of 2 CPUs, 10 idle (one CPU's worth busy), and this process used 0.1 s of CPU
    monkeypatch.setattr(runtime, "_window_start", (10.0, 5.0, 1000, 800))
    monkeypatch.setattr(runtime, "_snapshot", lambda: (10.1, 5.1, 1020, 810))
    assert runtime.cores_busy_elsewhere() == pytest.approx(0.0)
    # the same ticks while this process slept: another process held a core
    monkeypatch.setattr(runtime, "_snapshot", lambda: (10.1, 5.0, 1020, 810))
    assert runtime.cores_busy_elsewhere() == pytest.approx(1.0)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
def test_the_avx512_k_quant_row_kernels_give_the_avx2_kernels_bits(qtype):
    # kernels/cpu/quant_dot.py: on AVX-512 CPUs the Q4_K/Q6_K rows multiply two 32-chunks per instruction and two
    # weight rows per activation read (their float steps side by side in one zmm), folding to the AVX2 kernel's
    # int32 lanes (exact) before its float steps.
    from localllm.kernels.cpu import quant_dot, simd

    from test_backend_ops import random_blocks

    if not simd.HAVE_AVX512:
        pytest.skip("this CPU has no AVX-512 (F, BW, VL): its K-quant rows run the AVX2 kernels, tested elsewhere")
    avx2, avx512 = {T.Q4_K: (quant_dot._rows_q4_k_avx2, quant_dot._rows_q4_k_avx512),
                    T.Q6_K: (quant_dot._rows_q6_k_avx2, quant_dot._rows_q6_k_avx512)}[qtype]
    raw = random_blocks(qtype, 37, 1024, seed=3).reshape(37, -1)  # extreme scales too: any finite fp16
    raw.flags.writeable = False
    rng = np.random.default_rng(4)
    # weight rows in pairs, an odd last row paired with itself, at any x-row count
    for n, (r0, r1) in [(1, (0, 37)), (3, (5, 36)), (9, (0, 37)), (16, (1, 2)), (17, (0, 37)), (40, (0, 37)), (33, (3, 36))]:
        xq, xd, bsums = quant_dot.quantize_q8_K((rng.standard_normal((n, 1024)) * 3).astype(np.float32))
        want = np.full((n, 37), 7, np.float32)
        got = want.copy()
        avx2(raw, xq, xd, bsums, want, r0, r1)
        avx512(raw, xq, xd, bsums, got, r0, r1)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _acts_32(qtype, x):
    """x quantized as a 32-block format's row kernels take it: (bytes, scales, block sums or the scales again)."""
    from localllm.kernels.cpu import quant_dot

    if qtype in (T.Q4_1, T.Q5_1):
        return quant_dot.quantize_q8_1(x)
    xq, xd = quant_dot.quantize_q8_0(x)
    return xq, xd, xd


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1])
def test_the_vnni_32_block_row_kernels_give_the_avx2_kernels_bits(qtype):
    # kernels/cpu/quant_dot.py _rows_32_avx512: tiles of 4 weight rows, unsigned-offset weights, two blocks per VNNI
    # product and per float step (each half the AVX2 kernel's step for its block), column passes
    from localllm.kernels.cpu import quant_dot, simd

    from test_backend_ops import random_blocks

    if not simd.HAVE_AVX512_VNNI:
        pytest.skip("this CPU has no AVX-512 VNNI: its 32-block rows run the AVX2 kernels, tested elsewhere")
    kind = quant_dot._KIND_32[qtype]
    block_bytes = FORMATS[qtype].type_size
    rng = np.random.default_rng(5)
    for cols in (32 * 7, 32 * 8, 32 * 66, 32 * 67):  # an odd last block; pairs only; three column passes, without
        # and with an odd block
        raw = random_blocks(qtype, 29, cols, seed=6).reshape(29, -1)
        raw.flags.writeable = False
        for n, (r0, r1) in [(1, (0, 29)), (2, (0, 29)), (3, (2, 29)), (4, (3, 28)), (7, (0, 29)), (16, (1, 2))]:
            xq, xd, xs = _acts_32(qtype, (rng.standard_normal((n, cols)) * 3).astype(np.float32))
            want = np.full((n, 29), 7, np.float32)
            got = want.copy()
            quant_dot._rows_32_avx2(raw, kind, block_bytes, xq, xd, xs, want, r0, r1)
            quant_dot._rows_32_avx512(raw, kind, block_bytes, xq, xd, xs, got, r0, r1)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q5_1])
def test_the_few_row_avx2_kernels_give_the_avx2_kernels_bits_at_any_number_of_rows(qtype):
    # _rows_32_avx2_few (groups of 2 and 1) and _rows_32_avx2_one (1): what a VNNI machine compiles for the
    # x-row counts it leaves to AVX2, in place of _rows_32_avx2's groups of 4, 2, 1 and its decoded scratch row
    from localllm.kernels.cpu import quant_dot

    from test_backend_ops import random_blocks

    kind = quant_dot._KIND_32[qtype]
    block_bytes = FORMATS[qtype].type_size
    rng = np.random.default_rng(8)
    raw = random_blocks(qtype, 13, 32 * 9, seed=9).reshape(13, -1)
    raw.flags.writeable = False
    for n, (r0, r1) in [(1, (0, 13)), (2, (0, 13)), (3, (2, 11)), (5, (0, 13)), (6, (4, 5))]:
        xq, xd, xs = _acts_32(qtype, (rng.standard_normal((n, 32 * 9)) * 3).astype(np.float32))
        want = np.full((n, 13), 7, np.float32)
        quant_dot._rows_32_avx2(raw, kind, block_bytes, xq, xd, xs, want, r0, r1)
        for few in (quant_dot._rows_32_avx2_few, quant_dot._rows_32_avx2_one):
            got = np.full((n, 13), 7, np.float32)
            few(raw, kind, block_bytes, xq, xd, xs, got, r0, r1)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_kernels_with_scratch_memory_keep_it_alive_in_parallel_regions():
    # Numba frees an array after its last use *as an array*; the 32-block kernels' scratch rows are written
    # and read through their addresses after that (simd.keep_alive marks the real end). Without it, in a parallel
    # region the other thread was handed the freed memory: a heap corruption that aborted the test suite. glibc's
    # checking malloc turns such a write into an abort at the next free, so a subprocess runs the kernels there.
    import subprocess
    import sys
    from pathlib import Path

    from localllm.kernels.cpu import simd

    libs = [p for p in ("/lib/x86_64-linux-gnu/libc_malloc_debug.so.0", "/usr/lib64/libc_malloc_debug.so.0",
                        "/lib64/libc_malloc_debug.so.0") if Path(p).exists()]
    if not libs or not simd.HAVE_AVX2:
        pytest.skip("no glibc checking malloc (libc_malloc_debug) or no AVX2 kernels here")
    script = """
import numpy as np, numba
from gguf import GGMLQuantizationType as Q
from localllm.kernels.cpu import quant_dot as qd
from localllm.kernels.bench_quant_dot import random_weights
numba.set_num_threads(2)
rng = np.random.default_rng(1)
for it in range(40):
    qt = (Q.Q5_0, Q.Q8_0, Q.Q4_1)[it % 3]
    n, rows, cols = int(rng.integers(4, 24)), int(rng.integers(600, 2000)), 32 * int(rng.integers(12, 40))
    raw = random_weights(qt, rows, cols, rng)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    qd.matmul(raw, qt, x, np.empty((n, rows), np.float32))
print("ok")
"""
    env = dict(__import__("os").environ, LD_PRELOAD=libs[0], MALLOC_CHECK_="3", PYTHONMALLOC="malloc",
               NUMBA_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
