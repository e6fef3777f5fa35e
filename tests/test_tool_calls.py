"""Tool calls: the official `openai` and `ollama` clients run a tool round trip on /v1/chat/completions and
/api/chat; the parser reads each model form (Hermes/Qwen2.5, Llama 3.x, llama.cpp's generic JSON) the same however
the text is cut; tool_choice shapes the grammar; a model without native tool support gets the generic form; the
lazy grammar keeps a call inside its function's schema and changes nothing for speculation."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import numpy as np
import ollama
import openai
import pytest
from conftest import DATA, model_file
from test_server import start_server, stop_server

from localllm.chat.template import ChatTemplate
from localllm.chat.tool_formats import (CallDelta, TextDelta, ToolCallParser, ToolError, plan_tools, supports_tools,
                                tool_format)

BIG, SMALL, NO_TOOLS = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
WEATHER_RESULT = '{"city": "Paris", "temperature_c": 18, "sky": "sunny"}'


def parse(fmt: str, text: str, cuts=None):
    """(content, calls as (name, arguments, arguments_json), streamed content, streamed arguments per call)
    for `text` fed in pieces cut at `cuts` (None: whole)."""
    p = ToolCallParser(fmt)
    pieces = [text] if cuts is None else [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    deltas = []
    for piece in pieces:
        deltas += p.feed(piece)
    deltas += p.finish()
    streamed = "".join(d.text for d in deltas if isinstance(d, TextDelta))
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    for d in deltas:
        if isinstance(d, CallDelta):
            args[d.index] = args.get(d.index, "") + d.arguments
            if d.name is not None:
                assert d.index not in names, "a call's name is sent once"
                names[d.index] = d.name
    calls = [(c.name, c.arguments, c.arguments_json) for c in p.calls]
    assert [names[i] for i in range(len(calls))] == [c[0] for c in calls]
    return p.content, calls, streamed, [args[i] for i in range(len(calls))]


def same_however_cut(fmt: str, text: str):
    """The parse of `text` whole, checked equal to char-by-char and to random cuts."""
    whole = parse(fmt, text)
    content, calls, streamed, args = whole
    assert streamed == content
    assert args == [c[2] for c in calls], "streamed argument fragments reassemble to the call's arguments"
    assert parse(fmt, text, list(range(1, len(text)))) == whole
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        assert parse(fmt, text, cuts) == whole
    return content, calls


# ---- the parsers ---------------------------------------------------------------------------------------


def test_hermes_calls_are_read_the_same_char_by_char_and_their_markup_never_reaches_the_content():
    text = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"the '
            'city\\" {}", "days": [1, {"x": null}]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
            '"arguments": {"zone": "Europe/Paris"}}\n</tool_call>')
    content, calls = same_however_cut("hermes", text)
    assert content == "Let me look that up."
    assert calls == [("get_weather", {"city": 'Paris "the city" {}', "days": [1, {"x": None}]},
                      '{"city": "Paris \\"the city\\" {}", "days": [1, {"x": null}]}'),
                     ("get_time", {"zone": "Europe/Paris"}, '{"zone": "Europe/Paris"}')]
    # qwen2.5-coder's untagged form: the same JSON, bare at the answer's start (one per line when parallel).
    content, calls = same_however_cut("hermes", '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                                '{"name": "get_time", "arguments": {"zone": "UTC"}}')
    assert content == "" and [c[:2] for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    # ... or in a ```json fence (qwen2.5-coder-0.5b under Ollama's repeat penalty), which is markup too.
    content, calls = same_however_cut("hermes", '```json\n{\n    "name": "get_weather",\n    "arguments": {\n'
                                                '        "city": "Paris"\n    }\n}\n```')
    assert content == "" and [c[:2] for c in calls] == [("get_weather", {"city": "Paris"})]
    fenced = '```json\n{"a": 1}\n```'
    assert same_however_cut("hermes", fenced) == (fenced, [])
    assert same_however_cut("hermes", "```python\nprint(1)\n```") == ("```python\nprint(1)\n```", [])
    assert same_however_cut("hermes", '{"answer": 42}') == ('{"answer": 42}', [])
    assert same_however_cut("hermes", 'Use {"name": "x"} here') == ('Use {"name": "x"} here', [])
    # Prose with angle brackets that are not a call's opening stays prose, whole.
    assert same_however_cut("hermes", "a <tool> and <tool_cal x < y") == ("a <tool> and <tool_cal x < y", [])
    assert same_however_cut("hermes", "no calls here \n") == ("no calls here \n", [])


def test_a_call_cut_short_by_the_token_limit_keeps_its_partial_arguments_and_no_markup_leaks():
    content, calls = same_however_cut("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert content == "" and calls == [("get_weather", None, '{"ci')]
    assert same_however_cut("hermes", "Sure.<tool_call>\n{\"na") == ("Sure.", [])


def test_llama3_json_calls_at_the_start_or_after_python_tag_are_read_and_prose_braces_are_not():
    content, calls = same_however_cut("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert content == "" and calls == [("get_weather", {"city": "Oslo"}, '{"city": "Oslo"}')]
    content, calls = same_however_cut(
        "llama3", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", '
                  '"parameters": {"city": "Rome"}}')
    assert content == "" and [c[:2] for c in calls] == [("get_time", {"zone": "UTC"}),
                                                        ("get_weather", {"city": "Rome"})]
    assert same_however_cut("llama3", '{"answer": 42} is JSON') == ('{"answer": 42} is JSON', [])
    assert same_however_cut("llama3", 'In C, {"name": x} is a brace.') == ('In C, {"name": x} is a brace.', [])


def test_the_generic_json_form_gives_the_response_as_content_or_the_calls():
    content, calls = same_however_cut("generic", '{"response": "It is 18 \\u00b0C \\ud83d\\ude00, \\"sunny\\".\\n"}')
    assert content == 'It is 18 \u00b0C \U0001f600, "sunny".\n' and calls == []
    content, calls = same_however_cut("generic",
                                      '{"tool_call": {"name": "get_weather", "arguments": {"city": "Lima"}}}')
    assert content == "" and calls == [("get_weather", {"city": "Lima"}, '{"city": "Lima"}')]
    content, calls = same_however_cut(
        "generic", '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", '
                   '"arguments": {"city": "Quito"}}]}')
    assert [c[0] for c in calls] == ["get_time", "get_weather"]
    # Not the form (an unconstrained or cut-short answer): its text is the content.
    assert same_however_cut("generic", "plain words") == ("plain words", [])
    assert same_however_cut("generic", '{"tool_call": {"name": "get_wea') == ('{"tool_call": {"name": "get_wea', [])


# ---- templates, tool_choice, grammars --------------------------------------------------------------------


@pytest.fixture(scope="module")
def templates():
    from localllm.gguf_file import load_metadata

    out = {}
    for name in (SMALL, NO_TOOLS):
        meta = load_metadata(model_file(name))
        out[name] = ChatTemplate.from_metadata(meta[0] if isinstance(meta, tuple) else meta, name)
    out["chatml"] = ChatTemplate(None)
    out["llama3"] = ChatTemplate(
        "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
        "{% endfor %}{% if tools %}Respond with {\"name\": function name, \"parameters\": dictionary}. "
        "{% for t in tools %}{{ t | tojson }}{% endfor %}<|python_tag|>{% endif %}")
    return out


def test_the_form_is_read_from_the_template(templates):
    assert tool_format(templates[SMALL]) == "hermes" and supports_tools(templates[SMALL])
    assert tool_format(templates["llama3"]) == "llama3"
    for name in (NO_TOOLS, "chatml"):
        assert tool_format(templates[name]) == "generic" and not supports_tools(templates[name])


def test_tool_choice_auto_is_lazy_required_and_named_constrain_from_the_start_and_none_is_plain(templates):
    t = templates[SMALL]
    auto = plan_tools(t, [WEATHER, TIME], "auto")
    assert auto.grammar.count("TEXT") >= 2 and "start: TEXT | TEXT call" in auto.grammar
    assert "get_weather" in auto.grammar and "get_time" in auto.grammar
    required = plan_tools(t, [WEATHER, TIME], "required")
    assert "start: call" in required.grammar and "TEXT" not in required.grammar
    named = plan_tools(t, [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.choice == "required" and "get_time" in named.grammar and "get_weather" not in named.grammar
    single = plan_tools(t, [WEATHER], "required", parallel_tool_calls=False)
    assert "start: call | fn\n" in single.grammar
    none = plan_tools(t, [WEATHER], "none")
    assert none.choice == "none" and none.grammar is None and none.json_schema is None
    assert "get_weather" not in none.render(t, ASK)  # tool_choice none: the tools are not offered
    assert "get_weather" in auto.render(t, ASK)  # through the template's own <tools> section
    generic = plan_tools(templates[NO_TOOLS], [WEATHER], "auto")
    assert generic.grammar is None and generic.json_schema["anyOf"][1]["required"] == ["response"]
    with pytest.raises(ToolError, match="not among the 'tools'"):
        plan_tools(t, [WEATHER], {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ToolError, match="tool_choice"):
        plan_tools(t, [WEATHER], "sometimes")
    with pytest.raises(ToolError, match=r"tools\[0\].function.name"):
        plan_tools(t, [{"type": "function", "function": {"name": "has space"}}])
    with pytest.raises(ToolError, match="two tools"):
        plan_tools(t, [WEATHER, WEATHER])


def test_tool_messages_render_in_the_templates_form_and_the_generic_form(templates):
    convo = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": WEATHER_RESULT}]
    hermes = plan_tools(templates[SMALL], [WEATHER]).render(templates[SMALL], convo)
    # OpenAI's arguments (JSON text) reach the template as an object: not encoded twice.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in hermes
    assert "<tool_response>\n" + WEATHER_RESULT + "\n</tool_response>" in hermes
    generic = plan_tools(templates[NO_TOOLS], [WEATHER]).render(templates[NO_TOOLS], convo)
    assert '"name": "get_weather"' in generic and "Respond in JSON format" in generic
    assert '<|im_start|>assistant\n{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}' in generic
    assert '<|im_start|>user\n{"tool_response": {"name": "get_weather", "content": ' in generic


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from localllm.tokenizer import Tokenizer

    return Tokenizer.from_file(model_file(SMALL))


def _walk(tokenizer, grammar, pieces):
    """Consume each text piece's tokens; returns how many pieces the grammar took before refusing one."""
    from localllm.chat.grammar import lark_grammar

    m = lark_grammar(grammar, tokenizer, tokenizer.vocab_size).matcher()
    for i, piece in enumerate(pieces):
        tokens = tokenizer.encode(piece, add_special=False, parse_special=True)
        if m.valid_prefix(tokens) < len(tokens):
            return i, m
        for t in tokens:
            m.consume(t)
    return len(pieces), m


