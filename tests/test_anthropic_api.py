"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official `anthropic`
client: messages, streams (the SDK's `messages.stream` helper and raw `stream=True` events), stop reasons,
count_tokens, errors in Anthropic's shape, x-api-key auth, and a body shaped as Claude Code sends it. One
in-process server (the real app and engine under uvicorn on a loopback port, smollm2-135m-instruct, with an API
key) for the module; the translation of Anthropic requests into the internal chat request and of internal
results into Anthropic blocks and events is tested without a model."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import httpx2
import pytest
import uvicorn
from conftest import model_file

from localllm.runtime.engine import Engine
from localllm.server import bind
from localllm.server.anthropic_api import EventWriter, ToolCall, message_body, to_chat_request
from localllm.server.app import ApiError, ServerState
from localllm.server.asgi import create_app
from localllm.server.scheduler import Final, Scheduler

MODEL = "smollm2-135m-instruct"
KEY = "test-key-anthropic"
MAX_TOKENS = 32
QUESTION = [{"role": "user", "content": "Name three colors."}]
# The SDK (2.x) has no sampling arguments; the API still takes them, and Claude Code sends `temperature`.
GREEDY = {"extra_body": {"temperature": 0}}


# ---- translation: Anthropic request -> the internal chat request (no model) ---------------------------------


def test_system_blocks_and_turns_become_openai_shaped_messages():
    chat = to_chat_request({
        "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Answer in English."}],
        "messages": [{"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
                     {"role": "user", "content": [{"type": "text", "text": "Colors?"},
                                                  {"type": "text", "text": "Three."}]}]})
    assert chat.messages == [{"role": "system", "content": "You are terse.\nAnswer in English."},
                             {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello."},
                             {"role": "user", "content": "Colors?\nThree."}]
    assert chat.tools == [] and chat.tool_choice is None and chat.prefill == ""
    assert to_chat_request({"system": "Be brief.", "messages": QUESTION}).messages[0] == \
        {"role": "system", "content": "Be brief."}


def test_consecutive_turns_of_one_role_are_combined():
    chat = to_chat_request({"messages": [{"role": "user", "content": "One."}, {"role": "user", "content": "Two."},
                                         {"role": "assistant", "content": "Ok."}, {"role": "user", "content": "Go"}]})
    assert chat.messages == [{"role": "user", "content": "One.\nTwo."}, {"role": "assistant", "content": "Ok."},
                             {"role": "user", "content": "Go"}]


def test_tool_use_and_tool_result_history_become_tool_calls_and_tool_messages():
    chat = to_chat_request({"messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "service down"}, {"type": "text", "text": "retry later"}]},
            {"type": "text", "text": "And tomorrow?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_3", "name": "get_weather",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]}]})
    assert chat.messages == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        # The results answer the calls just before them, so they come before the turn's own text.
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: service down\nretry later"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_3", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""}]


def test_tools_and_tool_choice_become_openai_functions():
    tools = [{"name": "get_weather", "description": "Weather of a city", "cache_control": {"type": "ephemeral"},
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
             {"type": "custom", "name": "now", "input_schema": {"type": "object"}}]
    body = {"messages": QUESTION, "tools": tools}
    chat = to_chat_request(body)
    assert chat.tools == [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                          "parameters": tools[0]["input_schema"]}},
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    expected = {"auto": "auto", "any": "required", "none": "none"}
    for kind, choice in expected.items():
        chat = to_chat_request({**body, "tool_choice": {"type": kind}})
        assert chat.tool_choice == choice and chat.parallel_tool_calls is None
    chat = to_chat_request({**body, "tool_choice": {"type": "tool", "name": "now", "disable_parallel_tool_use": True}})
    assert chat.tool_choice == {"type": "function", "function": {"name": "now"}}
    assert chat.parallel_tool_calls is False


