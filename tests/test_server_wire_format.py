"""Answers are written byte for byte in the form of the server each API's clients were written against.

Clients parse with shortcuts: llama.vim drops an /infill answer unless it matches '"content"\\s*:"' (no space
after the colon), as llama.cpp's server (nlohmann::json dump()) writes it. So every JSON answer, SSE `data:`
line and NDJSON line is compact (no space after ',' or ':') with text as UTF-8, not \\u escapes; /completion
and /infill keep llama.cpp's key order (tools/server/server-task.cpp, to_json_non_oaicompat of its partial and
final results); Ollama's routes write what Go's json.Marshal writes for Ollama's structs (api/types.go): its
field order, zero metrics left out, and <, >, & escaped as \\u003c, \\u003e, \\u0026.

One qwen2.5-coder-0.5b server (it has FIM tokens) for the module.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from conftest import model_file
from test_server import start_server, stop_server

from localllm.server.app import dumps_compact, dumps_go, go_float32

CODER = "qwen2.5-coder-0.5b-instruct"

# llama.cpp's key order (server-task.cpp): the final answer of /completion and /infill, and a streamed part.
LLAMACPP_FINAL = ["index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
                  "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
                  "tokens_cached", "timings", "completion_probabilities"]
LLAMACPP_PARTIAL = ["index", "content", "tokens", "stop", "id_slot", "tokens_predicted", "tokens_evaluated",
                    "timings", "prompt_progress", "completion_probabilities"]
LLAMACPP_TIMINGS = ["cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                    "predicted_ms", "predicted_per_token_ms", "predicted_per_second"]
# Ollama's structs (api/types.go), in field order
OLLAMA_GENERATE = ["model", "created_at", "response", "thinking", "done", "done_reason", "context",
                   "total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                   "eval_duration"]
OLLAMA_CHAT = ["model", "created_at", "message", "done", "done_reason", "total_duration", "load_duration",
               "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration"]
OLLAMA_TAG = ["name", "model", "modified_at", "size", "digest", "details"]
OLLAMA_PS = ["name", "model", "size", "digest", "details", "expires_at", "size_vram", "context_length"]
OLLAMA_SHOW = ["license", "modelfile", "parameters", "template", "system", "details", "messages", "model_info",
               "capabilities", "modified_at"]

# llama.vim's s:fim_on_response, the check an answer must pass before the plugin decodes it (Vim's \v regex)
LLAMA_VIM_CHECK = re.compile(r'"content"\s*:"')


@pytest.fixture(scope="module")
def coder():
    model_file(CODER)
    proc, url = start_server(CODER, "--ctx", "2048", "--max-tokens", "16")
    with httpx.Client(base_url=url, timeout=300) as client:
        yield client
    err = stop_server(proc)
    assert "Traceback" not in err, err


def keys(raw: str) -> list[str]:
    return list(json.loads(raw))


def in_order(got: list[str], reference: list[str]) -> bool:
    """`got` holds only keys of `reference`, in its order."""
    positions = [reference.index(k) for k in got if k in reference]
    return len(positions) == len(got) and positions == sorted(positions)


def compact(raw: str) -> bool:
    """Written as dumps_compact would write what it holds: no space after ',' or ':', no \\u escape of text."""
    return raw == dumps_compact(json.loads(raw))


def sse_data(response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_compact_writer_matches_the_reference_writers_byte_for_byte():
    value = {"content": "héllo <b> & \u2028 \"q\"\n", "n": [1, 2.5, None, True]}
    # nlohmann::json dump() and JSON.stringify: compact, UTF-8, only '"', '\\' and controls escaped
    assert dumps_compact(value) == '{"content":"héllo <b> & \u2028 \\"q\\"\\n","n":[1,2.5,null,true]}'
    # Go's json.Marshal (Ollama): the same, with HTML characters and the JS line separators escaped
    assert dumps_go(value) == ('{"content":"héllo \\u003cb\\u003e \\u0026 \\u2028 \\"q\\"\\n",'
                               '"n":[1,2.5,null,true]}')


def test_float32_values_are_written_as_gos_encoder_writes_them():
    # what Go's json.Marshal of a []float32 printed for these values (Go 1.19, Debian's golang-go)
    values = [0.1, 1e-7, -1.5e-7, 123456792.0, 1e21, 3.4028235e38, -0.0, 1.0, 0.0, -0.01379362028092146, 1e-6,
              9.99e-7, 1.4e-45]
    go = "0.1,1e-7,-1.5e-7,123456790,1e+21,3.4028235e+38,-0,1,0,-0.01379362,0.000001,9.99e-7,1e-45"
    assert ",".join(map(go_float32, values)) == go


def test_ollama_embed_writes_its_vectors_as_go_writes_float32(coder):
    r = coder.post("/api/embed", json={"model": CODER, "input": ["a", "b c"]})
    assert r.status_code == 200
    raw = r.text
    assert keys(raw) == ["model", "embeddings", "total_duration", "prompt_eval_count"]
    vectors = r.json()["embeddings"]
    numbers = raw[raw.index('"embeddings":[[') + 15 : raw.index("]]")].replace("],[", ",").split(",")
    assert len(numbers) == 2 * len(vectors[0]) and numbers == [go_float32(x) for row in vectors for x in row]
    assert all(len(n.lstrip("-0.").replace(".", "").split("e")[0]) <= 9 for n in numbers)  # float32's digits


def test_infill_answer_passes_llama_vims_check_and_keeps_llamacpps_key_order(coder):
    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "n_predict": 8, "temperature": 0}
    r = coder.post("/infill", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    raw = r.text
    assert raw.startswith('{"index":0,"content":"') and LLAMA_VIM_CHECK.search(raw) and compact(raw)
    got = keys(raw)
    # every key llama.cpp writes but the prompt text, in its order
    assert in_order(got, LLAMACPP_FINAL)
    assert set(LLAMACPP_FINAL) - set(got) <= {"prompt", "completion_probabilities"}
    # llama.cpp's timings first, in its order (localllm's own counters follow)
    assert list(r.json()["timings"])[:len(LLAMACPP_TIMINGS)] == LLAMACPP_TIMINGS
    # llama.vim's own request: the fields it asks for, flattened, in its order
    body["response_fields"] = ["content", "timings/prompt_n", "truncated", "tokens_cached"]
    raw = coder.post("/infill", json=body).text
    assert raw.startswith('{"content":"') and keys(raw) == body["response_fields"] and compact(raw)


def test_completion_stream_parts_and_final_keep_llamacpps_key_order(coder):
    body = {"prompt": "def add(a, b):", "n_predict": 6, "temperature": 0, "stream": True, "n_probs": 2}
    with coder.stream("POST", "/completion", json=body) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert len(data) >= 2 and all(line == "" or line.startswith("data: {") for line in lines)
    for part in data[:-1]:
        assert part.startswith('{"index":0,"content":"') and compact(part)
        assert in_order(keys(part), LLAMACPP_PARTIAL), part
    assert in_order(keys(data[-1]), LLAMACPP_FINAL) and compact(data[-1])
    body["stream"] = False
    raw = coder.post("/completion", json=body).text
    assert compact(raw) and in_order(keys(raw), LLAMACPP_FINAL) and keys(raw)[-1] == "completion_probabilities"


def test_text_is_written_as_utf8_not_escaped(coder):
    ids = coder.post("/tokenize", json={"content": "héllo wörld ✓"}).json()["tokens"]
    r = coder.post("/detokenize", json={"tokens": ids})
    assert r.content == '{"content":"héllo wörld ✓"}'.encode()
    # an error message that quotes the request: compact in every flavor
    for path in ("/v1/chat/completions", "/completion", "/v1/messages"):
        r = coder.post(path, content=b"[1]", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and compact(r.text), r.text


def test_openai_answers_and_stream_chunks_are_compact(coder):
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}
    r = coder.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and compact(r.text) and '"content":"' in r.text
    with coder.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        chunks = sse_data(s)
    assert chunks and all(compact(c) and c.startswith('{"id":"') for c in chunks), chunks
    r = coder.post("/v1/completions", json={"prompt": "def", "max_tokens": 3})
    assert compact(r.text) and '"text":"' in r.text
    r = coder.get("/v1/models")
    assert compact(r.text)


def test_anthropic_events_are_compact_with_their_event_lines(coder):
    body = {"model": CODER, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi"}]}
    r = coder.post("/v1/messages", json=body)
    assert r.status_code == 200 and compact(r.text) and r.text.startswith('{"id":"msg_')
    with coder.stream("POST", "/v1/messages", json={**body, "stream": True}) as s:
        text = s.read().decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[0].startswith('event: message_start\ndata: {"type":"message_start","message":{')
    for e in events:
        name, data = e.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ") and compact(data[6:])
        assert json.loads(data[6:])["type"] == name[7:]


def test_ollama_lines_are_what_gos_encoder_writes_for_ollamas_structs(coder):
    with coder.stream("POST", "/api/generate", json={"model": CODER, "prompt": "Say hi",
                                                      "options": {"num_predict": 4}}) as s:
        assert s.headers["content-type"] == "application/x-ndjson"
        lines = [line for line in s.iter_lines() if line]
    for line in lines:
        assert line == dumps_go(json.loads(line)) and in_order(keys(line), OLLAMA_GENERATE), line
        assert line.startswith('{"model":"' + CODER + '","created_at":"')
    last = json.loads(lines[-1])
    assert last["done"] is True and "load_duration" not in last  # zero: omitempty
    assert keys(lines[-1])[keys(lines[-1]).index("done"):][:3] == ["done", "done_reason", "context"]
    r = coder.post("/api/chat", json={"model": CODER, "stream": False, "options": {"num_predict": 4},
                                      "messages": [{"role": "user", "content": "Say hi"}]})
    assert r.text == dumps_go(r.json()) and in_order(keys(r.text), OLLAMA_CHAT)
    assert r.text.startswith('{"model":"' + CODER + '","created_at":"')
    assert '"message":{"role":"assistant","content":"' in r.text
    # /api/show: the template's <|im_start|> written as Go writes it
    r = coder.post("/api/show", json={"model": CODER})
    assert r.text == dumps_go(r.json()) and in_order(keys(r.text), OLLAMA_SHOW)
    assert "\\u003c|im_start|\\u003e" in r.text and "<|im_start|>" not in r.text
    info = list(r.json()["model_info"])
    assert info == sorted(info)  # a Go map: sorted keys
    for path in ("/api/tags", "/api/ps", "/api/version"):
        r = coder.get(path)
        assert r.status_code == 200 and r.text == dumps_go(r.json()), path
    assert keys(dumps_go(coder.get("/api/tags").json()["models"][0])) == OLLAMA_TAG
    assert keys(dumps_go(coder.get("/api/ps").json()["models"][0])) == OLLAMA_PS
    # errors too
    r = coder.post("/api/generate", json={"model": CODER, "prompt": "x", "options": {"num_predict": "<many>"}})
    assert r.status_code == 400 and r.text == dumps_go(r.json()) and "\\u003c" in r.text
