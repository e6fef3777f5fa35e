"""What the server holds and Ollama's model management: the model lists of /v1/models, /api/tags and /api/ps
(with several models behind the port), DELETE /api/delete, POST /api/copy, POST /api/create, HEAD and POST
/api/blobs/:digest.

Everything here works inside the model store (`paths.models_dir()`): a model is `NAME.gguf` there, a name is a
plain file name (store.name_problem), and blobs (what the `ollama` client uploads before a create) live in its
`blobs/` folder as `sha256-<64 hex>`, a digest checked strictly before it is used as a file name (Ollama's
CVE-2026-7020 was a path traversal through a digest). The blobs folder holds at most LOCALLLM_BLOBS_MAX bytes
(default BLOBS_MAX, 100 GB) and an upload never leaves less than disk.KEEP_FREE (1 GiB) free on its disk: a blob
past either is refused with a 413 before its first byte is written when it declares its length, or as soon as it
passes the bound when it is chunked (the partial file removed); uploads in flight count with what they declared.
A copy is a hard link: a second name for the same bytes. A new model is written to a partial file in the store
and renamed into place, so a failed create leaves nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import errno
import hashlib
import os
import re
import shutil
import tempfile
import threading
import uuid
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from localllm.errors import LocalLLMError
from localllm.server.app import ApiError, Fields, ServerState, ndjson_line, off_loop, ollama_response, read_json

DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")


# ---- what the server holds ---------------------------------------------------------------------------------


_facts: dict[tuple, dict] = {}


def model_facts(path: Path) -> dict:
    """model_info of a file, with Ollama's `digest` and `modified_at`; cached by the file's identity."""
    from localllm.store.model_info import model_info

    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _facts:
        info = model_info(path)
        info["digest"] = hashlib.sha256(repr(key).encode()).hexdigest()
        info["modified_at"] = dt.datetime.fromtimestamp(st.st_mtime, dt.timezone.utc).isoformat().replace(
            "+00:00", "Z")
        _facts[key] = info
    return _facts[key]


def details(info: dict) -> dict:
    arch = info["architecture"] or ""
    params = info["parameters"] or 0
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    quant = next(iter(info["tensor_types"]), "")
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch], "parameter_size": size,
            "quantization_level": quant}


def tag_entry(name: str, path: Path) -> dict:
    info = model_facts(path)
    return {"name": name, "model": name, "modified_at": info["modified_at"], "size": info["file_size"],
            "digest": info["digest"], "details": details(info)}


def present(state: ServerState) -> list[tuple[str, Path]]:
    """(name, file) of each model this server can serve that is on disk, by name."""
    out = []
    for name, path in sorted(state.registry.available().items()):
        if Path(path).is_file():
            out.append((name, Path(path)))
    return out


def tags(state: ServerState) -> list[dict]:
    out = []
    for name, path in present(state):
        try:
            out.append(tag_entry(name, path))
        except (LocalLLMError, OSError):
            continue  # a file that is not a readable GGUF is not a model to offer
    return out


def ps(state: ServerState) -> list[dict]:
    from localllm.server.registry import iso

    out = []
    for m in state.registry.ps():
        entry = tag_entry(m.name, m.path)
        out.append(ps_entry(entry, m.size, iso(m.expires_at()), m.ctx))
    return out


def ps_entry(tag: dict, size: int, expires_at: str, ctx: int) -> dict:
    """A loaded model as Ollama's ProcessModelResponse writes it (its fields' order; no modified_at)."""
    return {"name": tag["name"], "model": tag["model"], "size": size, "digest": tag["digest"],
            "details": tag["details"], "expires_at": expires_at, "size_vram": 0, "context_length": ctx}


def model_cards(state: ServerState) -> list[dict]:
    loaded = {m.name: m for m in state.registry.ps()}
    out = []
    for name, path in present(state):
        card = {"id": name, "object": "model", "created": int(path.stat().st_mtime), "owned_by": "localllm"}
        if name in loaded:
            card["meta"] = {"n_ctx": loaded[name].ctx, "n_vocab": loaded[name].n_vocab}
        out.append(card)
    return out


def model_card(state: ServerState, name: str) -> dict:
    from localllm.server.registry import strip_latest

    for card in model_cards(state):
        if card["id"] == strip_latest(name):
            return card
    raise state.registry.not_found(name)


# ---- store operations (each a plain function: run off the event loop) ----------------------------------------


def _store() -> Path:
    from localllm import paths

    folder = paths.models_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _check_new_name(name: str, key: str) -> str:
    from localllm.store import local as store
    from localllm.server.registry import strip_latest

    name = strip_latest(name)
    if problem := store.name_problem(name):
        raise ApiError(400, f"'{key}': {name[:200]!r} is not a model name: {problem}", param=key)
    return name


def _partial(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.partial")


def _place(partial: Path, dest: Path) -> None:
    """Move a finished file into place (replacing a model of that name: a loaded one keeps its own bytes)."""
    from localllm.store import local as store

    os.replace(partial, dest)
    with contextlib.suppress(OSError):
        store._marker(dest).unlink()  # a catalog model's 'verified' note is not about this file


def link_or_copy(src: Path, dest: Path, replace: bool) -> str:
    """dest as a second name of src's bytes (a hard link), or a copy where the file system cannot link.
    Returns "linked" or "copied". Without `replace`, an existing dest is an error."""
    if not replace and dest.exists():
        raise ApiError(400, f"a model named {dest.stem!r} exists already; delete it first")
    tmp = _partial(dest)
    try:
        try:
            os.link(src, tmp)
            how = "linked"
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                raise
            shutil.copyfile(src, tmp)
            how = "copied"
        if replace:
            _place(tmp, dest)
        else:
            os.link(tmp, dest)  # fails if dest appeared meanwhile: never replaces a model it should not
            tmp.unlink()
        return how
    except FileExistsError:
        raise ApiError(400, f"a model named {dest.stem!r} exists already; delete it first") from None
    except OSError as e:
        raise ApiError(500, f"cannot write {dest.name} in the model store: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def check_gguf(path: Path) -> None:
    from localllm.gguf_file import GGUFFile

    try:
        with GGUFFile(path) as g:
            if not g.tensors:
                raise ApiError(400, f"{path.name}: a GGUF file without tensors is not a model")
    except LocalLLMError as e:
        raise ApiError(400, str(e)) from None


def blob_path(digest: str) -> Path:
    """The store's file for a blob digest: 'sha256:<64 lowercase hex>' (or Ollama's 'sha256-...'), nothing else."""
    if not isinstance(digest, str) or not (m := DIGEST.fullmatch(digest)):
        raise ApiError(400, f"{str(digest)[:100]!r} is not a blob digest: expected sha256:<64 hex digits>",
                       param="digest")
    return _store() / "blobs" / f"sha256-{m.group(1)}"


# ---- routes ------------------------------------------------------------------------------------------------


async def delete(state: ServerState, request: Request):
    """Ollama's DELETE /api/delete {"model"}: remove a model from the store (a loaded one is unloaded first, as
    Ollama does; one with requests in flight goes once they end)."""
    from localllm.store import local as store
    from localllm.server.registry import file_key, strip_latest

    f = Fields(await read_json(request, state.max_body))
    name = f.get("model", str) or f.get("name", str)
    if not name:
        raise ApiError(400, "'model' is required", param="model")
    name = strip_latest(name)
    if not store.has_model(name):
        raise ApiError(404, f"model '{name[:200]}' not found in the model store", param="model")
    registry = state.registry
    path = store.model_path(name)
    if registry is not None and path.stat().st_nlink == 1:  # (another name of the same file keeps it loaded)
        model = registry.models.get(file_key(path))
        if model is not None:
            if model.pinned:
                raise ApiError(400, f"{name} is pinned (serve --pin, or the one model of this server); it cannot "
                                    "be deleted while the server runs")
            model.keep_alive, model.held = 0, False
            if model.in_flight == 0:
                await registry.unload(model)
    try:
        await off_loop(store.remove, name)
    except LocalLLMError as e:
        raise ApiError(404 if "no model" in str(e) or "not downloaded" in str(e) else 400, str(e)) from None
    return ollama_response({})


async def copy(state: ServerState, request: Request):
    """Ollama's POST /api/copy {"source", "destination"}: a new name for a model, the same bytes (a hard link)."""
    from localllm.store import local as store
    from localllm.server.registry import strip_latest

    f = Fields(await read_json(request, state.max_body))
    source = strip_latest(f.get("source", str, ""))
    if not source:
        raise ApiError(400, "'source' is required", param="source")
    dest = _check_new_name(f.get("destination", str, ""), "destination")
    if not store.has_model(source):
        raise ApiError(404, f"model '{source[:200]}' not found in the model store", param="source")
    await off_loop(link_or_copy, store.model_path(source), store.model_path(dest), False)
    return ollama_response({})


