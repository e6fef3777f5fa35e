"""OpenAI's Responses API (POST /v1/responses, GET/DELETE /v1/responses/{id}), what Codex CLI speaks: through the
official `openai` SDK and as raw events, against one `localllm serve qwen2.5-coder-0.5b-instruct` (its template has a
tool form) for the module."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import model_file
from test_server import start_server, stop_server

CODER = "qwen2.5-coder-0.5b-instruct"
SHELL = {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
         "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                        "required": ["command"], "additionalProperties": False}, "strict": False}


@pytest.fixture(scope="module")
def server():
    model_file(CODER)
    proc, url = start_server(CODER, "--ctx", "4096", "--max-tokens", "64")
    yield url
    err = stop_server(proc)
    assert "Traceback" not in err, err


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server, timeout=300) as c:
        yield c


def events(http, body: dict) -> list[tuple[str, dict]]:
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    out = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), chunk
        out.append((name[7:], json.loads(data[6:])))
    return out


def test_a_string_input_answers_with_a_message_item_and_usage(oai):
    r = oai.responses.create(model=CODER, input="Say hello.", instructions="Be brief.", max_output_tokens=16,
                             temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].role == "assistant" and r.output_text.strip()
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.max_output_tokens == 16


def test_the_stream_has_the_events_codex_reads_in_order_with_sequence_numbers(http, oai):
    body = {"model": CODER, "input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
            "max_output_tokens": 12, "temperature": 0}
    got = events(http, body)
    names = [n for n, _ in got]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if got[-1][1]["response"]["status"] == "incomplete"
                          else "response.completed"]
    assert [d["sequence_number"] for _, d in got] == list(range(len(got)))
    assert all(d["type"] == n for n, d in got)
    deltas = "".join(d["delta"] for n, d in got if n == "response.output_text.delta")
    final = got[-1][1]["response"]
    assert deltas and final["output"][0]["content"][0]["text"] == deltas
    assert final["usage"]["output_tokens"] > 0
    # the same stream through the SDK's event parser
    with oai.responses.stream(model=CODER, input="Say hello.", max_output_tokens=12, temperature=0) as s:
        texts = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(texts) == final.output_text and final.output_text


def test_function_tools_give_function_call_items_streamed_and_not(http, oai):
    body = {"model": CODER, "input": "List the files in the current directory.", "tools": [SHELL],
            "tool_choice": "required", "max_output_tokens": 48, "temperature": 0}
    r = oai.responses.create(**body)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "shell" and calls[0].call_id.startswith("call_")
    assert isinstance(json.loads(calls[0].arguments)["command"], list)
    got = events(http, body)
    names = [n for n, _ in got]
    added = [d["item"] for n, d in got if n == "response.output_item.added"]
    assert added and added[-1]["type"] == "function_call" and added[-1]["name"] == "shell"
    assert "response.function_call_arguments.delta" in names
    args = "".join(d["delta"] for n, d in got if n == "response.function_call_arguments.delta")
    done = [d["item"] for n, d in got if n == "response.output_item.done" and d["item"]["type"] == "function_call"]
    assert done and done[0]["arguments"] == args and done[0]["status"] == "completed"
    assert got[-1][0] == "response.completed" and got[-1][1]["response"]["output"][-1] == done[0]


def test_function_call_output_items_continue_the_conversation(oai):
    r = oai.responses.create(model=CODER, tools=[SHELL], max_output_tokens=32, temperature=0, input=[
        {"role": "user", "content": "How many files are here?"},
        {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"command": ["ls"]}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py\nc.py\n"},
        {"type": "reasoning", "id": "rs_1", "summary": []}])
    assert r.status in ("completed", "incomplete") and r.output


def test_previous_response_id_continues_a_stored_conversation_and_get_returns_it(http, oai):
    first = oai.responses.create(model=CODER, input="My name is Ada. Say OK.", max_output_tokens=8, temperature=0)
    again = http.get(f"/v1/responses/{first.id}")
    assert again.status_code == 200 and again.json()["id"] == first.id
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    second = oai.responses.create(model=CODER, input="What is my name?", previous_response_id=first.id,
                                  max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    # the first turn (its input and its answer) is in the prompt, and read from the cache
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    unstored = oai.responses.create(model=CODER, input="Hi", max_output_tokens=4, store=False)
    assert http.get(f"/v1/responses/{unstored.id}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=CODER, input="Hi", previous_response_id=unstored.id)
    assert http.delete(f"/v1/responses/{first.id}").json()["deleted"] is True
    assert http.get(f"/v1/responses/{first.id}").status_code == 404


def test_text_format_json_schema_constrains_the_answer(oai):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    r = oai.responses.create(model=CODER, input="What is 2+3?", max_output_tokens=24, temperature=0,
                             text={"format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}})
    assert isinstance(json.loads(r.output_text)["answer"], int)


def test_fields_it_cannot_honour_are_accepted_and_ignored(http):
    body = {"model": CODER, "input": "Hi", "max_output_tokens": 4, "reasoning": {"effort": "high", "summary": "auto"},
            "include": ["reasoning.encrypted_content"], "truncation": "auto", "service_tier": "auto",
            "prompt_cache_key": "k", "metadata": {"a": "b"}, "parallel_tool_calls": False,
            "tools": [{"type": "web_search"}, {"type": "custom", "name": "apply_patch"}], "tool_choice": "auto"}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"a": "b"} and r.json()["tools"] == []
    # tools of other types are left out of the prompt: the same prompt as without them
    plain = http.post("/v1/responses", json={"model": CODER, "input": "Hi", "max_output_tokens": 4})
    assert r.json()["usage"]["input_tokens"] == plain.json()["usage"]["input_tokens"]
    r = http.post("/v1/responses", json={"model": CODER, "input": [{"type": "message", "role": "critic",
                                                                    "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
