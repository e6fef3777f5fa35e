"""Hostile web pages and hostile bodies against the REST port, in-process (Starlette's TestClient on the real
app and engine): a page cannot drive the server (DNS rebinding: the Host allow-list; cross-site requests: the
Origin check and JSON-only bodies), no answer shows a filesystem path, and well-formed JSON that is not text
(a lone surrogate) or not a token (logit_bias) gets a 400, never a 500."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
from conftest import model_file
from starlette.testclient import TestClient

from localllm.runtime.engine import Engine
from localllm.server import anthropic_api, llamacpp_api, ollama_api, openai_api
from localllm.server.app import ServerState
from localllm.server.asgi import create_app
from localllm.server.scheduler import Scheduler

MODEL = "smollm2-135m-instruct"
BASE = "http://127.0.0.1:8080"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

# A valid body for each POST endpoint, with every text field it reads.
BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "stop": ["\n\n"]},
    "/v1/chat/completions": {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stop": "\n\n"},
    "/completion": {"prompt": "Hello", "n_predict": 2, "stop": ["\n\n"]},
    "/completions": {"prompt": ["Hello", " there"], "n_predict": 2},
    "/infill": {"input_prefix": "def f():", "input_suffix": "\n", "prompt": "",
                "input_extra": [{"filename": "a.py", "text": "x = 1"}], "n_predict": 2},
    "/tokenize": {"content": "Hello"},
    "/detokenize": {"tokens": [1, 2]},
    "/api/show": {"model": MODEL},
    "/api/generate": {"model": MODEL, "prompt": "Hello", "system": "Be brief.", "suffix": "", "stream": False,
                      "options": {"num_predict": 2, "stop": ["\n\n"]}},
    "/api/chat": {"model": MODEL, "messages": MESSAGES, "stream": False, "options": {"num_predict": 2}},
    "/v1/messages": {"model": MODEL, "max_tokens": 2, "system": [{"type": "text", "text": "Be brief."}],
                     "stop_sequences": ["\n\n"], "messages": [
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "now",
                                                            "input": {"zone": "UTC"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                       "content": [{"type": "text", "text": "10:42"}]}]}]},
    "/v1/messages/count_tokens": {"model": MODEL, "system": "Be brief.", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
}


@pytest.fixture(scope="module")
def engine():
    return Engine.load(str(model_file(MODEL)), ctx=512, quiet=True)


def make_client(engine, **options) -> TestClient:
    state = ServerState(engine=engine, scheduler=Scheduler(engine, parallel=2), model_name=MODEL,
                        model_path=str(model_file(MODEL)), max_tokens=4, parallel=2)
    return TestClient(create_app(state, **options), base_url=BASE)


@pytest.fixture(scope="module")
def client(engine):
    with make_client(engine) as c:  # with: the lifespan runs, so the scheduler generates
        yield c


def message_of(r) -> str:
    err = r.json()["error"]
    return err if isinstance(err, str) else err["message"]


def post(c, path, body=None, **headers):
    return c.post(path, content=json.dumps(BODIES[path] if body is None else body),
                  headers={"Content-Type": "application/json", **headers})


# ---- web pages ---------------------------------------------------------------------------------------------


def test_requests_whose_host_does_not_name_this_server_are_refused(engine, client):
    """DNS rebinding: a page at evil.example whose name now points at 127.0.0.1 is same-origin with the server
    in the browser's eyes, but its requests say `Host: evil.example`."""
    for method, path in [("GET", "/v1/models"), ("POST", "/completion"), ("GET", "/api/tags"),
                         ("GET", "/health"), ("POST", "/api/show")]:
        r = client.request(method, path, headers={"Host": "evil.example:8080", "Content-Type": "application/json"},
                           content=json.dumps(BODIES.get(path, {})))
        assert r.status_code == 403, (path, r.text)
        assert "DNS rebinding" in message_of(r) and "--allowed-host evil.example" in message_of(r)
    assert isinstance(client.get("/api/tags", headers={"Host": "evil.example"}).json()["error"], str)  # Ollama's
    assert client.get("/v1/models", headers={"Host": "evil.example"}).json()["error"]["type"] == "permission_error"

    local = ["localhost", "localhost:8080", "LocalHost.:8080", "127.0.0.1", "127.0.0.1:8080", "[::1]:8080",
             "192.168.1.20:8080", "[fe80::1]", "dev.localhost", socket.gethostname()]
    for host in local:
        r = client.get("/v1/models", headers={"Host": host})
        assert r.status_code == 200, (host, r.text)
    for host in ["evil.example", "127.0.0.1.nip.io", "localhost.evil.example", "a b", "x@localhost"]:
        assert client.get("/v1/models", headers={"Host": host}).status_code == 403, host

    with make_client(engine, allowed_hosts=["box.lan"], host="0.0.0.0") as c:
        assert c.get("/v1/models", headers={"Host": "box.lan:8080"}).status_code == 200
        assert c.get("/v1/models", headers={"Host": "10.0.0.7:8080"}).status_code == 200
        assert c.get("/v1/models", headers={"Host": "evil.example"}).status_code == 403
    with make_client(engine, allowed_hosts=["*"]) as c:
        assert c.get("/v1/models", headers={"Host": "anything.example"}).status_code == 200


