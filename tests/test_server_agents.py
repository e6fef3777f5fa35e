"""What coding agents and their clients send, as they send it (issue 38): Claude Code's Messages requests (system
messages inside `messages`, its extra fields, tool schemas with keywords the grammar engine cannot enforce),
aider's Ollama chat without a Content-Type header, llm-ollama's look for embedding models in /api/show, and
/apply-template giving the prompt the chat route runs.

Unit checks first (no model), then one `localllm serve qwen2.5-coder-0.5b-instruct` (its template has a tool form)
for the module.
"""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import model_file
from test_server import start_server, stop_server

from localllm.chat.template import ChatTemplate
from localllm.server.anthropic_api import to_chat_request
from localllm.server.app import fold_system, render_system_anywhere
from localllm.server.tool_calls import relaxed_keywords

CODER = "qwen2.5-coder-0.5b-instruct"
HI = [{"role": "user", "content": "Hi"}]

# Claude Code 2.1's TaskCreate tool keeps a map of metadata keyed by names of a pattern: `propertyNames`, which
# llguidance does not implement (its whole grammar failed to compile: every request was a 400).
TASK_CREATE = {
    "name": "TaskCreate", "description": "Create a task in the task list.",
    "input_schema": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": {"subject": {"type": "string"},
                       "metadata": {"type": "object", "propertyNames": {"pattern": "^[a-z_]+$"},
                                    "additionalProperties": {"type": "string"}}},
        "required": ["subject"], "additionalProperties": False}}


# ---- no model ----------------------------------------------------------------------------------------------


def test_system_messages_inside_messages_stay_where_they_stand():
    chat = to_chat_request({"system": "You are Claude Code.", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": [{"type": "text", "text": "The user changed a file.",
                                        "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": "Go on"}]})
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "system", "user"]
    assert chat.messages[3] == {"role": "system", "content": "The user changed a file."}


# gemma's template shape: one optional system message first, then strictly alternating turns
ONE_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] %}"
              "{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
              "{% for m in rest %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
              "{% endif %}<{{ m['role'] }}>{% if loop.first %}{{ first }} {% endif %}{{ m['content'] }}"
              "{% endfor %}")


def test_a_template_that_takes_one_system_message_gets_the_others_folded_into_it():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "system", "content": "A file changed."},
                {"role": "user", "content": "Go on"}]
    strict = ChatTemplate(ONE_SYSTEM)
    text = render_system_anywhere(strict.render, messages)
    assert text == "<user>Be brief.\n\nA file changed. Hi<assistant>Hello.<user>Go on"
    assert fold_system(messages)[0] == {"role": "system", "content": "Be brief.\n\nA file changed."}
    # ChatML renders each where it stands
    chatml = ChatTemplate(None)
    assert "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>system\nA file changed." in \
        render_system_anywhere(chatml.render, messages)


def test_system_messages_given_as_text_parts_fold_as_their_text():
    # OpenAI's content parts: a late system message as [{"type": "text", ...}] folds as its text
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                {"role": "user", "content": "Go on"}]
    assert render_system_anywhere(ChatTemplate(ONE_SYSTEM).render, messages) == \
        "<user>Be brief. Hi<assistant>Hello.<user>Go on"


def test_the_keywords_the_grammar_engine_cannot_enforce_are_named():
    assert relaxed_keywords(TASK_CREATE["input_schema"]) == ["propertyNames"]
    assert relaxed_keywords({"type": "object", "properties": {"a": {"type": "string"}}}) == []
    both = {"type": "array", "items": {"not": {"type": "null"}}, "uniqueItems": True}
    assert relaxed_keywords(both) == ["not", "uniqueItems"]


# ---- a real server -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def coder():
    model_file(CODER)
    proc, url = start_server(CODER, "--ctx", "4096", "--max-tokens", "64")
    with httpx.Client(base_url=url, timeout=300) as client:
        client.proc = proc
        yield client
    err = stop_server(proc)
    assert "Traceback" not in err, err


def server_log(client) -> str:
    client.proc.log.seek(0)
    return client.proc.log.read()


def sse_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        out.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return out


