"""The compiled RMSNorm and RoPE kernels against their numpy references (kernels/reference.py)."""

from __future__ import annotations

import numpy as np
import pytest

from localllm.kernels import ops, reference


@pytest.mark.parametrize("shape", [(1, 576), (7, 640), (3, 4, 256)])
def test_rms_norm_matches_reference(shape):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    got = ops.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, reference.rms_norm(x, w, 1e-6), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("rope_dim", [64, 32])
def test_rope_matches_reference_and_leaves_unrotated_dims(neox, rope_dim):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3, 64)).astype(np.float32)
    angles = rng.uniform(0, 50, (5, rope_dim // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    expected = reference.rope(x, cos, sin, rope_dim, neox)
    ops.rope(x, cos, sin, rope_dim, neox)
    np.testing.assert_allclose(x, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(x[..., rope_dim:], expected[..., rope_dim:])


def test_rope_preserves_norms_of_rotated_pairs():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 1, 8)).astype(np.float32)
    before = np.hypot(x[..., :4], x[..., 4:])
    angles = rng.uniform(0, 6, (2, 4))
    ops.rope(x, np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32), 8, True)
    np.testing.assert_allclose(np.hypot(x[..., :4], x[..., 4:]), before, rtol=1e-5)


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_gated_activation_matches_numpy(kind):
    from localllm.kernels import reference

    rng = np.random.default_rng(5)
    gate = (rng.standard_normal((3, 300)) * 4).astype(np.float32)
    up = rng.standard_normal((3, 300)).astype(np.float32)
    act = {"silu": reference.silu, "gelu_tanh": reference.gelu_tanh}[kind]
    np.testing.assert_allclose(ops.gated_activation(gate, up, kind), act(gate) * up, rtol=2e-6, atol=1e-6)


def test_exp_f32_is_within_one_ulp_of_exp_over_the_float32_range():
    # the activations' exp is plain arithmetic (vectorized); its error bound is what keeps them at numpy's accuracy
    from numba import njit

    from localllm.kernels.cpu.blocks import exp_f32

    @njit
    def each(x, out):
        for i in range(x.shape[0]):
            out[i] = exp_f32(x[i])

    x = np.concatenate([np.linspace(-87.0, 88.0, 400_001), [0.0, -0.0, 1e-30, -1e-30]]).astype(np.float32)
    out = np.empty_like(x)
    each(x, out)
    exact = np.exp(x.astype(np.float64))
    ulps = np.abs(out - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1.0
    assert out[-4] == 1.0 and out[-3] == 1.0


def test_activations_saturate_without_nan_for_huge_inputs():
    gate = np.array([[-1e30, -200.0, -90.0, 90.0, 200.0, 1e30, np.float32(3.4e38)]], np.float32)
    up = np.ones_like(gate)
    for kind in ("silu", "gelu_tanh"):
        out = ops.gated_activation(gate, up, kind)
        assert np.all(np.isfinite(out[0, :-1]))
        np.testing.assert_allclose(out[0, :3], 0.0, atol=1e-30)
        np.testing.assert_allclose(out[0, 3:6], gate[0, 3:6], rtol=1e-6)


def test_gated_activation_loop_is_vectorized():
    # np.exp/np.tanh kept it scalar (libm calls), and so did a division's ZeroDivisionError check: 14x slower
    from numba import njit

    from localllm.kernels.cpu import blocks

    options = {k: v for k, v in blocks.gated_activation_part.targetoptions.items() if k != "cache"}
    fresh = njit(**options)(blocks.gated_activation_part.py_func)  # its code and options, compiled here
    gate = np.ones((2, 64), np.float32)
    fresh(gate, gate, 0, np.empty_like(gate), 0, 2, 0, 64)
    asm = fresh.inspect_asm(fresh.signatures[0])
    assert "vdivps" in asm and "ZeroDivisionError" not in asm
