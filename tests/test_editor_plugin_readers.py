"""The code the VS Code plugins read an answer with, ported line for line from their sources, run on this
server's real answers (the bytes as they arrive, streamed or not). Where a plugin takes a shortcut (Twinny splits
a line on "data:", Continue's NDJSON reader drops a last line without a newline, Tabby's Rust struct wants
`content` a string and `stop` a boolean in every event and panics otherwise), the answer must survive it.

  llama.vscode  ggml-org/llama.vscode at 3938fb3 (2026-08-19): src/llama-server.ts getFIMCompletion (axios,
                JSON), src/completion.ts getComplFromContent, src/statusbar.ts showInfo
  Continue      continuedev/continue: packages/fetch/src/stream.ts streamSse / parseSseLine / parseDataLine
                (at 0c0a783), core/llm/llms/LlamaCpp.ts _streamComplete (at 0c38ecf), core/llm/llms/Ollama.ts
                _streamFim (at 0108be5)
  Twinny        twinnydotdev/twinny at 193d14c (2025-08-07): src/extension/llm.ts llm (its line splitter),
                src/extension/utils.ts safeParseJsonResponse, getFimDataFromProvider
  Tabby         TabbyML/tabby at 131d61a: crates/http-api-bindings/src/completion/llama.rs (EventSource on
                /completion, serde struct CompletionResponseChunk {content: String, stop: bool})

One qwen2.5-coder-0.5b server for the module.
"""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import model_file
from test_server import start_server, stop_server
from test_server_plugins import llama_vscode_payload

CODER = "qwen2.5-coder-0.5b-instruct"
PREFIX = "def area_of_circle(radius):\n    return "
SUFFIX = "\n\n\nprint(area_of_circle(2))\n"
FIM_PROMPT = f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"


@pytest.fixture(scope="module")
def coder():
    model_file(CODER)
    proc, url = start_server(CODER, "--ctx", "2048", "--max-tokens", "128")
    with httpx.Client(base_url=url, timeout=300) as client:
        yield client
    err = stop_server(proc)
    assert "Traceback" not in err, err


def chunks(client, path: str, body: dict) -> tuple[str, list[str]]:
    """(the response's Content-Type, its body as the text chunks the client's decoder sees them)."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        return r.headers["content-type"], [b.decode("utf-8") for b in r.iter_raw() if b]


def reference(client, body: dict, path: str = "/completion", key: str = "content") -> str:
    """The same request not streamed: the text a reader must put together."""
    r = client.post(path, json={**body, "stream": False})
    assert r.status_code == 200, r.text
    return r.json()[key]


# ---- llama.vscode ------------------------------------------------------------------------------------------


def llama_vscode_completions(data) -> list[str]:
    """completion.ts getComplFromContent"""
    if isinstance(data, dict) and "content" in data:  # if ("content" in codeCompletions)
        return [data["content"] if data["content"] is not None else ""]
    if isinstance(data, list) and len(data) > 0:
        return list(dict.fromkeys(c.get("content") or "" for c in data))  # a Set, in insertion order
    return []


def llama_vscode_status(data: dict) -> str:
    """statusbar.ts showInfo: the numbers it formats (toFixed needs numbers: a string would throw)."""
    t = data.get("timings") or {}
    for key in ("prompt_ms", "prompt_per_second", "predicted_ms", "predicted_per_second"):
        assert isinstance(t.get(key), (int, float)) and not isinstance(t.get(key), bool), (key, t)
    return (f"c: {data['tokens_cached']} / {data['generation_settings'].get('n_ctx', 0)} | "
            f"p: {t['prompt_n']} ({t['prompt_ms']:.2f} ms) | g: {t['predicted_n']} ({t['predicted_ms']:.2f} ms)")


def test_llama_vscode_reads_the_suggestion_and_its_status_line(coder):
    body = llama_vscode_payload(False, PREFIX, SUFFIX, [], "", 4)
    r = coder.post("/infill", json=body)  # axios: JSON.parse of the body
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    data = json.loads(r.text)
    completions = llama_vscode_completions(data)
    assert len(completions) == 1 and completions[0].strip(), data
    assert "c: " in llama_vscode_status(data) and f"/ {2048}" in llama_vscode_status(data)


# ---- Continue ----------------------------------------------------------------------------------------------


def continue_parse_data_line(line: str):
    """stream.ts parseDataLine"""
    payload = line[len("data: "):] if line.startswith("data: ") else line[len("data:"):]
    try:
        data = json.loads(payload)
    except ValueError:
        raise AssertionError(f"Malformed JSON sent from server: {payload}") from None
    if isinstance(data, dict) and data.get("error"):
        raise AssertionError(f"Error streaming response: {data['error']}")
    return data


def continue_parse_sse_line(line: str):
    """stream.ts parseSseLine -> (done, data)"""
    if line.startswith("data:[DONE]") or line.startswith("data: [DONE]"):
        return True, None
    if line.startswith("data:"):
        return False, continue_parse_data_line(line)
    if line.startswith(": ping"):
        return True, None
    return False, None


def continue_stream_sse(pieces: list[str]):
    """stream.ts streamSse"""
    buffer = ""
    for value in pieces:
        buffer += value
        while (position := buffer.find("\n")) >= 0:
            line, buffer = buffer[:position], buffer[position + 1:]
            done, data = continue_parse_sse_line(line)
            if done:
                break
            if data:
                yield data
    if buffer:
        done, data = continue_parse_sse_line(buffer)
        if not done and data:
            yield data


def continue_ollama_fim(pieces: list[str]):
    """Ollama.ts _streamFim: split on newlines, the last piece kept for the next chunk (so a last line without
    a newline is never read)"""
    buffer = ""
    for value in pieces:
        buffer += value
        parts = buffer.split("\n")
        buffer = parts.pop() if parts else ""
        for chunk in parts:
            if chunk.strip() != "":
                j = json.loads(chunk)
                if "response" in j:
                    yield j["response"]
                elif "error" in j:
                    raise AssertionError(j["error"])


def test_continue_autocomplete_reads_llamacpp_and_ollama_streams(coder):
    # LlamaCpp.ts _streamComplete: /completion streamed, `value.content` when truthy
    body = {"prompt": FIM_PROMPT, "stream": True, "n_predict": 24, "temperature": 0}
    _, pieces = chunks(coder, "/completion", body)
    text = "".join(v["content"] for v in continue_stream_sse(pieces) if v.get("content"))
    assert text and text == reference(coder, body)
    # Ollama.ts _streamFim: /api/generate with the suffix, raw, NDJSON
    body = {"model": CODER, "prompt": PREFIX, "suffix": SUFFIX, "raw": True, "stream": True,
            "options": {"num_predict": 24, "temperature": 0}}
    _, pieces = chunks(coder, "/api/generate", body)
    text = "".join(continue_ollama_fim(pieces))
    assert text and text == reference(coder, body, "/api/generate", "response")


# ---- Twinny ------------------------------------------------------------------------------------------------


def twinny_safe_parse(line: str):
    """utils.ts safeParseJsonResponse (isStreamWithDataPrefix: startsWith "data:")"""
    try:
        if line.startswith("data:"):
            return json.loads(line.split("data:")[1])  # JSON.parse(stringBuffer.split("data:")[1])
        return json.loads(line)
    except (ValueError, IndexError):
        return None


def twinny_stream(pieces: list[str]) -> list[dict]:
    """llm.ts llm: the TransformStream's transform (complete lines) and flush (what is left)"""
    out, buffer = [], ""
    for chunk in pieces:
        buffer += chunk
        while (position := buffer.find("\n")) != -1:
            line, buffer = buffer[:position], buffer[position + 1:]
            data = twinny_safe_parse(line)
            if data:
                out.append(data)
    if buffer:
        data = twinny_safe_parse(buffer)
        if data:
            out.append(data)
    return out


