"""The Starlette application: routes of the four APIs, authentication, limits, errors in each API's format.

Handlers are thin: they validate a request (`Fields`), turn it into prompt tokens and `GenerationParams`, hand
it to the one `Scheduler`, and stream back what comes out. Streams stop generating the moment their client
goes away (Starlette cancels the response when it sees the disconnect; a non-streamed request watches for it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from localllm.runtime.engine import Engine
from localllm.errors import LocalLLMError
from localllm.server.scheduler import Final, Handle, RequestFailed, Scheduler
from localllm.server.scheduler import Request as SchedRequest

log = logging.getLogger("localllm.server")

MAX_BODY = 4 * 1024 * 1024  # bytes
# Bodies above this are parsed in a worker thread: json.loads of 4 MiB holds the event loop for ~30 ms.
PARSE_OFF_LOOP = 64 * 1024
BODY_KEY = "localllm.json"  # where a body parsed before its handler ran is kept in the ASGI scope


@dataclass
class ServerState:
    engine: Engine
    scheduler: Scheduler
    model_name: str
    model_path: str
    max_tokens: int  # the most tokens one request may generate
    parallel: int
    api_key: str | None = None
    max_body: int = MAX_BODY
    created: int = field(default_factory=lambda: int(time.time()))
    # Several models behind one port (registry.ModelRegistry): the app's base state holds it, and each request
    # gets the state of the model it names. None: this state's one engine serves every request.
    registry: object | None = None
    # llama.cpp's --slot-save-path: the folder `/slots/N?action=save|restore` write and read; None: refused (501)
    slot_save_path: str | None = None


def id_slot(f) -> int:
    """llama.cpp's `id_slot` field of a completion request: the slot to run in, -1 (the default) for any."""
    return f.get("id_slot", int, -1, lo=-1, hi=1 << 16)


# ---- errors --------------------------------------------------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                             404: "not_found_error", 413: "invalid_request_error", 415: "invalid_request_error",
                             503: "unavailable_error"}.get(status, "server_error")


# Anthropic's error types by HTTP status (its Messages API errors: {"type": "error", "error": {"type", "message"}})
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                         415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
                         529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


def flavor_of(path: str) -> str:
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path.startswith("/v1/"):
        return "openai"
    if path.startswith("/api/"):
        return "ollama"
    return "llamacpp"


def error_response(flavor: str, status: int, message: str, param: str | None = None,
                   kind: str | None = None, headers: dict | None = None) -> Response:
    e = ApiError(status, message, param, kind)
    if flavor == "ollama":
        body = {"error": message}
    elif flavor == "anthropic":
        body = anthropic_error_body(status, message)
    elif flavor == "openai":
        body = {"error": {"message": message, "type": e.kind, "param": param, "code": None}}
    else:  # llama.cpp's server
        body = {"error": {"code": status, "message": message, "type": e.kind}}
    if flavor == "ollama":
        return ollama_response(body, status, headers)
    return json_response(body, status, headers)


# ---- request bodies ------------------------------------------------------------------------------------


def is_json_type(content_type: str) -> bool:
    """application/json, with or without parameters (charset=utf-8), or any other */json or */*+json type.
    None of them is one a web page may send to another site without a CORS preflight (text/plain, a form, or
    no type at all are), so a page elsewhere cannot get a body read here."""
    media = content_type.split(";", 1)[0].strip().lower()
    kind, _, sub = media.partition("/")
    return bool(re.fullmatch(r"[a-z0-9!#$&^_.+-]+", kind)) and (sub == "json" or (
        sub.endswith("+json") and bool(re.fullmatch(r"[a-z0-9!#$&^_.+-]+", sub))))


