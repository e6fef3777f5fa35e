"""The ASGI application: the four APIs' route tables over app.py's plumbing, with auth, CORS, and the guard
against web pages (a Host allow-list against DNS rebinding, an Origin check against cross-site requests).

Apart from app.py so that the API modules, which import app.py's helpers, are imported by this module alone.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import socket

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from localllm.chat import grammar_worker
from localllm.errors import LocalLLMError
from localllm.server import (anthropic_api, embeddings_api, llamacpp_api, models_api, ollama_api, ollama_pull,
                             openai_api, responses_api)
from localllm.server.app import (BODY_KEY, ApiError, ServerState, error_response, flavor_of, json_response,
                                 ollama_response, read_json)
from localllm.server.metrics import Metrics

log = logging.getLogger("localllm.server")


# ---- the application -----------------------------------------------------------------------------------


class AuthMiddleware:
    """With an API key, every endpoint but /health needs `Authorization: Bearer KEY` or `x-api-key: KEY`
    (Anthropic's header: Claude Code sends its ANTHROPIC_API_KEY so)."""

    OPEN = ("/health", "/v1/health")

    def __init__(self, app, api_key: str):
        self.app = app
        self.bearer = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    def authorized(self, headers: dict) -> bool:
        bearer, key = headers.get(b"authorization"), headers.get(b"x-api-key")
        # Both compared whenever given, so the time taken says nothing about which one was close.
        ok_bearer = bearer is not None and hmac.compare_digest(bearer, self.bearer)
        ok_key = key is not None and hmac.compare_digest(key, self.key)
        return ok_bearer or ok_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN and scope.get("method") != "OPTIONS":
            headers = dict(scope.get("headers") or [])
            # the chat page and its files hold no secret: a browser gets them, and the page sends the key typed in
            page = scope["path"].startswith("/ui/") or (scope["path"] == "/" and b"text/html" in
                                                          headers.get(b"accept", b""))
            if not page and not self.authorized(headers):
                response = error_response(flavor_of(scope["path"]), 401, "invalid or missing API key "
                                          "(send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                                          headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LocalNames:
    """Which Host and Origin headers name this server.

    Host (DNS rebinding, Ollama's CVE-2024-28224): a page at http://evil.example:8080 whose name its owner
    then points at 127.0.0.1 is same-origin with this server in the browser's eyes, but its requests still
    say `Host: evil.example:8080`. Answered are only: an IP address (a browser sends one only when the page's
    own address is that IP, so it cannot be a rebound name), localhost and *.localhost (RFC 6761: always
    loopback), this machine's host name, the name given to --host, and the names given to --allowed-host
    ('*': any). The port is not looked at.

    Origin (cross-site requests): a browser names the page behind every POST. Accepted: none (not a browser),
    a page of this machine (localhost, *.localhost, a loopback address, the --host address or name, the host
    name, an --allowed-host name), an app's own scheme (vscode-webview://, app://, ...: no web page can
    claim one), and the --cors-origin origins. Refused: any other web page, and "null" (sandboxed frames
    and file:// pages)."""

    def __init__(self, bound_host: str = "127.0.0.1", allowed_hosts: list[str] | None = None,
                 cors_origins: list[str] | None = None):
        allowed = [h.strip().lower().rstrip(".") for h in allowed_hosts or []]
        for h in allowed:
            if h != "*" and split_host(h)[0] is None:
                raise LocalLLMError(f"--allowed-host {h!r} is not a host name: give one such as box.lan (no "
                                    "scheme, no path), or '*' for any")
        self.any_host = "*" in allowed
        self.names = {"localhost", socket.gethostname().lower()} | {split_host(h)[0] for h in allowed if h != "*"}
        self.bound_ip = _ip(bound_host)
        if self.bound_ip is None:
            self.names.add(bound_host.lower().rstrip("."))
        self.cors_origins = {o.rstrip("/").lower() for o in cors_origins or []}

    def _local_name(self, host: str) -> bool:
        return host in self.names or host.endswith(".localhost")

    def host_ok(self, header: str) -> bool:
        if self.any_host or not header:
            return True
        host, _ = split_host(header)
        return host is not None and (_ip(host) is not None or self._local_name(host))

    def origin_ok(self, origin: str) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if "*" in self.cors_origins or origin in self.cors_origins:
            return True
        scheme, sep, rest = origin.partition("://")
        if not sep or origin == "null":
            return False
        if scheme not in ("http", "https"):
            return True
        host, _ = split_host(rest)
        if host is None:
            return False
        ip = _ip(host)
        if ip is not None:
            return ip.is_loopback or (ip == self.bound_ip and not ip.is_unspecified)
        return self._local_name(host)


def _ip(host: str):
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def split_host(header: str) -> tuple[str | None, str | None]:
    """("name or address", "port" or None) of a Host header or an origin's authority, lowercased, without
    the trailing dot of a fully qualified name; (None, None) if it is malformed."""
    header = header.strip().lower()
    if header.startswith("["):  # [IPv6]:port
        end = header.find("]")
        if end < 0 or (header[end + 1:] and not header[end + 1:].startswith(":")):
            return None, None
        host, port = header[1:end], header[end + 2:] or None
    elif header.count(":") == 1:
        host, port = header.split(":")
    else:
        host, port = header, None
    if port is not None and not port.isdigit():
        return None, None
    host = host.rstrip(".")
    if not host or any(c in host for c in "/@\\ ?#"):
        return None, None
    return host, port


class WebPageGuard:
    """Refuses, with 403 in the API's error format, requests whose Host does not name this server and
    state-changing requests (anything but GET, HEAD, OPTIONS) from a foreign web page. See LocalNames."""

    SAFE_METHODS = ("GET", "HEAD", "OPTIONS")

    def __init__(self, app, names: LocalNames):
        self.app = app
        self.names = names

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            host = headers.get(b"host", b"").decode("latin-1")
            origin = headers.get(b"origin")
            message = None
            if not self.names.host_ok(host):
                name = split_host(host)[0] or host
                message = (f"the Host header {host!r} does not name this server, so the request may come from a web "
                           "page whose address was pointed at it (DNS rebinding); if it is a name you use for "
                           f"this machine, start the server with --allowed-host {name}")
            elif (origin is not None and scope.get("method") not in self.SAFE_METHODS
                  and not self.names.origin_ok(origin.decode("latin-1"))):
                shown = origin.decode("latin-1")
                message = (f"the web page at {shown!r} may not send requests to this server (cross-site request "
                           f"protection); to let it, start the server with --cors-origin {shown}")
            if message is not None:
                log.info("refused %s %s: %s", scope.get("method"), scope["path"], message)
                response = error_response(flavor_of(scope["path"]), 403, message)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# The routes that run a model: with several models behind the port (a registry), each request gets the state of
# the model it names (the body's `model`, or `?model=` on GET), loaded if it is not. Every other route (the model
# lists, the management routes) gets the server's own state.
MODEL_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/messages",
                "/v1/messages/count_tokens", "/api/generate", "/api/chat", "/api/show", "/api/embed",
                "/api/embeddings", "/completion", "/completions", "/infill", "/tokenize", "/detokenize",
                "/apply-template", "/embedding", "/embeddings", "/props", "/slots", "/slots/{id_slot}", "/metrics"}
# Read without loading anything: with no model named and none loaded, an empty answer.
PEEK_ROUTES = {"/slots": lambda: json_response([]),
               "/metrics": lambda: PlainTextResponse(Metrics().render(), media_type="text/plain; version=0.0.4")}


class _Releasing:
    """A response that releases the request's hold on its model once it has been sent (a stream: once it ends
    or its client goes away)."""

    def __init__(self, response, lease):
        self.response, self.lease = response, lease

    async def __call__(self, scope, receive, send):
        try:
            await self.response(scope, receive, send)
        finally:
            self.lease.release()


async def _model_request(state: ServerState, request: Request, path: str):
    """(name, keep_alive, body) a request names; the body (parsed once) is kept for its handler."""
    from localllm.server.registry import parse_keep_alive

    if request.method != "POST" or (path == "/slots/{id_slot}" and request.query_params.get("action") == "erase"):
        return request.query_params.get("model") or None, None, None  # an erase has no body (llama.cpp's)
    data = await read_json(request, state.max_body)
    request.scope[BODY_KEY] = data
    name = data.get("model")
    if path == "/api/show" and not name:
        name = data.get("name")
    return name, parse_keep_alive(data.get("keep_alive")), data


async def _stop(registry, path: str, name, data: dict):
    """Ollama's way to unload a model (`ollama stop`): /api/generate or /api/chat with keep_alive 0 and nothing
    to answer."""
    from localllm.server.ollama_api import _now

    await registry.stop_model(name)
    out = {"model": name, "created_at": _now()}  # Ollama's field order: ..., response/message, done, done_reason
    out.update({"response": ""} if path == "/api/generate" else {"message": {"role": "assistant", "content": ""}})
    out.update({"done": True, "done_reason": "unload"})
    return ollama_response(out)


def endpoint(state: ServerState, fn, path: str = ""):
    """Wraps a handler: ApiErrors (and user errors from the library) become the API's error response."""
    registry = state.registry
    routed = registry is not None and path in MODEL_ROUTES

    async def handler(request: Request):
        flavor = flavor_of(request.url.path)
        lease = None
        grammar_worker.client_request.set(request)  # a grammar compile stops when this client goes
        try:
            if not routed:
                return await fn(state, request)
            name, keep_alive, data = await _model_request(state, request, path)
            if (keep_alive == 0 and path in ("/api/generate", "/api/chat") and not data.get("prompt")
                    and not data.get("messages") and not data.get("suffix")):
                return await _stop(registry, path, name, data)
            if name is None and path in PEEK_ROUTES:
                model = registry.loaded()
                if model is None:
                    return PEEK_ROUTES[path]()
                name = model.name
            lease = await registry.acquire(name, keep_alive)
            response = _Releasing(await fn(lease.state, request), lease)
            lease = None
            return response
        except ApiError as e:
            return error_response(flavor, e.status, e.message, e.param, e.kind, headers=e.headers)
        except LocalLLMError as e:
            return error_response(flavor, 400, str(e))
        finally:
            if lease is not None:  # the handler failed: its response will not release it
                lease.release()

    return handler


def create_app(state: ServerState, cors_origins: list[str] | None = None, allowed_hosts: list[str] | None = None,
               host: str = "127.0.0.1") -> Starlette:
    """The application. `host`: the address the server listens on; `allowed_hosts`: more names clients may
    call it by (serve --allowed-host); `cors_origins`: web pages that may use it (serve --cors-origin)."""
    from localllm.server import chat_page as webui

    # The chat page first: `/` is the page for a browser and Ollama's "is running" for its clients (webui.py)
    routes = [Route("/", webui.root(endpoint(state, ollama_api.root, "/")), methods=["GET", "HEAD"]),
              Route(webui.PREFIX + "{name}", webui.asset, methods=["GET", "HEAD"])]
    for module in (anthropic_api, openai_api, responses_api, llamacpp_api, ollama_api, embeddings_api, models_api,
                   ollama_pull):
        for path, methods, fn in module.ROUTES:
            routes.append(Route(path, endpoint(state, fn, path), methods=methods))

    async def http_error(request: Request, exc: HTTPException):
        message = {404: f"no such endpoint: {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return error_response(flavor_of(request.url.path), exc.status_code, message,
                              headers=getattr(exc, "headers", None))

    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(flavor_of(request.url.path), 500, "internal server error")

    middleware = [Middleware(WebPageGuard, names=LocalNames(host, allowed_hosts, cors_origins))]
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["*"],
                                     allow_headers=["*"]))
    if state.api_key:
        middleware.append(Middleware(AuthMiddleware, api_key=state.api_key))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if state.registry is not None:
            await state.registry.start()
        else:
            state.scheduler.start()
        try:
            yield
        finally:
            if state.registry is not None:
                await state.registry.close()
            else:
                state.scheduler.stop()

    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: http_error, Exception: server_error}, lifespan=lifespan)
    app.state.server = state
    return app