def test_the_lazy_grammar_lets_text_through_then_holds_a_call_to_its_schema(qwen_tokenizer, templates):
    tok = qwen_tokenizer
    auto = plan_tools(templates[SMALL], [WEATHER, TIME], "auto").grammar
    good = ["Sure, let me check.\n", "<tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
            "\n", "</tool_call>"]
    n, m = _walk(tok, auto, good)
    assert n == len(good) and m.accepting
    # After a call: the end, or (parallel calls allowed) another call.
    after = set(np.flatnonzero(m.allowed()).tolist())
    opening = set(tok.encode("\n", add_special=False) + tok.encode("<tool_call>", add_special=False))
    assert opening <= after <= set(tok.eog_ids) | opening
    single = plan_tools(templates[SMALL], [WEATHER, TIME], "auto", parallel_tool_calls=False).grammar
    n, m = _walk(tok, single, good)
    assert n == len(good) and set(np.flatnonzero(m.allowed()).tolist()) <= set(tok.eog_ids)
    # The untagged form is held to the schema too, and free text may not start like it.
    bare = ['{"name": "get_time", "arguments": {"zone": "UTC"}}']
    assert _walk(tok, single, bare)[1].accepting
    assert _walk(tok, single, ['{"name": "get_time", "arguments": {"zone": 5'])[0] == 0
    assert _walk(tok, single, ['{"name": "other"'])[0] == 0
    fenced = ['```json\n{\n    "name": "get_time",\n    "arguments": {\n        "zone": "UTC"\n    }\n}\n```']
    assert _walk(tok, single, fenced)[1].accepting
    assert _walk(tok, single, ['```json\n{\n  "name": "get_time", "arguments": {"zone": 1'])[0] == 0
    assert _walk(tok, single, ['```json\n[1, 2]\n```'])[1].accepting  # a JSON block that is not a call
    # Free text may not spell the opening out of plain tokens.
    assert _walk(tok, auto, ["Sure <", "tool", "_call", ">"])[0] == 3
    assert _walk(tok, auto, ["Plain answer, no call."])[1].accepting
    # Inside a call: an unknown function, an argument of the wrong type or an extra key are refused.
    assert _walk(tok, auto, ["<tool_call>", '\n{"name": "get_wind"'])[0] == 1
    assert _walk(tok, auto, ["<tool_call>", '\n{"name": "get_time", "arguments": {"zone": 5'])[0] == 1
    assert _walk(tok, auto, ["<tool_call>", '\n{"name": "get_time", "arguments": {"zone": "UTC", "x"'])[0] == 1
    # Llama 3.x's form: a call is the answer from its first brace, held to the schema; ';' between calls.
    # (qwen's vocabulary has no <|python_tag|>: a Llama-3.0-like template without it.)
    no_tag = ChatTemplate(templates["llama3"].source.replace("<|python_tag|>", ""))
    assert tool_format(no_tag) == "llama3"
    llama3 = plan_tools(no_tag, [WEATHER, TIME], "auto").grammar
    two = '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert _walk(tok, llama3, [two])[1].accepting and _walk(tok, llama3, ["Plain text."])[1].accepting
    assert _walk(tok, llama3, ['{"name": "get_time", "parameters": {"zone": 5'])[0] == 0
    # tool_choice required: a call from the first token.
    required = plan_tools(templates[SMALL], [WEATHER], "required").grammar
    assert _walk(tok, required, ["Sure"])[0] == 0
    assert _walk(tok, required, ["<tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n',
                                 "</tool_call>"])[1].accepting


