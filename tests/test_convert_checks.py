"""`localllm convert` against hostile or inconsistent checkpoints (issue 39): config.json is checked against the
tensors before anything is sized by it, and what cannot be converted is refused in one clear line, never a
traceback, never an allocation the checkpoint's own size does not bound. Small checkpoints from tests/data/arch
(vocabulary 320, hidden size 64, 2 layers), changed in a temporary copy."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from convert_fixtures import write_safetensors

from localllm.cli.main import main as cli_main
from localllm.convert import convert
from localllm.convert.safetensors import SafetensorsFile
from localllm.errors import LocalLLMError

ARCH_DATA = Path(__file__).parent / "data" / "arch"


def copy(tmp_path: Path, case: str = "llama3", **changes) -> Path:
    src = shutil.copytree(ARCH_DATA / case, tmp_path / case,
                          ignore=shutil.ignore_patterns("reference.json", "reference.npz"))
    if changes:
        cfg = json.loads((src / "config.json").read_text())
        cfg.update(changes)
        (src / "config.json").write_text(json.dumps(cfg))
    return src


def refused(ckpt: Path, out: Path, *fragments: str) -> str:
    with pytest.raises(LocalLLMError) as e:
        convert(ckpt, out, "f32", progress=False)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, msg
    assert "Traceback" not in msg and "\n" not in msg
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()
    return msg


def tensors_of(ckpt: Path) -> dict[str, np.ndarray]:
    st = SafetensorsFile(ckpt / "model.safetensors")
    return {name: st.read(e).astype(np.float32) for name, e in st.tensors.items()}


# -- item 1: sizes come from the tensors, not from config.json ------------------------------------------------

def test_convert_refuses_a_vocab_size_larger_than_the_embedding(tmp_path):
    refused(copy(tmp_path, vocab_size=321), tmp_path / "o.gguf", "vocab_size", "321", "320 rows")


def test_convert_refuses_a_vocab_size_smaller_than_the_embedding(tmp_path):
    refused(copy(tmp_path, vocab_size=300), tmp_path / "o.gguf", "vocab_size", "300", "320 rows")


def test_convert_refuses_more_layers_than_the_checkpoint_holds(tmp_path):
    refused(copy(tmp_path, num_hidden_layers=3), tmp_path / "o.gguf", "num_hidden_layers", "layer 2 has none")


def test_convert_refuses_a_hidden_size_the_embedding_does_not_have(tmp_path):
    refused(copy(tmp_path, hidden_size=128), tmp_path / "o.gguf", "hidden_size", "128", "64 columns")


def test_convert_refuses_head_counts_the_attention_projections_do_not_have(tmp_path):
    refused(copy(tmp_path, num_attention_heads=4), tmp_path / "o.gguf", "q_proj", "4 heads")


@pytest.mark.parametrize("key,value", [("num_attention_heads", 0), ("num_key_value_heads", 0),
                                       ("num_hidden_layers", 0), ("vocab_size", -5)])
def test_convert_refuses_a_count_that_is_not_positive_naming_it(tmp_path, key, value):
    refused(copy(tmp_path, **{key: value}), tmp_path / "o.gguf", key, "positive integer")


@pytest.mark.parametrize("key", ["num_key_value_heads", "hidden_size", "vocab_size", "num_hidden_layers"])
def test_convert_refuses_a_null_count_naming_it(tmp_path, key):
    refused(copy(tmp_path, **{key: None}), tmp_path / "o.gguf", key, "None")


def test_convert_refuses_a_count_beyond_a_gguf_field(tmp_path):
    refused(copy(tmp_path, max_position_embeddings=2**40), tmp_path / "o.gguf", "max_position_embeddings")


def test_convert_refuses_a_rope_factor_that_is_not_a_number(tmp_path):
    refused(copy(tmp_path, rope_scaling={"rope_type": "linear", "factor": "two"}), tmp_path / "o.gguf",
            "rope_scaling.factor")


def test_a_config_bomb_is_refused_in_bounded_memory_and_one_line(tmp_path):
    """vocab_size 1e9 and num_hidden_layers 1e7 (the issue's bombs took 18.5 and 7 GB): refused by a CLI whose
    address space is capped at 3 GB, with one line on stderr."""
    code = ("import resource, sys\nresource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
            "from localllm.cli.main import main\nsys.exit(main(sys.argv[1:]))\n")
    for change in ({"vocab_size": 10**9}, {"num_hidden_layers": 10**7}):
        ckpt = copy(tmp_path / str(len(list(tmp_path.iterdir()))), **change)
        r = subprocess.run([sys.executable, "-c", code, "convert", str(ckpt), "-o", str(tmp_path / "o.gguf"), "-q"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 1, r.stderr
        assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
        assert next(iter(change)) in r.stderr


# -- item 6: what used to be a traceback ----------------------------------------------------------------------

def test_a_deeply_nested_config_json_is_a_clear_error(tmp_path):
    ckpt = copy(tmp_path)
    (ckpt / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(ckpt, tmp_path / "o.gguf", "config.json", "nested too deeply")


def test_a_deeply_nested_safetensors_header_is_a_clear_error(tmp_path):
    ckpt = copy(tmp_path)
    header = ("[" * 100_000 + "]" * 100_000).encode()
    (ckpt / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    refused(ckpt, tmp_path / "o.gguf", "model.safetensors", "nested too deeply")


@pytest.mark.parametrize("entry", [{"dtype": "F32", "shape": [-2, 4], "data_offsets": [0, 0]},
                                   {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]},
                                   {"dtype": "F32", "shape": [None], "data_offsets": [0, 4]},
                                   {"dtype": "Q9", "shape": [10**12, 10**12], "data_offsets": [0, 8]}])
def test_a_safetensors_entry_with_impossible_numbers_is_refused(tmp_path, entry):
    ckpt = copy(tmp_path)
    header = json.dumps({"model.embed_tokens.weight": entry}).encode()
    (ckpt / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    refused(ckpt, tmp_path / "o.gguf", "model.safetensors")


def test_a_malformed_tokenizer_value_is_one_line_on_the_cli(tmp_path, capsys):
    ckpt = copy(tmp_path)
    tj = json.loads((ckpt / "tokenizer.json").read_text())
    tj["model"]["merges"] = 5
    (ckpt / "tokenizer.json").write_text(json.dumps(tj))
    assert cli_main(["convert", str(ckpt), "-o", str(tmp_path / "o.gguf"), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1


# -- item 7: inconsistent checkpoints -------------------------------------------------------------------------

def test_convert_refuses_an_untied_checkpoint_without_lm_head(tmp_path):
    ckpt = copy(tmp_path)
    sd = tensors_of(ckpt)
    del sd["lm_head.weight"]
    write_safetensors(ckpt / "model.safetensors", sd, "F32")
    refused(ckpt, tmp_path / "o.gguf", "tie_word_embeddings", "lm_head.weight")


def test_a_gemma2_lm_head_equal_to_the_embedding_is_dropped_as_llama_cpp_does(tmp_path):
    ckpt = copy(tmp_path, "gemma2")
    sd = tensors_of(ckpt)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].copy()
    write_safetensors(ckpt / "model.safetensors", sd, "F32")
    out = Path(convert(ckpt, tmp_path / "o.gguf", "f32", progress=False)["output"])
    from localllm.gguf_file import GGUFFile

    with GGUFFile(out) as g:
        assert "output.weight" not in g.tensors and "token_embd.weight" in g.tensors


def test_a_gemma2_lm_head_that_differs_from_the_embedding_is_refused_with_the_reason(tmp_path):
    ckpt = copy(tmp_path, "gemma2")
    sd = tensors_of(ckpt)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] * 2
    write_safetensors(ckpt / "model.safetensors", sd, "F32")
    refused(ckpt, tmp_path / "o.gguf", "lm_head.weight", "differs from the token embedding")



def test_an_hf_source_under_offline_reads_only_the_cache(monkeypatch, tmp_path):
    import huggingface_hub

    from localllm.cli import convert_cmd as cli_convert

    seen = {}

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, **kw):
        seen.update(kw)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setenv("LOCALLLM_OFFLINE", "1")
    cli_convert.resolve_source("hf://owner/repo", quiet=True)
    assert seen == {"local_files_only": True}
