"""The command line as scripts and users meet it: --help everywhere, tokenize's JSON, clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import VOCAB_DIR
from localllm.cli import build_parser

COMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)


def localllm(*args):
    return subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    out = localllm(command, "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: localllm") and out.stderr == ""


def test_tokenize_json_on_a_vocab_only_file():
    # The first case of llama.cpp's qwen2 vocab test (tests/data/vocab/ggml-vocab-qwen2.gguf.inp/.out).
    out = localllm("tokenize", str(VOCAB_DIR / "ggml-vocab-qwen2.gguf"), "--text", "Hello world",
                   "--no-add-special", "--no-parse-special", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) == {"ids", "pieces"}
    assert result["ids"] == [9707, 1879]
    assert result["pieces"] == ["Hello", " world"]


def test_tokenize_parse_special_switch():
    path = str(VOCAB_DIR / "ggml-vocab-qwen2.gguf")
    special = json.loads(localllm("tokenize", path, "--text", "<|im_start|>", "--json").stdout)
    plain = json.loads(localllm("tokenize", path, "--text", "<|im_start|>", "--no-parse-special", "--json").stdout)
    assert len(special["ids"]) == 1 and len(plain["ids"]) > 1


def test_unknown_model_and_bad_arguments_fail_cleanly():
    out = localllm("show", "no-such-model")
    assert out.returncode == 1 and out.stderr.startswith("error: unknown model") and "Traceback" not in out.stderr
    out = localllm("run")
    assert out.returncode == 2 and "usage" in out.stderr