@pytest.mark.parametrize("body, words", [
    ({"messages": []}, "'messages' must be a non-empty array"),
    ({"messages": [{"role": "system", "content": "x"}]}, "needs a user message"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "must be 'user', 'assistant' or 'system'"),
    ({"messages": [{"role": "system", "content": [{"type": "image"}]}, *QUESTION]}, "must be a text block"),
    ({"messages": [{"role": "user"}]}, "'messages[0].content' is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "images are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "unknown content block type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     "belong in assistant messages"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure "}]},
     "trailing whitespace"),
    ({"messages": [{"role": "assistant", "content": "Hi"}]}, "needs a user message"),
    ({"messages": QUESTION, "system": [{"type": "image"}]}, "'system[0]' must be a text block"),
    ({"messages": QUESTION, "tools": [{"name": "x"}]}, "'tools[0].input_schema' must be a JSON schema"),
    ({"messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tool \"web_search_20250305\" is not supported"),
    ({"messages": QUESTION, "tool_choice": {"type": "any"}}, "needs 'tools'"),
    ({"messages": QUESTION, "tools": [{"name": "x", "input_schema": {}}],
      "tool_choice": {"type": "tool", "name": "y"}}, "'y' is not one of the request's tools"),
    ({"messages": QUESTION, "tool_choice": {"type": "sometimes"}}, "'tool_choice.type' must be"),
])
def test_malformed_requests_name_what_is_wrong(body, words):
    with pytest.raises(ApiError) as e:
        to_chat_request(body)
    assert e.value.status == 400 and words in e.value.message


def test_a_final_assistant_message_is_a_prefill():
    chat = to_chat_request({"messages": QUESTION + [{"role": "assistant", "content": "Red,"}]})
    assert chat.messages == QUESTION and chat.prefill == "Red,"


def test_claude_codes_billing_header_line_is_dropped_from_the_system_prompt():
    billing = "x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch=fa690;"
    system = [{"type": "text", "text": billing}, {"type": "text", "text": "You are Claude Code."}]
    assert to_chat_request({"system": system, "messages": QUESTION}).messages[0] == \
        {"role": "system", "content": "You are Claude Code."}


# ---- translation: internal result -> Anthropic blocks and events (no model) -----------------------------------


def final(reason="stop", stop_word=None, completion=5) -> Final:
    return Final(finish_reason=reason, prompt_tokens=11, completion_tokens=completion, cached_tokens=0,
                 stop_word=stop_word, timings={})


def parse_sse(text: str) -> list[tuple[str, dict]]:
    out = []
    for chunk in text.strip().split("\n\n"):
        name_line, data_line = chunk.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), chunk
        out.append((name_line[7:], json.loads(data_line[6:])))
    return out


PIECES = ["I'll ", "check.", ToolCall("toolu_a", "get_weather", '{"city": "Paris"}'),
          ToolCall("toolu_b", "get_weather", '{"city": "Rome"}')]


def test_text_and_tool_calls_become_content_blocks_with_stop_reason_tool_use():
    body = message_body("msg_x", MODEL, PIECES, final())
    assert body["content"] == [
        {"type": "text", "text": "I'll check."},
        {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {"city": "Rome"}}]
    assert body["stop_reason"] == "tool_use" and body["stop_sequence"] is None
    assert body["usage"] == {"input_tokens": 11, "output_tokens": 5}
    assert message_body("m", MODEL, ["a"], final("length"))["stop_reason"] == "max_tokens"
    stopped = message_body("m", MODEL, ["a"], final(stop_word="###"))
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "###")
    assert message_body("m", MODEL, ["a"], final())["stop_reason"] == "end_turn"


def test_events_follow_anthropics_sequence_for_text_and_tool_use():
    w = EventWriter("msg_x", MODEL, 11)
    events = parse_sse("".join(w.start() + [c for p in PIECES for c in w.piece(p)] + w.finish(final())))
    assert [name for name, _ in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in events)
    assert events[0][1]["message"]["usage"] == {"input_tokens": 11, "output_tokens": 0}
    assert [d["index"] for n, d in events if n.startswith("content_block")] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    assert events[6][1]["content_block"] == {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {}}
    assert events[7][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                             "usage": {"output_tokens": 5}}


