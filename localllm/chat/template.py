"""Chat templates: turning a list of chat messages into the prompt text a model was trained on.

A GGUF carries its chat template as Jinja source in `tokenizer.chat_template`. That source is untrusted code
downloaded from the internet, so it is rendered in Jinja's `ImmutableSandboxedEnvironment`, configured the
way Hugging Face transformers configures it (`trim_blocks`, `lstrip_blocks`, the `loopcontrols` extension)
and given what HF templates expect:

- `messages`, `tools` (None unless given), `add_generation_prompt`, `bos_token`, `eos_token`, and any extra
  keyword arguments of `render` (e.g. `enable_thinking`);
- `raise_exception(msg)`, `strftime_now(fmt)`;
- a `tojson` filter with HF's semantics: `json.dumps(x, ensure_ascii=False, indent=..., separators=...,
  sort_keys=...)`, without Jinja's HTML escaping.

On top of the stock sandbox:
- reaching an unsafe attribute (`__class__`, `__globals__`, `__subclasses__`, `mro`, ...) is an error at
  once, where stock Jinja returns an Undefined that renders as "" until something is done with it;
- a render is bounded in time and memory (`template_sandbox.BoundedSandbox`): it fails after
  `RENDER_SECONDS`, and no value it builds, nor its output, may exceed `BASE_LIMIT` characters plus twice the
  size of what it was given (the messages, tools and options);
- the template is compiled at its first render, not at model load, without evaluating anything (stock Jinja
  runs constant filter calls while compiling), and a template longer than `MAX_SOURCE_CHARS` is refused.
Legitimate templates never come near these bounds. Renders run on the caller's thread: the server renders off
its event loop, so that a slow template delays only its own request.

Any failure (syntax error, `raise_exception`, sandbox violation, undefined access) becomes a `LocalLLMError`
(`ChatTemplateError`) naming the model and the problem; a traceback never reaches the user. A template that
does not compile is reported by `render` (see `compile_error`), not by `from_metadata`, so a model with a
broken template still loads for plain completion. HF's `{% generation %}` block tag is accepted as a no-op.

A GGUF without a template gets ChatML, as llama.cpp does:
`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then `<|im_start|>assistant\\n`.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError

from localllm.errors import LocalLLMError
from localllm.chat.template_sandbox import BoundedSandbox, Budget, BudgetExceeded, current, rendering

__all__ = ["ChatTemplate", "ChatTemplateError", "CHATML_TEMPLATE"]

# A render's budget. The catalog models' templates render a 20-message conversation in about 1 ms.
RENDER_SECONDS = 2.0
BASE_LIMIT = 2 << 20  # characters, plus twice the size of the messages, tools and options
# The largest templates in the wild are about 20 kB. Compiling 64 kB takes 0.8-2.2 s on a busy 2-core machine,
# once, at the first render (the qwen2.5 template, 2.5 kB: 25 ms).
MAX_SOURCE_CHARS = 64 * 1024
_MAX_MESSAGE_CHARS = 2000  # of a raise_exception() message, as shown to the user

# The ChatML fallback, written as a template for reference/documentation; rendering it uses `_render_chatml`.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(LocalLLMError):
    """A chat template failed to compile or render, or the messages given to it are malformed."""


class _RaisedByTemplate(TemplateError):
    """What the template's own `raise_exception(msg)` raises."""


def _raise_exception(message: Any) -> None:
    text = current().text(message)
    if len(text) > _MAX_MESSAGE_CHARS:
        text = text[:_MAX_MESSAGE_CHARS] + "..."
    raise _RaisedByTemplate(text)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # HF overrides Jinja's tojson: no HTML escaping, and json.dumps' formatting options are exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > 1000:  # each directive expands to ~30 characters at most
        raise TypeError("strftime_now() takes a format string of at most 1000 characters")
    return datetime.now().strftime(fmt)