async def blob_exists(state: ServerState, request: Request):
    if request.method == "HEAD":
        path = blob_path(request.path_params["digest"])
        return Response(status_code=200 if path.is_file() else 404)
    return await blob_upload(state, request)


BLOBS_MAX = 100 * 1000 ** 3  # bytes the blobs folder may hold (LOCALLLM_BLOBS_MAX)
BLOB_CLAIM_STEP = 16 << 20  # a chunked upload claims room in steps of this many bytes
_blob_lock = threading.Lock()
_blob_claims: dict[Path, int] = {}  # uploads in flight: the bytes each may write (declared, or claimed so far)


def blobs_max() -> int:
    from localllm.store import disk

    text = os.environ.get("LOCALLLM_BLOBS_MAX")
    if not text:
        return BLOBS_MAX
    try:
        return disk.parse_size(text)
    except LocalLLMError as e:
        raise ApiError(500, f"LOCALLLM_BLOBS_MAX: {e}") from None


def _claim_blob_room(folder: Path, tmp: Path, n: int) -> None:
    """Let the upload into `tmp` write `n` bytes in all, or refuse it (413): the blobs folder's files and the
    other uploads' claims may not pass blobs_max(), and what all of them have still to write must leave
    disk.KEEP_FREE free on the disk."""
    from localllm.store import disk

    def size(p: Path) -> int:
        try:
            return p.stat().st_size
        except OSError:
            return 0

    limit = blobs_max()
    with _blob_lock:
        stored = 0
        with os.scandir(folder) as it:
            for entry in it:
                if entry.is_file(follow_symlinks=False) and Path(entry.path) not in _blob_claims:
                    stored += entry.stat(follow_symlinks=False).st_size  # (an upload's .checkpoint- folder: links)
        others = {p: c for p, c in _blob_claims.items() if p != tmp}
        held = stored + sum(others.values())
        if held + n > limit:
            raise ApiError(413, f"the blob store is full: it holds {disk.gb(held)} of the {disk.gb(limit)} it may "
                                f"(LOCALLLM_BLOBS_MAX), and this blob needs {disk.gb(n)}; nothing was written. "
                                "Blobs stay until removed from the model store's blobs folder")
        to_write = n - size(tmp) + sum(max(0, c - size(p)) for p, c in others.items())
        free = disk.free_bytes(folder)
        if free - to_write < disk.KEEP_FREE:
            raise ApiError(413, f"the server's disk has {disk.gb(free)} free and keeps {disk.gb(disk.KEEP_FREE)} "
                                f"free: this blob ({disk.gb(n)}) does not fit; nothing was written")
        _blob_claims[tmp] = n


