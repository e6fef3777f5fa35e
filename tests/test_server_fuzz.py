"""The API survives fuzzing: hypothesis throws well-typed, ill-typed and absurd JSON (and non-JSON) at every POST
endpoint of a real server; no answer is a 5xx, every error has a message, and the server stays up. Text anywhere
may hold a lone surrogate ("\\ud800": valid JSON, not text), and any value, however deep, may turn into a null, a
list or an object."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import model_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import start_server, stop_server

MODEL = "smollm2-135m-instruct"

# Text with a lone surrogate: json.dumps writes it as a "\\ud800" escape, which json.loads takes back.
lone_surrogate = st.builds(lambda a, s, b: a + s + b, st.text(max_size=6),
                           st.sampled_from(["\ud800", "\udbff", "\udc80", "\udfff"]), st.text(max_size=6))
json_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | lone_surrogate)
json_any = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


number = st.floats(min_value=-3, max_value=3) | st.integers(min_value=-3, max_value=50)
small = st.integers(min_value=-2, max_value=6)
text = st.text(max_size=30) | lone_surrogate
stop = text | st.lists(text, max_size=3)
# Tool calls an assistant made (OpenAI's arguments as JSON text, Ollama's as an object) and tool results.
tool_call = st.fixed_dictionaries({"function": st.fixed_dictionaries({"name": text}, optional={
    "arguments": st.just('{"city": "Oslo"}') | text | json_any})}, optional={"id": text, "type": st.just("function")})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]) | text,
                                 "content": text | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                   "text": text}), max_size=2)},
                                optional={"tool_calls": st.lists(tool_call, max_size=2), "tool_call_id": text,
                                          "tool_name": text})
messages = st.lists(message, min_size=1, max_size=3)
token_ids = st.lists(st.integers(min_value=-5, max_value=50000), max_size=6)
bias = st.dictionaries(st.integers(-2, 49200).map(str) | text, st.floats(-150, 150) | json_any, max_size=3)
unit = st.floats(min_value=0, max_value=1)
penalty = st.floats(min_value=-2, max_value=2)
sampling = {"temperature": st.floats(0, 2) | st.just(0), "top_p": unit, "top_k": small, "min_p": unit,
            "seed": number, "presence_penalty": penalty, "frequency_penalty": penalty,
            "repeat_penalty": st.floats(0.5, 2), "stop": stop}
options = st.fixed_dictionaries({}, optional={"num_predict": small, **sampling})

# Structured output: JSON schemas built from real keywords with any values, and GBNF-like text.
schema = st.recursive(
    st.fixed_dictionaries({}, optional={"type": st.sampled_from(["object", "string", "integer", "array", "frob"])
                                        | json_any, "enum": st.lists(json_scalars, max_size=3),
                                        "pattern": text, "minimum": number, "maxLength": small}),
    lambda inner: st.fixed_dictionaries({"type": st.just("object")}, optional={
        "properties": st.dictionaries(st.text(max_size=6), inner, max_size=3), "required": st.lists(text, max_size=2),
        "items": inner, "anyOf": st.lists(inner, max_size=2), "$ref": text}), max_leaves=6)
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "f.x-1"]) | text}, optional={"description": text, "parameters": schema})})
tools = st.lists(tool | json_any, max_size=2)
tool_choice = (st.sampled_from(["auto", "none", "required"]) | json_any
               | st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                   {"name": st.just("get_weather") | text})}))
grammar = st.sampled_from(['root ::= "yes" | "no"', "root ::= x", 'root ::= [a-z]+ "."', "root ::=", ""]) | text

# Anthropic's Messages API: content blocks of every kind it reads (and some it refuses), tools, tool_choice.
text_block = st.fixed_dictionaries({"type": st.just("text"), "text": text},
                                   optional={"cache_control": st.just({"type": "ephemeral"})})
block = (text_block
         | st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": text,
                                  "input": st.dictionaries(st.text(max_size=6), json_scalars, max_size=2)})
         | st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": text},
                                 optional={"content": text | st.lists(text_block, max_size=2),
                                           "is_error": st.booleans()})
         | st.fixed_dictionaries({"type": st.sampled_from(["image", "thinking", "document", "frob"])}))
a_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]) | text,
                                   "content": text | st.lists(block, max_size=3)})
a_tool = st.fixed_dictionaries({"name": text}, optional={"description": text, "type": st.just("custom") | text,
                                                         "input_schema": schema})
anthropic_fields = {
    "model": text, "system": text | st.lists(text_block, max_size=2), "stream": st.booleans(),
    "stop_sequences": st.lists(text, max_size=3), "temperature": unit, "top_p": unit, "top_k": small,
    "metadata": st.fixed_dictionaries({"user_id": text}), "tools": st.lists(a_tool, max_size=2),
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"]) | text},
                                         optional={"name": text, "disable_parallel_tool_use": st.booleans()})}

# path -> (required fields, optional fields), each with plausible values
BODIES = {
    "/v1/messages": ({"max_tokens": small, "messages": st.lists(a_message, min_size=1, max_size=3)},
                     anthropic_fields),
    "/v1/messages/count_tokens": ({"messages": st.lists(a_message, min_size=1, max_size=3)}, anthropic_fields),
    "/v1/completions": ({"prompt": text | token_ids}, {
        "model": text, "max_tokens": small, "stream": st.booleans(), "logprobs": small, "logit_bias": bias,
        "n": st.just(1) | small, "echo": st.booleans(), "suffix": text, "ignore_eos": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), **sampling}),
    "/v1/chat/completions": ({"messages": messages}, {
        "model": text, "max_tokens": small, "max_completion_tokens": small, "stream": st.booleans(),
        "logprobs": st.booleans(), "top_logprobs": small, "logit_bias": bias, "tools": tools,
        "tool_choice": tool_choice, "parallel_tool_calls": st.booleans(),
        "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})
        | st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
            {"name": text}, optional={"schema": schema, "strict": st.booleans()})}), **sampling}),
    "/completion": ({"prompt": text | token_ids | st.lists(text | st.integers(-1, 49200), max_size=3)}, {
        "n_predict": small, "stream": st.booleans(), "n_probs": small, "ignore_eos": st.booleans(),
        "logit_bias": st.lists(st.tuples(st.integers(-1, 49200) | json_any, st.booleans() | st.floats(-5, 5)
                                         | json_any), max_size=2) | bias,
        "n_indent": small, "json_schema": schema, "grammar": grammar, **sampling}),
    "/infill": ({"input_prefix": text, "input_suffix": text}, {
        "input_extra": st.lists(st.fixed_dictionaries({"filename": text, "text": text}), max_size=2),
        "n_predict": small}),
    "/tokenize": ({"content": text}, {"add_special": st.booleans(), "with_pieces": st.booleans()}),
    "/detokenize": ({"tokens": token_ids}, {}),
    "/api/generate": ({"model": text, "prompt": text}, {
        "system": text, "raw": st.booleans(), "stream": st.booleans(), "context": token_ids, "suffix": text,
        "options": options, "format": st.just("json") | schema}),
    "/api/chat": ({"model": text, "messages": messages}, {"stream": st.booleans(), "options": options,
                                                          "format": st.just("json") | schema, "tools": tools}),
    "/api/show": ({"model": text}, {}),
}


hostile = (st.none() | st.lists(json_scalars, max_size=2) | st.dictionaries(text, json_scalars, max_size=2)
           | lone_surrogate)


def places(value, trail=()):
    """The trail to every value inside a body (its fields, their items, theirs...)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, item in items:
        yield trail + (key,)
        yield from places(item, trail + (key,))


