"""The chat page at `/` (issue 41 item 3): a page a person can use in their browser, as llama-server's is.

Its three files (webui/index.html, app.css, app.js: vanilla JavaScript, no framework) ship in the package and are
served from here; the page asks nothing of any other host (its Content-Security-Policy allows this server only).
It talks to the server's OpenAI routes: GET /v1/models for the model picker, POST /v1/chat/completions streamed.
With `serve --api-key`, the page and its files are open (they hold no secret) and the page sends the key typed in
its key field. `/` still answers "Ollama is running" to a client that does not ask for HTML (Ollama's clients probe
it so); a browser asks for text/html.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

ASSETS = {"app.js": "text/javascript; charset=utf-8", "app.css": "text/css; charset=utf-8"}
PREFIX = "/ui/"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}


def _read(name: str) -> bytes:
    return resources.files("localllm.server").joinpath("webui", name).read_bytes()


def wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "")


def root(ollama_root):
    """GET / : the page for a browser, Ollama's answer for everyone else."""

    async def handler(request: Request):
        if not wants_html(request):
            return await ollama_root(request)
        return Response(_read("index.html"), media_type="text/html; charset=utf-8", headers=HEADERS)

    return handler


async def asset(request: Request):
    name = request.path_params["name"]
    if name not in ASSETS:
        return PlainTextResponse(f"no such file: {PREFIX}{name}", status_code=404)
    return Response(_read(name), media_type=ASSETS[name], headers=HEADERS)