async def blob_upload(state: ServerState, request: Request):
    """Ollama's POST /api/blobs/:digest: the body is stored once its sha256 matches the digest (a blob already
    there is not read again, as Ollama answers it: 200). Bounded by the blobs folder's total and the disk's free
    space (_claim_blob_room): past them, a 413 and nothing kept."""
    path = blob_path(request.path_params["digest"])
    want = path.name[len("sha256-"):]
    if path.is_file():
        return Response(status_code=200)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _partial(path)
    length = request.headers.get("content-length")
    declared = int(length) if length is not None and length.isdigit() else None
    digest = hashlib.sha256()
    written = 0

    async def claim(needed: int) -> int:
        """Room for `needed` bytes in all (a chunked body: a step more when there is room for it)."""
        if declared is None:
            with contextlib.suppress(ApiError):
                await off_loop(_claim_blob_room, path.parent, tmp, needed + BLOB_CLAIM_STEP)
                return needed + BLOB_CLAIM_STEP
        await off_loop(_claim_blob_room, path.parent, tmp, needed)
        return needed

    try:
        claimed = await claim(declared or 0)  # a declared length: refused before a byte is written
        with open(tmp, "wb") as out:
            async for chunk in request.stream():
                written += len(chunk)
                if written > claimed:
                    if declared is not None:
                        raise ApiError(400, f"the body is longer than its Content-Length ({declared} bytes)")
                    claimed = await claim(written)  # a chunked body claims room as it comes
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != want:
            raise ApiError(400, f"the body's sha256 is {digest.hexdigest()}, not the digest in the path")
        os.replace(tmp, path)
    except OSError as e:
        raise ApiError(500, f"cannot store the blob: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
        with _blob_lock:
            _blob_claims.pop(tmp, None)
    return Response(status_code=201)


UNSUPPORTED_CREATE = ("adapters", "template", "system", "parameters", "messages", "license")


def _create_source(f: Fields) -> tuple[str, Path, Path | None]:
    """("gguf" | "checkpoint", the source path, a temporary folder to remove afterwards) of a create request:
    `from` (a model of the store, an absolute path to a GGUF file or to a safetensors checkpoint folder) or
    `files` (uploaded blobs: one GGUF, or a checkpoint's files)."""
    from localllm.store import local as store
    from localllm.server.registry import strip_latest

    source = f.get("from", str, None)
    files = f.get("files", dict, None)
    if bool(source) == bool(files):
        raise ApiError(400, "give 'from' (a model name or a path on the server) or 'files' (uploaded blobs)",
                       param="from")
    if source:
        if store.has_model(strip_latest(source)):
            return "gguf", store.model_path(strip_latest(source)), None
        path = Path(source).expanduser()
        if not path.is_absolute():
            raise ApiError(404, f"'from': {source[:200]!r} is neither a model in the store nor an absolute path",
                           param="from")
        if path.is_dir():
            return "checkpoint", path, None
        if path.is_file():
            return "gguf", path, None
        raise ApiError(400, f"'from': {source[:200]} does not exist on the server", param="from")
    blobs = {}
    for file_name, digest in files.items():
        if store.name_problem(file_name) or not isinstance(digest, str):
            raise ApiError(400, f"'files': {file_name[:100]!r} must be a plain file name mapped to a digest",
                           param="files")
        blob = blob_path(digest)
        if not blob.is_file():
            raise ApiError(400, f"'files': the blob {digest} of {file_name} was not uploaded (POST /api/blobs/"
                                f"{digest})", param="files")
        blobs[file_name] = blob
    ggufs = [n for n in blobs if n.endswith(".gguf")]
    if ggufs:
        if len(blobs) != 1:
            raise ApiError(400, "'files': one GGUF file per model (split GGUFs and adapters are not supported)",
                           param="files")
        return "gguf", blobs[ggufs[0]], None
    if "config.json" not in blobs or not any(n.endswith(".safetensors") for n in blobs):
        raise ApiError(400, "'files': a GGUF file, or a checkpoint (config.json and *.safetensors)", param="files")
    folder = Path(tempfile.mkdtemp(prefix=".checkpoint-", dir=_store() / "blobs"))
    for file_name, blob in blobs.items():
        os.symlink(blob, folder / file_name)
    return "checkpoint", folder, folder


def _shown(source: Path) -> str:
    """A source as an error names it to the client: an upload's scratch folder as "the uploaded checkpoint", an
    uploaded blob as "the uploaded model", a path by its last part (the server's folders are not the client's
    business)."""
    if source.name.startswith(".checkpoint-"):
        return "the uploaded checkpoint"
    if source.parent.name == "blobs" and DIGEST.fullmatch(source.name):
        return "the uploaded model"
    return repr(source.name)


def _without_paths(message: str, source: Path) -> str:
    """`message` with the server's paths (the source's folder, the model store) replaced by what they are."""
    for path, what in ((source, _shown(source)), (source.parent, "the server's folder"), (_store(), "the model store")):
        for form in {str(path), str(path.resolve())}:
            message = message.replace(form + "/", "").replace(form, what)
    if _shown(source) == "the uploaded model":  # (its file name is the store's, not the client's)
        message = message.replace(source.name, "the uploaded model")
    return message


def _create(name: str, kind: str, source: Path, quantize: str | None, say, cancel=None) -> None:
    """Write model `name` from `source`; `say(status)` reports progress; `cancel` (a threading.Event) set when the
    client goes stops a conversion or a quantization (each runs in a process of its own: create_worker.py)."""
    from localllm.store import local as store

    dest = store.model_path(name)
    tmp = _partial(dest)
    try:
        if kind == "checkpoint":
            from localllm.server import create_worker

            say(f"converting {source.name}" + (f" to {quantize.upper()}" if quantize else ""))
            try:  # in a process with a time and memory budget, stopped if the client goes (create_worker.py)
                create_worker.convert(source, tmp, (quantize or "auto").lower(), name, cancel)
            except LocalLLMError as e:
                raise ApiError(400, f"cannot convert {_shown(source)}: {_without_paths(str(e), source)}") from None
        else:
            check_gguf(source)
            if quantize:
                from localllm.server import create_worker

                say(f"quantizing to {quantize.upper()}")
                try:  # in a process with a time and memory budget, stopped if the client goes, as a conversion
                    create_worker.quantize(source, tmp, quantize, cancel)
                except LocalLLMError as e:
                    raise ApiError(400, f"cannot quantize {_shown(source)}: {_without_paths(str(e), source)}") \
                        from None
            else:
                say("writing model")
                link_or_copy(source, dest, True)
                return
        check_gguf(tmp)
        _place(tmp, dest)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


async def create(state: ServerState, request: Request):
    """Ollama's POST /api/create: a model in the store from a GGUF file (`from` a path or a model, or an uploaded
    blob in `files`), quantized when `quantize` names a type, or from a safetensors checkpoint (converted, then
    quantized). Streams {"status"} lines as Ollama does unless 'stream' is false."""
    f = Fields(await read_json(request, state.max_body))
    name = _check_new_name(f.get("model", str, "") or f.get("name", str, ""), "model")
    for key in UNSUPPORTED_CREATE:
        if f.data.get(key):
            raise ApiError(400, f"'{key}' is not supported by this server's create: it imports a model as it is "
                                "(its own chat template and defaults)", param=key)
    quantize = f.get("quantize", str, None)
    if quantize:
        from localllm.convert.quantize_gguf import file_type

        try:
            file_type(quantize)
        except LocalLLMError as e:
            raise ApiError(400, f"'quantize': {e}", param="quantize") from None
    kind, source, scratch = await off_loop(_create_source, f)
    stream = f.get("stream", bool, True)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()  # set when the client goes: a conversion or quantization stops

    def say(status: str) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, status)

    def work():
        try:
            _create(name, kind, source, quantize, say, cancel)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)

    task = asyncio.ensure_future(off_loop(work))
    if not stream:
        from localllm.server import create_worker

        gone = asyncio.ensure_future(create_worker.client_gone(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            cancel.set()
        await task
        return ollama_response({"status": "success"})

    async def lines():
        yield ndjson_line({"status": "parsing model"})
        while not task.done() or not queue.empty():
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield ndjson_line({"status": getter.result()})
            else:
                getter.cancel()
        try:
            task.result()
        except ApiError as e:
            yield ndjson_line({"error": e.message})
            return
        except Exception:
            yield ndjson_line({"error": "internal error while creating the model"})
            raise
        yield ndjson_line({"status": "success"})

    async def stopping_lines():
        try:
            async for line in lines():
                yield line
        finally:
            if not task.done():
                cancel.set()  # the client went away mid-create: its conversion or quantization stops

    return StreamingResponse(stopping_lines(), media_type="application/x-ndjson")


ROUTES = [
    ("/api/delete", ["DELETE"], delete),
    ("/api/copy", ["POST"], copy),
    ("/api/create", ["POST"], create),
    ("/api/blobs/{digest:path}", ["HEAD", "POST"], blob_exists),
]
