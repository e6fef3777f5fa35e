"""`localllm imatrix`: the importance matrix llama-imatrix computes, in its file formats.

The golden files (tests/data/imatrix_golden.*, made by tests/make_imatrix_golden.py) hold what llama-imatrix
computed for smollm2-135m-instruct on tests/data/edit_colorsys.txt with -c 172 --chunks 3.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct

import numpy as np
import pytest

from conftest import DATA, model_file
from make_imatrix_golden import dat_skeleton
from tiny_models import write_tiny_model

from localllm.convert import imatrix
from localllm.architectures import load_config
from localllm.architectures.transformer import Transformer
from localllm.errors import LocalLLMError
from localllm.gguf_file import GGUFFile
from localllm.convert.quantize_gguf import load_imatrix, quantize_file

GOLDEN = json.loads((DATA / "imatrix_golden.json").read_text())
TEXT = DATA / "edit_colorsys.txt"
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def engine():
    from localllm.runtime.engine import Engine

    return Engine.load(str(model_file(MODEL)), ctx=512, quiet=True)


@pytest.fixture(scope="module")
def ours(engine):
    assert hashlib.sha256(model_file(MODEL).read_bytes()).hexdigest() == GOLDEN["model_sha256"]
    assert hashlib.sha256(TEXT.read_bytes()).hexdigest() == GOLDEN["text_sha256"]
    return imatrix.compute(engine, TEXT.read_text(), n_ctx=GOLDEN["n_ctx"], n_chunks=GOLDEN["chunks"],
                           dataset="edit_colorsys.txt")


def test_counts_skip_the_rows_llama_imatrix_skips(ours):
    # Three 172-token chunks in one batch: ubatches of 170 tokens per chunk, then one of 3 x 2 = 6 rows, which
    # llama-imatrix does not collect (under 16 rows): 510 tokens counted per matrix, not 516.
    g = GOLDEN["gguf"]
    assert ours.counts == {name: int(c) for name, c in g["counts"].items()}
    assert set(g["counts"].values()) == {510.0}
    assert ours.chunk_count == g["chunk_count"] == 2 and ours.chunk_size == g["chunk_size"] == 172


def test_small_ubatches_are_not_collected_as_in_llama_cpp():
    assert imatrix.collected_rows(172, 3).sum() == 170  # the golden's case, measured with llama-imatrix
    assert imatrix.collected_rows(512, 4).all()
    assert imatrix.collected_rows(770, 2).sum() == 768  # ubatches of 256 per chunk, then 2 x 2 rows
    assert imatrix.collected_rows(770, 1).all()  # a lone chunk: ubatches of 512 and 258
    assert imatrix.collected_rows(2050, 1).sum() == 2048  # batches of 2048: the second has 2 tokens


def test_sums_of_squared_inputs_agree_with_llama_imatrix(ours):
    g = GOLDEN["gguf"]
    assert set(ours.sums) == set(g["counts"])
    full = np.load(DATA / "imatrix_golden.npz")
    # Layer 0's Q/K/V input is the RMS-normed embedding, the same numbers in both: only the order of float
    # additions differs.
    for name in ("blk.0.attn_q.weight", "blk.0.attn_v.weight"):
        np.testing.assert_allclose(ours.sums[name], full[name], rtol=2e-5)
    # Deeper, llama.cpp's F16 KV cache and its own rounding of activations move each sum a little (measured:
    # relative L2 error 0.09% median, 1.8% worst over the 210 matrices).
    errors = {}
    for name, ref in full.items():
        errors[name] = np.linalg.norm(ours.sums[name] - ref) / np.linalg.norm(ref)
    assert max(errors.values()) < 0.05, max(errors.items(), key=lambda kv: kv[1])
    assert np.median(list(errors.values())) < 0.005
    totals = np.array([ours.sums[n].sum() / t for n, t in g["in_sum2_totals"].items()])
    assert np.all(np.abs(totals - 1) < 0.03) and np.median(np.abs(totals - 1)) < 0.003


def test_gguf_file_is_laid_out_as_llama_imatrix_writes_it(ours):
    data = imatrix.gguf_bytes(ours)
    g = GOLDEN["gguf"]
    assert len(data) == g["size"]
    assert hashlib.sha256(data[: g["data_offset"]]).hexdigest() == g["header_sha256"]


def test_legacy_dat_file_is_laid_out_as_llama_imatrix_writes_it(ours):
    skeleton, entries = dat_skeleton(imatrix.dat_bytes(ours))
    assert [list(e) for e in entries] == GOLDEN["dat"]["entries"]
    assert len(skeleton) == GOLDEN["dat"]["size"]
    assert hashlib.sha256(skeleton).hexdigest() == GOLDEN["dat"]["skeleton_sha256"]


@pytest.mark.parametrize("fmt", ["gguf", "dat"])
def test_files_round_trip_through_load_imatrix(ours, tmp_path, fmt):
    path = imatrix.write(ours, tmp_path / f"m.{fmt}", fmt)
    assert not list(tmp_path.glob("*.partial"))
    loaded = load_imatrix(str(path))
    assert loaded.datasets == ["edit_colorsys.txt"] and loaded.chunk_count == 2
    assert set(loaded.entries) == set(ours.sums)
    for name, sums in ours.sums.items():
        # what llama-quantize uses: mean squared input per column (.dat: (sum / count) * ncall / ncall)
        np.testing.assert_allclose(loaded.entries[name], sums.astype(np.float32) / np.float32(510), rtol=1e-6)


def test_observing_the_forward_changes_no_logit(engine):
    tokens = engine.tokenizer.encode(TEXT.read_text())[:40]
    seen = []
    plain, observed = engine.new_sequence(), engine.new_sequence()
    try:
        a = engine.evaluate(plain, tokens, logit_positions=np.arange(40))
        b = engine.evaluate(observed, tokens, logit_positions=np.arange(40),
                            observe=lambda names, x: seen.append((names, x.shape)))
    finally:
        plain.close()
        observed.close()
    assert np.array_equal(a, b)
    c = engine.config
    assert len(seen) == 4 * c.n_layers + 1  # QKV, attention output, gate/up, down per layer; then the output
    assert seen[0] == (("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"), (40, c.n_embd))
    assert seen[3] == (("blk.0.ffn_down.weight",), (40, c.n_ff))


def test_too_short_or_empty_text_is_refused(engine):
    with pytest.raises(LocalLLMError, match="at least two chunks, 1024 tokens"):
        imatrix.compute(engine, "Hello world. " * 20)
    with pytest.raises(LocalLLMError, match="empty"):
        imatrix.compute(engine, "\n")


def test_quantize_accepts_a_computed_imatrix(tmp_path):
    # Tiny model A (tests/tiny_models.py) has no tokenizer: drive its forward with token ids directly.
    src = write_tiny_model(tmp_path / "A.gguf", "A")
    with GGUFFile(src) as g:
        model = Transformer(g, dataclasses.replace(load_config(g.metadata), vocab_size=320))
        collector = imatrix.Collector()
        rng = np.random.default_rng(0)
        for _ in range(2):
            model.forward(rng.integers(0, 320, 64).tolist(), model.new_cache(64), observe=collector)
    result = imatrix.ImatrixResult(sums=collector.sums, counts=collector.counts, chunk_size=64, chunk_count=2,
                                   datasets=["ids"], chunks=2, tokens=128)
    assert set(result.sums) == {f"blk.{i}.{m}.weight" for i in range(2) for m in
                                ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    path = imatrix.write(result, tmp_path / "A-imatrix.gguf")
    plain = quantize_file(src, tmp_path / "plain.gguf", "Q4_K_M")
    weighted = quantize_file(src, tmp_path / "weighted.gguf", "Q4_K_M", imatrix=str(path))
    assert sum(t.importance is not None for t in weighted.tensors) == 14
    assert all(t.importance is None for t in plain.tensors)
    with GGUFFile(tmp_path / "weighted.gguf") as w, GGUFFile(tmp_path / "plain.gguf") as p:
        assert w.metadata["quantize.imatrix.entries_count"] == 14
        assert w.metadata["quantize.imatrix.chunks_count"] == 2
        assert w.raw("blk.0.ffn_up.weight").tobytes() != p.raw("blk.0.ffn_up.weight").tobytes()


def test_legacy_dat_values_are_mean_times_calls():
    result = imatrix.ImatrixResult(sums={"blk.0.attn_q.weight": np.array([3.0, 0.5])},
                                   counts={"blk.0.attn_q.weight": 600}, chunk_size=512, chunk_count=1,
                                   datasets=["t.txt"], chunks=2, tokens=1100)
    data = imatrix.dat_bytes(result)
    n, length = struct.unpack_from("<ii", data, 0)
    assert n == 1 and data[8 : 8 + length] == b"blk.0.attn_q.weight"
    ncall, nval = struct.unpack_from("<ii", data, 8 + length)
    values = np.frombuffer(data, np.float32, nval, 16 + length)
    assert (ncall, nval) == (2, 2)  # ceil(600 / 512)
    np.testing.assert_array_equal(values, np.float32([3.0, 0.5]) / np.float32(600) * np.float32(2))
    assert data[16 + length + 8 :] == struct.pack("<ii", 1, 5) + b"t.txt"


def test_command_writes_the_file_and_a_json_summary(tmp_path, capsys):
    from localllm.cli.main import main as cli_main

    out = tmp_path / "m.gguf"
    assert cli_main(["imatrix", str(model_file(MODEL)), str(TEXT), "-c", "16", "--chunks", "2", "-o", str(out),
                     "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["chunks"] == 2 and summary["chunk_size"] == 16 and summary["entries"] == 210
    assert summary["output"] == str(out) and summary["ppl"] > 1
    assert load_imatrix(str(out)).chunk_count == 2 and not list(tmp_path.glob("*.partial"))
    assert cli_main(["imatrix", "no-such-model", str(TEXT), "-o", str(tmp_path / "x.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model") and "Traceback" not in err
    assert not (tmp_path / "x.gguf").exists()


def test_output_matrix_is_collected_only_with_process_output(tmp_path):
    src = write_tiny_model(tmp_path / "A.gguf", "A")  # has an output.weight of its own
    with GGUFFile(src) as g:
        model = Transformer(g, dataclasses.replace(load_config(g.metadata), vocab_size=320))
        plain, with_output = imatrix.Collector(), imatrix.Collector(process_output=True)
        tokens = list(range(20))
        model.forward(tokens, model.new_cache(32), output_rows=np.arange(20), observe=plain)
        model.forward(tokens, model.new_cache(32), output_rows=np.arange(20), observe=with_output)
    assert "output.weight" not in plain.sums and with_output.counts["output.weight"] == 20
    assert set(with_output.sums) - set(plain.sums) == {"output.weight"}
    assert not any(n.startswith("token_embd") for n in with_output.sums)
