"""Shared fixtures: test data paths and the real catalog models (pulled by `make test-models`)."""

from __future__ import annotations

import importlib.util
import json
import os
from functools import cache
from pathlib import Path

import pytest

from localllm.paths import models_dir

DATA = Path(__file__).parent / "data"
VOCAB_DIR = DATA / "vocab"
REFERENCE_DIR = DATA / "llamacpp"

# catalog name -> reference file stem in tests/data/llamacpp
REFERENCE_FILES = {
    "smollm2-135m-instruct": "smollm2-135m-instruct-q4_1_shared.json",
    "gemma3-270m": "gemma3-270m-q4_k_m_shared.json",
    "qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b-instruct-q4_k_m_shared.json",
    "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-1.5b-instruct-q4_k_m_shared.json",
}
CATALOG_MODELS = list(REFERENCE_FILES)


def model_file(name: str) -> Path:
    """Path of a pulled catalog model. A missing model is a failure, not a skip: `make test` pulls them."""
    path = models_dir() / f"{name}.gguf"
    if not path.exists():
        pytest.fail(f"test model {name} is not pulled ({path} missing): run `make test-models`")
    return path


def reference_cases(name: str) -> list[dict]:
    return json.loads((REFERENCE_DIR / REFERENCE_FILES[name]).read_text())["cases"]


def english_tokens(tokenizer, n: int, seed: int) -> list[int]:
    """n tokens of ordinary English (a shuffled, repeated word list): varied but plain text, so continuations
    are seldom near-ties, and the same for a given seed."""
    import numpy as np

    words = "the river ran past an old mill where a miller kept bread and grain for every family in town".split()
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < n:
        out += tokenizer.encode(" " + " ".join(rng.permutation(words)) + ".", add_special=False)
    return out[:n]


# ---- the OpenCL device the tests run on ----------------------------------------------------------------------

POCL_SPEC = "Portable Computing Language:"
INTEL_CPU_PLATFORM = "Intel(R) OpenCL"  # Intel's CPU runtime; its GPU driver's platform is "Intel(R) OpenCL Graphics"
POCL_INSTALLED = importlib.util.find_spec("pocl_binary_distribution") is not None
# The one PoCL failure that is the machine's, not ours: PoCL 3.0 (the newest wheel) links LLVM 14, which does not
# know CPUs newer than it (AMD family 1Ah, Zen 5) and fails every build there, listing its device all the same.
POCL_UNKNOWN_CPU = "unknown target CPU"


@cache
def intel_cpu_spec() -> str | None:
    """The spec of Intel's CPU runtime's device where pyopencl lists it (`make setup-dev` registers the installed
    intel-opencl-rt), else None."""
    try:
        from localllm.kernels.opencl import device as cl_device

        found = [i for i in cl_device.list_devices() if i.platform == INTEL_CPU_PLATFORM and i.type == "CPU"]
    except Exception:  # no pyopencl, no runtime
        return None
    return found[0].spec if found else None


@cache
def pocl_problem() -> str | None:
    """Why PoCL cannot build kernels on this machine (None: it can, or it is not installed)."""
    if not POCL_INSTALLED:
        return None
    from localllm.kernels.opencl.device import compiler_problem

    return compiler_problem(POCL_SPEC)


@cache
def opencl_test_spec() -> str | None:
    """The device spec the OpenCL tests run on: LOCALLLM_TEST_OPENCL where set; else PoCL (installed with the
    project on Linux x86_64); where PoCL's compiler does not know this CPU, Intel's CPU runtime (a dev dependency),
    so the tests still run every kernel on a real OpenCL compiler (the header of the run says so); None: the
    preferred device (no PoCL wheel for this platform)."""
    if os.environ.get("LOCALLLM_TEST_OPENCL"):
        return os.environ["LOCALLLM_TEST_OPENCL"]
    if not POCL_INSTALLED:
        return None
    problem = pocl_problem()
    if problem and POCL_UNKNOWN_CPU in problem and intel_cpu_spec():
        return intel_cpu_spec()
    return POCL_SPEC  # PoCL works, or fails for a reason of ours: the tests on it say why


def pytest_report_header(config):
    if not POCL_INSTALLED or os.environ.get("LOCALLLM_TEST_OPENCL"):
        return None
    try:
        spec = opencl_test_spec()
    except Exception as err:  # pragma: no cover - no pyopencl at all
        return f"OpenCL tests: no device ({err})"
    if spec == POCL_SPEC:
        return "OpenCL tests on PoCL"
    return f"OpenCL tests on {spec}: PoCL cannot compile for this CPU ({pocl_problem()})"


def parse_python(path: Path):
    """ast.parse of a source file, for the tests that read the project's imports. CPython 3.11 keeps the AST
    builder's recursion depth in state its threads share: a parse while a thread left over from another test (a
    test worker runs many files) builds an AST of its own can fail with SystemError "AST constructor recursion
    depth mismatch" (seen once in `make test`'s two workers). That is the interpreter's race, not the file's:
    parse again; a real syntax error is a SyntaxError and is raised at once."""
    import ast

    source = path.read_text(encoding="utf-8")
    for attempt in range(5):
        try:
            return ast.parse(source, str(path))
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == 4:
                raise