# A lone surrogate can only come from a \ud800-\udfff escape or the 3-byte form 0xED 0xA0-0xBF 0x..; a body
# without either needs no walk.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(data: dict) -> tuple[str, str] | None:
    """(where, its top-level field) of the first string, value or key, that holds a lone UTF-16 surrogate,
    e.g. ("messages[0].content", "messages"); None if there is none. Iterative: any depth json.loads
    accepts is walked."""

    def bad(s: str) -> bool:
        return not s.isascii() and _SURROGATE.search(s) is not None

    def name(trail) -> tuple[str, str]:
        keys = []
        while trail is not None:
            trail, key = trail
            keys.append(key)
        keys.reverse()
        where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys).lstrip(".")
        return where[:100], str(keys[0])[:100]

    stack: list = [(item, (None, key)) for key, item in data.items()]
    for key in data:
        if bad(key):
            return "a field name", None
    while stack:
        value, trail = stack.pop()
        if isinstance(value, str):
            if bad(value):
                return name(trail)
        elif isinstance(value, dict):
            for key, item in value.items():
                if bad(key):
                    where, top = name(trail)
                    return f"a key of {where}", top
                if isinstance(item, (str, dict, list)):
                    stack.append((item, (trail, key)))
        elif isinstance(value, list):
            stack.extend((item, (trail, i)) for i, item in enumerate(value) if isinstance(item, (str, dict, list)))
    return None


def parse_json(raw: bytes) -> dict:
    """The body's JSON object, or a 400: not JSON, not an object, or a string that is not Unicode text."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    if _MAYBE_SURROGATE.search(raw) or not json.detect_encoding(raw).startswith("utf-8"):
        found = _lone_surrogate(data)
        if found is not None:
            # JSON lets "\ud800" through, but it is no character: nothing can encode it as UTF-8.
            where, field_name = found
            raise ApiError(400, f"{where if where.startswith('a ') else repr(where)} holds a lone UTF-16 "
                                "surrogate (\\ud800-\\udfff), which is not text", param=field_name)
    return data


async def read_json(request: Request, max_body: int) -> dict:
    """The request's JSON object, or a 4xx: not sent as JSON (415), too large (413), not JSON, not an object,
    not text (400)."""
    cached = request.scope.get(BODY_KEY)
    if cached is not None:  # read already, to learn the model it names (asgi.endpoint)
        return cached
    content_type = request.headers.get("content-type", "").strip()
    # No Content-Type at all (aider's litellm on /api/chat; llama-server reads such a body) is read as JSON: no
    # web page can have sent it here. A page's post names the page in Origin, and WebPageGuard has refused every
    # page but this machine's and the --cors-origin ones before this runs. Types a page may post without a
    # preflight (text/plain, forms) stay refused.
    if content_type and not is_json_type(content_type):
        raise ApiError(415, f"the request body must be JSON sent with 'Content-Type: application/json' (got "
                            f"{json.dumps(content_type) if content_type else 'none'}); with curl, add "
                            "-H 'Content-Type: application/json' (or use --json)")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_body:
        raise ApiError(413, f"the request body is larger than {max_body} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            raise ApiError(413, f"the request body is larger than {max_body} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError(400, "the request needs a JSON body")
    if len(raw) > PARSE_OFF_LOOP:
        return await off_loop(parse_json, raw)
    return parse_json(raw)


async def off_loop(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a worker thread: work that grows with the request (parsing, templating,
    tokenizing: 4-26 s for 4 MB on smollm2, by how often words repeat) must not hold the event loop, which
    serves every other request."""
    return await asyncio.to_thread(fn, *args, **kwargs)


