"""The local REST port (`localllm serve`): OpenAI-, Anthropic-, llama.cpp- and Ollama-compatible endpoints over
one scheduler that batches concurrent requests on the engine.

Modules: `app` (the Starlette app: auth, limits, errors, request plumbing), `scheduler` (continuous batching in
the engine's thread), `openai_api`, `anthropic_api`, `llamacpp_api`, `ollama_api` (the routes), `embeddings_api`
(the embedding routes of the OpenAI, Ollama and llama.cpp APIs), `infill` (FIM prompts), `metrics` (Prometheus
text), `registry` (several models behind the port: loaded by the request's model, unloaded for room or after their
keep_alive), `models_api` (the model lists, and Ollama's delete, copy, create and blobs on the model store).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import sys

from localllm import parameters
from localllm.errors import LocalLLMError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or a clear error (port taken, address not on this machine)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise LocalLLMError(f"cannot resolve host {host!r}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose
    # protocol says TCP, and accepted sockets inherit it. With Nagle on, a kept-alive connection's streamed tokens
    # waited for the client's delayed ACK: the first ~40 ms of every answer after a connection's first came in one
    # burst (qwen2.5-coder-0.5b, a 50-token prompt: time to first token 140 ms, with it 99 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise LocalLLMError(f"port {port} on {host} is already in use (another server?); choose another "
                                "with --port") from None
        raise LocalLLMError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(model: str | None, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, api_key: str | None = None,
          parallel: int = 4, ctx: int | None = None, max_tokens: int = 2048, cors_origins: list[str] | None = None,
          max_body: int | None = None, max_queue: int = 256, verbose: bool = False, speculation=None,
          allowed_hosts: list[str] | None = None, device: str = parameters.DEVICE, models: list[str] | None = None,
          max_loaded: int | None = None, pins: list[str] | None = None, keep_alive: float | None = None,
          offline: bool = False, cache_reuse: int = 0, slot_save_path: str | None = None) -> None:
    """Serve until Ctrl-C: `model` alone (loaded now, pinned), or several (`models`; none: any model of the store)
    loaded by the requests' `model` field, up to `max_loaded` at once (None: as many as fit in the memory
    available now), each kept `keep_alive` seconds after its last request (None: 5 minutes; the one model: for
    ever), `pins` always. `speculation` (a SpeculationParams): decode every request speculatively. A catalog model
    or hub reference named here that is not in the store yet is pulled first, unless `offline`.
    `allowed_hosts`: names clients may call the server by beyond localhost, IP addresses and this machine's
    host name (see asgi.LocalNames; '*': any). `cache_reuse`: llama.cpp's --cache-reuse N (cache_reuse.py), 0 off.
    `slot_save_path`: llama.cpp's --slot-save-path, the folder of /slots/N?action=save|restore (created)."""
    import uvicorn

    from localllm.server import liveness

    from localllm.server.app import MAX_BODY
    from localllm.server.asgi import LocalNames, create_app

    if offline:
        os.environ["LOCALLLM_OFFLINE"] = "1"  # /api/pull too: nothing is downloaded
    if parallel < 1:
        raise LocalLLMError("--parallel must be at least 1")
    if max_tokens < 1:
        raise LocalLLMError("--max-tokens must be at least 1")
    LocalNames(host, allowed_hosts)  # a malformed --allowed-host fails now, not after loading the model
    if model is not None and models:
        raise LocalLLMError("give one MODEL or --models A,B,..., not both")
    if max_loaded is not None and max_loaded < 1:
        raise LocalLLMError("--max-loaded must be at least 1")
    if slot_save_path:
        try:
            os.makedirs(slot_save_path, exist_ok=True)
        except OSError as e:
            raise LocalLLMError(f"--slot-save-path {slot_save_path}: cannot create the folder: {e.strerror or e}") \
                from None
        slot_save_path = os.path.abspath(slot_save_path)
    sock = bind(host, port)  # before loading: a taken port fails fast
    try:
        registry, state, name = _registry(model, models or [], pins or [], max_loaded, keep_alive, ctx, device,
                                          parallel, max_queue, speculation, max_tokens, api_key,
                                          max_body or MAX_BODY, offline, cache_reuse, slot_save_path)
        engine = state.engine if model is not None else None
        app = create_app(state, cors_origins, allowed_hosts, host)
        if not is_loopback(host) and not api_key:
            print(f"warning: listening on {host} without --api-key: anyone who can reach this port can use it",
                  file=sys.stderr)
        if not is_loopback(host) and "*" not in (allowed_hosts or []):
            names = ", ".join(["localhost", socket.gethostname(), *(allowed_hosts or [])])
            print(f"note: requests must call this server by an IP address or {names} (the Host header); add "
                  "other names with --allowed-host NAME", file=sys.stderr)
        shown = f"[{host}]" if ":" in host else host
        if engine is not None:
            print(f"localllm: serving {name} on http://{shown}:{port} (context {engine.ctx}, {parallel} parallel); "
                  "Ctrl-C stops", file=sys.stderr, flush=True)
        else:
            what = ", ".join(registry.allowed) if registry.allowed is not None else "the models of the store"
            room = (f"up to {registry.max_loaded} loaded" if registry.max_loaded is not None else
                    f"as many loaded as fit in {registry.memory_budget / 1e9:.1f} GB" if registry.memory_budget
                    else "no limit on loaded models")
            print(f"localllm: serving {what} on http://{shown}:{port} (loaded on demand, {room}); Ctrl-C stops",
                  file=sys.stderr, flush=True)
        logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose,
                                timeout_graceful_shutdown=3, lifespan="on")
        server = liveness.Server(config)  # a stop signal ends the process within 5 s (liveness.py)
        server.run(sockets=[sock])
    finally:
        sock.close()


