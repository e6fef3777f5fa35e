"""Ollama's POST /api/pull: pull a catalog model or a hub reference into the store, streaming progress as NDJSON.

The stream is Ollama's: {"status": "pulling manifest"}, then per file {"status": "pulling <12 hex>", "digest":
"sha256:<hex>", "total": N, "completed": M} (a line every 0.1 s at most), {"status": "verifying sha256 digest"},
{"status": "writing manifest"}, {"status": "success"}; an error after the stream started is a last line
{"error": "..."}. With "stream": false, one object: {"status": "success"}, or the error with its HTTP status
(400 for a name that is not a safe reference, 404 for no such model, 500 for a failed download, as Ollama).
The reference is parsed, and an unsafe one refused, before anything touches the network or the disk. A client
that goes away stops the download at its next chunk; what was downloaded stays as a partial that the next pull
resumes. `serve --offline` refuses pulls of anything not in the store.
"""

from __future__ import annotations

import asyncio
import threading

from starlette.requests import Request
from starlette.responses import StreamingResponse

from localllm.errors import LocalLLMError, OfflineError, UnknownModelError
from localllm.server.app import ApiError, ServerState, ndjson_line, ollama_response, read_json


class _ClientGone(Exception):
    pass


def _run_pull(name: str, progress) -> None:
    """The pull itself, in a worker thread; `progress` receives Ollama-shaped events."""
    from localllm.store import catalog
    from localllm.store import hub
    from localllm.store import local as store

    if name in catalog.entries():
        entry = catalog.entries()[name]
        digest = f"sha256:{entry.sha256}"
        progress({"status": "pulling manifest"})
        if hub.offline() and not store.has_model(name):
            raise OfflineError(f"{name} is not in the store and the server runs --offline")
        progress({"status": f"pulling {entry.sha256[:12]}", "digest": digest, "total": entry.size, "completed": 0})
        store.pull_by_name(name, quiet=True)
        progress({"status": f"pulling {entry.sha256[:12]}", "digest": digest, "total": entry.size,
                  "completed": entry.size})
        progress({"status": "verifying sha256 digest"})
        progress({"status": "writing manifest"})
        return
    store.pull_reference(name, quiet=True, progress=progress)


def _status_of(e: LocalLLMError) -> int:
    from localllm.store.hub import ReferenceError_

    if isinstance(e, ReferenceError_):
        return 400
    if isinstance(e, UnknownModelError):
        return 404
    if isinstance(e, OfflineError):  # the server cannot download now: not a failure of the server
        return 503
    return 500


async def pull(state: ServerState, request: Request):
    body = await read_json(request, state.max_body)
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "a model name is required ('model': a catalog name or hub reference)", "model")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "stream")
    from localllm.store import catalog
    from localllm.store import hub

    if name not in catalog.entries():
        hub.parse(name)  # an unsafe or malformed reference: a 400 before any network or file access

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    gone = threading.Event()

    def progress(event: dict) -> None:
        if gone.is_set():
            raise _ClientGone()
        loop.call_soon_threadsafe(queue.put_nowait, event)

    def work() -> None:
        try:
            _run_pull(name, progress)
            loop.call_soon_threadsafe(queue.put_nowait, {"status": "success"})
        except _ClientGone:
            pass
        except LocalLLMError as e:
            loop.call_soon_threadsafe(queue.put_nowait, {"error": str(e), "_status": _status_of(e)})
        except Exception as e:  # noqa: BLE001 — reported to the client, never a dead stream
            loop.call_soon_threadsafe(queue.put_nowait, {"error": f"pull failed: {type(e).__name__}: {e}",
                                                         "_status": 500})
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    worker = threading.Thread(target=work, name="api-pull", daemon=True)
    worker.start()

    if not stream:
        last = None
        while (event := await queue.get()) is not None:
            last = event
        if last is None or "error" in last:
            status = (last or {}).pop("_status", 500)
            return ollama_response({"error": (last or {}).get("error", "pull failed")}, status=status)
        return ollama_response({"status": "success"})

    async def lines():
        try:
            while (event := await queue.get()) is not None:
                event.pop("_status", None)
                # Ollama's ProgressResponse order (status, digest, total, completed), zeros left out
                order = ("status", "digest", "total", "completed")
                ordered = {k: event[k] for k in order if event.get(k) not in (None, "", 0)}
                ordered.update((k, v) for k, v in event.items() if k not in order)
                yield ndjson_line(ordered)
        finally:
            gone.set()  # the client went away (or the stream ended): a running download stops at its next chunk

    return StreamingResponse(lines(), media_type="application/x-ndjson")


ROUTES = [
    ("/api/pull", ["POST"], pull),
]