def test_speculative_decoding_under_the_lazy_tool_grammar_gives_the_same_greedy_answer():
    from localllm.runtime.engine import Engine, GenerationParams
    from localllm.chat.grammar import lark_grammar
    from localllm.chat.sampling import SamplingParams
    from localllm.runtime.speculative import SpeculationParams

    engine = Engine.load(SMALL, quiet=True)
    plan = plan_tools(engine.template, [WEATHER], "auto")
    grammar = lark_grammar(plan.grammar, engine.tokenizer, engine.config.vocab_size)
    prompt = plan.render(engine.template, ASK)

    def run(speculation):
        params = GenerationParams(max_tokens=40, sampling=SamplingParams(temperature=0), grammar=grammar,
                                  speculation=speculation)
        events = list(engine.generate(prompt, params, chat=True))
        return [e.token for e in events], "".join(e.text for e in events), events[-1]

    plain, text, _ = run(None)
    spec, _, last = run(SpeculationParams(mode="ngram", draft_max=4, adaptive=False))
    assert spec == plain and last.timings.draft_n > 0
    p = ToolCallParser("hermes")
    p.feed(text)
    p.finish()
    assert [c.name for c in p.calls] == ["get_weather"] and isinstance(p.calls[0].arguments, dict)


# ---- the APIs, with the official clients -----------------------------------------------------------------


