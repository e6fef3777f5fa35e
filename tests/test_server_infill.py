"""Fill-in-the-middle over the REST port: llama.cpp's /infill prompt layout (with qwen2.5-coder's repo-level
tokens) and a real completion that makes a Python file valid."""

from __future__ import annotations

import ast
from types import SimpleNamespace

import httpx
import pytest
from conftest import model_file
from test_server import start_server, stop_server

from localllm.errors import LocalLLMError
from localllm.server.infill import IndentCut, infill_tokens
from localllm.tokenizer import Tokenizer

CODER = "qwen2.5-coder-0.5b-instruct"


def stand_in_engine(name: str, ctx: int = 4096):
    return SimpleNamespace(tokenizer=Tokenizer.from_file(model_file(name)), ctx=ctx, name=name)


def test_infill_layout_is_llamacpps_repo_level_pattern_with_the_typed_line_after_the_middle_token():
    engine = stand_in_engine(CODER)
    tok = engine.tokenizer
    fim = tok.fim
    assert {"pre", "suf", "mid", "rep", "sep"} <= set(fim)
    ids = infill_tokens(engine, "def f():\n    ", "\nprint(f())\n", extra=[{"filename": "a.py", "text": "X = 1\n"}],
                        n_predict=32)
    text = tok.decode(ids)
    assert text == ("<|repo_name|>myproject\n<|file_sep|>a.py\nX = 1\n<|file_sep|>filename\n"
                    "<|fim_prefix|>def f():\n    <|fim_suffix|>\nprint(f())\n<|fim_middle|>")
    # The text typed so far on the cursor's line starts the middle: a keystroke only extends the prompt's end.
    typed = infill_tokens(engine, "def f():\n", "\nprint(f())\n", "    ret", n_predict=32)
    assert tok.decode(typed) == ("<|repo_name|>myproject\n<|file_sep|>filename\n<|fim_prefix|>def f():\n"
                                 "<|fim_suffix|>\nprint(f())\n<|fim_middle|>    ret")
    more = infill_tokens(engine, "def f():\n", "\nprint(f())\n", "    retu", n_predict=32)
    first_change = next((i for i, (a, b) in enumerate(zip(typed, more)) if a != b), len(typed))
    assert first_change > typed.index(fim["mid"])
    # The prefix keeps its end and the suffix its start when they do not fit (3:1 of the batch).
    small = stand_in_engine(CODER, ctx=64)
    ids = infill_tokens(small, "x = 1\n" * 100, "y = 2\n" * 100)
    assert ids[-1] == fim["mid"] and len(ids) < 64
    assert tok.decode(ids[ids.index(fim["pre"]) + 1 : ids.index(fim["suf"])]).endswith("x = 1\n")


def test_infill_needs_fim_tokens():
    with pytest.raises(LocalLLMError, match="fill-in-the-middle"):
        infill_tokens(stand_in_engine("smollm2-135m-instruct"), "a", "b")


def test_indent_cut_stops_when_a_line_leaves_the_block():
    cut = IndentCut(4)
    out = []
    for piece in ["return a", " + b\n", "\n", "    \n", "print", "(x)"]:
        text, stop = cut.feed(piece)
        out.append(text)
        if stop:
            break
    assert stop and "".join(out) == "return a + b\n\n    \n"
    cut = IndentCut(4)
    assert [cut.feed(p)[1] for p in ["x\n    y\n", "        z\n", "    w"]] == [False, False, False]


@pytest.fixture(scope="module")
def coder_server():
    model_file(CODER)
    proc, url = start_server(CODER, "--ctx", "2048", "--max-tokens", "64")
    yield url
    stop_server(proc)


def test_infill_completes_a_python_file(coder_server):
    prefix = "def add(a, b):\n    "
    suffix = "\n\n\nprint(add(1, 2))\n"
    r = httpx.post(coder_server + "/infill", timeout=120, json={
        "input_prefix": prefix, "input_suffix": suffix, "temperature": 0, "n_predict": 48, "n_indent": 4,
        "input_extra": [{"filename": "README.md", "text": "add(a, b) returns the sum of a and b.\n"}]})
    assert r.status_code == 200, r.text
    middle = r.json()["content"]
    assert "return" in middle
    ast.parse(prefix + middle + suffix)


def test_ollama_generate_with_suffix_fills_in_the_middle(coder_server):
    import ollama

    out = ollama.Client(host=coder_server).generate(model=CODER, prompt="def add(a, b):\n    ",
                                                    suffix="\n\nprint(add(1, 2))\n",
                                                    options={"temperature": 0, "num_predict": 8})
    assert "return a + b" in out.response
