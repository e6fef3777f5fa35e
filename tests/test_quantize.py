"""`localllm quantize` and the format table's quantizers, against llama-quantize's own output.

tests/data/quantize_golden.json holds llama-quantize's whole-file and per-tensor sha256 for the tiny synthetic
models of tiny_models.py (made by tests/make_quantize_golden.py; the llama.cpp commit is named in the file), for
every type with --pure (each quantizer on every tensor, edge-case rows included) and with llama.cpp's mixes (the
per-tensor type rules and the row-width fallbacks)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as gguf_quantize

from localllm.convert import quantize_gguf as Q
from localllm.cli.main import main as cli_main
from localllm.gguf_file import GGUFFile
from localllm.kernels import reference
from localllm.kernels.cpu.cpu_formats import FORMATS
from conftest import DATA
from tiny_models import write_imatrix_dat, write_imatrix_gguf, write_tiny_model

GOLDEN = json.loads((DATA / "quantize_golden.json").read_text())


def _options(opts: list[str]) -> dict:
    kw = {"pure": "--pure" in opts}
    for flag, key in (("--output-tensor-type", "output_tensor_type"), ("--token-embedding-type", "token_embedding_type"),
                      ("--imatrix", "imatrix")):
        if flag in opts:
            kw[key] = opts[opts.index(flag) + 1]
    return kw


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    paths = {spec: write_tiny_model(d / f"{spec}.gguf", spec) for spec in ("A", "B")}
    paths["imatrix-A.gguf"] = write_imatrix_gguf(d / "imatrix-A.gguf", "A")
    paths["imatrix-B.gguf"] = write_imatrix_gguf(d / "imatrix-B.gguf", "B")
    paths["imatrix-A.dat"] = write_imatrix_dat(d / "imatrix-A.dat", "A")
    assert set(paths) == set(GOLDEN["inputs"])
    for spec, path in paths.items():
        # the same input llama-quantize was given (else a mismatch below would blame the quantizers wrongly)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == GOLDEN["inputs"][spec], f"tiny model {spec} changed"
    return paths


def _case_id(case: dict) -> str:
    return "-".join([case["model"], case["type"], *[o.lstrip("-") for o in case["options"]]])


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=_case_id)
def test_quantize_writes_the_same_file_as_llama_quantize(case, tiny, tmp_path, monkeypatch):
    out = tmp_path / "out.gguf"
    monkeypatch.chdir(tiny["A"].parent)  # the imatrix path is written into the metadata as given: relative
    Q.quantize_file(tiny[case["model"]], out, case["type"], **_options(case["options"]))
    if hashlib.sha256(out.read_bytes()).hexdigest() == case["sha256"]:
        return
    with GGUFFile(out) as g:
        ours = {n: [i.qtype.name, hashlib.sha256(g.raw(n).tobytes()).hexdigest()[:16]] for n, i in g.tensors.items()}
    differing = {n: (ours.get(n), want) for n, want in case["tensors"].items() if ours.get(n) != want}
    pytest.fail(f"file differs from llama-quantize's; tensors that differ (ours, llama.cpp): {differing or 'none'}"
                f"{'; tensor order or metadata differ' if not differing else ''}")


def test_each_quantizer_round_trips_within_its_format_precision():
    # relative RMS error of dequantize(quantize(x)) on Gaussian rows; bounds 1.3x the measured values (F16 2.1e-4,
    # BF16 1.7e-3, Q8_0 5.3e-3, Q6_K 0.017, Q5_K 0.036, Q5_1 0.038, Q5_0 0.042, Q4_K 0.071, Q4_1 0.078, Q4_0 0.086,
    # Q3_K 0.15, Q2_K 0.30)
    bounds = {T.F32: 0, T.F16: 2.8e-4, T.BF16: 2.2e-3, T.Q8_0: 7e-3, T.Q6_K: 0.023, T.Q5_K: 0.047, T.Q5_1: 0.05,
              T.Q5_0: 0.055, T.Q4_K: 0.092, T.Q4_1: 0.1, T.Q4_0: 0.11, T.Q3_K: 0.195, T.Q2_K: 0.39}
    x = np.random.default_rng(3).standard_normal((16, 512)).astype(np.float32)
    for qtype, fmt in FORMATS.items():
        out = np.empty((16, fmt.row_bytes(512)), np.uint8)
        fmt.quantize(x, out)
        err = np.sqrt(np.mean((reference.dequantize(out, qtype) - x) ** 2) / np.mean(x**2))
        assert err <= bounds[qtype], f"{qtype.name}: relative RMS error {err:.4f} > {bounds[qtype]}"


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.BF16, T.F16], ids=lambda t: t.name)
def test_legacy_quantizers_agree_with_gguf_py(qtype):
    # gguf-py's numpy quantizers are an independent port of the same ggml functions
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((32, 256)) * rng.uniform(1e-6, 10, (32, 1))).astype(np.float32)
    x[0] = 0
    x[1, ::5] = 50
    fmt = FORMATS[qtype]
    out = np.empty((32, fmt.row_bytes(256)), np.uint8)
    fmt.quantize(x, out)
    np.testing.assert_array_equal(out, np.asarray(gguf_quantize(x, qtype)).view(np.uint8).reshape(out.shape))


def test_dry_run_json_lists_each_tensor_with_its_fallback_and_writes_nothing(tiny, tmp_path, capsys):
    out = tmp_path / "out.gguf"
    assert cli_main(["quantize", str(tiny["B"]), str(out), "Q4_K_M", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert not out.exists()
    by_name = {t["name"]: t for t in plan["tensors"]}
    want = next(c for c in GOLDEN["cases"] if c["model"] == "B" and c["type"] == "Q4_K_M" and not c["options"])
    assert {n: t["to"] for n, t in by_name.items()} == {n: v[0] for n, v in want["tensors"].items()}
    # width 320: the mix's Q4_K falls back to Q5_0; ffn_down's 720 columns fit no 32-block: F16
    assert by_name["blk.1.attn_q.weight"]["to"] == "Q5_0" and "not a multiple of 256" in by_name["blk.1.attn_q.weight"]["note"]
    assert by_name["blk.1.ffn_down.weight"]["to"] == "F16"
    assert plan["fallbacks"] > 0 and plan["file_type"] == 15


def test_quantized_input_is_refused_with_the_reason_unless_allowed(tiny, tmp_path, capsys):
    q8 = tmp_path / "q8.gguf"
    Q.quantize_file(tiny["A"], q8, "Q8_0")
    out = tmp_path / "out.gguf"
    assert cli_main(["quantize", str(q8), str(out), "Q4_K_M"]) == 1
    err = capsys.readouterr().err
    assert "already quantized" in err and "--allow-requantize" in err and "rounding errors" in err
    assert not out.exists() and not (tmp_path / "out.gguf.partial").exists()
    assert cli_main(["quantize", "--quiet", "--allow-requantize", str(q8), str(out), "Q4_K_M"]) == 0
    with GGUFFile(out) as g:
        assert g.tensors["blk.0.attn_q.weight"].qtype == T.Q4_K


def test_q2_k_s_without_an_importance_matrix_is_refused(tiny, tmp_path):
    with pytest.raises(Q.QuantizeError, match="importance matrix"):
        Q.quantize_file(tiny["A"], tmp_path / "o.gguf", "Q2_K_S")
    assert not (tmp_path / "o.gguf").exists()


def test_an_importance_matrix_of_another_model_is_refused(tiny, tmp_path):
    # B's matrices have 320 and 720 columns, A's 256 and 512
    with pytest.raises(Q.QuantizeError, match="another model"):
        Q.quantize_file(tiny["A"], tmp_path / "o.gguf", "Q4_K_M", imatrix=str(tiny["imatrix-B.gguf"]))
    with pytest.raises(Q.QuantizeError, match="neither a GGUF importance matrix"):
        Q.quantize_file(tiny["A"], tmp_path / "o.gguf", "Q4_K_M", imatrix=str(DATA / "README.md"))
    assert not (tmp_path / "o.gguf").exists()


def test_unknown_type_lists_the_valid_ones(tiny, tmp_path, capsys):
    assert cli_main(["quantize", str(tiny["A"]), str(tmp_path / "o.gguf"), "Q7_K"]) == 1
    err = capsys.readouterr().err
    assert "Q7_K" in err and "Q4_K_M" in err and "Q8_0" in err
    assert cli_main(["quantize", "--output-tensor-type", "Q9", str(tiny["A"]), str(tmp_path / "o.gguf"), "Q8_0"]) == 1
    assert "--output-tensor-type" in capsys.readouterr().err


def test_an_explicit_type_that_does_not_fit_the_row_width_is_refused(tiny, tmp_path):
    # llama-quantize fails on this too (an explicit type bypasses the fallbacks): 320 columns are not 256-blocks
    with pytest.raises(Q.QuantizeError, match="320 columns"):
        Q.quantize_file(tiny["B"], tmp_path / "o.gguf", "Q5_K_S", token_embedding_type="Q6_K")
    assert not (tmp_path / "o.gguf").exists()


def test_a_failure_while_writing_leaves_no_partial_file_and_keeps_the_old_output(tiny, tmp_path):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"previous")

    def boom(done):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        Q.quantize_file(tiny["A"], out, "Q4_0", progress=boom)
    assert out.read_bytes() == b"previous"
    assert list(tmp_path.iterdir()) == [out]


def test_progress_lines_off_a_terminal_show_the_time_left(capsys):
    from localllm.progress import progress_bar

    with progress_bar("quantizing to Q4_K_M", 1000, quiet=False) as bar:
        bar.update(1)  # the first instants give no estimate (one small tensor in 2 ms is not a rate)
        first = capsys.readouterr().err
        bar._start -= 10  # ten seconds in
        bar._last_line = 0.0
        bar.update(250)
    line = capsys.readouterr().err
    assert "0%" in first and "left" not in first
    assert "25%" in line and "about 30 s left" in line