def test_posts_from_foreign_web_pages_are_refused(engine, client):
    """Cross-site requests: a browser names the page behind every POST in Origin; only this machine's pages,
    apps' own schemes and --cors-origin origins may post."""
    for path in ("/v1/chat/completions", "/completion", "/api/generate", "/tokenize"):
        r = post(client, path, Origin="https://evil.example")
        assert r.status_code == 403 and "--cors-origin https://evil.example" in message_of(r), (path, r.text)
    for origin in ("null", "http://192.168.1.20:8080", "http://localhost.evil.example"):
        assert post(client, "/tokenize", Origin=origin).status_code == 403, origin
    # Reading is not refused (without CORS the page cannot see the answer); nor are this machine's pages.
    assert client.get("/v1/models", headers={"Origin": "https://evil.example"}).status_code == 200
    for origin in ("http://localhost:5173", "http://127.0.0.1:3000", "http://[::1]", "vscode-webview://abc123",
                   f"http://{socket.gethostname()}:8000"):
        assert post(client, "/tokenize", Origin=origin).status_code == 200, origin

    # CORS stays off unless asked; an origin given to --cors-origin may post, and reads its answers.
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
    assert client.options("/tokenize", headers=preflight).status_code == 405
    assert "access-control-allow-origin" not in post(client, "/tokenize", Origin="http://localhost:5173").headers
    with make_client(engine, cors_origins=["https://app.example"]) as c:
        assert c.options("/tokenize", headers=preflight).status_code == 200
        r = post(c, "/tokenize", Origin="https://app.example")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert post(c, "/tokenize", Origin="https://evil.example").status_code == 403


def test_request_bodies_must_be_sent_as_json(client):
    """A page may post text/plain or a form to any site without asking first (no CORS preflight), so those types
    are refused; what the openai and ollama clients, llama.vim, llama.vscode and Continue send (application/json,
    with or without a charset) is read."""
    body = json.dumps(BODIES["/completion"]).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         "text/plain; application/json"):
        headers = {"Content-Type": content_type}
        for path in ("/v1/completions", "/completion", "/api/generate"):
            r = client.post(path, content=body, headers=headers)
            assert r.status_code == 415, (path, content_type, r.text)
            assert "Content-Type: application/json" in message_of(r)
    r = client.post("/api/generate", content=body, headers={"Content-Type": "text/plain"})
    assert r.json()["error"].startswith("the request body must be JSON")
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON",
                         "application/vnd.example+json", "text/json"):
        r = client.post("/tokenize", content=json.dumps({"content": "Hi"}), headers={"Content-Type": content_type})
        assert r.status_code == 200, (content_type, r.text)


def test_a_json_body_without_content_type_is_read_unless_a_foreign_page_sent_it(client):
    """aider (litellm's ollama_chat) posts /api/chat with no Content-Type at all: no web page can have sent that
    here (a page's post names it in Origin), so it is read, as llama-server reads it. From this machine's page
    too; a foreign page's post stays refused, whatever its type."""
    body = json.dumps(BODIES["/completion"]).encode()
    for path in ("/v1/completions", "/completion", "/api/generate"):
        assert client.post(path, content=body).status_code == 200, path
        assert client.post(path, content=body, headers={"Origin": "http://localhost:5173"}).status_code == 200
        for origin in ("https://evil.example", "null"):
            r = client.post(path, content=body, headers={"Origin": origin})
            assert r.status_code == 403, (path, origin, r.text)
    # not JSON, untyped: the JSON parser's 400, not a 415
    r = client.post("/completion", content=b"prompt=hi")
    assert r.status_code == 400 and "not valid JSON" in message_of(r)


