"""`localllm convert hf://owner/repo[@rev]` against test_hub's loopback fake hub (issue 39: every download bounded):
the repo's listing is checked against --max-download and the free disk before anything is fetched, a body longer
than its declared size is stopped there, and a download that fails, is too long or is interrupted leaves nothing
where the checkpoint would be."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_hub import COMMIT, FakeHub, serve_overlong

from localllm.cli import convert_cmd as cli_convert
from localllm.store import disk
from localllm.store import hub
from localllm.errors import DownloadError, LocalLLMError

CKPT = Path(__file__).parent / "data" / "arch" / "llama3"
KEPT_IN_GIT = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    h = FakeHub()
    for name in (*KEPT_IN_GIT, "model.safetensors"):
        h.add("test/ckpt", name, CKPT / name)
    h.plain.update(KEPT_IN_GIT)
    other = tmp_path / "other.bin"
    other.write_bytes(b"\0" * 300_000)
    h.add("test/ckpt", "pytorch_model.bin", other)  # what a conversion does not read is not fetched
    h.add("test/ckpt", "original/model.safetensors", CKPT / "model.safetensors")
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LOCALLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("LOCALLLM_OFFLINE", raising=False)
    yield h
    h.close()


def fetched(h: FakeHub) -> list[str]:
    return [p.split("?")[0].split(f"/resolve/{COMMIT}/", 1)[1] for m, p, _ in h.requests
            if m == "GET" and "/resolve/" in p]


def files_left() -> list[str]:
    """Every file under the folder checkpoints are fetched into."""
    root = hub.checkpoints_dir()
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_a_checkpoint_is_fetched_file_by_file_checked_and_converted_and_a_second_run_downloads_nothing(
        fake_hub, tmp_path, monkeypatch):
    from localllm.cli.main import main
    from localllm.gguf_file import GGUFFile

    out = tmp_path / "o.gguf"
    assert main(["convert", "hf://test/ckpt", "-o", str(out), "-q"]) == 0
    assert sorted(fetched(fake_hub)) == sorted([*KEPT_IN_GIT, "model.safetensors"])
    with GGUFFile(out) as g:
        assert "token_embd.weight" in g.tensors
    folder = hub.checkpoints_dir() / "test--ckpt" / COMMIT
    for name in (*KEPT_IN_GIT, "model.safetensors"):
        assert (folder / name).read_bytes() == (CKPT / name).read_bytes()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".partial")]

    fake_hub.requests.clear()
    assert cli_convert.resolve_source("hf://test/ckpt", quiet=True) == folder
    assert fetched(fake_hub) == []
    monkeypatch.setenv("LOCALLLM_OFFLINE", "1")  # offline: the fetched folder, without a request
    fake_hub.requests.clear()
    assert cli_convert.resolve_source("hf://test/ckpt", quiet=True) == folder
    assert fake_hub.requests == []


def test_a_repo_declaring_more_than_max_download_is_refused_before_anything_is_downloaded(fake_hub, tmp_path,
                                                                                          capsys):
    from localllm.cli.main import main

    out = tmp_path / "o.gguf"
    assert main(["convert", "hf://test/ckpt", "-o", str(out), "--max-download", "100K"]) == 1
    err = capsys.readouterr().err
    assert "the 5 files a conversion reads declare 236.9 KB, more than the 100.0 KB allowed (--max-download)" \
        in err, err
    assert "nothing was downloaded" in err
    assert fetched(fake_hub) == [] and files_left() == [] and not out.exists()
    assert main(["convert", "hf://test/ckpt", "-o", str(out), "--max-download", "lots"]) == 1
    assert "'lots' is not a size" in capsys.readouterr().err
    # the same repo under a limit it fits fetches it
    assert cli_convert.resolve_source("hf://test/ckpt", True, disk.parse_size("1M")).is_dir()


def test_a_repo_larger_than_the_free_disk_is_refused_by_default(fake_hub, monkeypatch):
    monkeypatch.setattr(disk, "free_bytes", lambda path: disk.KEEP_FREE + 1000)
    with pytest.raises(DownloadError, match=r"more than the disk holding .* has free .*nothing was downloaded"):
        cli_convert.resolve_source("hf://test/ckpt", quiet=True)
    # an explicit limit does not raise the free disk's bound
    with pytest.raises(DownloadError, match="has free"):
        cli_convert.resolve_source("hf://test/ckpt", True, disk.parse_size("10G"))
    assert fetched(fake_hub) == [] and files_left() == []


def overlong(fake_hub: FakeHub, name: str, extra: int) -> None:
    serve_overlong(fake_hub, "test/ckpt", name, extra, COMMIT)


def test_a_file_longer_than_its_declared_size_is_stopped_there_and_nothing_is_left(fake_hub):
    size = (CKPT / "model.safetensors").stat().st_size
    overlong(fake_hub, "model.safetensors", 64 << 20)
    with pytest.raises(DownloadError, match=f"more than the {size} bytes it declared.*nothing was kept"):
        cli_convert.resolve_source("hf://test/ckpt", quiet=True)
    assert files_left() == []


def test_a_dropped_download_leaves_nothing_where_the_checkpoint_would_be_and_the_next_run_fetches_it_whole(
        fake_hub):
    fake_hub.drop_once["model.safetensors"] = 100_000
    fake_hub.fail_after_drop.add("model.safetensors")
    with pytest.raises(DownloadError) as e:
        cli_convert.resolve_source("hf://test/ckpt", quiet=True)
    assert "pull again" not in str(e.value) and "nothing was kept" in str(e.value)
    assert files_left() == []
    folder = cli_convert.resolve_source("hf://test/ckpt", quiet=True)
    assert (folder / "model.safetensors").read_bytes() == (CKPT / "model.safetensors").read_bytes()


def test_ctrl_c_mid_download_leaves_no_partial_files(fake_hub, monkeypatch):
    real = hub._download

    def interrupted(ref, base, revision, f, partial, *a, **k):
        if f.name == "model.safetensors":
            partial.write_bytes(b"x" * 1000)  # what had arrived
            raise KeyboardInterrupt
        return real(ref, base, revision, f, partial, *a, **k)

    monkeypatch.setattr(hub, "_download", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli_convert.resolve_source("hf://test/ckpt", quiet=True)
    assert files_left() == []


def test_a_file_kept_in_git_whose_bytes_differ_from_its_blob_id_is_refused(fake_hub):
    fake_hub.corrupt["config.json"] = 3
    with pytest.raises(DownloadError, match="config.json: git blob id .* does not match"):
        cli_convert.resolve_source("hf://test/ckpt", quiet=True)
    assert files_left() == []


def test_a_killed_runs_partial_folder_goes_with_the_next_run(fake_hub):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = hub.checkpoints_dir() / "test--ckpt" / f".partial-{COMMIT}-{dead.pid}"
    left.mkdir(parents=True)
    (left / "model.safetensors.partial").write_bytes(b"x" * 5000)
    live = hub.checkpoints_dir() / "test--ckpt" / f".partial-{COMMIT}-{os.getppid()}"  # a running process's
    live.mkdir()
    cli_convert.resolve_source("hf://test/ckpt", quiet=True)
    assert not left.exists() and live.exists()


def test_a_repo_that_is_not_a_safetensors_checkpoint_is_refused_before_downloading(fake_hub, tmp_path):
    fake_hub.add("test/gguf-only", "model-Q4_K_M.gguf", CKPT / "model.safetensors")
    with pytest.raises(DownloadError, match="no config.json and \\*.safetensors"):
        cli_convert.resolve_source("hf://test/gguf-only", quiet=True)
    with pytest.raises(LocalLLMError, match="not a branch, tag or commit"):
        cli_convert.resolve_source("hf://test/ckpt@../../x", quiet=True)
    assert fetched(fake_hub) == []
