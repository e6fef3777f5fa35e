"""The local REST port (`localllm serve`): OpenAI-, Anthropic-, llama.cpp- and Ollama-compatible endpoints over
one scheduler that batches concurrent requests on the engine.

Modules: `app` (the Starlette app: auth, limits, errors, request plumbing), `scheduler` (continuous batching in
the engine's thread), `openai_api`, `anthropic_api`, `llamacpp_api`, `ollama_api` (the routes), `embeddings_api`
(the embedding routes of the OpenAI, Ollama and llama.cpp APIs), `infill` (FIM prompts), `metrics` (Prometheus
text).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import sys

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
    sock = socket.socket(family, socket.SOCK_STREAM)
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


def serve(model: str, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, api_key: str | None = None,
          parallel: int = 4, ctx: int | None = None, max_tokens: int = 2048, cors_origins: list[str] | None = None,
          max_body: int | None = None, max_queue: int = 256, verbose: bool = False, speculation=None,
          allowed_hosts: list[str] | None = None, device: str = "cpu", offline: bool = False) -> None:
    """Serve `model` until Ctrl-C. `speculation` (a SpeculationParams): decode every request speculatively.
    `allowed_hosts`: names clients may call the server by beyond localhost, IP addresses and this machine's
    host name (see asgi.LocalNames; '*': any)."""
    import uvicorn

    from localllm import store
    from localllm.engine import Engine
    from localllm.server.app import MAX_BODY, ServerState
    from localllm.server.asgi import LocalNames, create_app
    from localllm.server.scheduler import Scheduler

    if offline:
        import os

        os.environ["LOCALLLM_OFFLINE"] = "1"  # /api/pull too: nothing is downloaded
    if parallel < 1:
        raise LocalLLMError("--parallel must be at least 1")
    if max_tokens < 1:
        raise LocalLLMError("--max-tokens must be at least 1")
    LocalNames(host, allowed_hosts)  # a malformed --allowed-host fails now, not after loading the model
    sock = bind(host, port)  # before loading: a taken port fails fast
    try:
        path = store.ensure(model, offline=offline)  # a missing catalog model or hub reference is pulled now
        engine = Engine.load(model, ctx=ctx, device=device)
        if speculation is not None:
            speculation.validated()
            if speculation.mode == "draft":
                engine.draft_engine(speculation.draft_model)  # load and check it now, not on the first request
        scheduler = Scheduler(engine, parallel=parallel, max_queue=max_queue, speculation=speculation)
        name = store.display_name(model, path)
        state = ServerState(engine=engine, scheduler=scheduler, model_name=name, model_path=str(path),
                            max_tokens=min(max_tokens, engine.ctx), parallel=parallel, api_key=api_key,
                            max_body=max_body or MAX_BODY)
        app = create_app(state, cors_origins, allowed_hosts, host)
        if not is_loopback(host) and not api_key:
            print(f"warning: listening on {host} without --api-key: anyone who can reach this port can use it",
                  file=sys.stderr)
        if not is_loopback(host) and "*" not in (allowed_hosts or []):
            names = ", ".join(["localhost", socket.gethostname(), *(allowed_hosts or [])])
            print(f"note: requests must call this server by an IP address or {names} (the Host header); add "
                  "other names with --allowed-host NAME", file=sys.stderr)
        shown = f"[{host}]" if ":" in host else host
        print(f"localllm: serving {name} on http://{shown}:{port} (context {engine.ctx}, {parallel} parallel); "
              "Ctrl-C stops", file=sys.stderr, flush=True)
        logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose,
                                timeout_graceful_shutdown=3, lifespan="on")
        server = uvicorn.Server(config)
        server.run(sockets=[sock])
    finally:
        sock.close()