def test_no_response_discloses_a_filesystem_path(client):
    """Every GET and POST endpoint of the four APIs, answering and failing: the model's directory and the
    home directory never appear (the model is named, not located)."""
    path = model_file(MODEL).resolve()
    secrets = [str(path.parent), str(Path.home()) + "/"]
    seen = {}

    def scan(what: str, r) -> None:
        text = r.text
        seen[what] = r.status_code
        for secret in secrets:
            assert secret not in text, (what, r.status_code, text[:300])

    for module in (openai_api, anthropic_api, llamacpp_api, ollama_api):
        for route, methods, _ in module.ROUTES:
            for name in (MODEL, "no-such-model"):
                url = re.sub(r"\{[^}]*\}", name, route)
                for method in methods:
                    if method == "GET":
                        scan(f"GET {url}", client.get(url))
                    elif method == "POST":
                        scan(f"POST {url}", post(client, url, BODIES.get(url, {"model": name})))
                        scan(f"POST {url} (stream)", post(client, url, {**BODIES.get(url, {}), "stream": True}))
                        scan(f"POST {url} (empty)", post(client, url, {}))
    assert seen["GET /props"] == seen["POST /api/show"] == seen["GET /v1/models"] == 200
    assert seen["POST /v1/chat/completions"] == seen["POST /api/generate"] == seen["POST /v1/messages"] == 200
    assert seen["GET /v1/models/no-such-model"] == 404 and seen["POST /infill"] == 400  # errors were scanned too
    assert client.get("/props").json()["model_path"] == MODEL
    assert client.post("/api/show", json={"model": MODEL}).json()["modelfile"] == f"FROM {MODEL}\n"


# ---- bodies that are JSON but not text ---------------------------------------------------------------------


def text_fields(body, trail=()):
    """(trail, value) of every string in a body, nested ones included."""
    if isinstance(body, str):
        yield trail, body
    elif isinstance(body, dict):
        for k, v in body.items():
            yield from text_fields(v, trail + (k,))
    elif isinstance(body, list):
        for i, v in enumerate(body):
            yield from text_fields(v, trail + (i,))


def replaced(body, trail, value):
    body = json.loads(json.dumps(body))
    at = body
    for key in trail[:-1]:
        at = at[key]
    at[trail[-1]] = value
    return body


def test_lone_surrogates_in_any_text_field_get_a_400(client):
    """JSON lets "\\ud800" through, but it is no character (nothing can encode it as UTF-8): each text field of
    each endpoint answers 400 naming the field."""
    n = 0
    for path, body in BODIES.items():
        for trail, value in text_fields(body):
            for bad in ("\ud800", value + "\udfff", "\udc80" + value):
                r = post(client, path, replaced(body, trail, bad))
                assert r.status_code == 400, (path, trail, r.status_code, r.text)
                assert "lone UTF-16 surrogate" in message_of(r) and str(trail[0]) in message_of(r), r.text
                n += 1
        # In a field name too, and as raw UTF-8 bytes of a surrogate (json.loads lets those through as well).
        r = client.post(path, content=b'{"\\ud800": 1}', headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        raw = json.dumps({**body, "model": "X"}).encode().replace(b'"X"', b'"\xed\xa0\x80"')
        assert client.post(path, content=raw, headers={"Content-Type": "application/json"}).status_code == 400
    assert n > 40
    # Paired surrogates are one character, and fine.
    assert post(client, "/tokenize", {"content": "\ud83d\ude00"}).json()["tokens"]


def test_logit_bias_entries_that_are_not_token_ids_get_a_400(client):
    llamacpp = [[[None, 1]], [[[1], 1]], [[{}, 1]], [[{"a": 1}, -1]], [["abc", 1]], [[1.5, 1]], [[True, 1]],
                [[-1, 1]], [[10**30, 1]], [[1, None]], [[1, [2]]], [[1]], [None], "x", 3]
    for bias in llamacpp:
        r = post(client, "/completion", {"prompt": "Hi", "n_predict": 1, "logit_bias": bias})
        assert r.status_code == 400 and "logit_bias" in message_of(r), (bias, r.text)
    openai = [{"abc": 1}, {"1": None}, {"1": [1]}, {"1": {}}, {"1": True}, {"1": 1e9}, {"-5": 1}, [[1, 1]]]
    for bias in openai:
        r = post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logit_bias": bias})
        assert r.status_code == 400 and "logit_bias" in message_of(r), (bias, r.text)
    # What is well formed still works: a string id, false to ban, an object.
    for bias in ([["15", -2]], [[15, False]], {"15": 2}):
        assert post(client, "/completion", {"prompt": "Hi", "n_predict": 1, "logit_bias": bias}).status_code == 200
