"""Ollama's blob upload (POST /api/blobs/sha256:<hex>) bounded as a whole (issue 39: uploads have a budget): the
blobs folder's total (LOCALLLM_BLOBS_MAX) and the disk's free space kept, with a 413 in Ollama's error shape and
nothing written when either would be passed, whether the body declares its length or comes chunked. In process,
through the real application (no model is needed for the store's routes)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from localllm.store import disk
from localllm.server import models_api
from localllm.server.app import ApiError, ServerState
from localllm.server.asgi import create_app


@pytest.fixture
def client(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LOCALLLM_BLOBS_MAX", raising=False)
    state = ServerState(engine=None, scheduler=None, model_name="none", model_path="none", max_tokens=1, parallel=1)
    return TestClient(create_app(state), base_url="http://127.0.0.1:8080")  # (no lifespan: no scheduler runs)


def blobs(tmp_path: Path) -> list[str]:
    folder = tmp_path / "home" / "models" / "blobs"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def upload(client, data: bytes, chunked: bool = False):
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    if chunked:  # no Content-Length: the body's size is known only as it comes
        return client.post(f"/api/blobs/{digest}", content=(data[i:i + 4096] for i in range(0, len(data), 4096)))
    return client.post(f"/api/blobs/{digest}", content=data)


def test_a_blob_past_the_store_total_is_refused_and_nothing_is_written(client, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_BLOBS_MAX", "1000")
    first = b"a" * 600
    assert upload(client, first).status_code == 201
    r = upload(client, b"b" * 600)
    assert r.status_code == 413
    error = r.json()["error"]
    assert "blob store is full" in error and "LOCALLLM_BLOBS_MAX" in error and "nothing was written" in error
    assert str(tmp_path) not in error
    assert blobs(tmp_path) == ["sha256-" + hashlib.sha256(first).hexdigest()]
    assert upload(client, b"c" * 400).status_code == 201  # what still fits is stored


def test_a_chunked_blob_is_stopped_where_it_passes_the_store_total_and_nothing_is_kept(client, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setenv("LOCALLLM_BLOBS_MAX", "64K")
    monkeypatch.setattr(models_api, "BLOB_CLAIM_STEP", 16 << 10)
    r = upload(client, b"x" * (1 << 20), chunked=True)
    assert r.status_code == 413 and "blob store is full" in r.json()["error"]
    assert blobs(tmp_path) == []
    assert models_api._blob_claims == {}
    small = b"y" * 50_000  # a chunked blob that fits is stored, the step it claimed ahead notwithstanding
    assert upload(client, small, chunked=True).status_code == 201
    assert blobs(tmp_path) == ["sha256-" + hashlib.sha256(small).hexdigest()]


def test_a_blob_that_would_leave_less_than_the_kept_free_space_is_refused(client, tmp_path, monkeypatch):
    monkeypatch.setattr(disk, "free_bytes", lambda path: disk.KEEP_FREE + 500)
    for chunked in (False, True):
        r = upload(client, b"z" * 600, chunked=chunked)
        assert r.status_code == 413, r.text
        assert "does not fit" in r.json()["error"] and "nothing was written" in r.json()["error"]
    assert blobs(tmp_path) == []
    assert upload(client, b"z" * 400).status_code == 201


def test_uploads_in_flight_count_against_the_total(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_BLOBS_MAX", "1000")
    folder = tmp_path / "blobs"
    folder.mkdir()
    try:
        models_api._claim_blob_room(folder, folder / ".one.partial", 700)
        with pytest.raises(ApiError) as e:
            models_api._claim_blob_room(folder, folder / ".two.partial", 400)
        assert e.value.status == 413
        models_api._claim_blob_room(folder, folder / ".two.partial", 300)
    finally:
        models_api._blob_claims.clear()


def test_a_blob_already_stored_is_not_written_again(client, tmp_path, monkeypatch):
    data = b"q" * 600
    assert upload(client, data).status_code == 201
    monkeypatch.setenv("LOCALLLM_BLOBS_MAX", "700")  # a second copy would not fit; none is made
    assert upload(client, data).status_code == 200
    assert len(blobs(tmp_path)) == 1


def test_a_limit_that_is_not_a_size_is_an_error_not_no_limit(client, monkeypatch):
    monkeypatch.setenv("LOCALLLM_BLOBS_MAX", "lots")
    r = upload(client, b"w" * 10)
    assert r.status_code == 500 and "LOCALLLM_BLOBS_MAX" in r.json()["error"]
