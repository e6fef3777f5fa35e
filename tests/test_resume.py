"""`convert --resume` and `quantize --resume`: a run interrupted after some tensors (kill -9, Ctrl-C, a full disk)
keeps OUT.partial and its record, never anything at OUT; resuming gives the same sha256 as an uninterrupted run,
and only when the source, the options and the kept bytes are what the partial was made from."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from convert_fixtures import SOURCES, make_tiny_checkpoint

from conftest import model_file
from localllm.cli.main import main as cli_main
from localllm.convert import converter
from localllm.convert import convert
from localllm.errors import LocalLLMError
from localllm.convert.quantize_gguf import quantize_file


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model_file(SOURCES["llama"])
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture(scope="module")
def whole(ckpt, tmp_path_factory):
    """Uninterrupted outputs: F32 and Q4_K_M conversions, and a Q4_K_M quantization of the F32 file."""
    d = tmp_path_factory.mktemp("whole")
    convert(ckpt, d / "f32.gguf", "f32", progress=False)
    convert(ckpt, d / "q4km.gguf", "q4_k_m", progress=False)
    quantize_file(d / "f32.gguf", d / "q.gguf", "Q4_K_M")
    return d


def interrupt_after(monkeypatch, module, attr, n: int, failure: BaseException) -> None:
    real = getattr(module, attr)
    calls = []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise failure
        return real(*a, **k)

    monkeypatch.setattr(module, attr, failing)


def ctrl_c_after(monkeypatch, src, out, n: int) -> None:
    """An f32 conversion of `src` to `out` interrupted (Ctrl-C) as tensor n is read: its partial is kept."""
    interrupt_after(monkeypatch, converter, "tensor_values", n, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, "f32", progress=False)
    monkeypatch.undo()


def test_conversion_killed_halfway_resumes_to_the_same_sha256(ckpt, whole, tmp_path, capsys):
    # A real kill -9 in a child process, after 10 of the 20 tensors: whatever the child had not flushed is lost.
    out = tmp_path / "o.gguf"
    code = ("import os, signal, sys\n"
            "from localllm.convert import converter\n"
            "real, n = converter.tensor_values, [0]\n"
            "def dying(plan, t):\n"
            "    n[0] += 1\n"
            "    if n[0] == 11: os.kill(os.getpid(), signal.SIGKILL)\n"
            "    return real(plan, t)\n"
            "converter.tensor_values = dying\n"
            "from localllm.cli.main import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", code, "convert", str(ckpt), "-o", str(out), "--type", "f32", "-q"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr
    assert not out.exists()
    records = (tmp_path / "o.gguf.partial.json").read_text().splitlines()
    assert len(records) == 1 + 10  # the plan line, then one line per finished tensor
    assert cli_main(["convert", str(ckpt), "-o", str(out), "--type", "f32", "--resume"]) == 0
    assert "10 of 20 tensors kept" in capsys.readouterr().err
    assert sha(out) == sha(whole / "f32.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.gguf"]


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), OSError(28, "No space left on device")])
def test_k_quant_conversion_interrupted_resumes_to_the_same_sha256(ckpt, whole, tmp_path, monkeypatch, failure):
    out = tmp_path / "o.gguf"
    interrupt_after(monkeypatch, converter, "tensor_values", 7, failure)
    with pytest.raises((KeyboardInterrupt, LocalLLMError), match=None if isinstance(failure, KeyboardInterrupt)
                       else "--resume"):
        convert(ckpt, out, "q4_k_m", progress=False)
    assert not out.exists() and (tmp_path / "o.gguf.partial").exists()
    monkeypatch.undo()
    said = []
    convert(ckpt, out, "q4_k_m", progress=False, resume=True, say=said.append)
    assert said == ["resuming o.gguf: 6 of 20 tensors kept (their sha256 checked)"]
    assert sha(out) == sha(whole / "q4km.gguf")


def test_quantize_interrupted_resumes_to_the_same_sha256(whole, tmp_path, monkeypatch, capsys):
    from localllm.convert import quantize_gguf as quantize

    out = tmp_path / "o.gguf"
    interrupt_after(monkeypatch, quantize, "convert_rows", 5, KeyboardInterrupt())
    assert cli_main(["quantize", str(whole / "f32.gguf"), str(out), "Q4_K_M", "--quiet"]) == 1
    assert "o.gguf.partial is kept" in capsys.readouterr().err
    monkeypatch.undo()
    assert cli_main(["quantize", str(whole / "f32.gguf"), str(out), "Q4_K_M", "--resume"]) == 0
    assert "tensors kept" in capsys.readouterr().err
    assert sha(out) == sha(whole / "q.gguf")


def test_a_changed_source_is_not_resumed_but_converted_again_saying_why(ckpt, tmp_path, monkeypatch):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    out = tmp_path / "o.gguf"
    ctrl_c_after(monkeypatch, src, out, 8)
    # new weights of the same size: only the file's modification time tells
    st = (src / "model.safetensors").stat()
    data = bytearray((src / "model.safetensors").read_bytes())
    data[-2:] = b"\x80\x3f"
    (src / "model.safetensors").write_bytes(bytes(data))
    os.utime(src / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    said = []
    convert(src, out, "f32", progress=False, resume=True, say=said.append)
    assert len(said) == 1 and "made from another source" in said[0] and "model.safetensors" in said[0]
    assert "starting over" in said[0]
    convert(src, tmp_path / "fresh.gguf", "f32", progress=False)
    assert sha(out) == sha(tmp_path / "fresh.gguf")


def test_other_options_are_not_resumed(ckpt, whole, tmp_path, monkeypatch):
    out = tmp_path / "o.gguf"
    ctrl_c_after(monkeypatch, ckpt, out, 8)
    said = []
    convert(ckpt, out, "q4_k_m", progress=False, resume=True, say=said.append)
    assert "with other options" in said[0] and "'f32', now 'q4_k_m'" in said[0]
    assert sha(out) == sha(whole / "q4km.gguf")


def test_a_damaged_kept_tensor_is_written_again(ckpt, whole, tmp_path, monkeypatch):
    out = tmp_path / "o.gguf"
    ctrl_c_after(monkeypatch, ckpt, out, 12)
    records = [json.loads(line) for line in (tmp_path / "o.gguf.partial.json").read_text().splitlines()]
    partial = tmp_path / "o.gguf.partial"
    raw = bytearray(partial.read_bytes())
    raw[records[5]["end"] - 40] ^= 0xFF  # inside the 5th tensor (the 4th ends before it)
    partial.write_bytes(bytes(raw))
    said = []
    convert(ckpt, out, "f32", progress=False, resume=True, say=said.append)
    assert said == ["resuming o.gguf: 4 of 20 tensors kept (their sha256 checked), 7 recorded tensor(s) failed "
                    "the check and will be written again"]
    assert sha(out) == sha(whole / "f32.gguf")


def test_without_resume_an_old_partial_is_replaced(ckpt, whole, tmp_path, monkeypatch):
    out = tmp_path / "o.gguf"
    ctrl_c_after(monkeypatch, ckpt, out, 8)
    said = []
    convert(ckpt, out, "f32", progress=False, say=said.append)
    assert said == ["o.gguf.partial from an earlier run is replaced (pass --resume to continue it)"]
    assert sha(out) == sha(whole / "f32.gguf")


def test_a_bad_input_error_removes_the_partial(ckpt, tmp_path, monkeypatch):
    # an error that would recur (not an interruption, not a system error) leaves nothing to resume
    out = tmp_path / "o.gguf"
    interrupt_after(monkeypatch, converter, "tensor_values", 8, LocalLLMError("bad tensor"))
    with pytest.raises(LocalLLMError):
        convert(ckpt, out, "f32", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_verify_checks_the_tokenizer_against_tokenizer_json_and_reports_the_perplexity_change(ckpt, tmp_path,
                                                                                               capsys):
    out = tmp_path / "o.gguf"
    assert cli_main(["convert", str(ckpt), "-o", str(out), "--type", "q8_0", "--verify", "--json", "-q"]) == 0
    v = json.loads(capsys.readouterr().out)["verify"]
    assert v["tokenizer"]["same_ids"] and v["tokenizer"]["n_tokens"] > 200
    assert v["tokenizer"]["source"].startswith("tokenizer.json")
    ppl = v["perplexity"]
    assert ppl["source_type"] == "BF16" and ppl["ppl"] > 1 and ppl["source_ppl"] > 1
    assert ppl["change"] == pytest.approx(ppl["ppl"] / ppl["source_ppl"] - 1, abs=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.gguf"]  # the source-precision file is gone


def test_verify_reports_a_tokenizer_that_disagrees_with_the_checkpoint(ckpt, tmp_path, capsys):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    out = tmp_path / "o.gguf"
    convert(src, out, "bf16", progress=False)
    tj = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    tj["model"]["merges"] = tj["model"]["merges"][:-20000]  # the checkpoint now merges less than the file
    (src / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    from localllm.convert.verify import verify

    lines = []
    result = verify(src, out, "BF16", "BF16", say=lines.append)
    assert not result["tokenizer"]["same_ids"] and "TOKENIZER MISMATCH" in lines[0]
    assert result["perplexity"]["change"] == 0.0  # written at the checkpoint's own precision: nothing to compare