def sdk_over(sse_text: str) -> anthropic.Anthropic:
    """The SDK reading a canned event stream (what EventWriter wrote), as it reads a server's."""

    def handler(request):
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=sse_text.encode())

    return anthropic.Anthropic(api_key="k", base_url="http://test", max_retries=0,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def test_the_sdk_rebuilds_text_and_tool_use_blocks_from_our_events():
    w = EventWriter("msg_x", MODEL, 11)
    text = "".join(w.start() + [c for p in PIECES for c in w.piece(p)] + w.finish(final()))
    with sdk_over(text).messages.stream(model=MODEL, max_tokens=10, messages=QUESTION) as stream:
        message = stream.get_final_message()
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[0].text == "I'll check."
    assert (message.content[1].name, message.content[1].input) == ("get_weather", {"city": "Paris"})
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == 5


def test_an_error_in_the_middle_of_a_stream_reaches_the_sdk_as_an_api_error():
    w = EventWriter("msg_x", MODEL, 11)
    text = "".join(w.start() + w.piece("Hi") + w.error(ApiError(500, "the model produced NaN logits")))
    assert parse_sse(text)[-1] == ("error", {"type": "error", "error": {"type": "api_error",
                                                                       "message": "the model produced NaN logits"}})
    with pytest.raises(anthropic.APIStatusError) as e:
        with sdk_over(text).messages.stream(model=MODEL, max_tokens=10, messages=QUESTION) as stream:
            stream.until_done()
    assert "NaN logits" in str(e.value)


def test_a_tool_call_cut_off_by_max_tokens_has_no_input_and_stop_reason_max_tokens():
    cut = [ToolCall("toolu_c", "get_weather", '{"city": "Par')]
    body = message_body("m", MODEL, cut, final("length"))
    assert body["content"] == [{"type": "tool_use", "id": "toolu_c", "name": "get_weather", "input": {}}]
    assert body["stop_reason"] == "max_tokens"
    w = EventWriter("m", MODEL, 11)
    events = parse_sse("".join(w.start() + w.piece(cut[0]) + w.finish(final("length"))))
    assert [name for name, _ in events] == ["message_start", "ping", "content_block_start", "content_block_stop",
                                           "message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


# ---- a real server ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    """(base URL, engine): the app with its scheduler under uvicorn in a thread, on a free loopback port."""
    engine = Engine.load(str(model_file(MODEL)), ctx=1024, quiet=True)
    # The scheduler's batched step (op-by-op kernels) compiled here, not inside the first request: on a fresh
    # machine that takes minutes on 2 cores, which a client's timeout would count.
    seqs = [engine.new_sequence(), engine.new_sequence()]
    engine.evaluate_batch([(seqs[0], [1, 2, 3]), (seqs[1], [4, 5])])
    for seq in seqs:
        seq.close()
    state = ServerState(engine=engine, scheduler=Scheduler(engine, parallel=4), model_name=MODEL,
                        model_path=str(model_file(MODEL)), max_tokens=MAX_TOKENS, parallel=4, api_key=KEY)
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    server.should_exit = True
    thread.join(timeout=15)
    sock.close()


@pytest.fixture
def client(served):
    return anthropic.Anthropic(base_url=served[0], api_key=KEY, max_retries=0, timeout=600)


def raw(served, path: str, body: dict, **headers) -> httpx.Response:
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", **headers}
    return httpx.post(served[0] + path, json=body, headers=headers, timeout=600)


def test_a_message_answers_with_text_usage_and_end_turn_or_max_tokens(client, served):
    m = client.messages.create(model=MODEL, max_tokens=24, **GREEDY, system="Be brief.",
                               messages=QUESTION, metadata={"user_id": "u1"})
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 0 < m.usage.output_tokens <= 24
    counted = client.messages.count_tokens(model="x", system="Be brief.", messages=QUESTION)
    assert m.usage.input_tokens == counted.input_tokens > 5


def test_max_tokens_and_stop_sequences_set_the_stop_reason(client):
    short = client.messages.create(model="x", max_tokens=3, **GREEDY, messages=QUESTION)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3

    full = client.messages.create(model="x", max_tokens=24, **GREEDY, messages=QUESTION).content[0].text
    word = next(w for w in full.split()[2:] if full.index(w) > 0)  # a word inside the answer, not at its start
    stopped = client.messages.create(model="x", max_tokens=24, **GREEDY, messages=QUESTION,
                                     stop_sequences=["never-in-it", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert "".join(b.text for b in stopped.content) == full[:full.index(word)]


def test_max_tokens_above_the_servers_limit_is_capped_not_refused(client):
    m = client.messages.create(model="x", max_tokens=32000, **GREEDY, messages=QUESTION)
    assert 0 < m.usage.output_tokens <= MAX_TOKENS


def test_streams_by_the_sdk_helper_and_raw_events_agree_with_the_message(client, served):
    args = dict(model="x", max_tokens=20, **GREEDY, messages=QUESTION)
    whole = client.messages.create(**args)

    with client.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text == streamed.content[0].text == whole.content[0].text
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert streamed.usage.input_tokens == whole.usage.input_tokens

    kinds = [e.type for e in client.messages.create(**args, stream=True)]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}

    # On the wire: `event:` names equal the data's type, and a ping comes after message_start.
    r = raw(served, "/v1/messages", {"model": "x", "max_tokens": 20, "temperature": 0, "messages": QUESTION,
                                     "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert all(name == data["type"] for name, data in events)
    assert [name for name, _ in events][:3] == ["message_start", "ping", "content_block_start"]


def test_a_prefill_is_continued_and_not_repeated(client, served):
    engine = served[1]
    prefill = "The three colors are"
    m = client.messages.create(model="x", max_tokens=8, **GREEDY,
                               messages=QUESTION + [{"role": "assistant", "content": prefill}])
    prompt = engine.render_chat(QUESTION) + prefill
    assert m.usage.input_tokens == len(engine.tokenize_prompt(prompt, chat=True))
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0
    assert not "".join(b.text for b in m.content).startswith(prefill)


def test_tool_use_history_renders_with_the_models_template(client, served):
    engine = served[1]
    history = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "now", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "10:42"},
                                     {"type": "text", "text": "So?"}]}]
    m = client.messages.create(model="x", max_tokens=8, **GREEDY, messages=history)
    # A history with tool calls goes through the tool-call engine, as on the OpenAI route: smollm2's template has
    # no tool form, so the generic one (a system message, calls and results written as JSON)
    from localllm.chat.tool_formats import plan_tools

    plan = plan_tools(engine.template, [], None, None)
    prompt = plan.render(engine.template, to_chat_request({"messages": history}).messages)
    assert plan.format == "generic"
    assert "10:42" in prompt and prompt.index("10:42") < prompt.index("So?")
    assert m.usage.input_tokens == len(engine.tokenize_prompt(prompt, chat=True))
    assert m.stop_reason in ("end_turn", "max_tokens")


def test_errors_have_anthropics_shape_and_status(client, served):
    r = raw(served, "/v1/messages", {"model": "x", "messages": QUESTION})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "'max_tokens' is required"}}

    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="x", max_tokens=5, extra_body={"temperature": 1.5}, messages=QUESTION)
    assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error"
    assert "'temperature' must be in [0, 1]" in e.value.body["error"]["message"]

    # A prompt that does not fit fails before the stream starts: an HTTP error, not a broken stream.
    long = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(anthropic.BadRequestError) as e:
        with client.messages.stream(model="x", max_tokens=5, messages=long) as stream:
            stream.until_done()
    assert "context holds 1024" in e.value.body["error"]["message"]

    r = raw(served, "/v1/messages/nowhere", {})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(served[0] + "/v1/messages", content=b"{", timeout=10,
                   headers={"x-api-key": KEY, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error" and "not valid JSON" in r.json()["error"]["message"]


def test_a_tool_round_trip_gives_a_tool_use_block_then_an_answer_from_the_result(client):
    tools = [{"name": "get_weather", "description": "The current weather in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model="x", max_tokens=48, messages=ask, tools=tools,
                                   tool_choice={"type": "any"}, **GREEDY)
    assert first.stop_reason == "tool_use"
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str)
    with client.messages.stream(model="x", max_tokens=48, messages=ask, tools=tools, tool_choice={"type": "any"},
                                **GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(call.name, call.input)]
    history = ask + [{"role": "assistant", "content": first.model_dump()["content"]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "18 degrees and sunny"}]}]
    answer = client.messages.create(model="x", max_tokens=32, messages=history, tools=tools,
                                    tool_choice={"type": "none"}, **GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.content[0].text.strip()
    counted = client.messages.count_tokens(model="x", messages=ask, tools=tools)
    assert counted.input_tokens > client.messages.count_tokens(model="x", messages=ask).input_tokens


def test_x_api_key_or_bearer_is_needed_on_every_route(served):
    url = served[0]
    keyless = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        keyless.messages.create(model="x", max_tokens=2, messages=QUESTION)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    assert "x-api-key" in e.value.body["error"]["message"]

    # Claude Code sends its ANTHROPIC_API_KEY as x-api-key.
    by_header = anthropic.Anthropic(base_url=url, max_retries=0, default_headers={"x-api-key": KEY})
    assert by_header.messages.create(model="x", max_tokens=2, messages=QUESTION).usage.output_tokens > 0
    assert httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.post(url + "/tokenize", json={"content": "Hi"}, headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"x-api-key": "nope"}).status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    r = httpx.post(url + "/v1/messages/count_tokens", json={"messages": QUESTION})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


