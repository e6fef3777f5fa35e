"""Chat templates: llama.cpp's renderings of the catalog models' templates, the sandbox, HF helpers."""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest

from conftest import CATALOG_MODELS, model_file, reference_cases
from localllm.chat.template import MAX_SOURCE_CHARS, ChatTemplate, ChatTemplateError, validate_messages
from localllm.runtime.engine import Engine
from localllm.errors import LocalLLMError
from localllm.gguf_file import load_metadata

_META_CACHE: dict[str, dict] = {}


def _meta(name: str) -> dict:
    if name not in _META_CACHE:
        _META_CACHE[name] = load_metadata(model_file(name))
    return _META_CACHE[name]


def _tmpl(source: str | None, **kw) -> ChatTemplate:
    return ChatTemplate(source, model_name="test-model", **kw)


USER = [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- llama.cpp reference renderings

@pytest.mark.parametrize("name", CATALOG_MODELS)
def test_reference_chat_cases(name):
    template = ChatTemplate.from_metadata(_meta(name))
    cases = [c for c in reference_cases(name) if "messages" in c]
    assert cases, f"no chat cases for {name}"
    for case in cases:
        assert template.render(case["messages"], add_generation_prompt=True) == case["templated_prompt"], case["name"]


def test_gemma3_has_no_template_and_falls_back_to_chatml():
    template = ChatTemplate.from_metadata(_meta("gemma3-270m"))
    assert not template.has_template
    assert template.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    assert template.render(USER, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_special_tokens_from_vocab():
    template = ChatTemplate.from_metadata(_meta("qwen2.5-coder-0.5b-instruct"))
    assert template.has_template
    assert template.eos_token == "<|im_end|>"
    assert template.bos_token == "<|endoftext|>"


def test_qwen_tools_and_tool_calls():
    template = ChatTemplate.from_metadata(_meta("qwen2.5-coder-0.5b-instruct"))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "Zürich"}}}]
    out = template.render(
        [{"role": "user", "content": "weather?"},
         {"role": "assistant", "content": None,
          "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
         {"role": "tool", "content": "sunny"}],
        tools=tools)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "Zürich"}}}' in out
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in out
    assert "<tool_response>\nsunny\n</tool_response>" in out
    assert out.endswith("<|im_start|>assistant\n")


def test_metadata_without_template_keys():
    template = ChatTemplate.from_metadata({})
    assert not template.has_template
    assert template.bos_token == "" and template.eos_token == ""
    assert template.render(USER) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------- context given to templates

