"""Tool calls: tools into the prompt, calls out of the answer, and the grammar that keeps a call well formed.

API-neutral: tools are given in OpenAI's function shape ({"type": "function", "function": {"name",
"description", "parameters"}}; Ollama sends the same), conversation messages carry assistant `tool_calls` whose
arguments are objects and `tool` messages with a `name`, and the calls found come back as `ToolCall(id, name,
arguments, arguments_json)`. The OpenAI, Ollama (and Anthropic) handlers translate their own shapes to and from
these.

A model's tool-call form is read from its chat template, as llama.cpp's `--jinja` does:

- "hermes": Hermes 2 Pro / Qwen2.5 templates, whose answer holds `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>` blocks (on Qwen2.5 `<tool_call>` and `</tool_call>` are single tokens), or, as
  qwen2.5-coder writes it, the same JSON bare at the answer's start, in a ```json fence or not;
- "llama3": Llama 3.x templates, whose answer is `{"name": ..., "parameters": {...}}`, or the same JSON after
  `<|python_tag|>`;
- "generic": any other template (no tool support, or a form not known here), llama.cpp's generic form: a
  system message describes the tools and the answer is a JSON object, `{"tool_call": {"name", "arguments"}}`
  (`{"tool_calls": [...]}` when parallel calls are allowed) or `{"response": "..."}`, constrained from the start
  by a JSON schema. Tool results go back as user messages, earlier calls as the assistant's JSON.

The tools reach a native template through its own `tools` variable (the GGUF's Jinja renders them).

`ToolCallParser` reads the answer incrementally, character by character if need be: text outside calls comes out
as content deltas at once (only a possible start of a call's markup is held back), a call comes out as its name
then fragments of its arguments' JSON as the model writes them, and the result never depends on how the text was
cut (tested char by char). The markup itself never reaches the content.

`ToolPlan.grammar` is llguidance Lark text: for tool_choice "auto" a lazy grammar, free text until the call's
opening (the `<tool_call>` token, or an answer that starts as a call, `{"name"`), then the call's name among the
tools and its arguments held to the function's JSON schema (objects closed to other keys, as llama.cpp reads
them), so a call always parses; for "required" or a named function, a call from the first token. The generic
form's constraint is a JSON schema (`ToolPlan.json_schema`) instead. Parallel calls: allowed unless
`parallel_tool_calls` is false, except in the generic form, where they must be asked for (llama.cpp's default).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from localllm.errors import LocalLLMError

__all__ = ["ToolError", "ToolCall", "TextDelta", "CallDelta", "ToolPlan", "ToolCallParser", "plan_tools",
           "tool_format", "supports_tools", "normalize_tools", "normalize_tool_choice", "new_call_id"]

# Whitespace a call's JSON may hold between tokens (as grammar.py bounds it for response formats): unbounded
# whitespace lets a small model pad forever.
_JSON_WHITESPACE = r"(?:\x20|\n{1,2}[\x20\t]{0,20})?"

GENERIC_SYSTEM = (
    "You can call tools to answer the user. Respond in JSON format, either with `tool_call` (a request to call a "
    "tool) or with `response` (your reply to the user's request).\n\n"
    "The tools you can call, described as JSON:\n{tools}\n\n"
    "To call a tool, respond with:\n{call_example}\n"
    "To reply to the user, respond with:\n{{\"response\": \"your reply\"}}\n"
    "A tool's result comes back in a message of the form {{\"tool_response\": {{\"name\": ..., \"content\": "
    "...}}}}."
)


class ToolError(LocalLLMError):
    """A request's tools, tool_choice or tool messages are malformed; the message names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict | None  # None when the answer ended inside the call (finish "length")
    arguments_json: str  # the arguments as the model wrote them: what OpenAI's `arguments` string holds

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name,
                                                                "arguments": self.arguments_json}}


@dataclass
class TextDelta:
    text: str