def _content_text(content) -> str:
    """A message's text: its string, or its text parts joined (OpenAI's and Anthropic's part lists)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def fold_system(messages: list[dict]) -> list[dict]:
    """The messages with every system message folded into one system prompt at the start (their texts in
    order, a blank line apart)."""
    system = [_content_text(m.get("content")) for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def render_system_anywhere(render, messages: list[dict]) -> str:
    """render(messages), with system messages after the first message rendered where they stand when the
    template renders them there (ChatML templates do); a template that refuses them ("roles must alternate")
    or leaves their text out gets them folded into the system prompt (fold_system), as llama-server does for a
    template that takes one system message. Every chat route renders its messages through this."""
    late = [_content_text(m.get("content")) for m in messages[1:] if isinstance(m, dict) and m.get("role") == "system"]
    if not late:
        return render(messages)
    try:
        text = render(messages)
        if all(c.strip() in text for c in late):
            return text
    except LocalLLMError:
        pass
    return render(fold_system(messages))


def prompt_tokens(state: "ServerState", text: str, chat: bool = False) -> list[int]:
    """engine.tokenize_prompt, after a check that takes milliseconds (40 ms for 4 MB): a text surely longer
    than the context (Tokenizer.min_tokens) is refused without being tokenized. Call it off the loop."""
    ctx = state.engine.ctx
    at_least = state.engine.tokenizer.min_tokens(text)
    if at_least + 1 > ctx:
        raise ApiError(400, f"the prompt is at least {at_least} tokens ({len(text)} characters) but the "
                            f"context holds {ctx}")
    return state.engine.tokenize_prompt(text, chat=chat)


_TYPE_NAMES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
               dict: "an object"}


class Fields:
    """Typed access to a JSON object's fields: a wrong type or range is a 400 naming the field."""

    def __init__(self, data: dict, prefix: str = ""):
        self.data = data
        self.prefix = prefix

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def _bad(self, key: str, what: str) -> ApiError:
        return ApiError(400, f"'{self.prefix}{key}' must be {what}, got {json.dumps(self.data[key])[:80]}",
                        param=self.prefix + key)

    def get(self, key: str, kind, default=None, lo=None, hi=None):
        v = self.data.get(key)
        if v is None:
            return default
        if kind is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise self._bad(key, "a number")
            v = float(v)
        elif kind is int:
            if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int):
                raise self._bad(key, "an integer")
        elif not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise self._bad(key, _TYPE_NAMES.get(kind, kind.__name__))
        if lo is not None and v < lo:
            raise self._bad(key, f">= {lo}")
        if hi is not None and v > hi:
            raise self._bad(key, f"<= {hi}")
        return v

    def param(self, p, api: str, vocab_size: int | None = None):
        """The value of the table's parameter `p` (localllm/parameters.py) as `api` takes it: its default there
        when absent, else checked against its type and `api`'s bounds."""
        v = self.get(p.name, p.kind)
        if v is None:
            return p.default_for(api)
        why = p.problem(v, api, vocab_size)
        if why is not None:
            raise self._bad(p.name, why)
        return v

    def stop(self, key: str = "stop") -> list[str]:
        """A string or a list of strings (OpenAI allows up to 4; we allow 16)."""
        v = self.data.get(key)
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and len(v) <= 16 and all(isinstance(s, str) for s in v):
            return list(v)
        raise self._bad(key, "a string or an array of at most 16 strings")


# ---- running a request ---------------------------------------------------------------------------------


def submit(state: ServerState, tokens: list[int], params, slot: int = -1) -> Handle:
    """The request into the model's scheduler. `slot`: llama.cpp's id_slot (-1: any free slot)."""
    if not tokens:
        raise ApiError(400, "the prompt is empty")
    if len(tokens) + 1 > state.engine.ctx:
        raise ApiError(400, f"the prompt is {len(tokens)} tokens but the context holds {state.engine.ctx}")
    try:
        return state.scheduler.submit(SchedRequest(tokens, params, slot))
    except RequestFailed as e:
        raise ApiError(e.status, str(e)) from None


async def stream_events(handle: Handle, first=None):
    """The request's TokenEvents then its Final (after `first`, if the caller already took it). If the consumer
    stops early (the client went away and Starlette cancelled the response), the generation is cancelled and
    its cache released at the scheduler's next step."""
    try:
        if first is not None:
            yield first
            if isinstance(first, Final):
                return
        async for item in handle.events():
            yield item
    except RequestFailed as e:
        raise ApiError(e.status, str(e)) from None
    finally:
        handle.cancel()  # a no-op once the request has finished


