"""Models by Hugging Face hub reference: parsing, choosing the file, pulling into the store, finding it again.

References (as Ollama and llama.cpp take them):

    hf.co/USER/REPO[:QUANT]          huggingface.co/USER/REPO[:QUANT]          USER/REPO[:QUANT]
    hf://USER/REPO/PATH/FILE.gguf    (one file, named)

A reference is never a path. It is parsed by `parse()` before anything touches the network or the disk, and
refused when it holds `..`, a NUL or another control character, a backslash, starts with `/`, or has a URL
scheme other than `hf://`; user and repo names follow the hub's own rule (letters, digits, `-`, `_`, `.`; no `--`
or `..`). The store file of a hub model is derived from its canonical name alone (percent-encoded, so it holds no
folder separator), inside `models_dir()/hub/`, so no reference can name a file elsewhere.

Choosing the file: the quant tag matches the quantization in the GGUF file names case-insensitively (`:q4_k_m`
and `:Q4_K_M` are one tag; `:latest` or no tag means the default). With no tag the file is the first present in
QUANT_PREFERENCE: Q4_K_M, then the nearest sizes around it (4-bit, then 5-bit, 6/8-bit, 3-bit, 2-bit, then
unquantized). A tag the repo does not have is an error listing the tags it has. Multimodal projector files
(`mmproj*`) are never chosen. A split GGUF (`...-00001-of-0000N.gguf`) is downloaded part by part and joined into
one GGUF (see gguf_split.py).

Downloads go through huggingface_hub: `HfApi.model_info(files_metadata=True)` for the file list with sizes and
LFS sha256, `get_hf_file_metadata` (HEAD on /resolve: commit, ETag, size) and `http_get` into a partial file
of our own (`.hub-partial-<name>/`), which survives a dropped connection or a Ctrl-C so that the next pull
resumes with a Range request; http_get itself retries a dropped connection within one pull. Each file's sha256
is checked against the hub's; a mismatch deletes the partial (it must not be resumed). `HF_TOKEN` and
`HF_ENDPOINT` are read when a pull starts. The finished file is renamed into place, with its provenance (repo,
revision, files, sha256, size) in `<name>.json` beside it: `list` and `show` read that, offline.
"""

from __future__ import annotations

import datetime as dt
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlparse

from localllm import paths
from localllm.errors import DownloadError, OfflineError, UnknownModelError
from localllm.store.gguf_split import join, split_index
from localllm.progress import note, progress_bar

DEFAULT_QUANT = "Q4_K_M"
# The order a missing default falls back in: the 4-bit mixes nearest Q4_K_M first, then a bit larger (better
# quality), then smaller, then unquantized.
QUANT_PREFERENCE = (
    "Q4_K_M", "Q4_K_S", "Q4_K_L", "IQ4_XS", "IQ4_NL", "Q4_0", "Q4_1", "Q4_K",
    "Q5_K_M", "Q5_K_S", "Q5_K_L", "Q5_0", "Q5_1", "Q5_K",
    "Q6_K", "Q6_K_L", "Q8_0",
    "Q3_K_L", "Q3_K_M", "Q3_K_XL", "Q3_K_S", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS",
    "Q2_K", "Q2_K_L", "Q2_K_S", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S",
    "BF16", "F16", "F32",
)
QUANT_RE = re.compile(
    r"(?:^|[-._/])((?:UD-)?(?:I?Q[1-8](?:_[A-Z0-9]+)*|BF16|F16|F32|FP16|FP32|TQ[12]_0|MXFP4(?:_MOE)?))(?=$|[-._])",
    re.IGNORECASE)
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
TAG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
FILE_PART_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}")
PREFIXES = ("hf.co/", "huggingface.co/")
DEFAULT_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 3.0


class ReferenceError_(UnknownModelError):
    """A text that is not a safe hub reference."""


@dataclass(frozen=True)
class HubRef:
    repo: str  # USER/REPO
    tag: str | None = None  # the quant tag as asked for, upper-cased; None: the default
    file: str | None = None  # hf:// form: the file inside the repo

    @property
    def requested(self) -> str:
        """The reference as asked for, in canonical spelling (the name a later `run` may use again)."""
        if self.file:
            return f"hf://{self.repo}/{self.file}"
        return f"hf.co/{self.repo}" + (f":{self.tag}" if self.tag else "")


# ---- parsing ---------------------------------------------------------------------------------------------


