"""Tests of the 16-row tiled weights (kernels/cpu/tiled.py, and kernels/cpu/tiled_k.py for Q4_K and Q6_K): the
repacking is lossless, the VNNI kernel is bitwise its portable loops and batch invariant, and a model loaded tiled
computes what the file's layout does."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localllm.kernels import ops
from localllm.kernels.cpu import quant_dot, tiled
from localllm.gguf_file import GGUFFile
from conftest import model_file

Q = GGMLQuantizationType
TILED = [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q6_K]
K_QUANTS = (Q.Q4_K, Q.Q6_K)
needs_vnni = pytest.mark.skipif(not tiled.HAVE_AVX512_VNNI, reason="the tiled kernel needs AVX-512 VNNI")


def random_weights(qtype, rows, cols, rng):
    """Random blocks (every quant and scale bit random) with finite fp16 scales in [-0.05, 0.05] (Q4_K's d and
    dmin, Q6_K's d at the block's end)."""
    size, bb = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // size * bb), dtype=np.uint8)
    blocks = raw.reshape(rows, cols // size, bb)
    for at in {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}.get(qtype, (0,)):
        blocks[:, :, at:at + 2] = rng.uniform(-0.05, 0.05, blocks.shape[:2]).astype(np.float16).view(
            np.uint8).reshape(*blocks.shape[:2], 2)
    return raw


def widths(qtype, *for_32):
    """Row widths for a format: the 32-block formats' as given, the K-quants' (256-blocks) their multiples."""
    return [c // 32 * 256 if qtype in K_QUANTS else c for c in for_32]


@pytest.mark.parametrize("qtype", TILED, ids=lambda q: q.name)
@pytest.mark.parametrize("width", [64, 96, 896])  # even and odd block counts
def test_untiling_any_rows_of_a_tiled_weight_gives_back_the_file_bytes(qtype, width):
    [cols] = widths(qtype, width)
    rng = np.random.default_rng(cols)
    raw = random_weights(qtype, 48, cols, rng)
    t = tiled.tile(raw, qtype)
    assert t.shape == raw.shape and t.ctypes.data % 64 == 0 and not t.flags.writeable
    assert np.array_equal(tiled.untile_rows(t, qtype, np.arange(48)), raw)
    ids = np.array([47, 0, 17, 17, 31])
    assert np.array_equal(tiled.untile_rows(t, qtype, ids), raw[ids])


@needs_vnni
@pytest.mark.parametrize("qtype", TILED, ids=lambda q: q.name)
def test_the_tiled_kernel_is_bitwise_its_portable_loops_at_every_batch_size(qtype):
    rng = np.random.default_rng(int(qtype))
    [cols], rows = widths(qtype, 320), 96
    raw = random_weights(qtype, rows, cols, rng)
    t = tiled.tile(raw, qtype)
    kernel = quant_dot.bind_tiled(t, qtype)
    for n in (1, 2, 3, 4, 5, 8, 9, 17):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        want = np.empty((n, rows), np.float32)
        quant_dot.matmul_tiled_portable(t, qtype, x, want)
        for threads in (1, 2):
            got = np.full((n, rows), np.nan, np.float32)
            kernel(x, got, threads)
            assert np.array_equal(got, want), (n, threads)


@needs_vnni
@pytest.mark.parametrize("qtype", TILED, ids=lambda q: q.name)
def test_a_row_alone_is_bitwise_the_same_row_in_any_batch(qtype):
    rng = np.random.default_rng(7)
    [cols], rows = widths(qtype, 96), 64
    t = tiled.tile(random_weights(qtype, rows, cols, rng), qtype)
    kernel = quant_dot.bind_tiled(t, qtype)
    x = rng.standard_normal((11, cols)).astype(np.float32)
    batch = np.empty((11, rows), np.float32)
    kernel(x, batch, 2)
    for i in range(11):
        alone = np.empty((1, rows), np.float32)
        kernel(x[i : i + 1], alone, 2)
        assert np.array_equal(alone[0], batch[i]), i


@needs_vnni
@pytest.mark.parametrize("qtype", TILED, ids=lambda q: q.name)
def test_tiled_products_agree_with_the_file_layout_kernel_to_float_rounding(qtype):
    """The same integer block sums, summed in another float order: 1e-5 of the row's magnitude bounds the
    difference of float32 sums of 28 block terms (each term ~1e-7 relative); the K-quants' file-layout kernel sums
    8 float lanes a row (ggml's order), the tiles one sum a row."""
    rng = np.random.default_rng(3)
    [cols], rows = widths(qtype, 896 if qtype not in K_QUANTS else 224), 128
    raw = random_weights(qtype, rows, cols, rng)
    x = rng.standard_normal((8, cols)).astype(np.float32)
    want = np.empty((8, rows), np.float32)
    quant_dot.matmul(raw, qtype, x, want)
    got = np.empty((8, rows), np.float32)
    quant_dot.bind_tiled(tiled.tile(raw, qtype), qtype)(x, got, 2)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-5 * scale


@needs_vnni
def test_a_model_loaded_tiled_embeds_dequantizes_and_multiplies_like_the_file_layout():
    g = GGUFFile(model_file("qwen2.5-coder-0.5b-instruct"))
    matrices = [(n, info.qtype) for n, info in g.tensors.items() if info.qtype in TILED and len(info.shape) == 2]
    names = [n for q in TILED for n in [n for n, t in matrices if t == q][:2]]  # two of each tiled format it has
    assert {g.tensors[n].qtype for n in names} == {Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K}
    for name in names:
        plain = ops.Weight.from_gguf(g, name)
        tiled_w = ops.Weight.from_gguf(g, name, tile=True)
        assert tiled_w.tiled and tiled_w.kernel_type >= tiled.TILED_BASE and tiled_w.qtype == plain.qtype
        assert tiled_w.nbytes == plain.nbytes
        ids = np.array([0, 5, plain.rows - 1])
        assert np.array_equal(ops.embed(tiled_w, ids), ops.embed(plain, ids))
        x = np.random.default_rng(0).standard_normal((3, plain.cols)).astype(np.float32)
        want, got = ops.matmul(plain, x), ops.matmul(tiled_w, x)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), name
    # a group of tiled weights (gate and up: both Q5_0 in this file) runs as one call, bitwise the weights one by one
    group = [ops.Weight.from_gguf(g, f"blk.0.ffn_{m}.weight", tile=True) for m in ("gate", "up")]
    fused = ops.WeightGroup(group)
    assert fused._many is not None and group[0].kernel_type == group[1].kernel_type
    x = np.random.default_rng(1).standard_normal((5, group[0].cols)).astype(np.float32)
    for a, b in zip(fused(x), [ops.matmul(w, x) for w in group]):
        assert np.array_equal(a, b)


def test_weights_that_do_not_fill_whole_tiles_keep_the_file_layout():
    assert not tiled.can_tile(Q.Q8_0, 24)
    assert not tiled.can_tile(Q.Q4_K, 40)
    assert not tiled.can_tile(Q.Q2_K, 64)  # no tiled kernel: the file's layout
    raw = random_weights(Q.Q8_0, 24, 64, np.random.default_rng(0))
    with pytest.raises(ValueError, match="cannot be tiled"):
        ops.Weight(raw, Q.Q8_0, tiled=True)
