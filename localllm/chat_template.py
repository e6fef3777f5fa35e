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

On top of the stock sandbox we harden two things (legitimate templates never hit either):
- reaching an unsafe attribute (`__class__`, `__globals__`, `__subclasses__`, `mro`, ...) is an error at
  once, where stock Jinja returns an Undefined that renders as "" until something is done with it;
- `*` and `**` refuse to build huge strings/lists or numbers (a cheap memory-exhaustion guard).
Loops are bounded by the sandbox's `range` limit (100 000 items per call) but not in total: a template with
deeply nested loops can still take long to render.

Any failure (syntax error, `raise_exception`, sandbox violation, undefined access) becomes a `LocalLLMError`
(`ChatTemplateError`) naming the model and the problem; a traceback never reaches the user. A template that
does not compile is reported by `render` (see `compile_error`), not by `from_metadata`, so a model with a
broken template still loads for plain completion. HF's `{% generation %}` block tag is accepted as a no-op.

A GGUF without a template gets ChatML, as llama.cpp does:
`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then `<|im_start|>assistant\\n`.
"""

from __future__ import annotations

import json
import operator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localllm.errors import LocalLLMError

__all__ = ["ChatTemplate", "ChatTemplateError", "CHATML_TEMPLATE"]

# Limits of the `*` / `**` guard.
_MAX_SEQUENCE_LEN = 1 << 20  # characters or items a `*` may produce
_MAX_POW_EXPONENT = 4096

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
    raise _RaisedByTemplate(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # HF overrides Jinja's tojson: no HTML escaping, and json.dumps' formatting options are exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _sized(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else None


class _HardenedSandbox(ImmutableSandboxedEnvironment):
    """HF's sandbox, plus: unsafe attribute access fails immediately, and `*`/`**` are size-limited."""

    intercepted_binops = frozenset(["*", "**"])

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
        if operator_ == "*":
            for seq, n in ((left, right), (right, left)):
                size = _sized(seq)
                if size is not None and isinstance(n, int) and size * n > _MAX_SEQUENCE_LEN:
                    raise SecurityError("the template tried to build a sequence that is too large")
            return operator.mul(left, right)
        if operator_ == "**":
            if isinstance(right, (int, float)) and abs(right) > _MAX_POW_EXPONENT:
                raise SecurityError("the template tried to compute a power that is too large")
            return operator.pow(left, right)
        return super().call_binop(context, operator_, left, right)


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
    env.filters["tojson"] = _tojson
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

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "", model_name: str = "model"):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.model_name = model_name
        self._template: jinja2.Template | None = None
        # A template that does not compile is reported when it is first needed (render), so that a model
        # with a broken template can still be used for plain completion.
        self.compile_error: str | None = None
        if source is not None:
            try:
                self._template = _make_environment().from_string(source)
            except Exception as exc:  # TemplateSyntaxError, or the compiler choking on hostile input
                self.compile_error = f"the chat template of {model_name} cannot be compiled: {_describe(exc)}"

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
        if self.compile_error is not None:
            raise ChatTemplateError(self.compile_error)
        if self._template is None:
            return _render_chatml(msgs, add_generation_prompt)
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        context.update(kwargs)
        context.update(messages=msgs, tools=list(tools) if tools is not None else None,
                       add_generation_prompt=bool(add_generation_prompt))
        try:
            return self._template.render(**context)
        except Exception as exc:  # untrusted code: whatever it raises is the template's failure
            raise ChatTemplateError(
                f"the chat template of {self.model_name} failed: {_describe(exc)}") from None
