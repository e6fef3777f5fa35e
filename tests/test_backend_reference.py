"""The backend seam as a table of ops (localllm/backends/interface.py `OPS`): a backend says which ops it runs on
kernels of its own (`supports(op, formats)`), and every op it does not is run by the numpy reference through the
host. A backend with no ops of its own (the reference backend) runs a whole model; a backend missing one op runs
with that op alone on the host; the CPU and OpenCL backends run every op of the table themselves."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from localllm import backends
from localllm.architectures import load_model_config
from localllm.architectures.transformer import Transformer
from localllm.backends.cpu_backend import CpuBackend
from localllm.backends.interface import OPS, Backend, HostMatrix
from localllm.backends.reference_backend import ReferenceBackend
from localllm.gguf_constants import GGMLQuantizationType as T
from localllm.gguf_file import GGUFFile
from localllm.kernels.formats import FORMATS


@cache
def tiny(case: str) -> GGUFFile:
    """A tiny checkpoint of tests/data/arch converted to F32 (test_architectures.py's fixtures)."""
    from test_architectures import converted

    return GGUFFile(converted(case, "f32"))


def two_steps(model, tokens):
    """The prompt (logits of every position), then 3 more tokens (logits of each): prefill and decode."""
    cache_ = model.new_pool().new_cache(256)
    first = model.forward(tokens[:-3], cache_, output_rows=np.arange(len(tokens) - 3))
    return np.concatenate([first, model.forward(tokens[-3:], cache_, output_rows=np.arange(3))])


def test_the_reference_backend_runs_no_op_of_its_own_and_the_cpu_runs_every_op_on_every_format():
    ref, cpu = ReferenceBackend(), backends.get("cpu")
    assert not any(ref.supports(op) for op in OPS)
    assert all(cpu.supports(op) for op in OPS)
    assert cpu.supports("matmul", tuple(FORMATS)) and cpu.supports("embed", (T.Q4_K, T.Q6_K))
    with pytest.raises(KeyError):
        cpu.supports("no_such_op")


# llama3: the plain decoder; gemma2: soft-caps, post norms, sliding windows, GeGLU; phi3: fused Q/K/V and
# gate/up; qwen3moe: Q/K norms and a mixture of experts
@pytest.mark.parametrize("case", ["llama3", "gemma2", "phi3", "qwen3moe"])
def test_a_model_runs_on_the_reference_fallback_alone_and_agrees_with_the_cpu_backend(case):
    g = tiny(case)
    config = load_model_config(g)
    ref = Transformer(g, config, backend=ReferenceBackend())
    cpu = Transformer(g, config)
    assert ref.fused is None and all(isinstance(w, HostMatrix) for w in ref.weights())
    tokens = [5, 17, 200, 3, 99, 41, 7, 250, 12, 64, 1, 300]
    got, want = two_steps(ref, tokens), two_steps(cpu, tokens)
    assert got.shape == want.shape == (len(tokens), config.vocab_size)
    # float64 products on the host against the CPU's float32 ones (F32 weights): measured 1.6e-7 to 3.6e-7
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-5, rel
    assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))


class CpuWithoutTwoOps(CpuBackend):
    """The CPU backend as a backend being brought up: no rms_norm and no attention of its own."""

    name = "cpu-without-two-ops"
    rms_norm = Backend.rms_norm
    attention = Backend.attention


def test_an_op_a_backend_lacks_runs_on_the_host_reference_and_the_rest_on_its_kernels():
    g = tiny("gemma2")  # sliding windows and soft-capped scores through the host's attention
    config = load_model_config(g)
    partial = CpuWithoutTwoOps()
    assert not partial.supports("rms_norm") and not partial.supports("attention")
    assert partial.supports("matmul", (T.Q8_0,)) and partial.supports("rope")
    model = Transformer(g, config, backend=partial)
    cpu = Transformer(g, config)
    model.fused = cpu.fused = None  # both op by op (the fused forward has every op of its own)
    tokens = [5, 17, 200, 3, 99, 41, 7, 250, 12, 64, 1, 300] * 6  # past the window (48)
    got, want = two_steps(model, tokens), two_steps(cpu, tokens)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-5, rel
    assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))


def test_the_opencl_backend_runs_every_op_of_the_table_itself():
    from localllm.errors import LocalLLMError

    try:
        cl = backends.get("opencl")
    except LocalLLMError as e:
        pytest.skip(f"no OpenCL device here: {e}")  # CI installs PoCL: tests/test_backend_opencl.py needs it too
    assert all(cl.supports(op, tuple(FORMATS)) for op in OPS if op in ("matmul", "embed", "group_matmul"))
    assert all(cl.supports(op) for op in OPS)
    # Bringing up an op on a device: without its own rms_norm (a result the host gives back) and rope (in place:
    # the host's values written back), the forward agrees with the device's own ops.
    partial = object.__new__(type("OpenCLWithoutTwoOps", (type(cl),), {"rms_norm": Backend.rms_norm,
                                                                         "rope": Backend.rope}))
    partial.__dict__.update(cl.__dict__)  # the same device, queue and programs
    assert not partial.supports("rms_norm") and not partial.supports("rope") and partial.supports("attention")
    g = tiny("llama3")
    config = load_model_config(g)
    model, full = Transformer(g, config, backend=partial), Transformer(g, config, backend=cl)
    model.fused = full.fused = None
    tokens = [5, 17, 200, 3, 99, 41, 7, 250, 12, 64, 1, 300]
    got, want = two_steps(model, tokens), two_steps(full, tokens)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-5, rel
    assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))
