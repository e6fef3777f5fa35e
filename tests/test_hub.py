"""Hub references and pull on demand, against a loopback fake hub (HF_ENDPOINT pointed at a server the tests
start): the real hub's API shapes that huggingface_hub calls (model info with `?blobs=true` siblings and LFS
sha256, HEAD/GET on /resolve with ETag, X-Repo-Commit, X-Linked-Etag, X-Linked-Size, and Range requests)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from localllm.store import catalog
from localllm.store import hub
from localllm.store import local as store
from localllm.errors import DownloadError, LocalLLMError, UnknownModelError
from localllm.gguf_file import GGUFFile

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SMOL = "smollm2-135m-instruct"


# ---- the fake hub ----------------------------------------------------------------------------------------


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, tuple[Path, str]]] = {}  # repo -> file -> (path, sha256)
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.drop_once: dict[str, int] = {}  # file -> bytes sent before the connection is dropped, once
        self.fail_after_drop: set[str] = set()  # files whose next request after the drop gets a 503
        self.corrupt: dict[str, int] = {}  # file -> offset of a flipped byte
        self.authorization: list[str | None] = []  # each request's Authorization header
        self.plain: set[str] = set()  # files kept in git, not LFS: no sha256, the git blob id as their ETag
        hub_self = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                hub_self.handle(self, body=True)

            def do_HEAD(self):
                hub_self.handle(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, repo: str, name: str, path: Path, sha256: str | None = None) -> None:
        if sha256 is None:
            sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        self.repos.setdefault(repo, {})[name] = (path, sha256)

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def _json(self, h, obj, status=200, extra=None):
        data = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(data)

    def handle(self, h, body: bool):
        path = h.path.split("?", 1)[0]
        self.requests.append((h.command, h.path, h.headers.get("Range")))
        self.authorization.append(h.headers.get("Authorization"))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            repo = m.group(1)
            if repo not in self.repos:
                return self._json(h, {"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"})
            siblings = [{"rfilename": "README.md", "size": 12, "blobId": "b" * 40}]
            for name, (p, sha) in self.repos[repo].items():
                size = p.stat().st_size
                if name in self.plain:
                    siblings.append({"rfilename": name, "size": size, "blobId": git_blob_id(p)})
                    continue
                siblings.append({"rfilename": name, "size": size, "blobId": sha[:40],
                                 "lfs": {"size": size, "sha256": sha, "pointerSize": 134}})
            return self._json(h, {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                  "siblings": siblings, "tags": ["gguf"]})
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if not m or m.group(1) not in self.repos or m.group(3) not in self.repos[m.group(1)]:
            return self._json(h, {"error": "Entry not found"}, 404, {"X-Error-Code": "EntryNotFound"})
        name = m.group(3)
        file, sha = self.repos[m.group(1)][name]
        size = file.stat().st_size
        if body and name in self.fail_after_drop and name not in self.drop_once:
            self.fail_after_drop.discard(name)
            return self._json(h, {"error": "unavailable"}, 503)
        start = 0
        rng = h.headers.get("Range")
        if rng:
            start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
        h.send_response(206 if rng else 200)
        h.send_header("Content-Length", str(size - start))
        h.send_header("Accept-Ranges", "bytes")
        if name in self.plain:
            h.send_header("ETag", f'"{git_blob_id(file)}"')
        else:
            h.send_header("ETag", f'"{sha}"')
            h.send_header("X-Linked-Etag", f'"{sha}"')
            h.send_header("X-Linked-Size", str(size))
        h.send_header("X-Repo-Commit", COMMIT)
        if rng:
            h.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        h.end_headers()
        if not body:
            return
        limit = self.drop_once.pop(name, None)
        with open(file, "rb") as f:
            f.seek(start)
            pos = start
            while block := f.read(1 << 20):
                if name in self.corrupt and pos <= self.corrupt[name] < pos + len(block):
                    i = self.corrupt[name] - pos
                    block = block[:i] + bytes([block[i] ^ 0xFF]) + block[i + 1:]
                if limit is not None and pos + len(block) >= limit:
                    h.wfile.write(block[: limit - pos])
                    h.wfile.flush()
                    h.connection.shutdown(socket.SHUT_RDWR)  # the connection drops midway
                    h.close_connection = True
                    return
                h.wfile.write(block)
                pos += len(block)


def git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def tiny_gguf(path: Path, label: str, n: int = 4096) -> Path:
    """A small GGUF whose general.name tells which file it is."""
    w = GGUFWriter(str(path), "llama")
    w.add_name(label)
    w.add_tensor("a.weight", np.arange(n, dtype=np.float32).reshape(-1, 64) + len(label))
    w.add_tensor("b.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


QUANTS = ["Q2_K", "Q4_K_M", "Q8_0", "f16"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hubfiles")
    out = {q: tiny_gguf(d / f"model-{q}.gguf", q.upper()) for q in QUANTS + ["Q3_K_M", "Q6_K"]}
    out["mmproj"] = tiny_gguf(d / "mmproj.gguf", "MMPROJ")
    out["big"] = tiny_gguf(d / "big.gguf", "BIG", n=6 * 1024 * 1024)  # 24 MB: drops land mid-file
    # A split set as gguf-split lays it out: every part a GGUF with split.* keys, the first holding the metadata.
    w = GGUFWriter(str(d / "split.gguf"), "llama", split_max_tensors=2)
    w.add_name("SPLIT")
    w.add_uint32("llama.block_count", 3)
    for i in range(5):
        w.add_tensor(f"t{i}.weight", np.full((8, 32), i, dtype=np.float32) + np.arange(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out["parts"] = sorted(d.glob("split-*-of-*.gguf"))
    w = GGUFWriter(str(d / "whole.gguf"), "llama")  # the same model in one file, to compare the join with
    w.add_name("SPLIT")
    w.add_uint32("llama.block_count", 3)
    for i in range(5):
        w.add_tensor(f"t{i}.weight", np.full((8, 32), i, dtype=np.float32) + np.arange(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out["whole"] = d / "whole.gguf"
    return out


@pytest.fixture
def fake_hub(files, tmp_path, monkeypatch):
    h = FakeHub()
    for q in QUANTS:
        h.add("test/repo", f"Model-{q}.gguf", files[q])
    h.add("test/repo", "mmproj-Model-f16.gguf", files["mmproj"])
    for q in ("Q3_K_M", "Q6_K", "f16"):
        h.add("test/noq4", f"noq4.{q}.gguf", files[q])
    h.add("test/big", "big-Q4_K_M.gguf", files["big"])
    n = len(files["parts"])
    for i, p in enumerate(files["parts"]):
        h.add("test/split", f"Q8_0/Split-Q8_0-{i + 1:05d}-of-{n:05d}.gguf", p)
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("LOCALLLM_OFFLINE", raising=False)
    yield h
    h.close()


def name_in(path: Path) -> str:
    return GGUFFile(path).get("general.name")


def leftovers() -> list[str]:
    """Anything in the store besides finished models: partials, staging folders, lock files."""
    found = []
    for p in Path(os.environ["LOCALLLM_HOME"], "models").rglob("*"):
        if p.is_file() and (".partial" in p.name or p.name.endswith(".lock") or ".hub-partial" in str(p)):
            found.append(str(p))
    return found


# ---- parsing ---------------------------------------------------------------------------------------------


def test_every_reference_form_parses_to_repo_tag_or_file():
    assert hub.parse("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M") == \
        hub.HubRef("bartowski/Llama-3.2-1B-Instruct-GGUF", tag="Q4_K_M")
    assert hub.parse("huggingface.co/u/r:q8_0") == hub.HubRef("u/r", tag="Q8_0")
    assert hub.parse("u/r") == hub.HubRef("u/r") == hub.parse("hf.co/u/r:latest")
    assert hub.parse("hf://u/r/sub/Model-Q5_K_M.gguf") == hub.HubRef("u/r", file="sub/Model-Q5_K_M.gguf")


UNSAFE = ["hf.co/../../etc/passwd", "hf.co/test/repo/../../x", "test/..", "../test/repo", "/etc/passwd",
          "/tmp/test/repo", "hf.co/test/re\0po", "hf.co/test\\repo", "test\\..\\repo", "https://evil.example/a/b",
          "http://127.0.0.1:1/test/repo", "file:///etc/passwd", "ftp://test/repo", "hf://test/repo/../x.gguf",
          "hf://test/repo//etc/passwd", "hf://test/repo/x.bin", "hf.co/test/repo:Q4_K_M/../../x",
          "hf.co/test/re%2e%2epo", "hf.co/test/repo?x=1", "test/repo@main", "hf.co/test--x/repo",
          "hf.co/test/repo:../x", "hf.co/te st/repo", "hf.co/test/repo\n"]


@pytest.mark.parametrize("text", UNSAFE)
def test_an_unsafe_reference_is_refused_by_the_parser(text):
    with pytest.raises(UnknownModelError):
        hub.parse(text)


def test_every_unsafe_reference_is_refused_before_the_hub_or_the_store_is_touched(fake_hub, tmp_path):
    victim = tmp_path / "victim.gguf"
    victim.write_bytes(b"GGUF keep me")
    for text in UNSAFE + [str(victim), "hf.co/../" + str(victim)]:
        with pytest.raises(LocalLLMError):
            store.pull_by_name(text, quiet=True)
        if not Path(text).exists():  # an existing file is a path for run and show (never for rm)
            with pytest.raises(LocalLLMError):
                store.ensure(text, quiet=True)
        with pytest.raises(LocalLLMError):
            store.remove(text)
    assert fake_hub.requests == []
    assert victim.read_bytes() == b"GGUF keep me"
    assert not Path(os.environ["LOCALLLM_HOME"], "models", "hub").exists()


def test_quant_names_are_read_from_file_names():
    assert hub.quant_of("Llama-3.2-1B-Instruct-Q4_K_M.gguf") == "Q4_K_M"
    assert hub.quant_of("model.q8_0.gguf") == "Q8_0"
    assert hub.quant_of("Q8_0/Model-Q8_0-00001-of-00002.gguf") == "Q8_0"
    assert hub.quant_of("qwen2.5-coder-0.5b-instruct-fp16.gguf") == "F16"
    assert hub.quant_of("Model-UD-IQ2_XXS.gguf") == "UD-IQ2_XXS"
    assert hub.quant_of("model.gguf") is None


# ---- pulling ---------------------------------------------------------------------------------------------


def test_pull_picks_the_tagged_file_case_insensitively_and_q4_k_m_by_default(fake_hub):
    r = store.pull_by_name("hf.co/test/repo:q8_0", quiet=True)
    assert r.downloaded and name_in(r.path) == "Q8_0"
    assert r.path.parent == hub.hub_dir()
    r = store.pull_by_name("test/repo", quiet=True)
    assert name_in(r.path) == "Q4_K_M"
    assert store.display_name("test/repo", r.path) == "hf.co/test/repo:Q4_K_M"
    prov = hub.provenance(r.path)
    assert prov["repo"] == "test/repo" and prov["revision"] == COMMIT
    assert prov["files"] == [{"file": "Model-Q4_K_M.gguf", "size": r.path.stat().st_size,
                              "sha256": hashlib.sha256(r.path.read_bytes()).hexdigest()}]
    assert prov["available"] == ["F16", "Q2_K", "Q4_K_M", "Q8_0"]  # never the mmproj file
    # the nearest quant when the repo has no Q4_K_M; a tag it lacks names the ones it has
    assert name_in(store.pull_by_name("hf.co/test/noq4", quiet=True).path) == "Q6_K"
    with pytest.raises(UnknownModelError, match="no Q5_K_M GGUF file; it has: F16, Q2_K, Q4_K_M, Q8_0"):
        store.pull_by_name("hf.co/test/repo:Q5_K_M", quiet=True)
    with pytest.raises(UnknownModelError, match="no such repository"):
        store.pull_by_name("hf.co/test/missing", quiet=True)
    # a second pull finds the file present (no download), and hf:// names a file directly
    n = len(fake_hub.requests)
    assert not store.pull_by_name("huggingface.co/test/repo:Q8_0", quiet=True).downloaded
    assert not any("/resolve/" in p and m == "GET" for m, p, _ in fake_hub.requests[n:])
    r = store.pull_by_name("hf://test/repo/Model-Q2_K.gguf", quiet=True)
    assert name_in(r.path) == "Q2_K" and store.display_name("x", r.path) == "hf://test/repo/Model-Q2_K.gguf"
    assert leftovers() == []


def test_hf_token_is_sent_on_every_hub_request(fake_hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_testtoken123")
    store.pull_by_name("hf.co/test/repo:Q2_K", quiet=True)
    ours = [auth for (_, path, _), auth in zip(fake_hub.requests, fake_hub.authorization)
            if path.startswith("/api/models/") or "/resolve/" in path]  # (not huggingface_hub's own calls)
    assert len(ours) == 3  # model info, HEAD, GET
    assert set(ours) == {"Bearer hf_testtoken123"}


def test_serve_offline_refuses_a_missing_reference_without_a_request(fake_hub):
    out = subprocess.run([sys.executable, "-m", "localllm", "serve", "hf.co/test/repo", "--offline", "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "not in the store" in out.stderr and "Traceback" not in out.stderr
    assert fake_hub.requests == []


def test_list_show_and_resolve_work_offline_and_rm_deletes_only_in_the_store(fake_hub, tmp_path):
    store.pull_by_name("hf.co/test/repo:Q8_0", quiet=True)
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
    cli = [sys.executable, "-m", "localllm"]
    out = subprocess.run(cli + ["list", "--json"], capture_output=True, text=True, env=env, timeout=60)
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["hf.co/test/repo:Q8_0"]["hub"]["revision"] == COMMIT
    out = subprocess.run(cli + ["show", "test/repo:q8_0", "--json"], capture_output=True, text=True, env=env,
                         timeout=60)
    info = json.loads(out.stdout)
    assert info["name"] == "Q8_0" and info["hub"]["files"][0]["file"] == "Model-Q8_0.gguf", out.stderr
    assert store.resolve("hf.co/test/repo:Q8_0") == store.resolve("test/repo:Q8_0")
    with pytest.raises(UnknownModelError, match="not in the store"):
        store.resolve("hf.co/test/repo:Q2_K")
    outside = tmp_path / "Model-Q8_0.gguf"
    outside.write_bytes(b"not the store's")
    path = store.remove("hf.co/test/repo:Q8_0")
    assert path.parent == hub.hub_dir() and not path.exists() and not path.with_suffix(".json").exists()
    assert outside.read_bytes() == b"not the store's"
    with pytest.raises(UnknownModelError, match="nothing was removed"):
        store.remove("hf.co/test/repo:Q8_0")


def test_a_split_gguf_is_downloaded_part_by_part_and_joined_into_one_valid_gguf(fake_hub, files):
    assert len(files["parts"]) == 3
    r = store.pull_by_name("hf.co/test/split:Q8_0", quiet=True)
    gets = [p for m, p, _ in fake_hub.requests if m == "GET" and "/resolve/" in p]
    assert len(gets) == 3
    joined, whole = GGUFFile(r.path), GGUFFile(files["whole"])
    assert list(joined.tensors) == list(whole.tensors)
    for name in whole.tensors:
        assert np.array_equal(joined.raw(name), whole.raw(name))
        assert joined.tensors[name].shape == whole.tensors[name].shape
    assert {k: v for k, v in joined.metadata.items()} == {k: v for k, v in whole.metadata.items()}
    assert not any(k.startswith("split.") for k in joined.metadata)
    assert r.path.read_bytes() == files["whole"].read_bytes()  # exactly the file written unsplit
    reader = GGUFReader(r.path)  # gguf-py's reader, independently of ours
    assert len(reader.tensors) == 5
    assert [f["file"] for f in hub.provenance(r.path)["files"]] == \
        [f"Q8_0/Split-Q8_0-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert leftovers() == []


def test_parts_out_of_order_are_refused_and_write_nothing(files, tmp_path):
    from localllm.errors import ModelFileError
    from localllm.store.gguf_split import join

    with pytest.raises(ModelFileError, match="expected part 0 of 3"):
        join(list(reversed(files["parts"])), tmp_path / "joined.gguf")
    with pytest.raises(ModelFileError, match="part 0 of 3, expected part 0 of 2"):  # a part missing
        join(files["parts"][:1] + files["parts"][2:], tmp_path / "joined.gguf")
    assert not (tmp_path / "joined.gguf").exists()


def test_a_dropped_connection_resumes_with_a_range_request(fake_hub, files):
    size = files["big"].stat().st_size
    fake_hub.drop_once["big-Q4_K_M.gguf"] = size // 2
    r = store.pull_by_name("hf.co/test/big", quiet=True)
    assert r.path.read_bytes() == files["big"].read_bytes()
    ranges = [rng for m, p, rng in fake_hub.requests if m == "GET" and rng]
    assert len(ranges) == 1 and 0 < int(ranges[0][6:-1]) <= size // 2


def test_a_pull_that_fails_midway_leaves_nothing_in_the_store_and_the_next_pull_resumes(fake_hub, files):
    size = files["big"].stat().st_size
    fake_hub.drop_once["big-Q4_K_M.gguf"] = size // 2
    fake_hub.fail_after_drop.add("big-Q4_K_M.gguf")
    with pytest.raises(DownloadError, match="pull again to resume"):
        store.pull_by_name("hf.co/test/big", quiet=True)
    assert hub.hub_models() == [] and not list(hub.hub_dir().glob("*.gguf"))
    n = len(fake_hub.requests)
    r = store.pull_by_name("hf.co/test/big", quiet=True)
    assert r.path.read_bytes() == files["big"].read_bytes()
    ranges = [rng for m, p, rng in fake_hub.requests[n:] if m == "GET" and rng]
    assert len(ranges) == 1 and int(ranges[0][6:-1]) > 0
    assert leftovers() == []


def test_a_corrupted_byte_is_caught_and_nothing_is_left_in_the_store(fake_hub, files):
    fake_hub.corrupt["Model-Q4_K_M.gguf"] = 1000
    with pytest.raises(DownloadError, match="does not match the hub's"):
        store.pull_by_name("hf.co/test/repo:Q4_K_M", quiet=True)
    assert hub.hub_models() == [] and leftovers() == []
    del fake_hub.corrupt["Model-Q4_K_M.gguf"]
    assert name_in(store.pull_by_name("hf.co/test/repo:Q4_K_M", quiet=True).path) == "Q4_K_M"


def test_an_unreachable_or_silent_hub_fails_within_seconds(fake_hub, monkeypatch):
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed}")
    t = time.monotonic()
    with pytest.raises(DownloadError, match="not reachable"):
        store.pull_by_name("hf.co/test/repo", quiet=True)
    assert time.monotonic() - t < 5
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.setenv("LOCALLLM_HUB_TIMEOUT", "2")
    t = time.monotonic()
    with pytest.raises(DownloadError, match="did not answer"):
        store.pull_by_name("hf.co/test/repo", quiet=True)
    assert time.monotonic() - t < 10
    silent.close()
    assert leftovers() == []


# ---- pull on demand: run, serve, and Ollama's /api/pull ----------------------------------------------------


@pytest.fixture(scope="module")
def smol_file():
    from conftest import model_file

    return model_file(SMOL)  # (module scope: looked up in the real store, before fake_hub points elsewhere)


@pytest.fixture
def smol_hub(smol_file, fake_hub):
    fake_hub.add("test/smol", "SmolLM2-135M-Instruct-Q4_K_M.gguf", smol_file, catalog.find(SMOL).sha256)
    return fake_hub


def test_run_pulls_a_missing_reference_with_progress_and_offline_refuses(smol_hub):
    cli = [sys.executable, "-m", "localllm", "run", "hf.co/test/smol", "Hello", "-n", "3", "--temp", "0"]
    out = subprocess.run(cli + ["--offline"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "not in the store" in out.stderr and "Traceback" not in out.stderr
    assert smol_hub.requests == []
    out = subprocess.run(cli, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "pulling SmolLM2-135M-Instruct-Q4_K_M.gguf" in out.stderr and out.stdout.strip()
    n = len(smol_hub.requests)
    out = subprocess.run(cli + ["--offline"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and len(smol_hub.requests) == n, out.stderr  # present: no network at all


def test_the_ollama_client_pulls_through_serve_which_pulled_its_own_model_on_demand(smol_hub):
    import ollama

    from test_server import start_server, stop_server

    proc, url = start_server("hf.co/test/smol", timeout=600)
    try:
        client = ollama.Client(host=url)
        events = list(client.pull("hf.co/test/repo:Q8_0", stream=True))
        statuses = [e.status for e in events]
        sha = smol_hub.repos["test/repo"]["Model-Q8_0.gguf"][1]
        assert statuses[0] == "pulling manifest" and statuses[-3:] == ["verifying sha256 digest",
                                                                       "writing manifest", "success"]
        layer = [e for e in events if e.status == f"pulling {sha[:12]}"]
        assert layer and layer[-1].digest == f"sha256:{sha}" and layer[-1].completed == layer[-1].total > 0
        assert client.pull("test/repo", stream=False).status == "success"
        again = [e.status for e in client.pull("hf.co/test/repo:q8_0", stream=True)]  # present: nothing fetched
        assert again == ["pulling manifest", f"pulling {sha[:12]}", "verifying sha256 digest", "writing manifest",
                         "success"]
        with pytest.raises(ollama.ResponseError) as err:
            client.pull("hf.co/../../etc/passwd", stream=False)
        assert err.value.status_code == 400
        with pytest.raises(ollama.ResponseError) as err:
            client.pull("hf.co/test/repo:Q5_K_M")
        assert "no Q5_K_M" in str(err.value)
        assert not any("etc" in p for _, p, _ in smol_hub.requests)
        names = {m.path.name for m in hub.hub_models()}
        assert len(names) == 3  # smol (pulled by serve), Q8_0 and the default Q4_K_M
    finally:
        err = stop_server(proc)
    assert "Traceback" not in err, err


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_the_tui_model_picker_pulls_a_typed_reference_and_loads_it(smol_hub):
    from localllm.tui.chat_app import ChatApp
    from localllm.tui.chat_session import load_engine
    from localllm.tui.screens import ModelPicker

    async def until(pilot, condition, timeout, what):
        start = time.monotonic()
        while not condition():
            assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
            await pilot.pause(0.05)

    app = ChatApp(None, loader=load_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        await pilot.press("escape")  # the first-run offer to pull the default model: declined
        await pilot.press("f3")
        picker = app.screen
        assert isinstance(picker, ModelPicker)
        await pilot.press("slash")
        box = picker.query_one("#reference")
        assert box.display and box.has_focus
        box.value = "hf.co/../../etc/passwd"
        await pilot.press("enter")
        assert "not a model reference" in str(picker.query_one("#pull_label").render())
        assert smol_hub.requests == [] and picker.pull_proc is None
        box.value = "hf.co/test/smol"
        await pilot.press("enter")
        await until(pilot, lambda: app.session is not None, 600, "the pulled model to load")
        assert app.session.engine.name == "hf.co/test/smol:Q4_K_M"
        assert [m.name for m in hub.hub_models()] == ["hf.co/test/smol:Q4_K_M"]


def serve_overlong(fake_hub: "FakeHub", repo: str, name: str, extra: int, commit: str) -> None:
    """From now on the hub declares `name`'s size but streams `extra` more bytes of it, chunked (no
    Content-Length): what a download must stop at the declared size."""
    real = fake_hub.handle

    def handle(h, body: bool):
        if not (body and h.command == "GET" and h.path.split("?")[0].endswith("/" + name)):
            return real(h, body)
        fake_hub.requests.append((h.command, h.path, h.headers.get("Range")))
        path, sha = fake_hub.repos[repo][name]
        data = path.read_bytes() + b"\0" * extra
        h.send_response(200)
        h.send_header("Transfer-Encoding", "chunked")
        h.send_header("ETag", f'"{sha}"')
        h.send_header("X-Repo-Commit", commit)
        h.end_headers()
        for i in range(0, len(data), 1 << 16):
            chunk = data[i:i + (1 << 16)]
            h.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        h.wfile.write(b"0\r\n\r\n")

    fake_hub.handle = handle