def _serve(model):
    model_file(model)
    proc, url = start_server(model, "--parallel", "2", "--max-tokens", "128")
    return proc, url


def _stop(proc):
    err = stop_server(proc)
    assert proc.returncode == 130 and "Traceback" not in err, err


def test_openai_and_ollama_tool_round_trips_on_qwen_1_5b():
    """The model calls get_weather(city), the result goes back, the model answers from it, through each official
    client; streamed deltas reassemble to the non-streamed call."""
    proc, url = _serve(BIG)
    try:
        oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        r = oai.chat.completions.create(model=BIG, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=40)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert not choice.message.content  # no markup, no stray newlines
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"].lower() == "paris"

        parts = list(oai.chat.completions.create(model=BIG, messages=ASK, tools=[WEATHER], temperature=0,
                                                 max_tokens=40, stream=True))
        calls: dict[int, dict] = {}
        content = ""
        for p in parts:
            if not p.choices:
                continue
            delta = p.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert entry["id"] is None, "a call's id is sent once"
                    entry["id"], entry["name"] = tc.id, tc.function.name
                entry["arguments"] += tc.function.arguments or ""
        assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "tool_calls"
        assert content == "" and list(calls) == [0]
        assert (calls[0]["name"], calls[0]["arguments"]) == (call.function.name, call.function.arguments)

        turn2 = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": WEATHER_RESULT}]
        # Offered the tool again, greedy qwen2.5-coder calls it again (1.5b and 0.5b alike, with or without the
        # grammar): the answer is asked for as OpenAI clients do, with tool_choice "none".
        r2 = oai.chat.completions.create(model=BIG, messages=turn2, tools=[WEATHER], tool_choice="none",
                                         temperature=0, max_tokens=40)
        answer = r2.choices[0].message
        assert not answer.tool_calls and "18" in answer.content and "<tool" not in answer.content
        assert r2.choices[0].finish_reason in ("stop", "length")

        # The same round trip through Ollama's /api/chat (arguments as objects, the result as `tool_name`).
        client = ollama.Client(host=url)
        r = client.chat(model=BIG, messages=ASK, tools=[WEATHER], options={"temperature": 0, "num_predict": 40})
        (ocall,) = r.message.tool_calls
        assert ocall.function.name == "get_weather" and ocall.function.arguments["city"].lower() == "paris"
        assert not r.message.content and r.done_reason == "stop"
        turn2 = ASK + [{"role": "assistant", "content": "", "tool_calls": [ocall.model_dump()]},
                       {"role": "tool", "content": WEATHER_RESULT, "tool_name": "get_weather"}]
        parts = list(client.chat(model=BIG, messages=turn2, stream=True,  # no tools: the answer, please
                                 options={"temperature": 0, "num_predict": 40}))
        text = "".join(p.message.content or "" for p in parts)
        assert not any(p.message.tool_calls for p in parts) and "18" in text and "<tool" not in text
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def small_server():
    proc, url = _serve(SMALL)
    yield url
    _stop(proc)