async def watching_disconnect(request: Request, handle: Handle, awaitable):
    """Await `awaitable`, cancelling the request if the client disconnects meanwhile."""

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                handle.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await awaitable
    finally:
        watcher.cancel()


async def first_item(request: Request, handle: Handle):
    """The first event of a request, before a streamed response starts: an error up to the first token
    (a prompt that does not fit, a busy server) is then a proper HTTP error, not a broken stream."""

    async def take():
        try:
            return await handle.events().__anext__()
        except RequestFailed as e:
            raise ApiError(e.status, str(e)) from None

    try:
        return await watching_disconnect(request, handle, take())
    except BaseException:
        handle.cancel()
        raise


async def collect(request: Request, handle: Handle) -> tuple[list, Final]:
    """All the events of a non-streamed request; cancels it if the client disconnects while waiting."""

    async def run():
        events = []
        async for item in stream_events(handle):
            if isinstance(item, Final):
                return events, item
            events.append(item)
        raise ApiError(500, "the generation ended without a result")

    return await watching_disconnect(request, handle, run())


def stream_error(e: ApiError, flavor: str) -> dict:
    """An error after a stream started: sent as one last message of the stream."""
    if flavor == "ollama":
        return {"error": e.message}
    return {"error": {"code": e.status, "message": e.message, "type": e.kind}}


def sse(obj) -> str:
    return f"data: {dumps_compact(obj)}\n\n"


def sampling_from(f: Fields, api: str, vocab_size: int):
    """SamplingParams from a request's fields, as `api` ("llamacpp", "openai", "anthropic", "ollama") defaults and
    bounds them (localllm/parameters.py). A top_p of 0 is "off" (1), as llama-server takes it; a dry_base below 1
    falls back to the default (1.75), as llama-server does; dry_sequence_breakers must be a non-empty array of
    strings."""
    from localllm import parameters
    from localllm.chat.sampling import DRY_SEQUENCE_BREAKERS, SamplingParams

    values = {}
    for p in parameters.SAMPLING:
        if p.name == "top_p" and type(f.data.get("top_p")) in (int, float) and f.data["top_p"] == 0:
            values["top_p"] = 1.0
            continue
        values[p.name] = f.param(p, api, vocab_size)
    if values["dry_base"] < 1.0:
        values["dry_base"] = parameters.BY_NAME["dry_base"].default
    breakers = f.data.get("dry_sequence_breakers")
    if breakers is None:
        breakers = DRY_SEQUENCE_BREAKERS
    elif (not isinstance(breakers, list) or not breakers or len(breakers) > 64
          or not all(isinstance(b, str) for b in breakers)):
        raise ApiError(400, "'dry_sequence_breakers' must be a non-empty array of strings (at most 64)",
                       param="dry_sequence_breakers")
    return SamplingParams(
        **values, dry_sequence_breakers=tuple(breakers),
        seed=f.get("seed", int, None, lo=-(1 << 63), hi=(1 << 64) - 1),
        logprob=False,  # an API that reports logprobs turns it on for the requests that ask (sampling.py)
    )


def fix_seed(sampling) -> None:
    """OpenAI and Ollama accept any integer seed; the sampler wants one >= 0."""
    if sampling.seed is not None:
        sampling.seed %= 1 << 64


def check_max_tokens(state: ServerState, value: int | None, key: str) -> int:
    if value is None:
        return state.max_tokens
    if value > state.max_tokens:
        raise ApiError(400, f"'{key}' is {value} but this server generates at most {state.max_tokens} tokens "
                            "per request (localllm serve --max-tokens)", param=key)
    return value


