"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens (what Claude Code speaks).

A translation layer over the server's chat path:

  Anthropic request --to_chat_request--> the internal chat request, in OpenAI's shape (`messages` with
      `tool_calls` on assistant turns and `role: "tool"` messages with `tool_call_id`; `tools` as OpenAI
      functions; `tool_choice` auto/required/none/a named function; `parallel_tool_calls`)
  --prompt_text / generated_pieces (the tool-call seam below)--> text pieces and tool calls, then a Final
  --message_body / EventWriter--> Anthropic content blocks, or its SSE events.

Anthropic's rules kept: `max_tokens` is required; `system` is a string or text blocks; consecutive turns of one
role are combined into one turn; a final assistant message is a prefill that the answer continues (and the
response holds only the continuation); temperature is in [0, 1]. What Claude Code sends besides: `system`
messages inside `messages` (rendered where they stand, or folded into the system prompt where the template
takes only one: render_system_anywhere); `output_config.format` (or the beta's `output_format`) JSON schema,
enforced; `metadata`, `cache_control`, `thinking` (these models do not think on request),
`context_management`, `output_config.effort` and the `anthropic-version` / `anthropic-beta` headers are
accepted and ignored. Errors are
`{"type": "error", "error": {"type", "message"}}` with Anthropic's types; in a stream, an `event: error`.

Two departures, both for clients that cannot be told otherwise: a `max_tokens` above the server's
--max-tokens is capped to it (Claude Code asks for 32000 on every request; the other APIs refuse such a
request, but there the field is optional), and a system block that is Claude Code's
`x-anthropic-billing-header: ...; cch=<hash>;` line is dropped: its hash changes on every request, so kept
first in the prompt it would defeat the reuse of the cached prefix (the system prompt and the tool list,
thousands of tokens) on every turn.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import StreamingResponse

from localllm.runtime.engine import GenerationParams
from localllm.errors import LocalLLMError
from localllm.server import tool_calls
from localllm.chat.tool_formats import CallDelta, TextDelta, ToolError, ToolPlan, plan_tools
from localllm.server.app import (ApiError, Fields, Final, ServerState, constrain, dumps_compact, first_item,
                                 fix_seed, json_response, off_loop, prompt_tokens, read_json,
                                 render_system_anywhere, sampling_from, stream_events, submit, watching_disconnect)
from localllm.server.app import anthropic_error_body as error_body

BILLING_HEADER = "x-anthropic-billing-header:"

# Anthropic's error types by HTTP status (docs: "errors"); anything else is an api_error.
def _new_id(prefix: str) -> str:
    """An id shaped like Anthropic's: a prefix and 24 base-62 characters."""
    alphabet = string.ascii_letters + string.digits
    return prefix + "".join(secrets.choice(alphabet) for _ in range(24))


# ---- the internal request and result ----------------------------------------------------------------------


@dataclass
class ChatRequest:
    """The internal chat request, in OpenAI's shape, plus Anthropic's prefill (the text of a final assistant
    message, which the answer continues)."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    tool_choice: str | dict | None = None  # "auto" | "required" | "none" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # None: the default (allowed)
    prefill: str = ""
    plan: ToolPlan | None = None  # set by prompt_text when the request uses tools


@dataclass
class ToolCall:
    """A tool call the model made: `arguments` is the JSON text of an object (OpenAI's shape)."""

    id: str
    name: str
    arguments: str


# ---- Anthropic request -> internal request -----------------------------------------------------------------


def _text_of_blocks(blocks, where: str, param: str) -> str:
    """The text of a string or of a list of text blocks (joined with newlines, as chat content parts are)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise ApiError(400, f"'{where}' must be a string or an array of text blocks", param=param)
    texts = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            shown = json.dumps(kind)[:60] if isinstance(block, dict) else type(block).__name__
            raise ApiError(400, f"'{where}[{j}]' must be a text block ({{\"type\": \"text\", \"text\": ...}}), "
                                f"got {shown}", param=param)
        if not isinstance(block.get("text"), str):
            raise ApiError(400, f"'{where}[{j}].text' must be a string", param=param)
        texts.append(block["text"])
    return "\n".join(texts)


def _system(value) -> str | None:
    if value is None:
        return None
    text = _text_of_blocks(value, "system", "system")  # validated as sent, so errors name the block sent
    if isinstance(value, list):
        text = "\n".join(b["text"] for b in value if not b["text"].startswith(BILLING_HEADER))
    return text or None


_UNSUPPORTED_BLOCKS = {
    "image": "images are not supported (the model reads text only)",
    "document": "documents are not supported (send the text as a text block)",
    "search_result": "search_result blocks are not supported",
    "server_tool_use": "server tools are not supported",
    "web_search_tool_result": "server tools are not supported",
}


def _blocks(content, where: str) -> list[dict]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}.content' must be a string or an array of content blocks",
                       param="messages")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ApiError(400, f"'{where}.content[{j}]' must be a content block (an object with a 'type')",
                           param="messages")
    return content


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content")
    if content is None:
        text = ""
    else:
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _UNSUPPORTED_BLOCKS:
                raise ApiError(400, f"'{where}.content[{j}]': {_UNSUPPORTED_BLOCKS[kind]}", param="messages")
        text = _text_of_blocks(content, f"{where}.content", "messages")
    if block.get("is_error") is True:
        # OpenAI's tool message has no error flag: the model learns of the failure from the text.
        text = f"Error: {text}" if text else "Error"
    return text


def _translate_message(role: str, blocks: list[tuple[dict, str]]) -> list[dict]:
    """One Anthropic turn, as (block, where it was sent) pairs, as internal messages: a user turn's tool
    results become `tool` messages, placed before its text (they answer the assistant's calls just before);
    an assistant turn's tool_use blocks become its `tool_calls`. Thinking blocks (of models that think) are
    dropped, as Anthropic drops them from earlier turns."""
    texts, calls, results = [], [], []
    for block, at in blocks:
        kind = block["type"]
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise ApiError(400, f"'{at}.text' must be a string", param="messages")
            texts.append(block["text"])
        elif kind == "tool_use":
            if role != "assistant":
                raise ApiError(400, f"'{at}': tool_use blocks belong in assistant messages", param="messages")
            ident, name, given = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(ident, str) or not ident or not isinstance(name, str) or not name:
                raise ApiError(400, f"'{at}' needs a string 'id' and 'name'", param="messages")
            if not isinstance(given, dict):
                raise ApiError(400, f"'{at}.input' must be an object", param="messages")
            calls.append({"id": ident, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(given, ensure_ascii=False)}})
        elif kind == "tool_result":
            if role != "user":
                raise ApiError(400, f"'{at}': tool_result blocks belong in user messages", param="messages")
            ident = block.get("tool_use_id")
            if not isinstance(ident, str) or not ident:
                raise ApiError(400, f"'{at}' needs a string 'tool_use_id'", param="messages")
            results.append({"role": "tool", "tool_call_id": ident, "content": _tool_result_text(block, at)})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind in _UNSUPPORTED_BLOCKS:
            raise ApiError(400, f"'{at}': {_UNSUPPORTED_BLOCKS[kind]}", param="messages")
        else:
            raise ApiError(400, f"'{at}': unknown content block type {json.dumps(kind)[:60]}", param="messages")
    out = results
    text = "\n".join(texts)
    if role == "assistant":
        # "" rather than OpenAI's null beside tool_calls: templates that know nothing of tools concatenate it.
        message = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    elif texts or not results:
        out.append({"role": "user", "content": text})
    return out


def _tools(value) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError(400, "'tools' must be an array of tools", param="tools")
    out, names = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ApiError(400, f"'{where}' must be an object", param="tools")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise ApiError(400, f"'{where}': the server tool {json.dumps(kind)[:60]} is not supported (only "
                                "client tools: a name, a description and an input_schema)", param="tools")
        name, schema, description = tool.get("name"), tool.get("input_schema"), tool.get("description")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"'{where}.name' must be a non-empty string", param="tools")
        if name in names:
            raise ApiError(400, f"'{where}': the tool name {name!r} is used twice", param="tools")
        names.add(name)
        if not isinstance(schema, dict):
            raise ApiError(400, f"'{where}.input_schema' must be a JSON schema (an object)", param="tools")
        if description is not None and not isinstance(description, str):
            raise ApiError(400, f"'{where}.description' must be a string", param="tools")
        function = {"name": name, "parameters": schema}
        if description is not None:
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value, tools: list[dict]) -> tuple[str | dict | None, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise ApiError(400, "'tool_choice' must be an object such as {\"type\": \"auto\"}", param="tool_choice")
    tc = Fields(value, "tool_choice.")
    kind = tc.get("type", str)
    disable_parallel = tc.get("disable_parallel_tool_use", bool, None)
    if kind == "auto":
        choice = "auto"
    elif kind == "any":
        choice = "required"
    elif kind == "none":
        choice = "none"
    elif kind == "tool":
        name = tc.get("name", str)
        if not name:
            raise ApiError(400, "'tool_choice.name' is required with 'type': 'tool'", param="tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise ApiError(400, f"'tool_choice.name' {name!r} is not one of the request's tools",
                           param="tool_choice")
        choice = {"type": "function", "function": {"name": name}}
    else:
        raise ApiError(400, f"'tool_choice.type' must be 'auto', 'any', 'tool' or 'none', got {json.dumps(kind)}",
                       param="tool_choice")
    if (choice == "required" or isinstance(choice, dict)) and not tools:
        raise ApiError(400, f"'tool_choice' {kind!r} needs 'tools'", param="tool_choice")
    parallel = False if disable_parallel else None
    return choice, parallel


def to_chat_request(data: dict) -> ChatRequest:
    """The internal chat request for an Anthropic Messages body (validated: a 400 names the field)."""
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array of messages", param="messages")
    turns: list[tuple[str, list[tuple[dict, str]]]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ApiError(400, f"'{where}' must be an object with 'role' and 'content'", param="messages")
        role = msg.get("role")
        if role not in ("user", "assistant", "system"):
            raise ApiError(400, f"'{where}.role' must be 'user', 'assistant' or 'system', got "
                                f"{json.dumps(role)[:40]}", param="messages")
        if "content" not in msg:
            raise ApiError(400, f"'{where}.content' is required", param="messages")
        if role == "system":
            # Claude Code's mid-conversation system messages: kept where they stand (prompt_text folds them
            # into the system prompt for a template that renders only one)
            text = _text_of_blocks(msg["content"], f"{where}.content", "messages")
            if isinstance(msg["content"], list):
                text = "\n".join(b["text"] for b in msg["content"] if not b["text"].startswith(BILLING_HEADER))
            turns.append(("system", [({"type": "text", "text": text}, where)]))
            continue
        blocks = [(b, f"{where}.content[{j}]") for j, b in enumerate(_blocks(msg["content"], where))]
        if turns and turns[-1][0] == role:  # Anthropic combines consecutive turns of one role
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks))

    prefill = ""
    if turns[-1][0] == "assistant":
        _, blocks = turns.pop()
        for block, at in blocks:
            if block["type"] in ("thinking", "redacted_thinking"):
                continue
            if block["type"] != "text":
                raise ApiError(400, f"'{at}': a final assistant message is a prefill that the answer continues: "
                                    "it may hold text only", param="messages")
            if not isinstance(block.get("text"), str):
                raise ApiError(400, f"'{at}.text' must be a string", param="messages")
            prefill += block["text"]
        if prefill != prefill.rstrip():
            raise ApiError(400, "final assistant content cannot end with trailing whitespace", param="messages")
        if not turns:
            raise ApiError(400, "'messages' needs a user message before the final assistant message",
                           param="messages")

    out = []
    system = _system(data.get("system"))
    if system is not None:
        out.append({"role": "system", "content": system})
    for role, blocks in turns:
        if role == "system":
            out.append({"role": "system", "content": blocks[0][0]["text"]})
        else:
            out.extend(_translate_message(role, blocks))
    if not any(m["role"] != "system" for m in out):
        raise ApiError(400, "'messages' needs a user message", param="messages")
    tools = _tools(data.get("tools"))
    choice, parallel = _tool_choice(data.get("tool_choice"), tools)
    return ChatRequest(messages=out, tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
                       prefill=prefill)


# ==== tools =================================================================================================
# Anthropic's tools arrive here in OpenAI's shape (to_chat_request) and go through the same engine as the OpenAI
# and Ollama routes (localllm/chat/tool_formats.py, server/tool_calls.py): the plan renders them into the prompt through
# the model's template and constrains the call; its parser finds the calls in the answer, which leave as
# tool_use blocks and input_json_delta events (message_body, EventWriter) with stop_reason "tool_use".


async def prompt_text(state: ServerState, chat: ChatRequest, params: GenerationParams | None) -> str:
    """The prompt text for the internal chat request; `params` (None when only counting tokens) takes the
    constraint the tools and tool_choice ask for."""
    if not tool_calls.uses_tools(chat.tools, chat.tool_choice, chat.messages):
        # Off the event loop: a model's template may take its whole render budget (2 s).
        return await off_loop(render_system_anywhere, state.engine.render_chat, chat.messages) + chat.prefill
    if params is None:  # count_tokens: the prompt the tools make, nothing to constrain
        try:
            chat.plan = plan_tools(state.engine.template, chat.tools, chat.tool_choice, chat.parallel_tool_calls)
        except ToolError as e:
            raise ApiError(400, str(e), param=e.param) from None
    else:
        chat.plan = await tool_calls.prepare(state, params, chat.tools, chat.tool_choice, chat.parallel_tool_calls)
    try:
        return await off_loop(render_system_anywhere, lambda msgs: chat.plan.render(state.engine.template, msgs),
                              chat.messages) + chat.prefill
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None


async def generated_pieces(state: ServerState, chat: ChatRequest, handle, first=None):
    """The answer as text pieces (str) and tool calls (ToolCall), then the request's Final."""
    parser = chat.plan.parser() if chat.plan is not None and chat.plan.choice != "none" else None

    def pieces(deltas):
        for d in deltas:
            if isinstance(d, TextDelta):
                if d.text:
                    yield d.text
            elif isinstance(d, CallDelta) and d.done is not None:
                yield ToolCall(d.done.id, d.done.name, d.done.arguments_json)

    async for item in stream_events(handle, first):
        if isinstance(item, Final):
            if parser is not None:
                for piece in pieces(parser.finish()):
                    yield piece
            yield item
            return
        if not item.text:
            continue
        if parser is None:
            yield item.text
        else:
            for piece in pieces(parser.feed(item.text)):
                yield piece


# ---- internal result -> Anthropic -------------------------------------------------------------------------


def stop_reason(final: Final, called_tools: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): the length limit (first: a call cut short is no call to run), a tool
    call, a stop sequence, or the model's end."""
    if final.finish_reason == "length":
        return "max_tokens", None
    if called_tools:
        return "tool_use", None
    if final.stop_word:
        return "stop_sequence", final.stop_word
    return "end_turn", None


def _tool_input(call: ToolCall) -> dict | None:
    """A call's arguments as an object; None when they are not one: a call cut off by max_tokens (the call
    grammar allows nothing else), which is then given with no input and stop_reason max_tokens."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def content_blocks(pieces) -> list[dict]:
    """Anthropic content blocks for text pieces and ToolCalls: consecutive text is one text block."""
    blocks: list[dict] = []
    for piece in pieces:
        if isinstance(piece, ToolCall):
            blocks.append({"type": "tool_use", "id": piece.id or _new_id("toolu_"), "name": piece.name,
                           "input": _tool_input(piece) or {}})
        elif piece:
            if blocks and blocks[-1]["type"] == "text":
                blocks[-1]["text"] += piece
            else:
                blocks.append({"type": "text", "text": piece})
    return blocks


def message_body(mid: str, model: str, pieces, final: Final) -> dict:
    blocks = content_blocks(pieces)
    reason, sequence = stop_reason(final, any(b["type"] == "tool_use" for b in blocks))
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": final.prompt_tokens, "output_tokens": final.completion_tokens}}


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {dumps_compact(data)}\n\n"


class EventWriter:
    """Anthropic's SSE events for a stream of pieces: message_start, ping, then per content block
    content_block_start / content_block_delta... / content_block_stop, then message_delta (stop_reason,
    output_tokens) and message_stop."""

    def __init__(self, mid: str, model: str, input_tokens: int):
        self.mid, self.model, self.input_tokens = mid, model, input_tokens
        self.index = -1
        self.open: str | None = None  # the type of the block being written
        self.called_tools = False

    def start(self) -> list[str]:
        message = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return [event("message_start", {"type": "message_start", "message": message}),
                event("ping", {"type": "ping"})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _begin(self, block: dict) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": block})]

    def piece(self, piece) -> list[str]:
        if isinstance(piece, ToolCall):
            self.called_tools = True
            out = self._begin({"type": "tool_use", "id": piece.id or _new_id("toolu_"), "name": piece.name,
                               "input": {}})
            if _tool_input(piece) is not None:  # else no input, as in message_body (the SDK parses the deltas)
                out.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                         "delta": {"type": "input_json_delta",
                                                                   "partial_json": piece.arguments}}))
            return out + self._close()
        if not piece:
            return []
        out = [] if self.open == "text" else self._begin({"type": "text", "text": ""})
        out.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                 "delta": {"type": "text_delta", "text": piece}}))
        return out

    def finish(self, final: Final) -> list[str]:
        reason, sequence = stop_reason(final, self.called_tools)
        return self._close() + [
            event("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": {"output_tokens": final.completion_tokens}}),
            event("message_stop", {"type": "message_stop"})]

    def error(self, e: ApiError) -> list[str]:
        return [event("error", error_body(e.status, e.message))]


# ---- the routes -------------------------------------------------------------------------------------------


def _params(state: ServerState, f: Fields) -> tuple[GenerationParams, bool]:
    """Generation parameters of a Messages request, and whether to stream."""
    f.get("model", str)
    asked = f.get("max_tokens", int, None, lo=1)
    if asked is None:
        raise ApiError(400, "'max_tokens' is required", param="max_tokens")
    # Capped, not refused: see the module's docstring.
    max_tokens = min(asked, state.max_tokens)
    sampling = sampling_from(f, "anthropic", state.engine.config.vocab_size)
    fix_seed(sampling)
    params = GenerationParams(max_tokens=max_tokens, stop=f.stop("stop_sequences"), sampling=sampling)
    return params, f.get("stream", bool, False)


def _output_schema(data: dict) -> dict | None:
    """The JSON schema of Anthropic's structured outputs (`output_config.format`, or the beta's `output_format`:
    {"type": "json_schema", "schema": {...}}); None when the request asks for none. `output_config`'s other
    settings (`effort`) have no meaning here and are ignored."""
    config = data.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise ApiError(400, "'output_config' must be an object", param="output_config")
    fmt, key = (config or {}).get("format"), "output_config.format"
    if fmt is None:
        fmt, key = data.get("output_format"), "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, f"'{key}' must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}", param=key)
    return fmt["schema"]


async def messages(state: ServerState, request: Request):
    f = Fields(await read_json(request, state.max_body))
    params, stream = _params(state, f)
    chat = to_chat_request(f.data)
    schema = _output_schema(f.data)
    if schema is not None:  # the answer is JSON of that schema (one constraint: not with tools)
        await constrain(state, params, "output_config.format", json_schema=schema)
    text = await prompt_text(state, chat, params)
    tokens = await off_loop(prompt_tokens, state, text, True)
    handle = submit(state, tokens, params)
    mid, model = _new_id("msg_"), state.model_name

    if not stream:
        async def run():
            pieces = []
            async for piece in generated_pieces(state, chat, handle):
                if isinstance(piece, Final):
                    return pieces, piece
                pieces.append(piece)
            raise ApiError(500, "the generation ended without a result")

        pieces, final = await watching_disconnect(request, handle, run())
        return json_response(message_body(mid, model, pieces, final))

    # The first event before the response starts: an error up to the first token is a proper HTTP error.
    first = await first_item(request, handle)
    writer = EventWriter(mid, model, len(tokens))

    async def body():
        for chunk in writer.start():
            yield chunk
        try:
            async for piece in generated_pieces(state, chat, handle, first):
                if isinstance(piece, Final):
                    for chunk in writer.finish(piece):
                        yield chunk
                    return
                for chunk in writer.piece(piece):
                    yield chunk
        except ApiError as e:
            for chunk in writer.error(e):
                yield chunk

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def count_tokens(state: ServerState, request: Request):
    """The prompt's token count for a Messages body (max_tokens not needed), as /v1/messages would read it."""
    f = Fields(await read_json(request, state.max_body))
    f.get("model", str)
    chat = to_chat_request(f.data)
    text = await prompt_text(state, chat, None)
    tokens = await off_loop(state.engine.tokenize_prompt, text, True)
    return json_response({"input_tokens": len(tokens)})


ROUTES = [
    ("/v1/messages", ["POST"], messages),
    ("/v1/messages/count_tokens", ["POST"], count_tokens),
]