def test_claude_codes_request_with_its_system_messages_extra_fields_and_tools_streams(coder):
    body = {
        "model": "claude-sonnet-4-5-20250929", "max_tokens": 64000, "temperature": 1, "stream": True,
        "metadata": {"user_id": "user_0a1b_account__session_5f6e"},
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Create a task: fix the build.",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "The task list is empty."}],
        "tools": [TASK_CREATE],
    }
    r = coder.post("/v1/messages?beta=true", json=body,
                   headers={"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"})
    assert r.status_code == 200, r.text
    names = [name for name, _ in sse_events(r.text)]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    # The tool's propertyNames was relaxed, and the log says so
    assert "TaskCreate" in server_log(coder) and "propertyNames" in server_log(coder)
    # tool_choice any: a call that follows the relaxed schema
    r = coder.post("/v1/messages", json={**body, "stream": False, "tool_choice": {"type": "any"}})
    assert r.status_code == 200, r.text
    calls = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert calls and calls[0]["name"] == "TaskCreate" and isinstance(calls[0]["input"].get("subject"), str)


def test_anthropic_structured_output_follows_output_config_format(coder):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    body = {"model": CODER, "max_tokens": 32, "messages": [{"role": "user", "content": "What is 2+3?"}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    r = coder.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["content"][0]["text"])["answer"], int)
    r = coder.post("/v1/messages", json={**body, "output_config": {"format": {"type": "xml"}}})
    assert r.status_code == 400 and "output_config.format" in r.json()["error"]["message"]


def test_openai_tool_schemas_with_unenforceable_keywords_are_relaxed_not_refused(coder):
    tool = {"type": "function", "function": {"name": "TaskCreate", "parameters": TASK_CREATE["input_schema"]}}
    body = {"messages": [{"role": "user", "content": "Create a task: fix the build."}], "tools": [tool],
            "tool_choice": "required", "max_tokens": 48, "temperature": 0}
    r = coder.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "TaskCreate" and "subject" in json.loads(call["arguments"])
    # a schema that is not a JSON Schema at all is still a 400
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}
    r = coder.post("/v1/chat/completions", json={**body, "tools": [bad]})
    assert r.status_code == 400, r.text


def test_strict_response_format_fails_closed_naming_the_keyword_and_loose_is_relaxed(coder):
    schema = TASK_CREATE["input_schema"]
    body = {"messages": [{"role": "user", "content": "A task as JSON."}], "max_tokens": 32, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema,
                                                                        "strict": True}}}
    r = coder.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "propertyNames" in r.json()["error"]["message"], r.text
    body["response_format"]["json_schema"]["strict"] = False
    r = coder.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


def test_ollama_chat_without_content_type_is_answered(coder):
    # aider's litellm (ollama_chat/): the body as JSON text, no Content-Type header at all
    body = {"model": CODER, "stream": False, "options": {"num_predict": 4},
            "messages": [{"role": "user", "content": "Say hi"}]}
    r = coder.post("/api/chat", content=json.dumps(body).encode())
    assert r.status_code == 200 and r.json()["done"] is True, r.text
    r = coder.post("/api/chat", content=json.dumps(body).encode(), headers={"Origin": "https://evil.example"})
    assert r.status_code == 403


def test_api_show_lists_embedding_where_api_embed_answers(coder):
    caps = coder.post("/api/show", json={"model": CODER}).json()["capabilities"]
    assert {"completion", "insert", "tools", "embedding"} <= set(caps)
    r = coder.post("/api/embed", json={"model": CODER, "input": ["a", "b"]})
    assert r.status_code == 200 and len(r.json()["embeddings"]) == 2


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
]


def test_apply_template_renders_exactly_what_the_chat_route_runs_with_tools_and_calls(coder):
    body = {"messages": CONVERSATION, "tools": [WEATHER]}
    prompt = coder.post("/apply-template", json=body).json()["prompt"]
    assert '"name": "get_weather"' in prompt and "Weather of a city" in prompt  # the tools, in the template's form
    # the call's arguments given as JSON text reach the template as an object: written once, not as a string
    assert '{"city": "Paris"}' in prompt and '\\"city\\"' not in prompt
    r = coder.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    assert r.status_code == 200, r.text
    ran = r.json()["usage"]["prompt_tokens"]
    tokens = coder.post("/tokenize", json={"content": prompt, "add_special": True, "parse_special": True}).json()
    assert len(tokens["tokens"]) == ran
    # without tools, the plain template, as before
    plain = coder.post("/apply-template", json={"messages": HI}).json()["prompt"]
    assert plain.endswith("<|im_start|>assistant\n") and "get_weather" not in plain