def _refuse(text: str, why: str) -> ReferenceError_:
    return ReferenceError_(f"{text!r} is not a model reference: {why}. A reference is hf.co/USER/REPO[:QUANT], "
                           "USER/REPO[:QUANT] or hf://USER/REPO/FILE.gguf")


def _check_name(text: str, part: str, what: str) -> None:
    if not NAME_RE.fullmatch(part) or "--" in part or ".." in part or part.endswith("."):
        raise _refuse(text, f"{what} {part!r} is not a hub name (letters, digits, '-', '_', '.'; no '--' or '..')")


def looks_like_reference(text: str) -> bool:
    """Whether `text` is meant as a hub reference (it may still be refused by parse): an hf.co/huggingface.co
    prefix, an hf:// URL, or USER/REPO[:TAG] with no .gguf suffix."""
    if not isinstance(text, str):
        return False
    low = text.lower()
    if low.startswith(PREFIXES) or low.startswith("hf://"):
        return True
    if text.endswith(".gguf") or text.startswith(("/", ".", "~")):
        return False
    return re.fullmatch(r"[^/\s]+/[^/\s]+", text) is not None


def parse(text: str) -> HubRef:
    """A HubRef, or ReferenceError_ saying why not. Pure: no network, no file access."""
    if not isinstance(text, str) or not text:
        raise _refuse(str(text), "it is empty")
    if len(text) > 400:
        raise _refuse(text[:40] + "...", "it is longer than 400 characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise _refuse(text, "it holds a NUL or another control character")
    if "\\" in text:
        raise _refuse(text, "it holds a backslash")
    if ".." in text:
        raise _refuse(text, "it holds '..'")
    if text.startswith("/"):
        raise _refuse(text, "it is an absolute path")
    if any(c.isspace() for c in text) or "%" in text or "?" in text or "#" in text or "@" in text:
        raise _refuse(text, "it holds spaces, '%', '?', '#' or '@'")
    low = text.lower()
    if low.startswith("hf://"):
        rest = text[5:]
        segments = rest.split("/")
        if len(segments) < 3:
            raise _refuse(text, "hf:// needs USER/REPO/FILE.gguf")
        user, repo, *file_parts = segments
        _check_name(text, user, "user")
        _check_name(text, repo, "repo")
        for seg in file_parts:
            if not FILE_PART_RE.fullmatch(seg):
                raise _refuse(text, f"file path part {seg!r} is not a plain file name")
        if not file_parts[-1].lower().endswith(".gguf"):
            raise _refuse(text, "hf:// names a .gguf file")
        return HubRef(f"{user}/{repo}", file="/".join(file_parts))
    if "://" in text or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", text.split("/")[0] + ("/" if "/" in text else "")):
        raise _refuse(text, "only hf:// URLs are references (no other URL schemes)")
    for prefix in PREFIXES:
        if low.startswith(prefix):
            text_rest = text[len(prefix):]
            break
    else:
        text_rest = text
    repo_part, colon, tag = text_rest.partition(":")
    segments = repo_part.split("/")
    if len(segments) != 2:
        raise _refuse(text, "it needs exactly USER/REPO")
    user, repo = segments
    _check_name(text, user, "user")
    _check_name(text, repo, "repo")
    if colon:
        if not TAG_RE.fullmatch(tag):
            raise _refuse(text, f"the tag {tag!r} is not a quantization name such as Q4_K_M")
        tag = None if tag.lower() == "latest" else tag.upper()
    return HubRef(f"{user}/{repo}", tag=tag or None)


# ---- choosing the file -----------------------------------------------------------------------------------


def quant_of(filename: str) -> str | None:
    """The quantization named in a GGUF file name (upper-case), e.g. 'Q4_K_M' for 'Llama-3.2-1B-Q4_K_M.gguf'."""
    base = filename.rsplit("/", 1)[-1]
    base = re.sub(r"(-\d{5}-of-\d{5})?\.gguf$", "", base, flags=re.IGNORECASE)
    found = QUANT_RE.findall(base)
    if not found:
        # a folder named after the quant (bartowski's split models: Q8_0/model-Q8_0-00001-of-00002.gguf)
        found = QUANT_RE.findall(filename.rsplit("/", 1)[0]) if "/" in filename else []
    if not found:
        return None
    q = found[-1].upper()
    return {"FP16": "F16", "FP32": "F32"}.get(q, q)


@dataclass(frozen=True)
class HubFile:
    name: str  # path inside the repo
    size: int | None
    sha256: str | None
    git_sha1: str | None = None  # the git blob id: what checks a file kept outside LFS (a config, a tokenizer)


def _gguf_groups(files: list[HubFile]) -> dict[str, list[HubFile]]:
    """GGUF models of the repo: a single file, or the parts of a split set in order, by their first file."""
    groups: dict[str, list[HubFile]] = {}
    for f in files:
        base = f.name.rsplit("/", 1)[-1].lower()
        if not base.endswith(".gguf") or "mmproj" in base:
            continue
        idx = split_index(f.name)
        if idx is None:
            groups[f.name] = [f]
            continue
        no, count = idx
        key = re.sub(r"-\d{5}-of-\d{5}\.gguf$", f"-00001-of-{count:05d}.gguf", f.name, flags=re.IGNORECASE)
        groups.setdefault(key, []).append(f)
    whole = {}
    for key, members in groups.items():
        idx = split_index(key)
        if idx is not None:
            members = sorted(members, key=lambda m: split_index(m.name)[0])
            if [split_index(m.name)[0] for m in members] != list(range(1, idx[1] + 1)):
                continue  # an incomplete split set cannot be loaded
        whole[key] = members
    return whole


def choose(ref: HubRef, files: list[HubFile]) -> tuple[str, list[HubFile]]:
    """(quant tag, the files to download in order) for the reference, among the repo's files."""
    groups = _gguf_groups(files)
    if ref.file:
        for key, members in groups.items():
            if ref.file in (m.name for m in members):
                return quant_of(key) or "", members
        raise UnknownModelError(f"{ref.repo} has no GGUF file {ref.file}")
    if not groups:
        raise UnknownModelError(f"{ref.repo} holds no GGUF file (localllm runs GGUF models)")
    by_quant: dict[str, list[HubFile]] = {}
    for key in sorted(groups, key=lambda k: (k.count("/"), len(k), k)):  # the shortest name of a quant wins
        q = quant_of(key)
        if q is not None:
            by_quant.setdefault(q, groups[key])
    if ref.tag:
        wanted = ref.tag.upper()
        if wanted in by_quant:
            return wanted, by_quant[wanted]
        have = ", ".join(sorted(by_quant)) or "(no quantization tags in its file names)"
        raise UnknownModelError(f"{ref.repo} has no {wanted} GGUF file; it has: {have}")
    for q in QUANT_PREFERENCE:
        if q in by_quant:
            return q, by_quant[q]
    if by_quant:
        q = sorted(by_quant)[0]
        return q, by_quant[q]
    only = sorted(groups)
    if len(only) == 1:
        return "", groups[only[0]]
    raise UnknownModelError(f"{ref.repo} has several GGUF files and none names its quantization; name one with "
                            f"hf://{ref.repo}/FILE.gguf: {', '.join(only)}")


# ---- the store's hub folder ------------------------------------------------------------------------------


def hub_dir() -> Path:
    return paths.models_dir() / "hub"


def canonical_name(ref: HubRef, tag: str, first_file: str) -> str:
    """The name `list` shows for a pulled model: hf.co/USER/REPO:TAG when it was chosen by tag, else (hf://
    references, or a repo's only GGUF whose name holds no tag) hf://USER/REPO/FILE."""
    if ref.file or not tag:
        return f"hf://{ref.repo}/{first_file}"
    return f"hf.co/{ref.repo}:{tag}"


def _encode(name: str) -> str:
    return quote(name, safe="-_.:")  # '/' becomes %2F: one plain file name, never a path


def store_path(name: str) -> Path:
    """The GGUF file of a hub model name in the store (a canonical name, as `list` shows it)."""
    path = hub_dir() / f"{_encode(name)}.gguf"
    if path.parent != hub_dir() or path.name.startswith("."):  # cannot happen for a parsed name; kept as a guard
        raise UnknownModelError(f"{name!r} cannot be a store name")
    return path


def _meta_path(gguf: Path) -> Path:
    return gguf.with_suffix(".json")


@dataclass(frozen=True)
class HubModel:
    name: str
    path: Path
    size: int
    provenance: dict


def hub_models() -> list[HubModel]:
    """Pulled hub models, from their provenance files (no network)."""
    folder = hub_dir()
    if not folder.is_dir():
        return []
    found = []
    for meta in sorted(folder.glob("*.json")):
        gguf = meta.with_suffix(".gguf")
        try:
            prov = json.loads(meta.read_text())
            size = gguf.stat().st_size
        except (OSError, ValueError):
            continue
        if isinstance(prov, dict) and isinstance(prov.get("name"), str) and store_path(prov["name"]) == gguf:
            found.append(HubModel(prov["name"], gguf, size, prov))
    return found


def find_local(ref: HubRef) -> HubModel | None:
    """The pulled model a reference names, if any: the same repo and file, or tag, or (no tag) the one pulled as
    the repo's default."""
    for m in hub_models():
        p = m.provenance
        if p.get("repo", "").lower() != ref.repo.lower():
            continue
        if ref.file:
            if ref.file in [f.get("file") for f in p.get("files", [])]:
                return m
        elif ref.tag:
            if (p.get("quant") or "").upper() == ref.tag:
                return m
        elif p.get("default_for_repo"):
            return m
    return None


def provenance(path: Path) -> dict | None:
    """The provenance of a store file, when it is a pulled hub model."""
    if path.parent != hub_dir():
        return None
    try:
        return json.loads(_meta_path(path).read_text())
    except (OSError, ValueError):
        return None


def remove(text: str) -> Path:
    """Delete the pulled model a reference names, and any partial download of it: only files in the hub folder,
    found from the provenance records (never from the text as a path)."""
    ref = parse(text)
    found = find_local(ref)
    if found is None:
        raise UnknownModelError(f"{ref.requested} is not in the store (`localllm list` shows what is); nothing "
                                "was removed")
    if found.path.parent != hub_dir():
        raise UnknownModelError(f"{found.path} is outside the store; nothing was removed")
    paths.remove_derived_files(found.path)
    found.path.unlink(missing_ok=True)
    _meta_path(found.path).unlink(missing_ok=True)
    found.path.with_name(f".{found.path.name}.verified.json").unlink(missing_ok=True)
    shutil.rmtree(_staging(found.name), ignore_errors=True)
    return found.path


# ---- pulling ---------------------------------------------------------------------------------------------


Progress = Callable[[dict], None]  # Ollama-shaped events: {"status", ["digest", "total", "completed"]}


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no") or \
        os.environ.get("LOCALLLM_OFFLINE", "0").lower() not in ("0", "", "false", "no")


def endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _timeout() -> float:
    try:
        return float(os.environ.get("LOCALLLM_HUB_TIMEOUT", DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def _probe(url: str) -> None:
    """One TCP connect with a short timeout, so an unreachable hub fails in seconds (huggingface_hub's own
    retries of an unreachable host take ~25 s per file)."""
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise DownloadError(f"HF_ENDPOINT {url!r} is not an http(s) URL")
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((u.hostname, port), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as e:
        raise DownloadError(f"the hub at {url} is not reachable ({e.strerror or e}); pull again when it is, "
                            "or use a model already in the store") from None


def _staging(name: str) -> Path:
    return paths.models_dir() / f".hub-partial-{_encode(name)}"


def _list_files(ref: HubRef, base: str, revision: str | None = None) -> tuple[str, list[HubFile]]:
    """(the commit, the repo's files with their sizes and digests) at `revision` (default: main)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = HfApi(endpoint=base).model_info(ref.repo, revision=revision, files_metadata=True,
                                               timeout=_timeout())
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise DownloadError(f"{ref.repo}: the hub refused access ({status}); a gated or private repo needs "
                                "HF_TOKEN") from None
        if status == 404:
            raise UnknownModelError(f"{ref.repo}: no such repository" + (f" or revision {revision!r}" if revision
                                                                         else "") + " on the hub") from None
        raise DownloadError(f"{ref.repo}: {str(e).splitlines()[0]}") from None
    except (OSError, ValueError) as e:
        raise DownloadError(f"{ref.repo}: the hub did not answer ({e})") from None
    except Exception as e:  # httpx errors (timeouts, protocol errors) are not OSErrors
        if type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore"):
            raise DownloadError(f"{ref.repo}: the hub did not answer ({type(e).__name__}: {e})") from None
        raise
    files = [HubFile(s.rfilename, s.lfs.size if s.lfs else s.size, s.lfs.sha256 if s.lfs else None,
                     getattr(s, "blob_id", None) if not s.lfs else None)
             for s in info.siblings or []]
    return info.sha or "main", files


class _TooLong(Exception):
    pass


class _CountingFile:
    """The partial file as http_get sees it: every write is counted for the progress events, and none may take
    it past `limit` bytes (the size the hub declared: a longer body is refused, not written)."""

    def __init__(self, f, done: int, report: Callable[[int], None], limit: int):
        self._f, self.done, self._report, self.limit = f, done, report, limit

    def write(self, data) -> int:
        if self._f.tell() + len(data) > self.limit:
            raise _TooLong()
        n = self._f.write(data)
        self.done += len(data)
        self._report(self.done)
        return n

    def seek(self, *a):
        r = self._f.seek(*a)
        self.done = self._f.tell()
        return r

    def tell(self):
        return self._f.tell()

    def truncate(self, *a):
        return self._f.truncate(*a)


def _git_blob_id(path: Path) -> str:
    """The git blob id of a file (sha1 of 'blob SIZE\\0' and its bytes): the hub's digest of a file outside LFS."""
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as src:
        while block := src.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def _download(ref: HubRef, base: str, revision: str, f: HubFile, partial: Path, quiet: bool,
              progress: Progress | None, git_ok: bool = False) -> str:
    """Download one file into `partial` (resuming what is there), check size and sha256; its sha256. With
    `git_ok`, a file outside LFS (no sha256 on the hub) is checked against its git blob id instead, which is
    returned."""
    if offline():
        raise OfflineError(f"{f.name}: the network is off (--offline or HF_HUB_OFFLINE); nothing was downloaded")
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers, disable_progress_bars

    from huggingface_hub import constants

    disable_progress_bars()
    # http_get reads its stream in chunks of this size (10 MiB by default); a dropped connection loses the chunk
    # in flight, and progress moves by whole chunks: 1 MiB keeps both small.
    constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, 1 << 20)
    url = hf_hub_url(ref.repo, f.name, revision=revision, endpoint=base)
    try:
        meta = get_hf_file_metadata(url, timeout=_timeout(), endpoint=base)
    except HfHubHTTPError as e:
        raise DownloadError(f"{f.name}: {str(e).splitlines()[0]}") from None
    except Exception as e:
        if isinstance(e, OSError) or type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore"):
            raise DownloadError(f"{f.name}: the hub did not answer ({type(e).__name__}: {e})") from None
        raise
    size = meta.size if meta.size is not None else f.size
    expected = (f.sha256 or (meta.etag if meta.etag and re.fullmatch(r"[0-9a-f]{64}", meta.etag) else None))
    git_id = None
    if expected is None and git_ok:
        git_id = f.git_sha1 or (meta.etag if meta.etag and re.fullmatch(r"[0-9a-f]{40}", meta.etag) else None)
    if expected is None and git_id is None:
        raise DownloadError(f"{f.name}: the hub gives no sha256 for it, so it cannot be verified")
    if f.sha256 and meta.etag and re.fullmatch(r"[0-9a-f]{64}", meta.etag) and meta.etag != f.sha256:
        raise DownloadError(f"{f.name}: the hub's listing and its file disagree on the sha256 ({f.sha256} vs "
                            f"{meta.etag}); try again later")
    if f.size is not None and size is not None and f.size != size:
        raise DownloadError(f"{f.name}: the hub's listing says {f.size} bytes, the file {size}")
    if size is None:
        raise DownloadError(f"{f.name}: the hub gives no size for it, so its download could not be bounded")
    digest = "sha256:" + (expected or git_id)
    have = partial.stat().st_size if partial.exists() else 0
    if size is not None and have > size:
        partial.unlink()
        have = 0
    if have and not quiet:
        note(f"resuming {f.name} at {have / 1e6:.1f} MB", quiet)
    last = [0.0]

    with progress_bar(f"pulling {f.name.rsplit('/', 1)[-1]}", size, quiet) as bar:
        def report(done: int) -> None:
            bar.update(done)
            now = time.monotonic()
            if progress is not None and (now - last[0] > 0.1 or done == size):
                last[0] = now
                progress({"status": f"pulling {digest[7:19]}", "digest": digest, "total": size,
                          "completed": done})

        report(have)
        if size is None or have < size:
            headers = build_hf_headers()
            headers["Accept-Encoding"] = "identity"
            try:
                with open(partial, "ab") as out:
                    http_get(meta.location, _CountingFile(out, have, report, size), resume_size=have,
                             headers=headers, expected_size=size, displayed_filename=f.name)
            except _TooLong:
                partial.unlink(missing_ok=True)
                raise DownloadError(f"{f.name}: the hub sent more than the {size} bytes it declared; the download was "
                                    "stopped there and removed") from None
            except HfHubHTTPError as e:
                raise DownloadError(f"{f.name}: {str(e).splitlines()[0]} (pull again to resume)") from None
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise
                raise DownloadError(f"{f.name}: {e} (pull again to resume)") from None
            except Exception as e:
                if type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore"):
                    raise DownloadError(f"{f.name}: the connection failed ({type(e).__name__}); pull again to "
                                        "resume") from None
                raise
    if progress is not None:
        progress({"status": "verifying sha256 digest"})
    if git_id is not None:
        got = _git_blob_id(partial)
        if got != git_id:
            partial.unlink(missing_ok=True)
            raise DownloadError(f"{f.name}: git blob id {got} does not match the hub's {git_id}; the download "
                                "was removed")
        return got
    h = hashlib.sha256()
    with open(partial, "rb") as src:
        while block := src.read(8 << 20):
            h.update(block)
    got = h.hexdigest()
    if got != expected:
        partial.unlink(missing_ok=True)  # a corrupt partial must not be resumed
        raise DownloadError(f"{f.name}: sha256 {got} does not match the hub's {expected}; the download was "
                            "removed")
    return got


def pull(text: str, quiet: bool = False, progress: Progress | None = None, *, lock, remember_verified
         ) -> tuple[str, Path, bool]:
    """Pull a reference into the store: (its listed name, its file, whether anything was downloaded). `lock` and
    `remember_verified` are the store's (store.pull_reference passes them: one lock per model file for catalog
    and hub pulls alike, without an import cycle)."""
    ref = parse(text)  # before any network or file access
    if progress is not None:
        progress({"status": "pulling manifest"})
    if offline():
        found = find_local(ref)
        if found:
            return found.name, found.path, False
        raise OfflineError(f"{ref.requested} is not in the store and the network is off (--offline or "
                           "HF_HUB_OFFLINE)")
    base = endpoint()
    _probe(base)
    revision, files = _list_files(ref, base)
    tag, chosen = choose(ref, files)
    name = canonical_name(ref, tag, chosen[0].name)
    # the store's file names (staging folder, partials, the model and its records) must fit the file system's
    # 255 bytes a name: a hub file name longer than that is refused here, not met as an OSError midway
    longest = max([len(_staging(name).name.encode()), len(f".{_encode(name)}.gguf.verified.json".encode()) + 12,
                   *(len((_encode(f.name) + ".partial").encode()) for f in chosen)])
    if longest > 255:
        shown = max([name, *(f.name for f in chosen)], key=len)
        raise DownloadError(f"{ref.repo}: the name {shown[:80]!r}... is too long for a file name in the store "
                            f"({longest} bytes encoded, 255 at most)")
    dest = store_path(name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with lock(dest, quiet):
        prov = provenance(dest)
        want = [{"file": f.name, "size": f.size, "sha256": f.sha256} for f in chosen]
        if dest.exists() and prov and prov.get("revision") == revision and prov.get("files") == want:
            _add_alias(dest, prov, ref)
            if progress is not None:
                for f in chosen:
                    progress({"status": f"pulling {(f.sha256 or '')[:12]}", "digest": f"sha256:{f.sha256}",
                              "total": f.size, "completed": f.size})
                progress({"status": "verifying sha256 digest"})  # (the store's file was verified when pulled)
                progress({"status": "writing manifest"})
            return name, dest, False
        staging = _staging(name)
        staging.mkdir(parents=True, exist_ok=True)
        # Partials of another revision are other bytes: start those files over.
        stamp = staging / "revision"
        if stamp.exists() and stamp.read_text() != revision:
            shutil.rmtree(staging)
            staging.mkdir()
        stamp.write_text(revision)
        parts = []
        total = sum(f.size or 0 for f in chosen)
        if total and shutil.disk_usage(dest.parent).free < total * (2 if len(chosen) > 1 else 1):
            raise DownloadError(f"not enough disk space in {dest.parent} for {name} ({total / 1e9:.2f} GB, "
                                f"{'twice over to join its parts' if len(chosen) > 1 else 'once'})")
        try:
            try:
                for f in chosen:
                    part = staging / (_encode(f.name) + ".partial")
                    sha = _download(ref, base, revision, f, part, quiet, progress)
                    parts.append((f, part, sha))
            except BaseException:
                # Keep the staging folder only when it holds bytes a next pull can resume from.
                if not any(p.stat().st_size for p in staging.glob("*.partial")):
                    shutil.rmtree(staging, ignore_errors=True)
                raise
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
            meta_tmp = _meta_path(dest).with_name(f".{dest.stem}.json.partial")
            try:
                if len(parts) == 1:
                    os.replace(parts[0][1], tmp)
                else:
                    note(f"joining {len(parts)} parts of {name}", quiet)
                    join([p for _, p, _ in parts], tmp)
                if progress is not None:
                    progress({"status": "writing manifest"})
                h = hashlib.sha256()
                with open(tmp, "rb") as src:
                    while block := src.read(8 << 20):
                        h.update(block)
                record = {"name": name, "repo": ref.repo, "revision": revision, "quant": tag, "files": want,
                          "sha256": h.hexdigest(), "size": tmp.stat().st_size, "endpoint": base,
                          "pulled_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                          "requested": [ref.requested], "default_for_repo": ref.tag is None and ref.file is None,
                          "available": sorted({q for q in (quant_of(k) for k in _gguf_groups(files)) if q})}
                meta_tmp.write_text(json.dumps(record, indent=1))
                os.replace(tmp, dest)
                os.replace(meta_tmp, _meta_path(dest))
                remember_verified(dest, record["sha256"])
            finally:
                tmp.unlink(missing_ok=True)
                meta_tmp.unlink(missing_ok=True)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                shutil.rmtree(staging, ignore_errors=True)
                raise DownloadError(f"the disk is full while writing {dest.parent}; the partial download was "
                                    "removed") from None
            raise
        shutil.rmtree(staging, ignore_errors=True)
    return name, dest, True


def _add_alias(dest: Path, prov: dict, ref: HubRef) -> None:
    if ref.tag is None and ref.file is None and not prov.get("default_for_repo"):
        prov["default_for_repo"] = True
    if ref.requested not in prov.get("requested", []):
        prov.setdefault("requested", []).append(ref.requested)
    tmp = _meta_path(dest).with_name(f".{dest.stem}.json.partial")
    tmp.write_text(json.dumps(prov, indent=1))
    os.replace(tmp, _meta_path(dest))


def ensure(text: str, quiet: bool = False, allow_pull: bool = True, pull_ref=None) -> Path:
    """The store file of a reference, pulling it first (with `pull_ref`, store.pull_reference) when it is missing
    and pulls are allowed."""
    ref = parse(text)
    found = find_local(ref)
    if found is not None:
        return found.path
    if offline():
        raise UnknownModelError(f"{ref.requested} is not in the store and the network is off (--offline or "
                                f"HF_HUB_OFFLINE); pull it with `localllm pull {text}` while online")
    if not allow_pull or pull_ref is None:
        raise UnknownModelError(f"{ref.requested} is not in the store yet: run `localllm pull {text}`")
    return pull_ref(text, quiet=quiet)[1]


def decode_name(stem: str) -> str:
    return unquote(stem)


# ---- checkpoints for `convert hf://` --------------------------------------------------------------------------
#
# A checkpoint (config, tokenizer, safetensors) is fetched into `checkpoints_dir()/OWNER--REPO/COMMIT/`, bounded
# as a pull is: the repo's listing gives every file's size before anything is downloaded, the total is refused
# past the caller's limit or the disk's free space (less disk.KEEP_FREE), and each file stops at its declared
# size and is checked against the hub's sha256 (LFS) or git blob id (a file kept in git). The files are fetched
# into `.partial-COMMIT-PID/` beside it and the folder is renamed into place when all are there: a failed, too
# long or interrupted download leaves nothing where the checkpoint would be (a killed run's folder is removed by
# the next run).

REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")


def checkpoints_dir() -> Path:
    return paths.cache_dir() / "hf-checkpoints"


def _checkpoint_folder(repo: str, revision: str | None) -> tuple[Path, Path]:
    """(the repo's folder, the file that records which commit `revision` was) for a checked repo name."""
    user, _, name = repo.partition("/")
    text = f"hf://{repo}"
    _check_name(text, user, "user")
    _check_name(text, name, "repo")
    if revision is not None and (not REVISION_RE.fullmatch(revision) or ".." in revision):
        raise _refuse(f"{text}@{revision}", "the revision is not a branch, tag or commit name")
    folder = checkpoints_dir() / f"{user}--{name}"
    return folder, folder / "refs" / quote(revision or "main", safe="")


def cached_checkpoint(repo: str, revision: str | None) -> Path | None:
    """The checkpoint an earlier fetch_checkpoint left for repo@revision (no network), if any."""
    folder, ref_file = _checkpoint_folder(repo, revision)
    try:
        commit = ref_file.read_text().strip()
    except OSError:
        return None
    snapshot = folder / commit
    return snapshot if re.fullmatch(r"[0-9a-f]{40}", commit) and snapshot.is_dir() else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_partials(folder: Path) -> None:
    """The `.partial-COMMIT-PID` folders of runs that are no longer running (killed mid-download)."""
    if not folder.is_dir():
        return
    for p in folder.glob(".partial-*-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or not _pid_alive(int(pid))):
            shutil.rmtree(p, ignore_errors=True)


def _matches(name: str, patterns: list[str]) -> bool:
    from fnmatch import fnmatchcase

    return "/" not in name and any(fnmatchcase(name, p) for p in patterns)


def fetch_checkpoint(repo: str, revision: str | None, patterns: list[str], limit: int | None = None,
                     quiet: bool = False) -> Path:
    """The folder of repo@revision's top-level files matching `patterns` (fnmatch), downloaded unless already
    there. `limit`: the most bytes the files may declare (None: the free disk space less disk.KEEP_FREE, which
    also bounds any limit). Raises DownloadError (or UnknownModelError) before downloading anything when the
    repo, its sizes or the space do not allow it."""
    from localllm.store import disk

    if offline():
        raise OfflineError(f"hf://{repo}: the network is off (--offline or HF_HUB_OFFLINE); nothing was downloaded")
    folder, ref_file = _checkpoint_folder(repo, revision)
    base = endpoint()
    _probe(base)
    ref = HubRef(repo)
    commit, files = _list_files(ref, base, revision)
    if not re.fullmatch(r"[0-9a-f]{40}", commit or ""):
        raise DownloadError(f"hf://{repo}: the hub gave no commit for {revision or 'main'}")
    wanted = [f for f in files if _matches(f.name, patterns)]
    names = {f.name for f in wanted}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise DownloadError(f"hf://{repo}: no config.json and *.safetensors at {revision or 'main'}: not a "
                            "Hugging Face safetensors checkpoint")
    for f in wanted:
        if not FILE_PART_RE.fullmatch(f.name):
            raise DownloadError(f"hf://{repo}: the file name {f.name[:80]!r} is not a plain file name")
        if f.size is None:
            raise DownloadError(f"hf://{repo}: the hub gives no size for {f.name}, so its download could not be "
                                "bounded")
    snapshot = folder / commit
    _remove_dead_partials(folder)
    if not snapshot.is_dir():
        total = sum(f.size for f in wanted)
        room = disk.free_bytes(folder) - disk.KEEP_FREE
        what = f"hf://{repo}: the {len(wanted)} files a conversion reads declare {disk.gb(total)}"
        if limit is not None and total > limit:
            raise DownloadError(f"{what}, more than the {disk.gb(limit)} allowed (--max-download); nothing was "
                                "downloaded")
        if total > room:
            raise DownloadError(f"{what}, more than the disk holding {checkpoints_dir()} has free "
                                f"({disk.gb(max(room, 0))} once {disk.gb(disk.KEEP_FREE)} is kept free); nothing "
                                "was downloaded")
        staging = folder / f".partial-{commit}-{os.getpid()}"
        staging.mkdir(parents=True, exist_ok=True)
        try:
            for f in wanted:
                part = staging / (f.name + ".partial")
                try:
                    _download(ref, base, commit, f, part, quiet, None, git_ok=True)
                except DownloadError as e:  # (its 'pull again to resume' is not this folder's way)
                    why = re.sub(r";? ?\(?pull again to resume\)?", "", str(e)).rstrip()
                    raise DownloadError(f"hf://{repo}: {why}; nothing was kept") from None
                os.replace(part, staging / f.name)
            try:
                os.rename(staging, snapshot)
            except OSError:
                if not snapshot.is_dir():  # (another run may have put the same commit in place meanwhile)
                    raise
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DownloadError(f"hf://{repo}: the disk is full while downloading; nothing was kept") from None
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    ref_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref_file.with_name(f".{ref_file.name}.{os.getpid()}.partial")
    tmp.write_text(commit)
    os.replace(tmp, ref_file)
    return snapshot