def test_ollama_tool_calls_streamed_and_not_agree_and_show_lists_tools(small_server):
    """Ollama's defaults (repeat penalty 1.1) make qwen2.5-coder-0.5b fence its call in ```json: still a call."""
    client = ollama.Client(host=small_server)
    r = client.chat(model=SMALL, messages=ASK, tools=[WEATHER], options={"temperature": 0, "num_predict": 40})
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments["city"].lower() == "paris"
    assert "<tool_call>" not in (r.message.content or "") and r.done_reason == "stop"
    parts = list(client.chat(model=SMALL, messages=ASK, tools=[WEATHER], stream=True,
                             options={"temperature": 0, "num_predict": 40}))
    streamed = [tc for p in parts for tc in (p.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [
        (call.function.name, dict(call.function.arguments))]
    assert "".join(p.message.content or "" for p in parts) == (r.message.content or "")
    show = client.show(SMALL)
    assert "tools" in show.capabilities and "completion" in show.capabilities


def test_tool_choice_required_and_named_always_call_and_none_never_does(small_server):
    oai = openai.OpenAI(base_url=small_server + "/v1", api_key="none", max_retries=0, timeout=120)
    chat = [{"role": "user", "content": "Tell me a joke about cats."}]  # no reason to call anything
    # One call: with parallel calls allowed the 0.5b, sampled at 0.7, may go on calling the two tools for one city
    # after another (Paris, London, Berlin, ... measured: 7 calls in 128 tokens), the model's loop, not the route's.
    r = oai.chat.completions.create(model=SMALL, messages=chat, tools=[WEATHER, TIME], tool_choice="required",
                                    parallel_tool_calls=False, temperature=0.7, seed=3, max_tokens=48)
    assert r.choices[0].finish_reason == "tool_calls"
    for c in r.choices[0].message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[c.function.name]
        jsonschema.validate(json.loads(c.function.arguments), tool["function"]["parameters"])
    r = oai.chat.completions.create(model=SMALL, messages=chat, tools=[WEATHER, TIME], temperature=0.7, seed=3,
                                    tool_choice={"type": "function", "function": {"name": "get_time"}},
                                    parallel_tool_calls=False, max_tokens=48)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
    r = oai.chat.completions.create(model=SMALL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                    temperature=0, max_tokens=24)
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=SMALL, messages=ASK, tools=[WEATHER], tool_choice={
            "type": "function", "function": {"name": "launch"}})
    assert "launch" in e.value.message and e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=SMALL, messages=ASK, tools=[WEATHER],
                                    response_format={"type": "json_object"})
    assert e.value.body["param"] == "tools"


