"""The compiled attention kernel over the paged KV cache, against the numpy reference (kernels/reference.py)."""

from __future__ import annotations

import numpy as np
import pytest

from localllm.kernels import ops, reference
from localllm import backends
from localllm.backends.cpu_backend import CpuKVStorage
from localllm.runtime.kv_cache import BLOCK, KVPool


# The CPU backend's KV storage (a pool is always made for a backend's storage)
CPU_KV = backends.get("cpu").kv_storage()


def cpu_pool(*args, **kwargs) -> KVPool:
    return KVPool(*args, storage=CPU_KV, **kwargs)

N_KV, GROUP, D = 2, 3, 64


def filled_cache(pool: KVPool, rng, n_tokens: int, interleave_with=None):
    """A cache holding n_tokens random keys/values in layer 0; with `interleave_with`, another cache takes a
    block between each of ours, so our block table is scattered (the paged layout)."""
    cache = pool.new_cache(4096)
    for start in range(0, n_tokens, BLOCK):
        n = min(BLOCK, n_tokens - start)
        cache.reserve(n)
        cache.write(0, rng.standard_normal((n, N_KV, D)).astype(np.float32),
                    rng.standard_normal((n, N_KV, D)).astype(np.float32))
        cache.commit()
        if interleave_with is not None:
            interleave_with.reserve(BLOCK)
            interleave_with.commit()
    return cache


def kernel_attention(cache, q, positions, window=0, softcap=0.0):
    cache.reserve(0)  # refresh the kernel's block tables, as a forward does
    return ops.attention(q, CpuKVStorage.attention_inputs(cache, 0), positions, cache.start(0), window, 1 / np.sqrt(D), softcap)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (40, 0.0), (40, 0.5)])
def test_kernel_matches_numpy_reference(paged, window, softcap):
    rng = np.random.default_rng(1)
    pool = cpu_pool(1, N_KV, D, D)
    other = pool.new_cache(4096) if paged else None
    cache = filled_cache(pool, rng, 100, interleave_with=other)
    assert cache.contiguous != paged
    n = 7  # the last 7 cached tokens are the queries (their keys were written, as in a forward)
    positions = np.arange(100 - n, 100)
    q = rng.standard_normal((n, N_KV * GROUP, D)).astype(np.float32)
    want = reference.attention(q, cache.keys(0), cache.values(0), positions, 1 / np.sqrt(D), window,
                               softcap=softcap)
    np.testing.assert_allclose(kernel_attention(cache, q, positions, window, softcap), want, rtol=1e-4, atol=1e-5)


def test_each_query_is_bitwise_independent_of_the_others():
    """Batch invariance: n queries at once give bitwise what each gives alone (prompt chunks, speculative
    verification and server batches all rely on it), also above the threading threshold."""
    rng = np.random.default_rng(2)
    pool = cpu_pool(1, N_KV, D, D)
    cache = filled_cache(pool, rng, 600)
    positions = np.arange(600 - 64, 600)
    q = rng.standard_normal((64, N_KV * GROUP, D)).astype(np.float32)
    together = kernel_attention(cache, q, positions)
    for i in (0, 17, 63):
        alone = kernel_attention(cache, np.ascontiguousarray(q[i : i + 1]), positions[i : i + 1])
        assert np.array_equal(alone[0].view(np.uint32), together[i].view(np.uint32))