@dataclass
class CallDelta:
    """A piece of call `index`: its first delta has `id` and `name`, later ones fragments of its arguments;
    `done` holds the finished call once its last fragment is out."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    done: ToolCall | None = None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# ---- request validation ----------------------------------------------------------------------------------


def normalize_tools(tools) -> list[dict]:
    """The tools in OpenAI's function shape (copies), checked: a name of letters, digits, '_', '-' or '.', and
    parameters that are a JSON schema object (an absent one means no arguments)."""
    if not isinstance(tools, list):
        raise ToolError("'tools' must be an array of tools", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolError(f"'{where}' must be an object", "tools")
        kind = tool.get("type", "function")
        if kind != "function":
            raise ToolError(f"'{where}.type' must be 'function', got {json.dumps(kind)[:60]}", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"'{where}.function' must be an object with a 'name'", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolError(f"'{where}.function.name' must be 1 to 64 letters, digits, '_', '-' or '.', got "
                            f"{json.dumps(name)[:80]}", "tools")
        if name in names:
            raise ToolError(f"two tools are named {name!r}", "tools")
        names.add(name)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolError(f"'{where}.function.parameters' must be a JSON schema object", "tools")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"'{where}.function.description' must be a string", "tools")
        clean = {"name": name}
        if desc is not None:
            clean["description"] = desc
        clean["parameters"] = params
        out.append({"type": "function", "function": clean})
    return out


def normalize_tool_choice(choice, tools: list[dict]) -> tuple[str, str | None]:
    """("auto" | "none" | "required", the one function's name or None) from OpenAI's tool_choice: a string, or
    {"type": "function", "function": {"name": ...}}."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ToolError(f"'tool_choice' must be 'auto', 'none', 'required' or a function, got {choice!r}",
                            "tool_choice")
        if choice == "required" and not tools:
            raise ToolError("'tool_choice' is 'required' but no 'tools' were given", "tool_choice")
        return choice, None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ToolError("'tool_choice' must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                            "tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise ToolError(f"'tool_choice' names the function {name!r}, which is not among the 'tools'",
                            "tool_choice")
        return "required", name
    raise ToolError("'tool_choice' must be a string or an object", "tool_choice")


def _arguments_object(raw, where: str) -> dict:
    if isinstance(raw, dict):
        return raw
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if isinstance(value, dict):
            return value
    raise ToolError(f"'{where}' must be a JSON object (or its JSON text), got {json.dumps(raw)[:80]}", "messages")


def normalize_messages(messages) -> list[dict]:
    """Messages for the template: assistant `tool_calls` as {"id", "type", "function": {"name", "arguments":
    object}} (OpenAI sends arguments as JSON text, Ollama as an object), and `tool` messages given a `name`
    (Ollama's `tool_name`, or the name of the call their OpenAI `tool_call_id` answers)."""
    if not isinstance(messages, list):
        return messages  # the template's validation reports it
    out, names = [], {}
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            out.append(msg)
            continue
        msg = dict(msg)
        calls = msg.get("tool_calls")
        if msg.get("role") == "assistant" and calls:
            if not isinstance(calls, list):
                raise ToolError(f"'messages[{i}].tool_calls' must be an array", "messages")
            clean = []
            for j, call in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ToolError(f"'{where}' must be {{\"function\": {{\"name\", \"arguments\"}}}}", "messages")
                cid = call.get("id") if isinstance(call.get("id"), str) else f"call_{i}_{j}"
                names[cid] = fn["name"]
                clean.append({"id": cid, "type": "function",
                              "function": {"name": fn["name"],
                                           "arguments": _arguments_object(fn.get("arguments"),
                                                                          where + ".function.arguments")}})
            msg["tool_calls"] = clean
        elif msg.get("role") == "assistant" and "tool_calls" in msg:
            del msg["tool_calls"]  # an empty list or null: a plain answer
        if msg.get("role") == "tool":
            name = next((n for n in (msg.get("tool_name"), msg.get("name")) if isinstance(n, str) and n), None)
            call_id = msg.get("tool_call_id")
            if name is None and isinstance(call_id, str):
                name = names.get(call_id)
            if isinstance(name, str):
                msg["name"] = name
        out.append(msg)
    return out


# ---- the template's form -------------------------------------------------------------------------------


_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_7f3a", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_support_cache: dict = {}


def supports_tools(template) -> bool:
    """Whether the chat template renders the tools it is given (a probe render, as llama.cpp's minja checks
    its templates' capabilities); cached per template source."""
    if template.source is None:
        return False
    key = template.source
    if key not in _support_cache:
        try:
            out = template.render([{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL])
            _support_cache[key] = "probe_tool_7f3a" in out
        except LocalLLMError:
            _support_cache[key] = False
    return _support_cache[key]


def tool_format(template) -> str:
    """"hermes", "llama3" or "generic" for this chat template."""
    if not supports_tools(template):
        return "generic"
    src = template.source or ""
    if "<tool_call>" in src:
        return "hermes"
    if "<|python_tag|>" in src or ("<|start_header_id|>" in src and "parameters" in src):
        return "llama3"
    return "generic"


# ---- planning a request ---------------------------------------------------------------------------------


@dataclass
class ToolPlan:
    format: str  # "hermes", "llama3", "generic"; "none" when tool_choice is none (plain content)
    tools: list[dict]
    choice: str  # "auto", "required", "none"
    function: str | None  # the one function tool_choice names
    parallel: bool
    grammar: str | None = None  # llguidance Lark text
    json_schema: dict | None = None  # the generic form's constraint (compiled as a schema)
    names: list[str] = field(default_factory=list)

    def parser(self) -> "ToolCallParser":
        return ToolCallParser(self.format if self.choice != "none" else "none", self.names)

    def render(self, template, messages: list[dict], **kwargs) -> str:
        """The prompt: native forms through the template's own `tools`, the generic form through a system
        message and messages rewritten as JSON."""
        from localllm.chat.template import validate_messages

        messages = normalize_messages(validate_messages(messages))  # content parts flattened first
        if self.format in ("hermes", "llama3"):
            tools = self.tools if self.choice != "none" else None
            return template.render(messages, tools=tools, **kwargs)
        system = _generic_system(self.tools, self.parallel) if self.choice != "none" and self.tools else None
        return template.render(_generic_messages(messages, system), **kwargs)


def plan_tools(template, tools, tool_choice=None, parallel_tool_calls=None) -> ToolPlan:
    """What a request with `tools` does on a model with this template (raises ToolError for bad input)."""
    try:
        return _plan(template, tools, tool_choice, parallel_tool_calls)
    except RecursionError:  # a schema nested as deep as JSON parsing allows
        raise ToolError("the tools' parameter schemas are nested too deeply", "tools") from None


def _plan(template, tools, tool_choice, parallel_tool_calls) -> ToolPlan:
    tools = normalize_tools(tools if tools is not None else [])
    choice, function = normalize_tool_choice(tool_choice, tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    fmt = tool_format(template)
    # Unless asked, parallel calls are allowed in the native forms (OpenAI's default) and not in the generic one
    # (llama.cpp's server default): in its `tool_calls` array a small model repeats the call until the token
    # limit (greedy smollm2-135m: the same get_weather call three times in 64 tokens).
    parallel = parallel_tool_calls if parallel_tool_calls is not None else fmt != "generic"
    offered = [t for t in tools if function is None or t["function"]["name"] == function]
    plan = ToolPlan(fmt, tools, choice, function, parallel, names=[t["function"]["name"] for t in tools])
    if choice == "none" or not tools:
        plan.choice = "none"
        return plan
    if fmt == "hermes":
        plan.grammar = _hermes_grammar(offered, choice == "required", parallel)
    elif fmt == "llama3":
        plan.grammar = _llama3_grammar(offered, choice == "required", parallel,
                                       python_tag="<|python_tag|>" in (template.source or ""))
    else:
        plan.json_schema = _generic_schema(offered, choice == "required", parallel)
    return plan


def _closed(schema):
    """The schema with every object that lists `properties` and says nothing of `additionalProperties` closed to
    other keys, as llama.cpp's schema converter reads such objects (llguidance, by the JSON Schema spec, would let
    a small model add keys of its own: smollm2 went on writing a "properties" key inside the arguments)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
            out[key] = {k: _closed(v) for k, v in value.items()} if isinstance(value, dict) else value
        elif key in ("items", "additionalItems", "not", "if", "then", "else", "contains", "anyOf", "oneOf",
                     "allOf", "prefixItems", "additionalProperties"):
            out[key] = _closed(value)
        else:
            out[key] = value
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema(params: dict) -> dict:
    """A function's parameters schema (closed objects) with the bounded whitespace of a call, lenient: a keyword
    llguidance cannot enforce (propertyNames, if/then, not, uniqueItems...) is left unenforced rather than failing
    the request, as llama.cpp's schema converter ignores what it does not know (server/tool_calls.py logs them)."""
    out = _closed(params)
    guide = dict(out.get("x-guidance") or {})
    guide.setdefault("whitespace_pattern", _JSON_WHITESPACE)
    guide.setdefault("lenient", True)
    out["x-guidance"] = guide
    return out


def _lit(s: str) -> str:
    return json.dumps(s)


_W = r"[\x20\t\n]{0,24}"  # whitespace between a call's JSON tokens, bounded


def _hermes_grammar(tools: list[dict], required: bool, parallel: bool) -> str:
    """<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>, as the Qwen2.5 template shows it, or the
    same JSON bare at the answer's start, in a ```json fence or not, as qwen2.5-coder writes it (greedy,
    qwen2.5-coder-0.5b answers "What is the weather in Paris?" with `{"name": "get_weather", ...}` and no tags;
    with Ollama's repeat penalty, in a fence; llama.cpp's Hermes handler takes both).

    A call's head up to its arguments is ONE regex lexeme: llguidance's lexer follows the free-text lexeme as long
    as it can, so a head cut into several lexemes would die with the free text where it stops matching."""
    lines = ["%llguidance {}"]
    calls = 'call ("\\n"? call)*' if parallel else "call"
    bare = "fn+" if parallel else "fn"
    lines.append(f"start: {calls} | {bare}" if required else f"start: TEXT | TEXT {calls} | {bare}")
    lines.append("call: <tool_call> fn </tool_call>")
    lines.append("fn: " + " | ".join(f"fn_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        fn = tool["function"]
        name = re.escape(json.dumps(fn["name"])).replace("/", "\\/")
        head = (f"{_W}(```json{_W})?\\{{{_W}\"name\"{_W}:{_W}{name}{_W},{_W}\"arguments\"{_W}:{_W}")
        lines.append(f"fn_{i}: HEAD_{i} %json {json.dumps(_schema(fn['parameters']))} TAIL")
        lines.append(f"HEAD_{i}: /{head}/")
    lines.append(f"TAIL: /{_W}\\}}({_W}```)?{_W}/")
    if not required:
        # Free text, which may neither spell the markup out of plain tokens nor start as a bare call: a call
        # opens with the <tool_call> token or `{"name"`, and is then constrained (and always read).
        lines.append(r'TEXT: /(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/ & ~/\s*(```json\s*)?\{\s*"name"(.|\n)*/')
    return "\n".join(lines) + "\n"


def _llama3_grammar(tools: list[dict], required: bool, parallel: bool, python_tag: bool = False) -> str:
    """{"name": "f", "parameters": {...}} as the whole answer (after <|python_tag|> where the template has it),
    Llama 3.x's JSON form; parallel calls separated by ';'. Free text may not start like a call, so a call is
    constrained from its first brace (one regex lexeme up to the arguments, as in the Hermes form)."""
    lines = ["%llguidance {}"]
    bodies = "fn (\";\" fn)*" if parallel else "fn"
    starts = [bodies] + ([f"<|python_tag|> {bodies}"] if python_tag else [])
    if not required:
        starts.insert(0, "TEXT")
    lines.append("start: " + " | ".join(starts))
    lines.append("fn: " + " | ".join(f"fn_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        fn = tool["function"]
        name = re.escape(json.dumps(fn["name"])).replace("/", "\\/")
        head = f"{_W}\\{{{_W}\"name\"{_W}:{_W}{name}{_W},{_W}\"(parameters|arguments)\"{_W}:{_W}"
        lines.append(f"fn_{i}: HEAD_{i} %json {json.dumps(_schema(fn['parameters']))} TAIL")
        lines.append(f"HEAD_{i}: /{head}/")
    lines.append(f"TAIL: /{_W}\\}}{_W}/")
    if not required:
        lines.append(r'TEXT: /(.|\n)*/ & ~/\s*\{\s*"name"(.|\n)*/')
    return "\n".join(lines) + "\n"


def _generic_call_schema(tool: dict) -> dict:
    fn = tool["function"]
    return {"type": "object",
            "properties": {"name": {"type": "string", "const": fn["name"]}, "arguments": _closed(fn["parameters"])},
            "required": ["name", "arguments"], "additionalProperties": False}


def _generic_schema(tools: list[dict], required: bool, parallel: bool) -> dict:
    """llama.cpp's generic form: {"tool_call": ...} / {"tool_calls": [...]} or {"response": "..."}."""
    calls = [_generic_call_schema(t) for t in tools]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if parallel:
        call = {"type": "object", "properties": {"tool_calls": {"type": "array", "items": one, "minItems": 1}},
                "required": ["tool_calls"], "additionalProperties": False}
    else:
        call = {"type": "object", "properties": {"tool_call": one}, "required": ["tool_call"],
                "additionalProperties": False}
    if required:
        schema = call
    else:
        schema = {"anyOf": [call, {"type": "object", "properties": {"response": {"type": "string"}},
                                   "required": ["response"], "additionalProperties": False}]}
    return {**schema, "x-guidance": {"whitespace_pattern": _JSON_WHITESPACE, "lenient": True}}


def _generic_system(tools: list[dict], parallel: bool) -> str:
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    if parallel:
        example = '{"tool_calls": [{"name": "tool name", "arguments": {"argument name": "value"}}]}'
    else:
        example = '{"tool_call": {"name": "tool name", "arguments": {"argument name": "value"}}}'
    return GENERIC_SYSTEM.format(tools=listed, call_example=example)


def _generic_messages(messages: list[dict], system: str | None) -> list[dict]:
    """Messages for a template without tool support: calls as the assistant's JSON, results as user messages."""
    out = []
    for msg in messages:
        if not isinstance(msg, dict):
            out.append(msg)
            continue
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in msg["tool_calls"]]
            body = {"tool_calls": calls} if len(calls) > 1 else {"tool_call": calls[0]}
            out.append({"role": "assistant", "content": json.dumps(body, ensure_ascii=False)})
        elif role == "tool":
            content = msg.get("content")  # a string: validate_messages flattened text parts
            response = {"name": msg.get("name"), "content": content}
            out.append({"role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False)})
        else:
            out.append({k: v for k, v in msg.items() if k not in ("tool_calls", "tool_call_id", "tool_name")})
    if system is not None:
        if out and isinstance(out[0], dict) and out[0].get("role") == "system" and isinstance(
                out[0].get("content"), str):
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


# ---- reading the answer ---------------------------------------------------------------------------------


class _JsonValueScanner:
    """Finds where one JSON value ends in text fed piece by piece (strings and nesting tracked)."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False
        self.scalar = False

    def feed(self, ch: str) -> bool:
        """Take one character; True when it ended the value (a scalar ends at the character after it, which is
        then not part of it: see `scalar_end`)."""
        if not self.started:
            if ch.isspace():
                return False
            self.started = True
            if ch in "{[":
                self.depth = 1
                return False
            if ch == '"':
                self.in_string = True
                self.scalar = True
                return False
            self.scalar = True
            return False
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 0:
                    return True
            return False
        if self.depth == 0:  # a bare scalar (number, true, ...): it ends at a delimiter
            return ch in ",}] \t\r\n"
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


_HEAD = {
    "hermes": re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:'),
    "llama3": re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:'),
}
_OPEN = {"hermes": "<tool_call>", "llama3": "<|python_tag|>"}
_CLOSE = {"<tool_call>": "</tool_call>"}  # the markup that ends a call opened by a marker (else its last brace)


class ToolCallParser:
    """The answer's content and tool calls, read incrementally. `feed(text)` and `finish()` return deltas
    (`TextDelta`, `CallDelta`); after `finish()`, `content` and `calls` hold the whole result."""

    def __init__(self, fmt: str, names: list[str] | None = None):
        self.format = fmt
        self.names = list(names or [])
        self.content = ""
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet handed out
        self._state = "text"  # text | head | args | tail (hermes/llama3); generic has its own
        self._ws = ""  # trailing whitespace held back (dropped if the answer made calls)
        self._pending_open = ""  # the call marker just read (handed out as text if no call follows)
        self._call: dict | None = None
        self._scanner: _JsonValueScanner | None = None
        self._out: list = []
        # generic
        self._gmode: str | None = None  # None (undecided), "response", "call", "text"
        self._gpos = 0
        self._gstr = ""

    # -- output helpers

    def _text(self, s: str) -> None:
        """Content. Trailing whitespace is held until more text follows: at the end it is dropped if the answer
        made calls (the newlines around a call's markup are not content) and handed out otherwise."""
        held = self._ws + s
        body = held.rstrip()
        self._ws = held[len(body):]
        if not body:
            return
        self.content += body
        if self._out and isinstance(self._out[-1], TextDelta):
            self._out[-1].text += body
        else:
            self._out.append(TextDelta(body))

    def _start_call(self, name: str) -> None:
        index = len(self.calls)
        self._call = {"index": index, "id": new_call_id(), "name": name, "args": ""}
        self._out.append(CallDelta(index, id=self._call["id"], name=name))

    def _args(self, s: str) -> None:
        if not self._call["args"]:
            s = s.lstrip()  # the whitespace before the value is not part of it
        if not s:
            return
        self._call["args"] += s
        last = self._out[-1] if self._out else None
        if isinstance(last, CallDelta) and last.index == self._call["index"] and last.done is None:
            last.arguments += s
        else:
            self._out.append(CallDelta(self._call["index"], arguments=s))

    def _end_call(self, complete: bool = True) -> None:
        c = self._call
        raw = c["args"]
        try:
            args = json.loads(raw) if complete else None
        except ValueError:
            args = None
        if complete and args is not None and not isinstance(args, dict):
            args = None
        call = ToolCall(c["id"], c["name"], args, raw)
        self.calls.append(call)
        self._out.append(CallDelta(c["index"], done=call))
        self._call = None

    def _take(self) -> list:
        out, self._out = self._out, []
        return out

    # -- public

    def feed(self, text: str) -> list:
        if not text:
            return []
        if self.format == "none":
            self._text(text)
        elif self.format == "generic":
            self._buf += text
            self._generic()
        else:
            self._buf += text
            self._native()
        return self._take()

    def finish(self) -> list:
        """The end of the answer: what was held back comes out; a call cut short is handed out with the
        arguments written so far (`arguments` None), as OpenAI does at finish "length"."""
        if self.format == "generic":
            self._generic(final=True)
        elif self.format in ("hermes", "llama3"):
            if self._state == "text":
                self._text(self._buf)
            elif self._call is not None:
                if self._state == "args":
                    self._args(self._buf)
                self._end_call(complete=self._state == "tail")
            elif self._state == "head" and self._pending_open in ("", "```json"):
                self._text(self._pending_open + self._buf)  # a leading '{' that never became a call's head
            elif self._state == "sep" and self._buf.strip() not in ("", "`", "``", "```"):
                self._text(self._buf)
            # else: a call's marker cut short before its name: markup, not content
            self._buf = ""
        if not self.calls and self._ws:
            ws, self._ws = self._ws, ""
            self.content += ws
            self._out.append(TextDelta(ws))
        return self._take()

    # -- native forms

    def _native(self) -> None:
        fmt = self.format
        while self._buf:
            if self._state == "text":
                opens = [_OPEN[fmt]] if fmt in _OPEN else []
                if not self.calls and not self.content:
                    opens.append("{")  # a bare JSON call at the answer's start
                    if fmt == "hermes":
                        opens.append("```json")  # ... or in a fence (qwen2.5-coder)
                hit, at = None, len(self._buf)
                for mark in opens:
                    i = self._buf.find(mark)
                    if i >= 0 and i < at:
                        hit, at = mark, i
                if hit in ("{", "```json") and self._buf[:at].strip():
                    hit, at = None, len(self._buf)  # text came first: a brace in prose is prose
                if hit is None:
                    keep = max((_partial_suffix(self._buf, m) for m in opens if m != "{"), default=0)
                    self._text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._text(self._buf[:at])
                if hit == "{":
                    self._pending_open = ""
                    self._buf = self._buf[at:]
                else:
                    self._pending_open = hit
                    self._buf = self._buf[at + len(hit):]
                self._state = "head"
            elif self._state == "head":
                m = _HEAD[fmt].match(self._buf)
                if m is None:
                    if self._head_impossible():
                        # Not a call after all (an unconstrained model's prose): the text goes out as it was.
                        text, self._buf = self._pending_open + self._buf, ""
                        self._state, self._pending_open = "text", ""
                        self._text(text)
                    return
                try:
                    name = json.loads(m.group(1))
                except ValueError:
                    name = m.group(1)
                self._start_call(name)
                self._buf = self._buf[m.end():]
                self._scanner = _JsonValueScanner()
                self._state = "args"
            elif self._state == "args":
                sc, i, buf = self._scanner, 0, self._buf
                while i < len(buf):
                    if sc.feed(buf[i]):
                        if not (sc.scalar and not sc.in_string and buf[i] != '"'):
                            i += 1  # the closing character belongs to the value
                        self._args(buf[:i])
                        self._buf = buf[i:]
                        self._state = "tail"
                        break
                    i += 1
                else:
                    self._args(buf)
                    self._buf = ""
            elif self._state == "tail":
                close = _CLOSE.get(self._pending_open)
                if close is None:  # a bare call (llama3's, or hermes' untagged): its closing brace ends it
                    j = self._buf.find("}")
                    if j < 0:
                        return
                    self._buf = self._buf[j + 1:]
                    self._end_call()
                    self._state = "sep"
                    continue
                j = self._buf.find(close)
                if j < 0:
                    return
                self._buf = self._buf[j + len(close):]
                self._end_call()
                self._state = "text"
            elif self._state == "sep":  # after a bare call: another (after ';' for llama3), or the end
                stripped = self._buf.lstrip()
                if not stripped:
                    return
                if "```".startswith(stripped) and self._pending_open == "```json":
                    return  # the fence's end may be coming
                if stripped.startswith("```") and self._pending_open == "```json":
                    self._buf = stripped[3:]
                    self._pending_open = ""
                    continue
                if stripped[0] == ";" or (stripped[0] == "{" and fmt == "hermes"):
                    self._buf = stripped[1:] if stripped[0] == ";" else stripped
                    self._pending_open = ""
                    self._state = "head"
                    continue
                self._state = "text"

    def _head_impossible(self) -> bool:
        """The held text can no longer become a call's head `{"name": "...", "arguments":`."""
        b = self._buf
        if len(b) > 4096:
            return True
        skeleton = '{"name":'
        squeezed = re.sub(r"\s+", "", b)[: len(skeleton)]
        if not skeleton.startswith(squeezed):
            return True
        close = _CLOSE.get(self._pending_open)
        return close is not None and close in b

    # -- generic form

    _GENERIC_HEAD = re.compile(r'\s*\{\s*"(response|tool_calls?)"\s*:\s*')

    def _generic(self, final: bool = False) -> None:
        if self._gmode is None:
            m = self._GENERIC_HEAD.match(self._buf)
            if m is not None:
                self._gmode = "response" if m.group(1) == "response" else "call"
                self._gpos = m.end()
            elif final or not _maybe_prefix(self._buf, ('{"response":', '{"tool_call":', '{"tool_calls":')):
                self._gmode = "text"
            else:
                return
        if self._gmode == "text":
            self._text(self._buf[self._gpos:])
            self._gpos = len(self._buf)
        elif self._gmode == "response":
            self._response_string(final)
        if final and self._gmode == "call":
            self._generic_calls()

    def _response_string(self, final: bool) -> None:
        """Decode the "response" string as it arrives (an escape is held until complete)."""
        b, i = self._buf, self._gpos
        while self._gstr == "" and i < len(b) and b[i].isspace():
            i += 1
        self._gpos = i
        if i < len(b) and self._gstr == "" and b[i] != '"':
            # Not a string after all: keep the text whole and read it at the end.
            if final:
                self._generic_fallback()
            return
        if i < len(b) and self._gstr == "":
            self._gstr = "open"
            i += 1
        out = []
        while i < len(b) and self._gstr == "open":
            ch = b[i]
            if ch == '"':
                self._gstr = "closed"
                i += 1
                break
            if ch == "\\":
                m = _ESCAPE.match(b, i)
                waiting = (m is None or (m.group() == "\\u")
                           or (m.group(1) and not m.group(2) and 0xD800 <= int(m.group(1), 16) < 0xDC00
                               and len(b) < i + 12))
                if waiting and not final:
                    break  # an escape not complete yet: wait for the rest
                if m is None:
                    i = len(b)
                    break
                try:
                    out.append(json.loads('"' + m.group() + '"'))
                except ValueError:
                    out.append(m.group())
                i = m.end()
                continue
            out.append(ch)
            i += 1
        self._gpos = i
        self._text("".join(out))

    def _generic_calls(self) -> None:
        try:
            obj = json.loads(self._buf)
        except ValueError:
            obj = None
        calls = []
        if isinstance(obj, dict):
            if isinstance(obj.get("tool_call"), dict):
                calls = [obj["tool_call"]]
            elif isinstance(obj.get("tool_calls"), list):
                calls = obj["tool_calls"]
        good = [c for c in calls if isinstance(c, dict) and isinstance(c.get("name"), str)]
        if not good or len(good) != len(calls):
            self._generic_fallback()
            return
        for c in good:
            args = c.get("arguments", {})
            self._start_call(c["name"])
            self._args(json.dumps(args, ensure_ascii=False))
            self._end_call()

    def _generic_fallback(self) -> None:
        """An answer that is not the generic form's JSON (cut short, or unconstrained): its text is the content."""
        self._text(self._buf)
        self._gpos = len(self._buf)


_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})(?:\\u([0-9a-fA-F]{4}))?|.)", re.S)


def _partial_suffix(text: str, mark: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `mark`."""
    for n in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-n:]):
            return n
    return 0


def _maybe_prefix(text: str, skeletons) -> bool:
    squeezed = re.sub(r"\s+", "", text)
    return any(s.startswith(squeezed[: len(s)]) for s in skeletons)
