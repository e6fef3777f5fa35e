"""Chat templates: llama.cpp's renderings of the catalog models' templates, the sandbox, HF helpers."""

from __future__ import annotations

import json

import pytest

from conftest import CATALOG_MODELS, model_file, reference_cases
from localllm.chat_template import ChatTemplate, ChatTemplateError, validate_messages
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
