"""`localllm convert`: tiny checkpoints of each architecture (real configs and tokenizers, 2 layers) converted and
compared with what llama.cpp's convert_hf_to_gguf.py wrote for the same inputs (tests/data/convert/golden.json);
bad input refused clearly with nothing left at the output path."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from convert_fixtures import DATA, SOURCES, gguf_digest, make_tiny_checkpoint
from gguf import GGUFReader

from conftest import model_file
from localllm.cli.main import main as cli_main
from localllm.convert import convert
from localllm.errors import LocalLLMError

GOLDEN = json.loads((DATA / "golden.json").read_text())
ARCHS = list(SOURCES)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch -> a tiny checkpoint directory (built once per module)."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for arch in ARCHS:
        model_file(SOURCES[arch])
        out[arch] = make_tiny_checkpoint(arch, root / f"tiny-{arch}")
    return out


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {arch: Path(convert(tiny[arch], root / f"{arch}.gguf", "f32", progress=False)["output"])
            for arch in ARCHS}


@pytest.fixture(scope="module")
def digests(converted):
    return {arch: gguf_digest(path) for arch, path in converted.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_output_has_llama_cpp_keys_in_its_order(digests, arch):
    ours = digests[arch]["keys"]
    theirs = GOLDEN["models"][arch]["keys"]
    assert [k[0] for k in ours] == [k[0] for k in theirs]
    assert ours == theirs


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_output_has_llama_cpp_tensors_byte_for_byte(digests, arch):
    ours = digests[arch]["tensors"]
    theirs = GOLDEN["models"][arch]["tensors"]
    assert [t[0] for t in ours] == [t[0] for t in theirs]
    assert ours == theirs


def test_sharded_checkpoint_converts_like_llama_cpp_reads_shards(tiny, tmp_path):
    ckpt = make_tiny_checkpoint("llama", tmp_path / "sharded", shards=3)
    out = Path(convert(ckpt, tmp_path / "s.gguf", "f32", progress=False)["output"])
    single = {t[0]: t[1:] for t in GOLDEN["models"]["llama"]["tensors"]}
    ours = gguf_digest(out)["tensors"]
    assert {t[0]: t[1:] for t in ours} == single
    # llama.cpp reads shards in file-name order, each shard's tensors sorted by name
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    first_shard = sorted(set(index["weight_map"].values()))[0]
    n_first = sum(1 for f in index["weight_map"].values() if f == first_shard)
    from localllm.convert.checkpoint import open_checkpoint

    names = list(open_checkpoint(ckpt).tensors)
    assert all(index["weight_map"][n] == first_shard for n in names[:n_first])


def test_default_type_keeps_bf16_source_as_bf16(tiny, tmp_path):
    summary = convert(tiny["llama"], tmp_path / "a.gguf", progress=False)
    assert summary["type"] == "BF16"
    r = GGUFReader(summary["output"])
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == "BF16" and types["token_embd.weight"] == "BF16"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert int(r.fields["general.file_type"].contents()) == 32  # MOSTLY_BF16


def test_bf16_output_is_the_source_bits(tiny, tmp_path):
    from localllm.convert.safetensors import SafetensorsFile

    out = convert(tiny["llama"], tmp_path / "b.gguf", "bf16", progress=False)["output"]
    st = SafetensorsFile(tiny["llama"] / "model.safetensors")
    src = st.read(st.tensors["model.layers.0.mlp.up_proj.weight"]).view(np.uint32) >> 16
    t = next(t for t in GGUFReader(out).tensors if t.name == "blk.0.ffn_up.weight")
    assert np.array_equal(np.asarray(t.data).view(np.uint16).reshape(src.shape), src.astype(np.uint16))


def test_q8_0_output_quantizes_matrices_and_keeps_norms_f32(tiny, tmp_path):
    out = convert(tiny["llama"], tmp_path / "q.gguf", "q8_0", progress=False)["output"]
    types = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
    assert types["blk.0.ffn_up.weight"] == "Q8_0" and types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.ffn_norm.weight"] == "F32"


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_model_loads_and_generates(converted, arch):
    from localllm.runtime.engine import Engine, GenerationParams
    from localllm.chat.sampling import SamplingParams

    engine = Engine(converted[arch], ctx=64, quiet=True)
    events = list(engine.generate("hello there", GenerationParams(max_tokens=4, ignore_eos=True,
                                                                   sampling=SamplingParams(temperature=0))))
    assert len(events) == 4 and events[-1].finish_reason == "length"
    assert all(0 <= e.token < engine.tokenizer.vocab_size for e in events)


# -- bad input ------------------------------------------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _refused(ckpt: Path, out: Path, *fragments: str) -> str:
    with pytest.raises(LocalLLMError) as e:
        convert(ckpt, out, "f32", progress=False)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, msg
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()
    return msg


def test_unsupported_architecture_lists_the_supported_ones(tiny, tmp_path):
    ckpt = _copy(tiny["llama"], tmp_path / "c")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _refused(ckpt, tmp_path / "o.gguf", "MambaForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM",
             "Gemma3ForCausalLM")


@pytest.mark.parametrize("method,name", [("gptq", "GPTQ"), ("awq", "AWQ"), ("fp8", "fp8"),
                                         ("bitsandbytes", "bitsandbytes")])
def test_quantized_checkpoint_is_refused_by_name(tiny, tmp_path, method, name):
    ckpt = _copy(tiny["llama"], tmp_path / "c")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _refused(ckpt, tmp_path / "o.gguf", name, "quantized")


def test_missing_shard_is_named(tiny, tmp_path):
    ckpt = make_tiny_checkpoint("llama", tmp_path / "c", shards=2)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    _refused(ckpt, tmp_path / "o.gguf", "model-00002-of-00002.safetensors", "missing")


def test_truncated_shard_is_named(tiny, tmp_path):
    ckpt = make_tiny_checkpoint("llama", tmp_path / "c", shards=2)
    shard = ckpt / "model-00001-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 1000)
    _refused(ckpt, tmp_path / "o.gguf", "model-00001-of-00002.safetensors", "truncated")


def test_index_that_disagrees_with_its_shards_is_refused(tiny, tmp_path):
    ckpt = make_tiny_checkpoint("llama", tmp_path / "c", shards=2)
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    _refused(ckpt, tmp_path / "o.gguf", "disagrees", "model.layers.9.mlp.up_proj.weight")


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failure_while_writing_leaves_nothing_at_the_output(tiny, tmp_path, monkeypatch, failure):
    from localllm.convert import converter

    real = converter.tensor_data
    calls = []

    def failing(plan, t):
        calls.append(t.name)
        if len(calls) == 5:
            raise failure
        return real(plan, t)

    monkeypatch.setattr(converter, "tensor_data", failing)
    out = tmp_path / "o.gguf"
    with pytest.raises((LocalLLMError, KeyboardInterrupt)):
        convert(tiny["llama"], out, "f32", progress=False)
    assert not out.exists()
    # only the partial file and its record, for --resume (tests/test_resume.py)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.gguf.partial", "o.gguf.partial.json"]


def test_cli_reports_bad_input_in_one_line_and_exits_1(tiny, tmp_path, capsys):
    ckpt = _copy(tiny["llama"], tmp_path / "c")
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert cli_main(["convert", str(ckpt), "-o", str(tmp_path / "o.gguf"), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unsupported architecture 'GPT2LMHeadModel'") and "Traceback" not in err


def test_cli_dry_run_writes_nothing_and_lists_the_plan(tiny, tmp_path, capsys):
    out = tmp_path / "o.gguf"
    assert cli_main(["convert", str(tiny["gemma3"]), "-o", str(out), "--outtype", "F32", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert not out.exists()
    assert plan["architecture"] == "gemma3" and plan["type"] == "F32"
    assert [t["name"] for t in plan["tensors"]] == [t[0] for t in GOLDEN["models"]["gemma3"]["tensors"]]


def _retokenized(tiny, tmp_path, edit) -> Path:
    ckpt = _copy(tiny["llama"], tmp_path / "c")
    tj = json.loads((ckpt / "tokenizer.json").read_text(encoding="utf-8"))
    edit(tj)
    (ckpt / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    return ckpt


def test_pre_tokenizer_unknown_to_llama_cpp_is_matched_by_structure(tiny, tmp_path):
    # fewer merges: the check text tokenizes differently, so llama.cpp's table has no entry for its hash
    ckpt = _retokenized(tiny, tmp_path, lambda tj: tj["model"].update(merges=tj["model"]["merges"][:20000]))
    summary = convert(ckpt, tmp_path / "o.gguf", "f32", progress=False)
    assert summary["pre"] == "gpt-2"
    assert summary["pre_recognised_by"] == "tokenizer.json's pre_tokenizer regexes"


def test_pre_tokenizer_neither_known_nor_implemented_is_a_clear_error(tiny, tmp_path):
    def edit(tj):
        tj["model"]["merges"] = tj["model"]["merges"][:20000]
        tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{Han}+|[a-z]{1,3}"}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}

    msg = _refused(_retokenized(tiny, tmp_path, edit), tmp_path / "o.gguf", "pre-tokenizer", "\\p{Han}+")
    assert "llama.cpp" in msg


def test_llama2_style_bpe_without_tokenizer_model_is_refused_not_guessed(tiny, tmp_path):
    def edit(tj):
        tj["model"]["byte_fallback"] = True
        tj["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]}

    _refused(_retokenized(tiny, tmp_path, edit), tmp_path / "o.gguf", "tokenizer.model", "byte fallback")


def test_default_type_keeps_f16_source_as_f16(tmp_path):
    model_file(SOURCES["llama"])
    ckpt = make_tiny_checkpoint("llama", tmp_path / "c", dtype="F16")
    summary = convert(ckpt, tmp_path / "o.gguf", progress=False)
    assert summary["type"] == "F16" and summary["source_dtype"] == "F16"


def test_hub_source_fetches_only_the_files_a_conversion_reads(monkeypatch, tmp_path):
    from localllm.cli import convert_cmd as cli_convert
    from localllm.store import hub

    seen = {}

    def fake_fetch(repo, revision, patterns, limit=None, quiet=False):
        seen.update(repo=repo, revision=revision, patterns=patterns, limit=limit)
        return tmp_path

    monkeypatch.setattr(hub, "fetch_checkpoint", fake_fetch)  # (test_convert_hub.py fetches from a fake hub)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("LOCALLLM_OFFLINE", raising=False)
    assert cli_convert.resolve_source("hf://owner/repo@v1.0", quiet=True, max_download=5) == tmp_path
    assert seen["repo"] == "owner/repo" and seen["revision"] == "v1.0" and seen["limit"] == 5
    assert "model*.safetensors" in seen["patterns"] and "tokenizer.model" in seen["patterns"]
    assert not any(p.endswith((".bin", ".pt", "*")) for p in seen["patterns"])
    with pytest.raises(LocalLLMError, match="hf://owner/repo"):
        cli_convert.resolve_source("hf://just-a-name", quiet=True)


def test_llama3_rope_scaling_becomes_llama_cpp_rope_freqs_tensor(tmp_path):
    model_file(SOURCES["llama"])
    ckpt = make_tiny_checkpoint("llama3-rope", tmp_path / "c")
    ours = gguf_digest(Path(convert(ckpt, tmp_path / "o.gguf", "f32", progress=False)["output"]))
    theirs = GOLDEN["models"]["llama3-rope"]
    assert ours["tensors"][0][0] == "rope_freqs.weight"
    assert ours == theirs


@pytest.mark.parametrize("mix", ["q4_k_m", "q4_0"])
def test_quantize_mix_convert_is_the_checkpoint_type_conversion_then_quantize(tiny, tmp_path, mix):
    """`convert --type q4_k_m` (or q4_0: llama-quantize's Q4_0 mix, with its Q6_K output matrix) converts and
    quantizes each tensor in one pass: the same bytes as convert (the checkpoint's own type) and `quantize` run one
    after the other, and no intermediate file beside the output."""
    from localllm.convert.quantize_gguf import quantize_file

    assert cli_main(["convert", str(tiny["llama"]), "-o", str(tmp_path / "one.gguf"), "--type", mix, "-q"]) == 0
    convert(tiny["llama"], tmp_path / "src.gguf", "auto", progress=False)
    quantize_file(tmp_path / "src.gguf", tmp_path / "two.gguf", mix.upper())
    assert (tmp_path / "one.gguf").read_bytes() == (tmp_path / "two.gguf").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.gguf", "src.gguf", "two.gguf"]


def test_k_quant_convert_passes_the_imatrix_to_its_quantize_step(tiny, tmp_path, monkeypatch):
    from localllm.convert import imatrix
    from localllm.gguf_file import GGUFFile
    from localllm.convert.quantize_gguf import quantize_file

    monkeypatch.chdir(tmp_path)  # the imatrix path is written into the metadata as given
    convert(tiny["llama"], tmp_path / "src.gguf", "auto", progress=False)
    rng = np.random.default_rng(3)
    with GGUFFile(tmp_path / "src.gguf") as g:
        sums = {n: rng.gamma(0.7, 1.0, t.shape[-1]) * 100 for n, t in g.tensors.items()
                if n.startswith("blk.") and len(t.shape) == 2}
    imatrix.write(imatrix.ImatrixResult(sums=sums, counts=dict.fromkeys(sums, 100), chunk_size=50, chunk_count=2,
                                        datasets=["calib.txt"], chunks=2, tokens=100), "im.gguf")
    assert cli_main(["convert", str(tiny["llama"]), "-o", "one.gguf", "--type", "q4_k_m", "--imatrix", "im.gguf",
                     "-q"]) == 0
    quantize_file(tmp_path / "src.gguf", tmp_path / "two.gguf", "Q4_K_M", imatrix="im.gguf")
    assert (tmp_path / "one.gguf").read_bytes() == (tmp_path / "two.gguf").read_bytes()
    with GGUFFile(tmp_path / "one.gguf") as g:
        assert g.metadata["quantize.imatrix.file"] == "im.gguf"
        assert g.metadata["quantize.imatrix.entries_count"] == len(sums)
    # a type that is not made through quantize has nothing to weigh: refused, nothing written
    assert cli_main(["convert", str(tiny["llama"]), "-o", "q8.gguf", "--type", "q8_0", "--imatrix", "im.gguf",
                     "-q"]) == 1
    assert not (tmp_path / "q8.gguf").exists()


def test_sentencepiece_checkpoint_converts_to_a_gguf_that_tokenizes_as_the_checkpoint(tiny, converted):
    # gemma3's user-defined pieces (whitespace runs, "\n\n") come from tokenizer_config.json's added_tokens_decoder,
    # as in Google's checkpoints: the written file keeps them whole, as the checkpoint's tokenizer does
    from localllm.convert.verify import TOKENIZER_TEXT, check_tokenizer
    from localllm.gguf_file import load_metadata
    from localllm.tokenizer.core import Tokenizer

    result = check_tokenizer(tiny["gemma3"], converted["gemma3"])
    assert result["source"] == "tokenizer.model" and result["same_ids"], result
    tok = Tokenizer.from_metadata(load_metadata(converted["gemma3"]))
    assert "\n\n\n" in TOKENIZER_TEXT and len(tok.encode("\n\n", add_special=False)) == 1