def test_bos_eos_and_generation_prompt_and_kwargs():
    meta = {"tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}:{{ m['content'] }}]"
                                       "{% endfor %}{% if add_generation_prompt %}GEN{% endif %}{{ eos_token }}"
                                       "{% if enable_thinking is defined %}T={{ enable_thinking }}{% endif %}",
            "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    template = ChatTemplate.from_metadata(meta)
    assert template.render(USER) == "<s>[user:hi]GEN</s>"
    assert template.render(USER, add_generation_prompt=False) == "<s>[user:hi]</s>"
    assert template.render(USER, enable_thinking=False) == "<s>[user:hi]GEN</s>T=False"


def test_trim_and_lstrip_blocks_like_hf():
    src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n<{{ m.content }}>\n    {% endif %}\n{% endfor %}\n"
    assert _tmpl(src).render(USER + USER) == "<hi>\n<hi>\n"


def test_loopcontrols_extension():
    src = "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'system' %}" \
          "{% continue %}{% endif %}{{ m.content }}{% endfor %}"
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert _tmpl(src).render(msgs) == "a"


def test_tools_default_none():
    assert _tmpl("{{ tools is none }}").render(USER) == "True"
    assert _tmpl("{{ tools | length }}").render(USER, tools=[{"a": 1}]) == "1"


def test_strftime_now():
    out = _tmpl("{{ strftime_now('%Y') }}").render(USER)
    assert out.isdigit() and len(out) == 4


# ---------------------------------------------------------------- tojson with HF's semantics

@pytest.mark.parametrize("expr, expected", [
    ("{{ x | tojson }}", json.dumps({"k": "é<>&'", "n": [1, 2]}, ensure_ascii=False)),
    ("{{ x | tojson(indent=2) }}", json.dumps({"k": "é<>&'", "n": [1, 2]}, ensure_ascii=False, indent=2)),
    ("{{ x | tojson(separators=(',', ':')) }}", '{"k":"é<>&\'","n":[1,2]}'),
    ("{{ x | tojson(ensure_ascii=True) }}", json.dumps({"k": "é<>&'", "n": [1, 2]})),
    ("{{ {'b': 1, 'a': 2} | tojson(sort_keys=True) }}", '{"a": 2, "b": 1}'),
])
def test_tojson_like_hf(expr, expected):
    # No HTML escaping (Jinja's own tojson would turn < into \u003c), non-ASCII kept as is.
    assert _tmpl(expr).render(USER, x={"k": "é<>&'", "n": [1, 2]}) == expected


# ---------------------------------------------------------------- errors become LocalLLMError

def test_raise_exception_surfaces_message():
    src = "{% if messages[0].role != 'system' %}{{ raise_exception('Conversation must start with a system message') }}{% endif %}"
    with pytest.raises(LocalLLMError) as info:
        _tmpl(src).render(USER)
    assert "Conversation must start with a system message" in str(info.value)
    assert "test-model" in str(info.value)


def test_syntax_error_is_user_error():
    # loading does not fail (plain completion still works); rendering reports it
    template = ChatTemplate.from_metadata({"tokenizer.chat_template": "{% for m in messages %}{{ m.content }}",
                                           "general.name": "Broken Model"})
    assert template.has_template and template.compile_error
    with pytest.raises(LocalLLMError) as info:
        template.render(USER)
    assert "Broken Model" in str(info.value)
    assert "syntax error" in str(info.value)


def test_common_template_idioms():
    # namespace, slicing, tests, filters and string methods that real templates use
    src = (
        "{% set ns = namespace(sys='') %}"
        "{% for m in messages %}{% if m.role == 'system' %}{% set ns.sys = m.content | trim %}{% endif %}{% endfor %}"
        "[{{ ns.sys }}]"
        "{% for m in messages[1:] %}"
        "{{ m.get('role') }}:{{ m.content.strip() if m.content is string else m.content | tojson }}"
        "{% if not loop.last %},{% endif %}{% endfor %}"
        "|{{ messages | selectattr('role', 'equalto', 'user') | list | length }}"
        "|{{ messages[0]['content'].startswith(' sy') }}|{{ messages[-1].content.split('b') | join('-') }}"
        "{% generation %}|gen{% endgeneration %}"
    )
    msgs = [{"role": "system", "content": " sys "}, {"role": "user", "content": " abc "},
            {"role": "assistant", "content": "xbyb"}]
    assert _tmpl(src).render(msgs) == "[sys]user:abc,assistant:xbyb|1|True|x-y-|gen"


def test_runtime_error_is_user_error():
    with pytest.raises(LocalLLMError):
        _tmpl("{{ messages[5].content }}").render(USER)  # undefined -> attribute of undefined
    with pytest.raises(LocalLLMError):
        _tmpl("{{ 1 / 0 }}").render(USER)


# ---------------------------------------------------------------- sandbox

MALICIOUS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ raise_exception.__globals__['os'].system('echo pwned') }}",
    "{{ strftime_now.__globals__['datetime'] }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'].getcwd() }}",
    "{{ self._TemplateReference__context }}",
    "{{ messages[0].__class__.__dict__ }}",
    "{{ (messages|first).update({'role': 'x'}) }}",
    "{% set x = messages.append(1) %}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ messages | attr('__class__') | attr('__mro__') }}",
    "{{ 'x' * 100000000 }}",
    "{{ 10 ** 100000000 }}",
    "{{ range(100000000) | list | length }}",
]