async def constrain(state: ServerState, params, param: str, *, json_schema=None, gbnf=None, lark=None) -> None:
    """Compile a request's structured-output constraint into `params.grammar` (off the event loop: the first
    one builds the vocabulary's matcher tables, ~0.5 s on a 49k vocabulary). One that does not compile is a
    400 with llguidance's reason, naming the field: never an unconstrained answer."""
    if json_schema is None and gbnf is None and lark is None:
        return
    from localllm.errors import LocalLLMError
    from localllm.chat.grammar_worker import GrammarBusy, compile_bounded

    engine = state.engine
    try:  # in a worker process with a time and memory budget, stopped if the client goes (grammar_worker.py)
        params.grammar = await compile_bounded(engine.tokenizer, engine.config.vocab_size,
                                               json_schema=json_schema, gbnf=gbnf, lark=lark)
    except GrammarBusy as e:
        raise ApiError(503, f"'{param}': {e}", param=param, headers={"Retry-After": str(e.retry_after)}) from None
    except LocalLLMError as e:
        raise ApiError(400, f"'{param}': {e}", param=param) from None


# ---- writing answers -----------------------------------------------------------------------------------
#
# Every body is written as the server its clients were written against writes it, byte for byte in form:
# clients parse with shortcuts (llama.vim drops an /infill answer that does not match '"content"\s*:"', i.e.
# a space after the colon). llama.cpp (nlohmann::json dump()), OpenAI's and Anthropic's APIs write compact JSON
# with text as UTF-8; Ollama (Go's encoding/json) writes it compact too, and escapes <, >, & and U+2028/U+2029
# as \u003c, \u003e, \u0026, \u2028, \u2029, as json.Marshal does.


def dumps_compact(obj) -> str:
    """JSON without a space after ',' or ':', non-ASCII text as UTF-8 (not \\u escapes)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# In JSON text these characters occur only inside strings, so escaping them in the whole text is exact.
_GO_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
                             "\u2029": "\\u2029"})


def dumps_go(obj) -> str:
    """JSON as Go's json.Marshal writes it (Ollama): compact, UTF-8, HTML characters escaped."""
    return dumps_compact(obj).translate(_GO_ESCAPES)


def go_float32(x) -> str:
    """A float32 as Go's encoding/json writes it (Ollama's []float32 embeddings): the shortest digits that read
    back to the same float32, positional unless |x| < 1e-6 or >= 1e21, where it is exponential with Go's
    exponent ("1e-7", "1e+21"), where Python's float64 repr of the same value has twice the digits."""
    f = np.float32(x)
    a = abs(f)
    if a != 0 and (a < np.float32(1e-6) or a >= np.float32(1e21)):
        text = np.format_float_scientific(f, unique=True, trim="-")
        mantissa, _, exponent = text.partition("e")
        sign, digits = exponent[0], exponent[1:].lstrip("0")
        # Go writes at least two exponent digits, then json.Marshal turns e-0N into e-N (not e+0N)
        return f"{mantissa}e{sign}{digits if sign == '-' else digits.rjust(2, '0')}"
    return np.format_float_positional(f, unique=True, trim="-")


def go_float32_rows(rows) -> str:
    """A matrix of float32 as Go's json.Marshal writes [][]float32."""
    return "[" + ",".join("[" + ",".join(map(go_float32, row)) + "]" for row in rows) + "]"


def _encode(text: str) -> bytes:
    # A lone surrogate cannot be UTF-8; requests holding one are refused (parse_json), so this only guards.
    return text.encode("utf-8", "replace")


def json_response(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(_encode(dumps_compact(obj)), status_code=status, media_type="application/json",
                    headers=headers)


def ollama_response(obj, status: int = 200, headers: dict | None = None) -> Response:
    """An Ollama route's JSON answer (see dumps_go)."""
    return Response(_encode(dumps_go(obj)), status_code=status, media_type="application/json; charset=utf-8",
                    headers=headers)


def ndjson_line(obj) -> str:
    """One line of an Ollama NDJSON stream."""
    return dumps_go(obj) + "\n"
