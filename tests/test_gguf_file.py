"""GGUF reading: agreement with gguf-py's reader, and a clear error for each kind of broken file."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from conftest import VOCAB_DIR, model_file
from localllm.errors import ModelFileError
from localllm import gguf_file
from localllm.gguf_file import GGUFFile


def test_metadata_and_tensors_match_gguf_py_reader():
    path = model_file("smollm2-135m-instruct")
    ours = GGUFFile(path)
    theirs = gguf.GGUFReader(path)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        got = ours.metadata[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        assert got == pytest.approx(expected) if isinstance(expected, float) else got == expected, key
    assert len(ours.tensors) == len(theirs.tensors)
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(ours.raw(t.name).reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))


def test_weights_are_memory_mapped_not_copied():
    g = GGUFFile(model_file("smollm2-135m-instruct"))
    raw = g.raw("blk.0.ffn_up.weight")
    assert not raw.flags.owndata and not raw.flags.writeable


def test_vocab_only_file_opens_with_no_tensors():
    g = GGUFFile(VOCAB_DIR / "ggml-vocab-qwen2.gguf")
    assert g.tensors == {} and len(g.metadata["tokenizer.ggml.tokens"]) == 151936


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("this is a text file, not a model\n")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        GGUFFile(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        GGUFFile(empty)


def test_truncated_header(tmp_path):
    src = model_file("smollm2-135m-instruct").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src[:100_000])  # inside the vocabulary
    with pytest.raises(ModelFileError, match="truncated"):
        GGUFFile(cut)


def test_tensor_data_outside_the_file(tmp_path):
    src = model_file("smollm2-135m-instruct").read_bytes()
    cut = tmp_path / "half.gguf"
    cut.write_bytes(src[: len(src) // 2])  # header intact, later tensors missing
    with pytest.raises(ModelFileError, match="lies outside the file"):
        GGUFFile(cut)


def _tiny_gguf(path, tensor_type: int = 0, arch: str = "llama"):
    """A hand-written GGUF v3 with one 32x2 tensor of the given raw type id."""
    def s(text: str) -> bytes:
        b = text.encode()
        return struct.pack("<Q", len(b)) + b

    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 1)
    kv = s("general.architecture") + struct.pack("<I", 8) + s(arch)
    info = s("w") + struct.pack("<I", 2) + struct.pack("<QQ", 32, 2) + struct.pack("<IQ", tensor_type, 0)
    body = header + kv + info
    body += b"\0" * (-len(body) % 32)
    path.write_bytes(body + b"\0" * 256)
    return path


def test_unknown_tensor_type_id(tmp_path):
    with pytest.raises(ModelFileError, match="tensor type 999"):
        GGUFFile(_tiny_gguf(tmp_path / "t.gguf", tensor_type=999))


def test_unsupported_version(tmp_path):
    p = _tiny_gguf(tmp_path / "v.gguf")
    data = bytearray(p.read_bytes())
    data[4:8] = struct.pack("<I", 7)
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="unsupported GGUF version 7"):
        GGUFFile(p)


def test_missing_tensor_lookup(tmp_path):
    g = GGUFFile(_tiny_gguf(tmp_path / "t.gguf"))
    with pytest.raises(ModelFileError, match="tensor 'output.weight' is missing"):
        g.raw("output.weight")


# ---- a corrupt tensor directory: refused as the file is parsed, before anything reads tensor data ----------


@pytest.fixture
def tiny_layout(tmp_path):
    from gguf_mutate import parse
    from test_model_load import write_tiny_model

    return parse(write_tiny_model(tmp_path / "tiny.gguf"))


def test_tensors_whose_data_overlap_are_refused(tmp_path, tiny_layout):
    tiny_layout.tensors[3].offset = tiny_layout.tensors[2].offset
    with pytest.raises(ModelFileError, match="the data of tensors '.*' and '.*' overlap"):
        GGUFFile(tiny_layout.write(tmp_path / "m.gguf"))


def test_a_tensor_offset_off_the_alignment_is_refused(tmp_path, tiny_layout):
    tiny_layout.tensors[1].offset += 4
    with pytest.raises(ModelFileError, match="not a multiple of the file's alignment 32"):
        GGUFFile(tiny_layout.write(tmp_path / "m.gguf"))


def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path, tiny_layout):
    tiny_layout.set("general.alignment", gguf.GGUFValueType.UINT32, 0)
    with pytest.raises(ModelFileError, match="general.alignment is 0; it must be a power of two"):
        GGUFFile(tiny_layout.write(tmp_path / "m.gguf"))


def test_a_tensor_or_key_named_twice_is_refused(tmp_path, tiny_layout):
    twice = tiny_layout.copy()
    twice.tensors[5].name = twice.tensors[4].name
    with pytest.raises(ModelFileError, match="appears twice"):
        GGUFFile(twice.write(tmp_path / "t.gguf"))
    tiny_layout.kv.append(tiny_layout.kv[0])
    with pytest.raises(ModelFileError, match="key 'general.architecture' appears twice"):
        GGUFFile(tiny_layout.write(tmp_path / "k.gguf"))


def test_a_shape_whose_size_overflows_64_bits_is_refused(tmp_path, tiny_layout):
    # 2^32 x 2^32 elements: a 64-bit product wraps to 0 and would pass a size check done in numpy
    tiny_layout.tensors[1].ne = [2**32, 2**32]
    with pytest.raises(ModelFileError, match="lies outside the file"):
        GGUFFile(tiny_layout.write(tmp_path / "m.gguf"))


def test_arrays_nested_without_end_are_refused(tmp_path, tiny_layout):
    V = gguf.GGUFValueType
    nested = struct.pack("<IQ", V.UINT8, 0)
    for _ in range(5000):  # each level an array of one array: past Python's recursion limit
        nested = struct.pack("<IQI", V.ARRAY, 1, V.ARRAY) + nested
    tiny_layout.kv.append(("deep", V.ARRAY, nested))
    with pytest.raises(ModelFileError, match="nested more than"):
        GGUFFile(tiny_layout.write(tmp_path / "m.gguf"))


def _string_array_kv(strings: list[bytes]) -> bytes:
    V = gguf.GGUFValueType
    return struct.pack("<IQ", V.STRING, len(strings)) + b"".join(struct.pack("<Q", len(s)) + s for s in strings)


@pytest.mark.parametrize("with_nul", [False, True], ids=["plain", "a NUL inside a string"])
def test_string_arrays_decode_as_each_string_alone_would(tmp_path, tiny_layout, with_nul):
    # gguf_file._Cursor._string_array decodes the whole array at once (NUL-separated); every string must come
    # out as decoding it alone gives: empty ones, multi-byte characters, invalid UTF-8 cut at a string's end
    # (kept lossless as surrogate escapes), long ones; a string holding a NUL takes the per-string loop
    rng = np.random.default_rng(3)
    strings = [b"", b"hello", "Ġworld".encode(), "日本".encode(), "日本".encode()[:4], b"\xff\xfe", b"\xe6", b" " * 300]
    strings += [bytes(rng.integers(1, 256, int(rng.integers(0, 12)), dtype=np.uint8)) for _ in range(500)]
    if with_nul:
        strings.append(b"a\x00b")
    tiny_layout.kv.append(("strings", gguf.GGUFValueType.ARRAY, _string_array_kv(strings)))
    got = GGUFFile(tiny_layout.write(tmp_path / "m.gguf")).metadata["strings"]
    assert got == [s.decode("utf-8", "surrogateescape") for s in strings]


def test_a_string_array_running_past_the_end_of_the_file_is_truncation(tmp_path, tiny_layout):
    V = gguf.GGUFValueType
    tiny_layout.kv.append(("strings", V.ARRAY, struct.pack("<IQ", V.STRING, 3) + struct.pack("<Q", 1) + b"a"
                           + struct.pack("<Q", 2**40) + b"bc"))
    with pytest.raises(ModelFileError, match="truncated"):
        GGUFFile(tiny_layout.write(tmp_path / "m.gguf"))


def test_a_second_open_takes_the_vocabularys_lengths_from_the_cache_and_checks_them(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_CACHE", str(tmp_path / "cache"))
    path = model_file("smollm2-135m-instruct")  # 49k tokens, 48k merges: both arrays cached
    want = GGUFFile(path).metadata
    cached = sorted((tmp_path / "cache" / "headers").iterdir())
    assert len(cached) == 2

    read = gguf_file._Cursor._read_lengths

    def no_loop(self, count):
        assert count < gguf_file._CACHED_LENGTHS_FROM, "a cached array's lengths were read one by one"
        return read(self, count)

    with monkeypatch.context() as m:
        m.setattr(gguf_file._Cursor, "_read_lengths", no_loop)
        got = GGUFFile(path).metadata
    assert got["tokenizer.ggml.tokens"] == want["tokenizer.ggml.tokens"]
    assert got["tokenizer.ggml.merges"] == want["tokenizer.ggml.merges"]
    # A damaged file of the right size is caught by the check, read past, and written again.
    lengths = np.fromfile(cached[0], np.uint32)
    lengths[[0, 1]] = lengths[[1, 0]] + 1
    lengths.tofile(cached[0])
    again = GGUFFile(path).metadata
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        assert again[key] == want[key]
    assert not np.array_equal(np.fromfile(cached[0], np.uint32), lengths)


def test_a_string_array_that_runs_past_the_file_is_refused_with_its_lengths_cached_or_not(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_CACHE", str(tmp_path / "cache"))
    src = model_file("smollm2-135m-instruct")
    GGUFFile(src)  # caches the lengths for this file ...
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(src, "rb").read(1_000_000))  # ... but not for this one: the vocabulary is cut short
    for _ in range(2):
        with pytest.raises(ModelFileError, match="truncated"):
            GGUFFile(cut)