class _HardenedSandbox(BoundedSandbox):
    """HF's sandbox, bounded, and where unsafe attribute access fails immediately."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` (marks assistant text for training masks): here a no-op
    block, so templates that use it compile and render their content unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _make_environment() -> _HardenedSandbox:
    env = _HardenedSandbox(trim_blocks=True, lstrip_blocks=True,
                           extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(meta: dict, key: str) -> str:
    """The text of the special token whose id is at `key` (e.g. tokenizer.ggml.bos_token_id), or ""."""
    token_id = meta.get(key)
    tokens = meta.get("tokenizer.ggml.tokens")
    if token_id is None or tokens is None:
        return ""
    try:
        token_id = int(token_id)
    except (TypeError, ValueError):
        return ""
    if 0 <= token_id < len(tokens):
        return str(tokens[token_id])
    return ""


def _flatten_content(content: list, where: str) -> str:
    """OpenAI-style content parts -> one string (text parts joined by newlines, as llama.cpp does)."""
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise ChatTemplateError(f"{where}: content part {j} must be an object, got {type(part).__name__}")
        kind = part.get("type", "text")
        if kind != "text":
            raise ChatTemplateError(f"{where}: content part {j} has type {kind!r}; only text is supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"{where}: content part {j} needs a string 'text'")
        texts.append(text)
    return "\n".join(texts)


def validate_messages(messages: Any) -> list[dict]:
    """Check chat messages and return copies ready for a template.

    Each message is a dict with a string `role` and a `content` that is a string, a list of
    {"type": "text", "text": ...} parts (flattened to a string), or None for an assistant message that
    carries `tool_calls`. Other keys (tool_calls, name, tool_call_id, ...) are passed through.
    """
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list, got {type(messages).__name__}")
    out = []
    for i, msg in enumerate(messages):
        where = f"message {i}"
        if not isinstance(msg, dict):
            raise ChatTemplateError(f"{where} must be an object with 'role' and 'content', got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"{where} needs a non-empty string 'role'")
        msg = dict(msg)
        content = msg.get("content")
        if isinstance(content, (list, tuple)):
            msg["content"] = _flatten_content(list(content), where)
        elif content is None:
            if not (role == "assistant" and msg.get("tool_calls")):
                raise ChatTemplateError(f"{where} ({role}) needs a string 'content'")
        elif not isinstance(content, str):
            raise ChatTemplateError(f"{where}: 'content' must be a string or a list of text parts, "
                                    f"got {type(content).__name__}")
        out.append(msg)
    return out


def _render_chatml(messages: list[dict], add_generation_prompt: bool) -> str:
    parts = []
    for msg in messages:
        content = msg.get("content") or ""
        parts.append(f"<|im_start|>{msg['role']}\n{content}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BudgetExceeded):
        return str(exc)
    if isinstance(exc, RecursionError):
        return "the template recursed too deeply"
    if isinstance(exc, MemoryError):
        return "the template ran out of memory"
    if isinstance(exc, _RaisedByTemplate):
        return f"the template raised an error: {exc}"
    if isinstance(exc, SecurityError):
        return f"the template did something the sandbox forbids ({exc})"
    if isinstance(exc, TemplateSyntaxError):
        return f"syntax error at line {exc.lineno}: {exc.message}"
    if isinstance(exc, TemplateError):
        return f"{type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc}"


class ChatTemplate:
    """A model's chat template, compiled once and rendered per request."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "", model_name: str = "model",
                 seconds: float = RENDER_SECONDS, base_limit: int = BASE_LIMIT):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.model_name = model_name
        self.seconds = seconds
        self.base_limit = base_limit
        # Compiled at the first render, not when the model loads: a plain completion never pays for it.
        self._template: jinja2.Template | None = None
        self._compile_error: str | None = None
        self._compiled = source is None
        self._compile_lock = threading.Lock()

    def _compile(self) -> None:
        with self._compile_lock:
            if self._compiled:
                return
            assert self.source is not None
            if len(self.source) > MAX_SOURCE_CHARS:
                self._compile_error = (f"the chat template of {self.model_name} is {len(self.source):,} characters "
                                       f"long; at most {MAX_SOURCE_CHARS:,} are accepted")
            else:
                try:
                    self._template = _make_environment().from_string(self.source)
                except Exception as exc:  # TemplateSyntaxError, or the compiler choking on hostile input
                    self._compile_error = (f"the chat template of {self.model_name} cannot be compiled: "
                                           f"{_describe(exc)}")
            self._compiled = True

    @property
    def compile_error(self) -> str | None:
        """Why the template cannot be used (it is reported when it is first needed, at render, so that a model
        with a broken template can still be used for plain completion); None if it compiles."""
        self._compile()
        return self._compile_error

    @property
    def has_template(self) -> bool:
        """True if the GGUF carried a template; False means the ChatML fallback is used."""
        return self.source is not None

    @classmethod
    def from_metadata(cls, meta: dict, model_name: str | None = None) -> "ChatTemplate":
        source = meta.get("tokenizer.chat_template")
        if source is not None and not isinstance(source, str):
            source = None
        if isinstance(source, str) and not source.strip():
            source = None
        name = model_name or meta.get("general.name") or "this model"
        return cls(
            source,
            bos_token=_token_text(meta, "tokenizer.ggml.bos_token_id"),
            eos_token=_token_text(meta, "tokenizer.ggml.eos_token_id"),
            model_name=str(name),
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               **kwargs: Any) -> str:
        """Render `messages` (validated, content parts flattened) to the prompt text."""
        msgs = validate_messages(messages)
        if tools is not None and not isinstance(tools, (list, tuple)):
            raise ChatTemplateError(f"tools must be a list, got {type(tools).__name__}")
        if self.compile_error is not None:  # compiles the template on first use
            raise ChatTemplateError(self.compile_error)
        if self._template is None:
            return _render_chatml(msgs, add_generation_prompt)
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        context.update(kwargs)
        context.update(messages=msgs, tools=list(tools) if tools is not None else None,
                       add_generation_prompt=bool(add_generation_prompt))
        try:
            budget = Budget(self.seconds, limit=2**62)
            given = budget.weight(context["tools"]) + budget.weight(kwargs)
            for msg in msgs:
                for value in msg.values():
                    given += len(value) + 8 if type(value) is str else budget.weight(value)
            budget.set_limit(self.base_limit + 2 * given)
            with rendering(budget):
                return self._template.render(**context)
        except Exception as exc:  # untrusted code: whatever it raises is the template's failure
            raise ChatTemplateError(
                f"the chat template of {self.model_name} failed: {_describe(exc)}") from None
