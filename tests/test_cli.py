"""The command line as scripts and users meet it: --help everywhere, tokenize's JSON, clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import VOCAB_DIR
from localllm.cli.main import build_parser

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


BAD_NUMBERS = [  # (arguments, the option named in the usage error)
    (["perplexity", "m", "f.txt", "-c", "0"], "argument -c: must be at least 3"),
    (["perplexity", "m", "f.txt", "-c", "2"], "argument -c: must be at least 3"),
    (["bench", "m", "-r", "0"], "argument -r: must be at least 1, not 0"),
    (["bench", "m", "-p", "-5"], "argument -p: must be at least 0"),
    (["bench", "m", "-t", "-1"], "argument -t/--threads: must be at least 1"),
    (["bench", "m", "--chat-turn", "-5"], "argument --chat-turn: must be at least 0"),
    (["run", "m", "x", "-n", "-2"], "argument -n/--max-tokens: must be at least -1"),
    (["run", "m", "x", "--keep", "-3"], "argument --keep: must be at least -1"),
    (["run", "m", "x", "--seed", "-1"], "argument --seed: must be at least 0"),
    (["run", "m", "x", "--draft-max", "0"], "argument --draft-max: must be in 1..32"),
    (["serve", "--parallel", "0"], "argument --parallel: must be at least 1"),
    (["serve", "--port", "70000"], "argument --port: must be in 0..65535"),
    (["bench-serve", "u", "--prompt-words", "0"], "argument --prompt-words: must be at least 1"),
    (["bench-serve", "u", "--slo-ttft", "nan"], "argument --slo-ttft: must be a number of seconds above 0"),
]


def test_out_of_range_counts_are_usage_errors_not_tracebacks(capsys):
    from localllm.cli.main import main
    from localllm.cli.generate import perplexity
    from localllm.errors import LocalLLMError

    for args, message in BAD_NUMBERS:
        with pytest.raises(SystemExit) as exit_:  # argparse's usage error, before any model is loaded
            main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err, (args, err)
    with pytest.raises(LocalLLMError, match="-c must be at least 3"):  # the library call refuses it too
        perplexity(None, "some text", n_ctx=2)


def test_the_command_lines_type_names_are_the_quantizer_and_converter_tables():
    # localllm/type_names.py keeps the parser off localllm.convert.quantize_gguf and localllm.convert
    from localllm import convert, type_names
    from localllm.convert import quantize_gguf as quantize

    assert tuple(quantize.FILE_TYPES) == type_names.FILE_TYPE_NAMES
    assert all(quantize.ALIASES[a] in quantize.FILE_TYPES for a in quantize.ALIASES)
    assert tuple(convert.OUTPUT_TYPES) == type_names.CONVERT_OUTPUT_TYPES
    assert convert.TYPE_CHOICES == ("auto", *convert.OUTPUT_TYPES, *convert.QUANTIZE_MIXES)


def test_the_argument_parser_imports_neither_the_quantizer_nor_the_converter():
    import subprocess
    import sys

    script = """
import sys
from localllm.cli import main as cli
cli.build_parser()
print(sorted(m for m in ("localllm.convert.quantize_gguf", "localllm.convert", "gguf", "yaml", "jinja2") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