def _served_name(given: str, path) -> str:
    from localllm.store import local as store

    return store.display_name(given, path)  # a store name, a hub model's reference, else the file's stem


def _registry(model, models, pins, max_loaded, keep_alive, ctx, device, parallel, max_queue, speculation,
              max_tokens, api_key, max_body, offline=False, cache_reuse=0, slot_save_path=None):
    """(registry, the app's state, the one model's name or None) for serve()'s options; the one model and the
    pinned ones are loaded now, so that a bad file fails before the port opens."""
    from localllm.store import catalog
    from localllm.store import local as store
    from localllm.runtime.engine import Engine
    from localllm.server.app import ServerState
    from localllm.server.registry import MEMORY_SHARE, ModelRegistry, available_memory, strip_latest
    from localllm.server.scheduler import Scheduler

    several = model is None
    if speculation is not None:
        speculation.validated()
        if speculation.mode == "draft" and several:
            raise LocalLLMError("--spec draft needs one MODEL (a draft model matches one target's vocabulary)")

    def loader(path, quiet=True):
        engine = Engine(path, ctx=ctx, quiet=quiet, backend=device)
        # A kept donor per slot, as llama.cpp's slots keep their caches, and one more: llama.vim's ring update
        # (extra context only) must not push out the last keystroke's cache, which the next keystroke needs.
        engine.cache_reuse, engine.retained_max = cache_reuse, parallel + 1
        return engine, Scheduler(engine, parallel=parallel, max_queue=max_queue, speculation=speculation)

    base = ServerState(engine=None, scheduler=None, model_name="", model_path="", max_tokens=max_tokens,
                       parallel=parallel, api_key=api_key, max_body=max_body, slot_save_path=slot_save_path)
    allowed, default = None, None
    if not several:
        path = store.ensure(model, offline=offline)  # a missing catalog model or hub reference is pulled now
        allowed = {_served_name(model, path): path}
        default = next(iter(allowed))
        pins = [default]
    elif models:
        allowed = {}
        for given in models:
            given = strip_latest(given.strip())
            if given:
                path = store.ensure(given, offline=offline)
                allowed[_served_name(given, path)] = path
        if not allowed:
            raise LocalLLMError("--models names no model")
        default = next(iter(allowed))
    else:
        fallback = catalog.default_entry().name
        default = fallback if store.has_model(fallback) else None  # for clients that name no model (llama.vim)
    budget = None
    if max_loaded is None and several:
        avail = available_memory()
        budget = int(avail * MEMORY_SHARE) if avail else None
    registry = ModelRegistry(base, loader=loader, allowed=allowed, default=default, lenient=not several,
                             max_loaded=max_loaded if several else None, pins=pins,
                             keep_alive=keep_alive if keep_alive is not None else (300.0 if several else
                                                                                 float("inf")),
                             ctx=ctx, device=device, memory_budget=budget)
    if max_loaded is not None and len(set(pins)) > max_loaded and several:
        raise LocalLLMError(f"--pin names {len(set(pins))} models but --max-loaded is {max_loaded}")
    base.registry = registry
    for name in dict.fromkeys(pins):
        try:
            loaded = registry.preload(name) if several else _preload_one(registry, name)
        except Exception:
            for m in registry.models.values():
                m.state.engine.gguf.close()
            raise
        del loaded
    if not several:
        one = next(iter(registry.models.values()))
        if speculation is not None and speculation.mode == "draft":
            one.state.engine.draft_engine(speculation.draft_model)  # load and check it now, not on a request
        return registry, one.state, default
    return registry, base, None


def _preload_one(registry, name):
    """The single model: loaded with its warm-up shown, as `serve MODEL` always did."""
    from localllm.server.registry import file_key

    name, path = registry.lookup(name)
    engine, scheduler = registry.loader(path, False)
    return registry._register(name, path, file_key(path), engine, scheduler)