def test_a_tool_request_decoded_beside_another_answers_as_it_does_alone(small_server):
    """Batch invariance under the call grammar: greedy answers are the same alone and two at a time."""
    from concurrent.futures import ThreadPoolExecutor

    oai = openai.OpenAI(base_url=small_server + "/v1", api_key="none", max_retries=0, timeout=120)
    asks = [(ASK, [WEATHER, TIME]), ([{"role": "user", "content": "What time is it in Tokyo?"}], [WEATHER, TIME])]

    def ask(i):
        messages, tools = asks[i]
        m = oai.chat.completions.create(model=SMALL, messages=messages, tools=tools, temperature=0,
                                        max_tokens=36).choices[0].message
        return m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or []]

    alone = [ask(0), ask(1)]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(ask, range(2)))
    assert together == alone
    assert any(calls for _, calls in alone)


def test_a_continue_agent_request_body_gets_schema_valid_calls(small_server):
    """Continue's agent mode, as it sends its request (tests/data/agents): streamed, parallel_tool_calls false.
    max_tokens is lowered to fit this test's server (--max-tokens 128)."""
    body = json.loads((DATA / "agents" / "continue_agent_tools.json").read_text())
    body["max_tokens"] = 64
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in body["tools"]}
    with httpx.Client(base_url=small_server, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    content, calls, finish = "", {}, None
    for c in chunks:
        for choice in c["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
                entry["name"] = tc["function"].get("name") or entry["name"]
                entry["arguments"] += tc["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    assert "<tool_call>" not in content and "</tool_call>" not in content
    assert len(calls) <= 1  # parallel_tool_calls false
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), tools[entry["name"]])
    assert finish == ("tool_calls" if calls else "stop")
    assert calls or content.strip()


def test_a_model_without_native_tool_support_gets_the_generic_json_form():
    proc, url = _serve(NO_TOOLS)
    try:
        oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = oai.chat.completions.create(model=NO_TOOLS, messages=ASK, tools=[WEATHER], tool_choice="required",
                                        temperature=0, max_tokens=64)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
        r = oai.chat.completions.create(model=NO_TOOLS, messages=[{"role": "user", "content": "Say hello."}],
                                        tools=[WEATHER], temperature=0, max_tokens=64)
        message = r.choices[0].message
        # Either form parses: a call, or the answer as plain content (never the JSON envelope).
        assert message.tool_calls or (message.content and not message.content.lstrip().startswith('{"response"'))
        turn2 = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": WEATHER_RESULT}]
        r2 = oai.chat.completions.create(model=NO_TOOLS, messages=turn2, tools=[WEATHER], temperature=0,
                                         max_tokens=64)
        assert r2.choices[0].message.tool_calls or r2.choices[0].message.content
        show = ollama.Client(host=url).show(NO_TOOLS)
        assert "tools" not in show.capabilities
    finally:
        _stop(proc)