# What Claude Code sends (v2.1.x, as captured in public issues: llama.cpp#20623, claude-code#68900): POST
# /v1/messages?beta=true with anthropic-beta flags, the billing-header line as the first system block, the
# system prompt as text blocks with cache_control, its tools, metadata.user_id, max_tokens 32000, streamed.
CLAUDE_CODE_HEADERS = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
                       "user-agent": "claude-cli/2.1.37 (external, cli)", "x-app": "cli"}
CLAUDE_CODE_BODY = {
    "model": "claude-sonnet-4-5-20250929",
    "max_tokens": 32000,
    "temperature": 1,
    "stream": True,
    "metadata": {"user_id": "user_0a1b2c_account__session_5f6e7d8c"},
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch=fa690;"},
        {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
         "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "You are an interactive CLI tool that helps users with software engineering tasks.",
         "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nAs you answer, be brief.\n</system-reminder>"},
        {"type": "text", "text": "Say hello.", "cache_control": {"type": "ephemeral"}}]}],
    "tools": [
        {"name": "Bash", "description": "Executes a given bash command.",
         "input_schema": {"type": "object", "properties": {"command": {"type": "string"},
                                                           "timeout": {"type": "number"}},
                          "required": ["command"], "additionalProperties": False,
                          "$schema": "http://json-schema.org/draft-07/schema#"}},
        {"name": "Read", "description": "Reads a file from the local filesystem.",
         "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                          "required": ["file_path"], "additionalProperties": False,
                          "$schema": "http://json-schema.org/draft-07/schema#"}}],
}


