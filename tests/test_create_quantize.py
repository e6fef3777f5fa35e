"""/api/create with `quantize` from a GGUF (issue 39: every compile or conversion of client input bounded and
stoppable): the quantization runs in a `localllm quantize` process with a memory and a time budget, as a
checkpoint's conversion does (create_worker.py), is stopped when its client goes, leaves nothing in the store when
it fails, and its errors name no path on the server."""

from __future__ import annotations

import hashlib
import shutil
import threading
import time
from pathlib import Path

import pytest

from localllm.gguf_file import GGUFFile
from localllm.server import create_worker, models_api
from localllm.server.app import ApiError
from tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "A.gguf", "A")  # F32 weights


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    return models


def as_blob(store: Path, path: Path) -> Path:
    """`path` as the store holds an uploaded blob."""
    data = path.read_bytes()
    blob = store / "blobs" / f"sha256-{hashlib.sha256(data).hexdigest()}"
    blob.parent.mkdir(exist_ok=True)
    blob.write_bytes(data)
    return blob


def files_in(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir() if p.is_file())


def test_api_create_quantizes_in_a_process_of_its_own(tiny, store, monkeypatch):
    from localllm.convert import quantize_gguf as quantize

    def not_here(*a, **k):
        raise AssertionError("the server process quantized")

    monkeypatch.setattr(quantize, "quantize_file", not_here)
    said = []
    models_api._create("small", "gguf", as_blob(store, tiny), "q8_0", said.append)
    assert "quantizing to Q8_0" in said
    with GGUFFile(store / "small.gguf") as g:
        assert g.tensors["blk.0.attn_q.weight"].qtype.name == "Q8_0"
    assert files_in(store) == ["small.gguf"]


def test_api_create_stops_a_quantization_past_its_time_budget_leaving_nothing(tiny, store, monkeypatch):
    monkeypatch.setattr(create_worker, "CONVERT_BASE_SECONDS", 0.3)
    monkeypatch.setattr(create_worker, "CONVERT_SECONDS_PER_GB", 0.0)
    t0 = time.monotonic()
    with pytest.raises(ApiError, match="the quantization took longer than its 0 s budget"):
        models_api._create("slow", "gguf", as_blob(store, tiny), "q4_k_m", lambda s: None)
    assert time.monotonic() - t0 < 3
    assert files_in(store) == []


def test_api_create_stops_its_quantization_when_the_client_goes(tiny, store):
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(ApiError, match="client went away: the quantization was stopped"):
        models_api._create("gone", "gguf", as_blob(store, tiny), "q4_k_m", lambda s: None, cancel)
    assert time.monotonic() - t0 < 3
    assert files_in(store) == []


def test_api_create_stops_a_quantization_past_its_memory_budget(tiny, store, monkeypatch):
    monkeypatch.setattr(create_worker, "BASE_MEMORY", 64 << 20)  # less than the interpreter and numpy take
    with pytest.raises(ApiError, match="the quantization needed more than its 0.1 GiB of memory"):
        models_api._create("big", "gguf", as_blob(store, tiny), "q4_k_m", lambda s: None)
    assert files_in(store) == []


def test_api_create_quantize_errors_name_no_server_path(tiny, store, tmp_path):
    from localllm.convert.quantize_gguf import quantize_file

    quantized = tmp_path / "q8.gguf"
    quantize_file(tiny, quantized, "q8_0")
    blob = as_blob(store, quantized)
    with pytest.raises(ApiError) as e:  # a quantized file is not quantized again
        models_api._create("again", "gguf", blob, "q4_k_m", lambda s: None)
    msg = e.value.message
    assert e.value.status == 400 and "the uploaded model is already quantized" in msg, msg
    assert str(tmp_path) not in msg and blob.name not in msg and ".partial" not in msg
    local = store / "q8.gguf"  # a model of the store: named by its file name only
    shutil.copyfile(quantized, local)
    with pytest.raises(ApiError) as e:
        models_api._create("again", "gguf", local, "q4_k_m", lambda s: None)
    assert "q8.gguf is already quantized" in e.value.message and str(tmp_path) not in e.value.message
    assert files_in(store) == ["q8.gguf"]
