"""The model's forward is written once against the backend interface (localllm/backends/interface.py): it touches
activations only through a backend's operations, so a backend with tensors of its own runs every architecture,
and on the CPU it computes bitwise what it computed before the interface existed (the fused forward's tests,
tests/test_fused_forward.py, tie the CPU's override to it)."""

from __future__ import annotations

import ast
from collections import Counter
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from conftest import english_tokens, model_file, parse_python
from localllm import backends
from localllm.architectures import load_model_config
from localllm.architectures.transformer import Transformer
from localllm.backends.interface import OPS, Backend
from localllm.gguf_file import GGUFFile
from localllm.tokenizer.core import Tokenizer

# smollm2: llama; qwen2.5: Q/K/V biases; gemma3: embedding scale, Q/K norms, post norms, sliding windows.
MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma3-270m")


class Box:
    """A tensor numpy cannot see into: no __array__, no arithmetic. Model code that computed on an activation
    itself, instead of asking its backend, would raise here."""

    __slots__ = ("a",)

    def __init__(self, a):
        self.a = a


def _unbox(v):
    if isinstance(v, Box):
        return v.a
    if isinstance(v, (list, tuple)):
        return type(v)(_unbox(x) for x in v)
    return v


def _box(v):
    if isinstance(v, np.ndarray):
        return Box(v)
    if isinstance(v, list):
        return [_box(x) for x in v]
    return v


def _delegate(name):
    def method(self, *args, **kwargs):
        self.calls[name] += 1
        result = getattr(self.cpu, name)(*_unbox(args), **{k: _unbox(v) for k, v in kwargs.items()})
        return result if name == "to_host" else _box(result)

    return method


# A backend whose tensors are Boxes around the CPU backend's arrays, counting the calls; no whole-forward override.
BoxBackend = type("BoxBackend", (Backend,), {
    "name": "box", **{name: _delegate(name) for name in (*OPS, "matrix", "vector", "group", "experts", "to_host",
                                                         "kv_storage")},
    "__init__": lambda self: (setattr(self, "cpu", backends.get("cpu")), setattr(self, "calls", Counter()))[0],
})


@cache
def models(name: str):
    g = GGUFFile(model_file(name))
    config = load_model_config(g)
    cpu = Transformer(g, config)
    cpu.fused = None  # the op-by-op forward on the CPU backend
    return g, config, cpu, Transformer(g, config, backend=BoxBackend())


def run(model, config, segments_tokens, observe=None):
    """Two steps of a batch of sequences: each sequence's prompt, then 3 more tokens each (logits for all)."""
    pool = model.new_pool()
    caches = [pool.new_cache(256) for _ in segments_tokens]
    first = model.forward_batch([(t[:-3], c, None) for t, c in zip(segments_tokens, caches)], observe=observe)
    second = model.forward_batch([(t[-3:], c, np.arange(3)) for t, c in zip(segments_tokens, caches)],
                                 observe=observe)
    return first + second


@pytest.mark.parametrize("name", MODELS)
def test_the_forward_reaches_activations_only_through_its_backend_and_matches_the_cpu_bitwise(name):
    g, config, cpu, boxed = models(name)
    tok = Tokenizer.from_metadata(g.metadata)
    seqs = [english_tokens(tok, 19, seed=3), english_tokens(tok, 7, seed=4)]
    for batch in ([seqs[0]], seqs):  # one sequence, and a batch of two (per-sequence attention and KV writes)
        want = run(cpu, config, batch)
        got = run(boxed, config, batch)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert isinstance(a, np.ndarray) and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    calls = boxed.backend.calls
    for op in ("embed", "group_matmul", "matmul", "rms_norm", "rope", "gated_activation", "kv_write", "attention",
               "add", "rows", "to_host"):
        assert calls[op] > 0, op
    assert calls["to_host"] == 4  # only the logits of each forward leave the backend (one per call)
    if config.traits.scale_embeddings:
        assert calls["scale"] == 4
    if name.startswith("qwen"):
        assert calls["add_bias"] == 4 * 3 * config.n_layers


def test_an_observed_forward_sees_host_arrays_from_any_backend():
    # imatrix observes each product's input: the hook gets host arrays, the same as the CPU backend's
    _, config, cpu, boxed = models("smollm2-135m-instruct")
    seen = {"cpu": [], "box": []}
    tokens = list(range(100, 120))
    run(cpu, config, [tokens], observe=lambda names, x: seen["cpu"].append((names, x.copy())))
    run(boxed, config, [tokens], observe=lambda names, x: seen["box"].append((names, x.copy())))
    assert len(seen["box"]) == len(seen["cpu"]) == 2 * (4 * config.n_layers + 1)
    for (na, a), (nb, b) in zip(seen["box"], seen["cpu"]):
        assert na == nb and type(a) is np.ndarray and np.array_equal(a, b)


def test_only_the_backends_import_the_cpu_kernels_and_numba():
    root = Path(__file__).resolve().parent.parent
    offenders = {}
    for path in sorted((root / "localllm").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("localllm/backends/", "localllm/kernels/")):
            continue
        for node in ast.walk(parse_python(path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module
                     else [])
            for n in names:
                if n.startswith(("numba", "localllm.kernels.cpu", "localllm.kernels.ops")):
                    offenders.setdefault(rel, set()).add(n)
    assert offenders == {}  # the tools that run the CPU's kernels on the host take them from backends.host_kernels
