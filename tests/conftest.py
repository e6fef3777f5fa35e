"""Shared fixtures: test data paths and the real catalog models (pulled by `make test-models`)."""

from __future__ import annotations

import json
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
