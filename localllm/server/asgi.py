"""The ASGI application: the three APIs' route tables over app.py's plumbing, with auth and CORS.

Apart from app.py so that the API modules, which import app.py's helpers, are imported by this module alone.
"""

from __future__ import annotations

import contextlib
import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.routing import Route

from localllm.errors import LocalLLMError
from localllm.server import llamacpp_api, ollama_api, openai_api
from localllm.server.app import ApiError, ServerState, error_response, flavor_of

log = logging.getLogger("localllm.server")


# ---- the application -----------------------------------------------------------------------------------


class AuthMiddleware:
    """With an API key, every endpoint but /health needs `Authorization: Bearer KEY`."""

    OPEN = ("/health", "/v1/health")

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN and scope.get("method") != "OPTIONS":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(flavor_of(scope["path"]), 401, "invalid or missing API key "
                                          "(send 'Authorization: Bearer KEY')",
                                          headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def endpoint(state: ServerState, fn):
    """Wraps a handler: ApiErrors (and user errors from the library) become the API's error response."""

    async def handler(request: Request):
        flavor = flavor_of(request.url.path)
        try:
            return await fn(state, request)
        except ApiError as e:
            return error_response(flavor, e.status, e.message, e.param, e.kind)
        except LocalLLMError as e:
            return error_response(flavor, 400, str(e))

    return handler


def create_app(state: ServerState, cors_origins: list[str] | None = None) -> Starlette:
    routes = []
    for module in (openai_api, llamacpp_api, ollama_api):
        for path, methods, fn in module.ROUTES:
            routes.append(Route(path, endpoint(state, fn), methods=methods))

    async def http_error(request: Request, exc: HTTPException):
        message = {404: f"no such endpoint: {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return error_response(flavor_of(request.url.path), exc.status_code, message,
                              headers=getattr(exc, "headers", None))

    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(flavor_of(request.url.path), 500, "internal server error")

    middleware = []
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["*"],
                                     allow_headers=["*"]))
    if state.api_key:
        middleware.append(Middleware(AuthMiddleware, api_key=state.api_key))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.scheduler.start()
        try:
            yield
        finally:
            state.scheduler.stop()

    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: http_error, Exception: server_error}, lifespan=lifespan)
    app.state.server = state
    return app