@pytest.mark.parametrize("src", MALICIOUS)
def test_sandbox_blocks_escape(src, tmp_path):
    with pytest.raises(LocalLLMError) as info:
        _tmpl(src).render(USER)
    assert "test-model" in str(info.value)


def test_sandbox_does_not_run_os_functions(tmp_path):
    marker = tmp_path / "pwned"
    srcs = [f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}",
            f"{{{{ raise_exception.__globals__['__builtins__']['open']('{marker}', 'w') }}}}"]
    for src in srcs:
        with pytest.raises(LocalLLMError):
            _tmpl(src).render(USER)
    assert not marker.exists()


def test_template_cannot_mutate_messages():
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(LocalLLMError):
        _tmpl("{% set _ = messages[0].update({'content': 'evil'}) %}").render(msgs)
    assert msgs == [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- message validation

def test_content_parts_are_flattened():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert _tmpl("{{ messages[0].content }}").render(msgs) == "one\ntwo"
    assert ChatTemplate(None).render(msgs, add_generation_prompt=False) == "<|im_start|>user\none\ntwo<|im_end|>\n"
    # the caller's message is not modified
    assert isinstance(msgs[0]["content"], list)


def test_extra_message_keys_pass_through():
    msgs = [{"role": "tool", "content": "r", "tool_call_id": "abc", "name": "f"}]
    assert _tmpl("{{ messages[0].tool_call_id }}/{{ messages[0].name }}").render(msgs) == "abc/f"


@pytest.mark.parametrize("bad", [
    "not a list",
    [{"content": "no role"}],
    [{"role": 3, "content": "x"}],
    [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": 42}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    ["just a string"],
])
def test_invalid_messages(bad):
    with pytest.raises(LocalLLMError):
        validate_messages(bad)
    with pytest.raises(ChatTemplateError):
        ChatTemplate(None).render(bad)


def test_assistant_tool_call_may_have_no_content():
    msgs = validate_messages([{"role": "assistant", "content": None,
                               "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}])
    assert msgs[0]["content"] is None


# ---------------------------------------------------------------- bounded in time and memory
# Each hostile template below, rendered by stock Jinja, runs for hours or builds gigabytes. Here each must fail
# with a ChatTemplateError, quickly and without memory to speak of (tracemalloc counts every Python allocation).

FAST = 0.5  # a render's deadline in the tests of endless work (the default is RENDER_SECONDS)
SLOW = 10.0  # in the tests of size checks: these must fire before any deadline, on however busy a machine


def _refused(src: str, seconds: float = FAST) -> tuple[str, float]:
    """Render `src`: it must fail within its deadline plus slack, its allocations peaking under 32 MB."""
    template = _tmpl(src, seconds=seconds)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ChatTemplateError) as info:
            template.render(USER)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "test-model" in str(info.value)
    assert elapsed < seconds + 1.5, (elapsed, src)
    assert peak < 32e6, (peak, src)
    return str(info.value), elapsed


def _too_large(src: str) -> None:
    message, _ = _refused(src, seconds=SLOW)
    assert "characters" in message or "bits" in message or "at most" in message, message  # not the deadline


@pytest.mark.parametrize("src", [
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "{% for a in range(100000) %}{% for b in range(100000) if b < 0 %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% for a in range(100000) %}{{ range(100000) | map('string') | list | length }}{% endfor %}",
], ids=["nested-loops", "loop-filter", "macro-recursion", "filter-generators"])
def test_endless_work_stops_at_the_deadline(src):
    message, elapsed = _refused(src)
    assert f"longer than {FAST:g} s" in message
    assert elapsed >= FAST


@pytest.mark.parametrize("step", [
    "ns.s ~ ns.s", "ns.s + ns.s", "ns.s.replace('x', 'xx')", "ns.s | replace('x', 'xx')",
    "[ns.s, ns.s] | join", "'{0}{0}'.format(ns.s)", "'%s%s' % (ns.s, ns.s)",
])
def test_doubling_a_string_in_a_loop_is_refused_before_it_is_built(step):
    _too_large(f"{{% set ns = namespace(s='x&') %}}{{% for i in range(64) %}}{{% set ns.s = {step} %}}{{% endfor %}}"
               "{{ ns.s | length }}")


def test_escaping_in_a_loop_is_refused():
    _too_large("{% set ns = namespace(s='&' * 100000) %}{% for i in range(64) %}{% set ns.s = ns.s | forceescape %}"
               "{% endfor %}{{ ns.s | length }}")


def test_doubling_by_captured_output_is_refused():
    _too_large("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set t %}{{ ns.s }}{{ ns.s }}{% endset %}"
               "{% set ns.s = t %}{% endfor %}{{ ns.s | length }}")


@pytest.mark.parametrize("expr", [
    "'x' | center(2500000000)", "'x'.center(2500000000)", "'x'.ljust(2500000000)", "'x'.rjust(2500000000)",
    "'x'.zfill(2500000000)", "'{:>2500000000}'.format('x')", "'{:.2500000000f}'.format(1.0)",
    "'{0:{1}}'.format('x', 2500000000)", "'%2500000000s' | format('x')", "'%2500000000s' % 'x'",
    "'%*s' % (2500000000, 'x')", "'%(a)2500000000s' % {'a': 'x'}", "('{0:1000000}' * 100).format('x')",
    "'x' | indent(2500000000)", "('x\\n' * 100000) | indent(100000)", "('x\\n' * 100000) | indent('y' * 100000)",
    "('\\t' * 100000).expandtabs(100000)", "('x' * 100000).replace('', 'y' * 100000)",
    "('a' * 100000).translate({97: 'b' * 100000})", "(1).to_bytes(2500000000, 'big')",
])
def test_widths_and_repeat_counts_are_refused_before_the_string_is_built(expr):
    _too_large("{{ " + expr + " }}")


@pytest.mark.parametrize("expr", [
    "'x' * 2500000000", "[1, 2, 3] * 1000000000", "([1] * 100000) * 100000", "10 ** 100000000",
    "10 ** 4096 ** 4096", "(10 ** 4096) ** 4096", "(10 ** 4096) * (10 ** 4096) * (10 ** 4096) * (10 ** 4096) * (10 ** 4096) * (10 ** 4096)",
])
def test_multiplying_operators_are_bounded(expr):
    _too_large("{{ " + expr + " }}")


@pytest.mark.parametrize("expr", [
    "([[[[[[[[[[1]]]]]]]]]] * 1000) | tojson(indent=100000)", "[[[1]]] | tojson(indent='x' * 1000000)",
    "([1] * 100000) | tojson(separators=('x' * 1000, ':'))", "([[[[[[[[[[1]]]]]]]]]] * 100000) | pprint",
])
def test_json_and_pprint_indentation_is_bounded(expr):
    _too_large("{{ " + expr + " }}")


@pytest.mark.parametrize("src", [
    # each level holds the previous one 10 times: 10^8 strings, built from a few hundred characters of source
    "{% set a = ['xxxxxxxxxx'] * 10 %}" + "".join(f"{{% set {n} = [{p},{p},{p},{p},{p},{p},{p},{p},{p},{p}] %}}"
                                                 for p, n in zip("abcdefg", "bcdefgh")) + "{{ h == h | list }}",
    "{% set ns = namespace(l=['x' * 1000]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
    "{% set a = ['x' * 1000000] %}{% set b = [a, a, a, a, a, a, a, a, a, a] %}{{ b ~ b }}",
    "{% set s = 'x' * 1000000 %}{% set ns = namespace() %}{% set ns.a = s %}{% set ns.b = s %}{% set ns.c = s %}"
    "{{ [ns, ns, ns, ns, ns, ns, ns, ns] }}",
    "{% set d = {'k': 'x' * 1000000} %}{{ {'a': d, 'b': d, 'c': d} | string }}",
], ids=["nested-literals", "list-doubling", "concatenated-repr", "namespace-repr", "dict-repr"])
def test_shared_structures_cannot_grow_exponentially(src):
    _too_large(src)


@pytest.mark.parametrize("expr", [
    "('x' * 1000000) | join('y' * 1000000)", "('y' * 1000000).join('x' * 100000)",
    "('x' * 1000000) | wordwrap(1, wrapstring='y' * 1000)", "('ab ' * 500000) | wordwrap(5, wrapstring='')",
    "('ab.cd http://x.y ' * 90000) | urlize", "[1] | batch(1000000000, 'x') | list",
    "[1] | slice(1000000000) | list", "lipsum(1000000)", "strftime_now('%c' * 1000000)",
])
def test_filters_and_helpers_that_build_from_their_arguments_are_bounded(expr):
    message, _ = _refused("{{ " + expr + " }}", seconds=SLOW)
    assert "longer than" not in message


def test_sum_of_lists_takes_linear_time():
    # Python's sum() copies the running list at every item: 30 000 lists would take 1.35 billion copies.
    start = time.perf_counter()
    assert _tmpl("{{ ([[1, 2, 3]] * 30000) | sum(start=[]) | length }}").render(USER) == "90000"
    assert time.perf_counter() - start < 1.0


def test_output_is_capped():
    message, _ = _refused("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}")
    assert "wrote more than" in message


def test_long_conversations_still_render():
    # The caps grow with what the template is given: 3 MB of messages is legitimate input.
    big = "word " * 600_000
    template = ChatTemplate.from_metadata(_meta("qwen2.5-coder-0.5b-instruct"))
    out = template.render([{"role": "user", "content": big}, {"role": "assistant", "content": big},
                           {"role": "user", "content": big}])
    assert out.count(big) == 3


@pytest.mark.parametrize("src", ["{{ 'x' | center(2500000000) }}", "{{ 'x' * 2500000000 }}",
                                 "{% autoescape 'x' | center(2500000000) != '' %}x{% endautoescape %}"])
def test_a_constant_folding_bomb_costs_nothing_at_load_and_fails_cleanly_at_render(src):
    meta = {"tokenizer.chat_template": src, "general.name": "Bomb"}
    tracemalloc.start()
    start = time.perf_counter()
    try:
        template = ChatTemplate.from_metadata(meta)
        assert template.compile_error is None  # compiles (at first use), evaluating nothing
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0 and peak < 32e6, (elapsed, peak)
    with pytest.raises(ChatTemplateError, match="Bomb.*2,500,000,000 characters"):
        template.render(USER)


def test_engine_load_does_not_compile_the_template(tmp_path):
    from test_model_load import write_tiny_model

    engine = Engine(write_tiny_model(tmp_path / "bomb.gguf", chat_template="{{ 'x' | center(2500000000) }}"),
                    ctx=64, quiet=True)
    assert not engine.template._compiled
    with pytest.raises(ChatTemplateError, match="2,500,000,000 characters"):
        engine.render_chat(USER)


def test_template_source_size_is_capped():
    template = _tmpl("x" * (MAX_SOURCE_CHARS + 1))
    assert "at most" in template.compile_error
    with pytest.raises(ChatTemplateError, match="characters long"):
        template.render(USER)


def test_deeply_nested_source_is_a_compile_error():
    for src in ["{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "{% for a in range(2) %}" * 30 + "{% endfor %}" * 30]:
        template = _tmpl(src)
        assert template.compile_error
        with pytest.raises(ChatTemplateError, match="cannot be compiled"):
            template.render(USER)
