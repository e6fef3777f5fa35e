"""Saved sessions (llama.cpp's --prompt-cache): a sequence's tokens and K/V survive a file round trip bitwise, a
file from another model or a damaged one is refused clearly, and `run --prompt-cache` reuses the saved prefix."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tracemalloc
import zipfile

import numpy as np
import pytest

from conftest import model_file
from localllm.runtime import session_file
from localllm.runtime.engine import Engine, GenerationParams
from localllm.errors import LocalLLMError
from localllm.chat.sampling import SamplingParams

CTX = 1024
GREEDY = GenerationParams(max_tokens=12, sampling=SamplingParams(temperature=0))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(model_file("smollm2-135m-instruct"), ctx=CTX, quiet=True)


def assert_same_kv(e: Engine, a, b) -> None:
    assert a.tokens == b.tokens and a.cache.length == b.cache.length
    for layer in range(e.config.n_layers):
        assert a.cache.start(layer) == b.cache.start(layer)
        assert np.array_equal(a.cache.keys(layer), b.cache.keys(layer))
        assert np.array_equal(a.cache.values(layer), b.cache.values(layer))


def round_trip(e: Engine, text: str, tmp_path):
    tokens = e.tokenize_prompt(text)
    seq = e.new_sequence()
    e.evaluate(seq, tokens)
    path = tmp_path / "session.bin"
    session_file.save(e, seq, path)
    loaded = session_file.load(e, path)
    assert_same_kv(e, seq, loaded)
    assert os.listdir(tmp_path) == ["session.bin"]  # no temporary file left behind
    # The same state, saved or not, continues the same way (a longer prompt reuses the same prefix in both).
    prompt = tokens + e.tokenizer.encode(" And then", add_special=False)
    assert [ev.token for ev in e.generate(prompt, GREEDY, seq=loaded)] == \
           [ev.token for ev in e.generate(prompt, GREEDY, seq=seq)]
    return tokens


def test_round_trip_is_bitwise_and_continues_identically(engine, tmp_path):
    tokens = round_trip(engine, "The quick brown fox jumps over the lazy dog. " * 4, tmp_path)
    assert len(tokens) % 16  # the last block is partial


def test_a_prefix_of_a_sequence_can_be_saved(engine, tmp_path):
    tokens = engine.tokenize_prompt("One two three four five six seven eight nine ten eleven twelve")
    seq = engine.new_sequence()
    engine.evaluate(seq, tokens)
    session_file.save(engine, seq, tmp_path / "s", n_tokens=7)
    loaded = session_file.load(engine, tmp_path / "s")
    seq.reuse_prefix(tokens[:8])  # rolls back to the first 7 tokens
    assert_same_kv(engine, seq, loaded)


def test_sliding_window_layers_restore_their_window(tmp_path):
    e = Engine(model_file("gemma3-270m"), ctx=CTX, quiet=True)
    tokens = round_trip(e, "The quick brown fox jumps over the lazy dog. " * 60, tmp_path)
    assert len(tokens) > e.config.sliding_window
    loaded = session_file.load(e, tmp_path / "session.bin")
    assert max(loaded.cache.start(layer) for layer in range(e.config.n_layers)) > 0  # only the window was stored
    # ... and a smollm2 engine refuses gemma3's session, naming both models.
    small = Engine(model_file("smollm2-135m-instruct"), ctx=CTX, quiet=True)
    with pytest.raises(LocalLLMError, match="saved with another model.*gemma3.*not smollm2"):
        session_file.load(small, tmp_path / "session.bin")


def test_damaged_files_are_refused_clearly(engine, tmp_path):
    seq = engine.new_sequence()
    engine.evaluate(seq, engine.tokenize_prompt("Hello there, how are you doing today?"))
    good = tmp_path / "good"
    session_file.save(engine, seq, good)
    data = good.read_bytes()
    for name, content in [("truncated", data[: len(data) // 2]), ("empty", b""), ("text", b"not a session\n"),
                          ("npy", b"")]:
        path = tmp_path / name
        if name == "npy":
            np.save(path.open("wb"), np.arange(3))
        else:
            path.write_bytes(content)
        with pytest.raises(LocalLLMError, match="not a (valid|localllm) session file"):
            session_file.load(engine, path)
    # A well-formed file whose header claims more tokens than it holds.
    with np.load(good) as npz:
        arrays = dict(npz)
    header = json.loads(bytes(arrays["header"]))
    arrays["header"] = np.frombuffer(json.dumps({**header, "n_tokens": header["n_tokens"] + 1}).encode(), np.uint8)
    np.savez(tmp_path / "lying.npz", **arrays)
    with pytest.raises(LocalLLMError, match="corrupt session file"):
        session_file.load(engine, tmp_path / "lying.npz")
    with pytest.raises(LocalLLMError, match="does not exist"):
        session_file.load(engine, tmp_path / "missing")


def test_a_failed_write_leaves_nothing_behind(engine, tmp_path):
    seq = engine.new_sequence()
    engine.evaluate(seq, engine.tokenize_prompt("Hello"))
    target = tmp_path / "dir"
    target.mkdir()  # os.replace cannot put a file over a directory
    with pytest.raises(LocalLLMError, match="cannot write session file"):
        session_file.save(engine, seq, target)
    assert os.listdir(tmp_path) == ["dir"] and os.listdir(target) == []


def run(*args):
    out = subprocess.run([sys.executable, "-m", "localllm", "run", str(model_file("smollm2-135m-instruct")), *args,
                          "--temp", "0", "-n", "12", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


def test_cli_prompt_cache_reuses_the_shared_prefix(engine, tmp_path):
    cache = str(tmp_path / "prompt.cache")
    # Short prompts: every forward takes the same (per-row) kernels whether the prompt is split or not, so
    # cached and uncached runs are bitwise alike. (Longer prompts evaluated in two pieces may take different
    # matmul kernels than one piece, and greedy text can then differ by rounding, as in llama.cpp.)
    first, second = "The capital of France is", "The capital of France is Paris. The"
    shared = len(engine.tokenize_prompt(first))
    assert len(engine.tokenize_prompt(second)) <= 8
    out, err = run(first, "--prompt-cache", cache)
    assert out["timings"]["cache_n"] == 0 and err == "" and os.path.exists(cache)
    out, err = run(second, "--prompt-cache", cache)
    assert out["timings"]["cache_n"] == shared and err == ""
    cold, _ = run(second)
    assert cold["timings"]["cache_n"] == 0 and out["text"] == cold["text"]
    # The file now holds the second prompt: running it again reuses all of it but the last token.
    out, _ = run(second, "--prompt-cache", cache, "--prompt-cache-ro")
    assert out["timings"]["cache_n"] == len(engine.tokenize_prompt(second)) - 1
    assert sorted(os.listdir(tmp_path)) == ["prompt.cache"]


def test_cli_n_0_caches_the_prompt_and_generates_nothing(engine, tmp_path):
    # llama.cpp's -n 0: evaluate the prompt (to warm a --prompt-cache for later runs), print no token.
    cache = str(tmp_path / "prompt.cache")
    prompt = "The capital of France is"
    out = subprocess.run([sys.executable, "-m", "localllm", "run", str(model_file("smollm2-135m-instruct")), prompt,
                          "-n", "0", "--json", "--prompt-cache", cache], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["tokens"] == [] and result["text"] == "" and result["timings"]["predicted_n"] == 0
    assert result["timings"]["prompt_n"] == len(engine.tokenize_prompt(prompt)) and os.path.exists(cache)
    again, _ = run(prompt, "--prompt-cache", cache)
    assert again["timings"]["cache_n"] == len(engine.tokenize_prompt(prompt)) - 1


def test_cli_prompt_cache_replaces_a_damaged_session_with_a_warning(engine, tmp_path):
    cache = tmp_path / "prompt.cache"
    seq = engine.new_sequence()
    engine.evaluate(seq, engine.tokenize_prompt("Hello there"))
    session_file.save(engine, seq, cache)
    with np.load(cache) as npz:
        arrays = dict(npz)
    header = json.loads(bytes(arrays["header"]))
    arrays["header"] = np.frombuffer(json.dumps({**header, "n_tokens": header["n_tokens"] + 1}).encode(), np.uint8)
    with cache.open("wb") as f:
        np.savez(f, **arrays)  # one of ours, but damaged: only a cache, so the run replaces it
    out, err = run("Hello, my name is", "--prompt-cache", str(cache))
    assert out["timings"]["cache_n"] == 0 and "warning: ignoring the prompt cache" in err
    again, err = run("Hello, my name is", "--prompt-cache", str(cache))  # the file was replaced by a good one
    assert err == "" and again["timings"]["cache_n"] > 0 and again["text"] == out["text"]


def test_cli_prompt_cache_refuses_to_overwrite_a_file_that_is_not_a_session(tmp_path):
    for name, content in [("notes.txt", b"my notes, not a cache\n"), ("broken.zip", b"PK\x03\x04 not really a zip")]:
        path = tmp_path / name
        path.write_bytes(content)
        out = subprocess.run([sys.executable, "-m", "localllm", "run", str(model_file("smollm2-135m-instruct")),
                              "Hello", "-n", "2", "--prompt-cache", str(path)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert out.stderr.startswith(f"error: --prompt-cache {path}: the file exists and is not a localllm session")
        assert path.read_bytes() == content
    assert sorted(os.listdir(tmp_path)) == ["broken.zip", "notes.txt"]


# ---- hostile files: every array's header is checked before its data is read ----------------------------------


def npy_member(shape, descr="<f4", data=b"", header_text=None) -> bytes:
    """The bytes of a .npy file whose header declares `shape` (or is `header_text` verbatim), followed by `data`."""
    f = io.BytesIO()
    if header_text is None:
        np.lib.format.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": shape})
    else:
        text = header_text.encode("latin1")
        f.write(np.lib.format.magic(1, 0) + len(text).to_bytes(2, "little") + text)
    return f.getvalue() + data


def with_members(good, path, compress=zipfile.ZIP_STORED, **members: bytes) -> None:
    """A copy of the session file `good` with some members replaced."""
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(path, "w", compress) as dst:
        for info in src.infolist():
            key = info.filename[: -len(".npy")]
            dst.writestr(info.filename, members[key] if key in members else src.read(info))


@pytest.fixture
def good_session(engine, tmp_path):
    seq = engine.new_sequence()
    engine.evaluate(seq, engine.tokenize_prompt("Hello there, how are you doing today?"))
    path = tmp_path / "good.npz"
    session_file.save(engine, seq, path)
    return path


def test_a_session_file_declaring_a_huge_array_is_refused_before_allocating(engine, good_session, tmp_path):
    c = engine.config
    # k0 says it holds 2^30 tokens (768 GiB) and really inflates to 64 MiB of zeros: a zip bomb.
    bomb = npy_member((c.n_head_kv, 1 << 30, c.head_dim), data=bytes(64 << 20))
    cases = {"huge keys": dict(k0=bomb),
             "wrong dtype": dict(v0=npy_member((c.n_head_kv, 1, c.value_dim), descr="<f8", data=bytes(8 * 192))),
             "negative shape": dict(k1=npy_member((c.n_head_kv, -1, c.head_dim))),
             "huge tokens": dict(tokens=npy_member((1 << 40,), descr="<i4")),
             "object array": dict(tokens=npy_member((1,), descr="|O"))}
    for what, members in cases.items():
        path = tmp_path / f"{what}.npz"
        with_members(good_session, path, zipfile.ZIP_DEFLATED, **members)
        tracemalloc.start()
        with pytest.raises(LocalLLMError, match="corrupt session file"):
            session_file.load(engine, path)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 4 << 20, (what, peak)  # nothing near the declared size was allocated, nor inflated


def test_a_session_file_with_a_nested_header_is_refused(engine, good_session, tmp_path):
    nested = ("[" * 30_000 + "]" * 30_000).encode()  # json recursion, within the header's 64 KiB bound
    cases = {"nested json": dict(header=npy_member((len(nested),), descr="|u1", data=nested)),
             "nested npy header": dict(k0=npy_member(None, header_text="{'descr': '<f4', 'fortran_order': False, "
                                                     "'shape': " + "(" * 500 + ")" * 500 + "}" + " " * 20 + "\n")),
             "huge json": dict(header=npy_member((1 << 30,), descr="|u1"))}
    for what, members in cases.items():
        path = tmp_path / f"{what}.npz"
        with_members(good_session, path, **members)
        with pytest.raises(LocalLLMError, match="session file"):
            session_file.load(engine, path)
    assert session_file.load(engine, good_session).tokens  # the file they came from loads