@st.composite
def requests(draw):
    """A plausible body for an endpoint; half the time one field (or a new one) is replaced by any JSON, and a
    third of the time one value at any depth by a null, a list, an object or a lone surrogate."""
    path = draw(st.sampled_from(sorted(BODIES)))
    required, optional = BODIES[path]
    body = draw(st.fixed_dictionaries(required, optional=optional))
    if draw(st.booleans()):
        key = draw(st.sampled_from(sorted(set(required) | set(optional))) | st.text(max_size=6))
        body[key] = draw(json_any)
    spots = list(places(body))
    if spots and draw(st.integers(0, 2)) == 0:
        *parent, last = draw(st.sampled_from(spots))
        at = body
        for key in parent:
            at = at[key]
        at[last] = draw(hostile)
    if draw(st.integers(0, 9)) == 0 and body:
        del body[draw(st.sampled_from(sorted(body)))]
    return path, body


@pytest.fixture(scope="module")
def fuzz_server():
    model_file(MODEL)
    proc, url = start_server(MODEL, "--parallel", "4", "--max-tokens", "8", "--max-body", "65536")
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client
    stop_server(proc)
    assert proc.returncode == 130


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err if isinstance(err, str) else err["message"]
    elif "stream" not in r.headers.get("content-type", "") and "ndjson" not in r.headers.get("content-type", ""):
        json.loads(r.text)
    else:
        assert '"error"' not in r.text, r.text[:300]  # no failure in the middle of a stream


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(req=requests())
def test_json_bodies_never_get_a_5xx(fuzz_server, req):
    path, body = req
    check(fuzz_server.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"}))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from(sorted(BODIES) + ["/v1/models", "/nowhere"]), body=st.binary(max_size=64),
       method=st.sampled_from(["POST", "GET", "PUT"]))
def test_garbage_never_gets_a_5xx(fuzz_server, path, body, method):
    check(fuzz_server.request(method, path, content=body))


def test_server_is_still_up_after_fuzzing(fuzz_server):
    assert fuzz_server.get("/health").status_code == 200
    r = fuzz_server.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3,
                                                  "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    metrics = fuzz_server.get("/metrics").text
    assert "localllm_sequences_live 0" in metrics