def test_a_claude_code_shaped_request_streams_with_and_without_its_tools(served):
    body = {k: v for k, v in CLAUDE_CODE_BODY.items() if k != "tools"}
    r = raw(served, "/v1/messages?beta=true", body, **CLAUDE_CODE_HEADERS)
    assert r.status_code == 200, r.text
    events = parse_sse(r.text)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert events[-2][1]["usage"]["output_tokens"] <= MAX_TOKENS  # 32000 asked, capped
    # The billing line, whose hash changes on every request, never reaches the prompt: the prefix stays cached.
    counted = raw(served, "/v1/messages/count_tokens?beta=true", {**body, "system": body["system"][1:]})
    assert events[0][1]["message"]["usage"]["input_tokens"] == counted.json()["input_tokens"]

    # With its tools: the same stream, the tools in the prompt (smollm2's template has no tool form: the generic
    # one), and count_tokens counts them.
    r = raw(served, "/v1/messages?beta=true", {**CLAUDE_CODE_BODY, "max_tokens": 24}, **CLAUDE_CODE_HEADERS)
    assert r.status_code == 200, r.text
    names = [name for name, _ in parse_sse(r.text)]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    with_tools = raw(served, "/v1/messages/count_tokens?beta=true", CLAUDE_CODE_BODY, **CLAUDE_CODE_HEADERS)
    assert with_tools.status_code == 200 and with_tools.json()["input_tokens"] > counted.json()["input_tokens"]
