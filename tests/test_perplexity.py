"""Perplexity of GPL-3 at n_ctx 512 within 2% of llama.cpp's llama-perplexity (tests/data/perplexity.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import DATA, model_file
from localllm.cli.generate import perplexity
from localllm.runtime.engine import Engine

GPL3 = Path("/usr/share/common-licenses/GPL-3")
REFERENCE = json.loads((DATA / "perplexity.json").read_text())["ppl"]
# qwen2.5-coder-0.5b's figure is in perplexity.json too (`localllm perplexity` reproduces it); the test leaves it
# out for time (2 minutes of GPL-3 on 2 cores), as its forward is pinned against llama.cpp token by token
# (tests/test_reference_llamacpp.py) and its architecture (qwen2) by the golden conversion tests.
MODELS = {
    "smollm2-135m-instruct": "smollm2-135m-instruct-q4_1",
    "gemma3-270m": "gemma3-270m-q4_k_m",
}


@pytest.mark.parametrize("name", MODELS)
def test_perplexity_matches_llamacpp(name):
    ref = REFERENCE[MODELS[name]]
    result = perplexity(Engine(model_file(name), ctx=512), GPL3.read_text(), n_ctx=512)
    print(f"{name}: ppl {result['ppl']:.4f} (llama.cpp {ref['ppl']}) over {result['chunks']} chunks")
    assert result["chunks"] == ref["chunks"]
    assert abs(result["ppl"] / ref["ppl"] - 1) <= 0.02
