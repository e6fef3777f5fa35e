"""The tile cache (kernels/cpu/tile_cache.py): a warm load maps the tiles an earlier load wrote, byte for byte the
tiles it would have made; a file that is not whole, of another model or of another layout is never read; the cache
stays within its budget and leaves nothing half-written behind."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from conftest import model_file

from localllm.gguf_constants import GGMLQuantizationType as Q
from localllm.gguf_file import GGUFFile
from localllm.kernels import ops
from localllm.kernels.cpu import tile_cache, tiled

needs_vnni = pytest.mark.skipif(not tiled.HAVE_AVX512_VNNI, reason="tiles are made only where there is AVX-512 VNNI")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_CACHE", str(tmp_path))
    monkeypatch.delenv("LOCALLLM_TILE_CACHE_GB", raising=False)
    tile_cache._total.clear()
    yield tmp_path / "tiles"
    tile_cache._total.clear()


def files(folder) -> list[str]:
    return sorted(os.listdir(folder)) if folder.exists() else []


def write(model: str, weight: str, data: np.ndarray) -> None:
    pending = tile_cache.create(model, weight, data.shape)
    assert pending is not None
    pending.array[...] = data
    pending.commit()


def test_tiles_written_to_the_cache_come_back_byte_for_byte_and_read_only(cache):
    data = np.random.default_rng(0).integers(0, 256, (32, 288), dtype=np.uint8)
    write("m", "w", data)
    got = tile_cache.load("m", "w", data.shape)
    assert np.array_equal(got, data) and not got.flags.writeable
    assert got.ctypes.data % 64 == 0  # the tiled kernels' aligned loads
    assert files(cache) == ["m-w.tiles"]


def test_tiles_being_written_are_never_read_and_an_abandoned_write_leaves_no_file(cache):
    pending = tile_cache.create("m", "w", (16, 64))
    assert tile_cache.load("m", "w", (16, 64)) is None  # not yet committed: under a temporary name
    pending.abandon()
    assert files(cache) == []


def test_a_cache_file_of_the_wrong_size_is_not_read(cache):
    write("m", "w", np.zeros((16, 64), np.uint8))
    path = cache / "m-w.tiles"
    with open(path, "r+b") as f:
        f.truncate(512)
    assert tile_cache.load("m", "w", (16, 64)) is None


def test_the_cache_keeps_within_its_budget_dropping_the_least_recently_used(cache, monkeypatch):
    monkeypatch.setenv("LOCALLLM_TILE_CACHE_GB", str(3 * 4096 / (1 << 30)))  # room for three 4 KiB weights
    for i in range(3):
        write("m", f"w{i}", np.full((16, 256), i, np.uint8))
        os.utime(cache / f"m-w{i}.tiles", (1000 + i, 1000 + i))
    assert tile_cache.load("m", "w0", (16, 256)) is not None  # used: now the most recent
    write("m", "w3", np.full((16, 256), 3, np.uint8))
    assert files(cache) == ["m-w0.tiles", "m-w2.tiles", "m-w3.tiles"]  # w1 was the least recently used


def test_a_budget_of_zero_or_a_disk_near_full_writes_nothing(cache, monkeypatch):
    monkeypatch.setenv("LOCALLLM_TILE_CACHE_GB", "0")
    assert tile_cache.create("m", "w", (16, 64)) is None
    monkeypatch.setenv("LOCALLLM_TILE_CACHE_GB", "8")
    usage = shutil.disk_usage(os.getcwd())
    monkeypatch.setattr(tile_cache.shutil, "disk_usage", lambda p: usage._replace(free=1 << 30))
    assert tile_cache.create("m", "w", (16, 64)) is None  # would leave less than 2 GiB free
    assert files(cache) == []


def test_a_temporary_file_left_by_a_killed_process_is_removed(cache):
    cache.mkdir(parents=True)
    stale = cache / ".m-w.tiles.12345.tmp"
    stale.write_bytes(b"x" * 100)
    os.utime(stale, (1, 1))
    write("m", "v", np.zeros((16, 64), np.uint8))
    assert files(cache) == ["m-v.tiles"]


def test_a_model_file_replaced_or_a_weight_of_other_bytes_gets_other_names(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"a" * 100)
    first = tile_cache.model_key(path)
    assert first == tile_cache.model_key(path)
    os.utime(path, ns=(1, 1))
    assert tile_cache.model_key(path) != first
    assert tile_cache.model_key(tmp_path / "missing.gguf") is None
    raw = np.zeros((16, 288), np.uint8)
    other = raw.copy()
    other[-1, -1] = 1
    key = tile_cache.weight_key("blk.0.attn_q.weight", None, Q.Q4_K, raw)
    assert key != tile_cache.weight_key("blk.0.attn_q.weight", None, Q.Q4_K, other)
    assert key != tile_cache.weight_key("blk.0.attn_k.weight", None, Q.Q4_K, raw)
    assert key != tile_cache.weight_key("blk.0.attn_q.weight", (0, 16), Q.Q4_K, raw)
    tile_cache._layout[:] = ["another layout"]
    try:
        assert key != tile_cache.weight_key("blk.0.attn_q.weight", None, Q.Q4_K, raw)
    finally:
        tile_cache._layout.clear()


@needs_vnni
def test_a_second_load_maps_the_tiles_the_first_one_made_and_multiplies_the_same(cache):
    g = GGUFFile(model_file("qwen2.5-coder-0.5b-instruct"))
    names = ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.1.ffn_gate.weight"]  # Q5_0, Q4_K / Q6_K, Q8_0
    first = [ops.Weight.from_gguf(g, n, tile=True) for n in names]
    assert len(files(cache)) == len(names)

    def no_tiling(*args, **kwargs):
        raise AssertionError("tiled again")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(tiled, "tile", no_tiling)
        again = [ops.Weight.from_gguf(g, n, tile=True) for n in names]
    x = np.random.default_rng(0).standard_normal((3, first[0].cols)).astype(np.float32)
    for name, a, b in zip(names, first, again):
        assert type(b.raw) is np.ndarray and not b.raw.flags.writeable, name
        assert b.tiled and np.array_equal(a.raw, b.raw), name
        fresh = tiled.tile(g.raw(name), g.tensors[name].qtype)
        assert np.array_equal(b.raw, fresh), name
    assert np.array_equal(ops.matmul(first[0], x), ops.matmul(again[0], x))