def twinny_fim_data(provider: str, data: dict):
    """utils.ts getFimDataFromProvider"""
    if provider in ("openaicompatible", "ollama", "openwebui"):
        return data.get("response")
    if provider == "llamacpp":
        return data.get("content")
    if provider == "litellm":
        return data["choices"][0]["delta"]["content"]
    if not data.get("choices"):
        return None
    text = data["choices"][0].get("text")
    return "" if text == "undefined" else (text or "")


def test_twinny_reads_ollama_and_llamacpp_fim_streams(coder):
    # provider-options.ts createStreamRequestBodyFim for Ollama: /api/generate with the FIM prompt
    body = {"model": CODER, "prompt": FIM_PROMPT, "stream": True, "keep_alive": "5m",
            "options": {"temperature": 0, "num_predict": 24}}
    _, pieces = chunks(coder, "/api/generate", body)
    text = "".join(twinny_fim_data("ollama", d) or "" for d in twinny_stream(pieces))
    assert text and text == reference(coder, body, "/api/generate", "response")
    # ... and for llama.cpp: /completion, streamed as SSE
    body = {"prompt": FIM_PROMPT, "stream": True, "temperature": 0, "n_predict": 24}
    _, pieces = chunks(coder, "/completion", body)
    events = twinny_stream(pieces)
    assert events and all(isinstance(d, dict) for d in events)
    text = "".join(twinny_fim_data("llamacpp", d) or "" for d in events)
    assert text and text == reference(coder, body)


# ---- Tabby -------------------------------------------------------------------------------------------------


def eventsource_messages(pieces: list[str]):
    """reqwest-eventsource's parser (the SSE spec): `data:` lines (one leading space dropped) gathered until a
    blank line dispatches the event."""
    buffer, data = "", []
    for chunk in pieces:
        buffer += chunk
        while (position := buffer.find("\n")) != -1:
            line, buffer = buffer[:position].rstrip("\r"), buffer[position + 1:]
            if not line:
                if data:
                    yield "\n".join(data)
                data = []
            elif line.startswith("data:"):
                value = line[5:]
                data.append(value[1:] if value.startswith(" ") else value)


def tabby_chunk(data: str) -> tuple[str, bool]:
    """serde_json::from_str::<CompletionResponseChunk>(&message.data).unwrap(): `content` a string and `stop` a
    bool, other fields ignored; anything else panics"""
    value = json.loads(data)
    assert isinstance(value.get("content"), str) and isinstance(value.get("stop"), bool), data
    return value["content"], value["stop"]


def test_tabby_reads_the_llamacpp_event_stream_until_stop(coder):
    body = {"seed": 0, "prompt": FIM_PROMPT, "n_predict": 24, "temperature": 0.0, "stream": True,
            "penalty_last_n": 0, "presence_penalty": 0.0}
    content_type, pieces = chunks(coder, "/completion", body)
    assert content_type.split(";")[0].strip() == "text/event-stream"  # EventSource refuses any other type
    out = []
    for message in eventsource_messages(pieces):
        content, stop = tabby_chunk(message)
        out.append(content)
        if stop:
            break
    else:
        pytest.fail("the stream ended without an event with stop true")
    assert "".join(out) and "".join(out) == reference(coder, body)
    # next_edit_suggestion mode: not streamed, `choices[0].text` or else `content`
    data = json.loads(coder.post("/completion", json={**body, "stream": False}).text)
    text = (data.get("choices") or [{}])[0].get("text") if "choices" in data else data.get("content")
    assert isinstance(text, str) and text == "".join(out)