def test_q8_0_cache_is_close_to_float32_and_smaller():
    rng = np.random.default_rng(3)
    exact, small = cpu_pool(1, N_KV, D, D), cpu_pool(1, N_KV, D, D, kv_type="q8_0")
    a = filled_cache(exact, np.random.default_rng(4), 80)
    b = filled_cache(small, np.random.default_rng(4), 80)
    assert small.nbytes * 3.5 < exact.nbytes  # int8 plus a float32 scale per 32 values: 36 bytes vs 128
    # Stored values are within half a quantization step of the originals.
    step = np.abs(a.keys(0)).reshape(N_KV, 80, D // 32, 32).max(-1, keepdims=True) / 127
    assert np.all(np.abs(b.keys(0) - a.keys(0)).reshape(N_KV, 80, D // 32, 32) <= step / 2 + 1e-6)
    positions = np.arange(75, 80)
    q = rng.standard_normal((5, N_KV * GROUP, D)).astype(np.float32)
    np.testing.assert_allclose(kernel_attention(b, q, positions), kernel_attention(a, q, positions), atol=0.03)
    # What attention reads from a q8_0 cache is exactly what keys()/values() dequantize.
    want = reference.attention(q, b.keys(0), b.values(0), positions, 1 / np.sqrt(D), 0)
    np.testing.assert_allclose(kernel_attention(b, q, positions), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [0, 100])
def test_a_q8_0_cache_attends_bit_for_bit_as_a_float32_cache_holding_its_dequantized_values(window):
    """The AVX2/AVX-512 kernel reads a q8_0 cache a tile at a time into float32 (int8 * scale, as keys() and
    values() give it) and runs the float32 operations on that: a prompt chunk, one row at a time (decode) and
    every thread count agree to the bit with the float32 kernel over a cache holding those values, on a paged
    cache with one and with three query heads per KV head."""
    from localllm.kernels.cpu import attention as kernel

    if not kernel.HAVE_AVX2:
        pytest.skip("the tiled q8_0 path is the AVX2 kernel's")
    for group in (1, 3):
        rng = np.random.default_rng(5)
        small = cpu_pool(1, N_KV, D, D, kv_type="q8_0")
        b = filled_cache(small, rng, 300, interleave_with=small.new_cache(4096))
        exact = cpu_pool(1, N_KV, D, D)
        a = exact.new_cache(4096)
        keys, values = b.keys(0), b.values(0)  # (n_kv, n, d), dequantized
        for start in range(0, 300, BLOCK):
            a.reserve(BLOCK)
            a.write(0, np.ascontiguousarray(keys[:, start:start + BLOCK].transpose(1, 0, 2)),
                    np.ascontiguousarray(values[:, start:start + BLOCK].transpose(1, 0, 2)))
            a.commit()
        positions = np.arange(300 - 40, 300)
        q = rng.standard_normal((40, N_KV * group, D)).astype(np.float32)
        scale, cap = np.float32(1 / np.sqrt(D)), np.float32(0)
        want = np.zeros((40, N_KV * group * D), np.float32)
        got = {}
        for name, cache in (("f32", a), ("q8_0", b)):
            cache.reserve(0)
            inputs = CpuKVStorage.attention_inputs(cache, 0)
            scores, acc = np.empty(300, np.float32), np.empty(D, np.float32)
            for chunks in (1, 2, 5):
                out = np.zeros_like(want)
                for c in range(chunks):
                    kernel._attend_items(c, chunks, q, *inputs, positions, 0, window, scale, cap, out, scores, acc)
                got[name, chunks] = out
            alone = np.zeros_like(want)
            for i in range(40):
                for c in range(2):
                    kernel._attend_items(c, 2, q[i:i + 1], *inputs, positions[i:i + 1], 0, window, scale, cap,
                                         alone[i:i + 1], scores, acc)
            got[name, "alone"] = alone
        ref = got["f32", 1]
        for key, out in got.items():
            assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), (group, key)


def test_unknown_kv_type_is_a_clear_error():
    with pytest.raises(ValueError, match="q8_0"):
        cpu_pool(1, N_KV, D, D, kv_type="q4")


def test_softmax_exponential_is_within_a_few_ulp_of_libm():
    from localllm.kernels.cpu.attention import _softmax_weights

    x = np.concatenate([-np.geomspace(1e-8, 86, 4000), [0.0]]).astype(np.float32)
    scores = x.copy()
    total = _softmax_weights(scores, len(scores), np.float32(0.0))
    want = np.exp(x.astype(np.float64))
    np.testing.assert_allclose(scores, want, rtol=3e-7)
    assert abs(total - want.sum()) < 1e-5 * want.sum()


@pytest.mark.parametrize("window, softcap", [(0, 0.0), (100, 0.0), (100, 0.5)])
def test_row_block_group_and_per_head_items_agree_bit_for_bit(window, softcap):
    """Several query rows (prompt chunks, speculative verifies) take (row block, KV head) items, reading each
    tile of keys once for all the block's rows and heads; one row (decode) takes (its one-row block, KV head)
    items, or (query, head) items where one KV head would leave a thread idle. A token's output must not depend
    on which: all agree to the bit, with gemma2's soft-capped scores too (a cap of 0.5 changes every score of
    these unit-variance queries)."""
    from localllm.kernels.cpu import attention as kernel

    if not kernel.HAVE_AVX2:
        pytest.skip("the grouped items are the AVX2 kernel's")
    rng = np.random.default_rng(3)
    pool = cpu_pool(1, N_KV, D, D)
    cache = filled_cache(pool, rng, 700, interleave_with=pool.new_cache(4096))
    cache.reserve(0)
    k, ks, v, vs, table, first_block = CpuKVStorage.attention_inputs(cache, 0)
    positions = np.arange(700 - 40, 700)
    q = rng.standard_normal((40, N_KV * GROUP, D)).astype(np.float32)
    scale, cap = np.float32(1 / np.sqrt(D)), np.float32(softcap)
    scores = np.empty(700, np.float32)
    acc = np.empty(D, np.float32)
    outs = []
    for chunks in (1, 3, 40 * N_KV * GROUP):  # blocks of 8 rows; blocks of 3-4 rows; a row per block
        out = np.zeros((40, N_KV * GROUP * D), np.float32)
        for c in range(chunks):
            kernel._attend_items(c, chunks, q, k, ks, v, vs, table, first_block, positions, 0, window, scale, cap,
                                 out, scores, acc)
        outs.append(out)
    alone = np.zeros((40, N_KV * GROUP * D), np.float32)  # each row by itself: (query, KV head) items
    for i in range(40):
        kernel._attend_items(0, 1, q[i:i + 1], k, ks, v, vs, table, first_block, positions[i:i + 1], 0, window,
                             scale, cap, alone[i:i + 1], scores, acc)
    for chunks in (1, 3):  # (query, head) items only: a cold start's kernel (fused_forward.compiled)
        out = np.zeros((40, N_KV * GROUP * D), np.float32)
        for c in range(chunks):
            kernel._attend_items_per_head(c, chunks, q, k, ks, v, vs, table, first_block, positions, 0, window,
                                          scale, cap, out, scores, acc)
        outs.append(out)
    per_head = np.zeros((40, N_KV * GROUP * D), np.float32)  # (query, head) items
    for i in range(40):
        lo = max(0, positions[i] - window + 1) if window else 0
        for h in range(N_KV * GROUP):
            kernel._one_query_avx2(q, i, h, h // GROUP, k, v, table, first_block, lo, positions[i], scale, cap,
                                   scores, per_head)
    for got in outs + [alone]:
        assert np.array_equal(got.view(np.uint32), per_head.view(np.uint32))
    want = reference.attention(q, cache.keys(0), cache.values(0), positions, 1 / np.sqrt(D), window,
                               softcap=softcap)
    np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=1e-5)
    if softcap:
        uncapped = reference.attention(q, cache.keys(0), cache.values(0), positions, 1 / np.sqrt(D), window)
        assert not np.allclose(outs[0], uncapped, rtol=1e-2, atol=1e-3)


def test_vector_softmax_exponentials_are_the_scalar_one_bit_for_bit():
    """The softmax's exponentials, 8 (AVX2) and 16 (AVX-512) at a time in vector registers, against the scalar
    function of the loops' tails and the portable kernel: float32 scores minus a float32 maximum, the same
    float32 operations in every lane, whatever the lane count."""
    from numba import njit

    from localllm.kernels.cpu import attention as kernel

    if not kernel.HAVE_AVX2:
        pytest.skip("an AVX2 kernel")

    @njit
    def both(scores, m, out_8, out_16, out_scalar):
        a, b, c = kernel.address_of(scores), kernel.address_of(out_8), kernel.address_of(out_16)
        for j in range(0, scores.shape[0], 8):
            kernel.storeu_ps(b + 4 * j, kernel.exp_nonpositive_8(kernel.loadu_ps(a + 4 * j), m))
        if kernel.HAVE_AVX512:
            for j in range(0, scores.shape[0], 16):
                kernel.storeu_ps_512(c + 4 * j, kernel.exp_nonpositive_16(kernel.loadu_ps_512(a + 4 * j), m))
        for j in range(scores.shape[0]):
            out_scalar[j] = kernel._exp_nonpositive(scores[j] - m)

    rng = np.random.default_rng(4)
    for m in (0.0, 3.5, 17.123, -2.25):
        m = np.float32(m)
        scores = (m - np.abs(rng.standard_normal(1 << 14)) * rng.choice([0.01, 1, 10, 100], 1 << 14))
        scores = np.concatenate([scores, [m, m - 86.9, m - 87.1, m - 200]]).astype(np.float32)
        scores = np.resize(scores, (len(scores) + 15) // 16 * 16)
        v8, v16, scalar = np.empty_like(scores), np.empty_like(scores), np.empty_like(scores)
        both(scores, m, v8, v16, scalar)
        assert np.array_equal(v8.view(np.uint32), scalar.view(np.uint32))
        if kernel.HAVE_AVX512:
            assert np.array_equal(v16.view(np.uint32), scalar.view(np.uint32))
        x = (scores - m).astype(np.float64)  # the float32 difference the kernels take the exponential of
        np.testing.assert_allclose(scalar[x >= -87], np.exp(x[x >= -87]), rtol=3e-7)


def test_vectorized_score_maximum_is_the_array_maximum_including_nan_and_infinity():
    """The softmax's maximum over a row of scores, taken in vector chains, is the array method's, at every
    length around the chains' widths, and where a NaN or an infinity sits in the row (left to the array method)."""
    from numba import njit

    from localllm.kernels.cpu import attention as kernel

    @njit
    def both(row, n):
        return kernel._max_of(row, n), row[:n].max()

    rng = np.random.default_rng(4)
    for n in (1, 7, 31, 32, 33, 40, 63, 64, 65, 1100):
        row = rng.standard_normal(n + 3).astype(np.float32) * 10
        got, want = both(row, n)
        assert got == want, n
        for special in (np.nan, np.inf, -np.inf):
            odd = row.copy()
            odd[n // 2] = special
            got, want = both(odd, n)
            assert (np.isnan(got) and np.isnan(want)) or got == want, (n, special)
