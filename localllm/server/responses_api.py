"""OpenAI's Responses API: POST /v1/responses (streamed or not), GET and DELETE /v1/responses/{id}.

What Codex CLI speaks (it has no other wire protocol), over the server's chat path:

  request --_conversation--> chat messages in OpenAI's shape: `instructions` as the system message, `input` as a
      string or items (messages of roles user, system, developer (a system message), assistant, with text,
      input_text and output_text parts; `function_call` items as an assistant's tool_calls,
      `function_call_output` items as tool messages), after the stored conversation of `previous_response_id`
  --the chat route's tool-call engine (tools, tool_choice, parallel_tool_calls), text.format as
      response_format--> text and tool calls
  --> a response object with `message` and `function_call` output items, or its event stream: response.created,
      response.in_progress, response.output_item.added, response.content_part.added,
      response.output_text.delta / response.function_call_arguments.delta, their .done events,
      response.output_item.done, then response.completed (response.incomplete when max_output_tokens cut it),
      each with its sequence_number.

`store` (the default, as OpenAI's) keeps the response and its conversation in memory (the latest 1,000), for
GET /v1/responses/{id} and for `previous_response_id`. What cannot be honoured is accepted and ignored, as
llama-server does: `reasoning`, `include`, `truncation`, `metadata` (echoed), `user`, `service_tier`,
`prompt_cache_key`, `background`, and tools of types other than `function` (web search, file search, computer
use, custom tools), which are left out of the prompt.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict

from starlette.requests import Request
from starlette.responses import StreamingResponse

from localllm.server import openai_api, tool_calls
from localllm.server.app import (ApiError, Fields, Final, ServerState, collect, dumps_compact, first_item,
                                 json_response, off_loop, prompt_tokens, read_json, render_system_anywhere,
                                 stream_events, submit)
from localllm.chat.tool_formats import CallDelta, TextDelta

STORE_SIZE = 1000
_STORE: OrderedDict[str, dict] = OrderedDict()  # id -> {"response": the object, "history": its conversation}


def _id(prefix: str) -> str:
    return prefix + secrets.token_hex(24)


# ---- request -> chat messages ------------------------------------------------------------------------------


def _text_of(content, where: str) -> str:
    """A message's text: a string, or parts of type input_text, output_text, text (and refusal)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}' must be a string or an array of content parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text"):
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"'{where}[{j}].text' must be a string", param="input")
            texts.append(part["text"])
        elif kind == "refusal":
            texts.append(str(part.get("refusal") or ""))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise ApiError(400, f"'{where}[{j}]': {kind} parts are not supported (the model reads text only)",
                           param="input")
        else:
            raise ApiError(400, f"'{where}[{j}]' must be a content part with a 'type' such as 'input_text'",
                           param="input")
    return "\n".join(texts)


def _input_messages(value) -> list[dict]:
    """`input` as chat messages."""
    if value is None:
        raise ApiError(400, "'input' is required", param="input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ApiError(400, "'input' must be a string or an array of input items", param="input")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"'{where}' must be an object", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"'{where}.role' must be 'user', 'system', 'developer' or 'assistant'",
                               param="input")
            text = _text_of(item.get("content", ""), f"{where}.content")
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
                raise ApiError(400, f"'{where}' needs string 'call_id', 'name' and 'arguments'", param="input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if out and out[-1]["role"] == "assistant":  # the calls of one turn belong to its assistant message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output", "")
            if not isinstance(call_id, str):
                raise ApiError(400, f"'{where}.call_id' must be a string", param="input")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif isinstance(kind, str):
            continue  # reasoning items, item references, other tools' calls: nothing this model reads
        else:
            raise ApiError(400, f"'{where}' must be an input item with a 'type' (or a message with a 'role')",
                           param="input")
    return out


def _tools(value) -> tuple[list[dict], list[dict]]:
    """(the chat route's function tools, the request's function tools as the response echoes them); tools of
    other types are left out."""
    if value is None:
        return [], []
    if not isinstance(value, list):
        raise ApiError(400, "'tools' must be an array of tools", param="tools")
    chat, echoed = [], []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise ApiError(400, f"'tools[{i}]' must be an object", param="tools")
        if tool.get("type") != "function":
            continue
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ApiError(400, f"'tools[{i}].name' must be a non-empty string", param="tools")
        fn = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        chat.append({"type": "function", "function": fn})
        echoed.append(tool)
    return chat, echoed


def _tool_choice(value, tools: list[dict]):
    """The chat route's tool_choice; None when no function tool is offered (other tool types are left out)."""
    if not tools:
        return None
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name") or (value.get("function") or {}).get("name")
        return {"type": "function", "function": {"name": name}}
    if isinstance(value, dict):
        return None  # a tool of another type (web_search...): not offered here
    raise ApiError(400, "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\"}",
                   param="tool_choice")


def _response_format(text) -> dict | None:
    """`text.format` as the chat route's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ApiError(400, "'text' must be an object such as {\"format\": {\"type\": \"text\"}}", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'text.format.type' must be 'text', 'json_object' or 'json_schema'", param="text")
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return {"type": fmt["type"]}


# ---- the answer -------------------------------------------------------------------------------------------


def _usage(final: Final) -> dict:
    return {"input_tokens": final.prompt_tokens, "input_tokens_details": {"cached_tokens": final.cached_tokens},
            "output_tokens": final.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": final.prompt_tokens + final.completion_tokens}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "arguments": arguments, "call_id": call_id,
            "name": name}


def _assistant_message(output: list[dict]) -> dict:
    """The output items as one chat message, for the stored conversation."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    message = {"role": "assistant", "content": text}
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    if calls:
        message["tool_calls"] = calls
    return message


class _Turn:
    """One request: its conversation, parameters and the response object it answers with."""

    def __init__(self, state: ServerState, f: Fields):
        data = f.data
        self.id, self.created = _id("resp_"), int(time.time())
        self.model = state.model_name
        previous = f.get("previous_response_id", str)
        history: list[dict] = []
        if previous:
            stored = _STORE.get(previous)
            if stored is None:
                raise ApiError(404, f"no stored response '{previous[:80]}' (responses are kept in memory, the latest "
                                    f"{STORE_SIZE}, when sent with 'store' true)", param="previous_response_id")
            history = list(stored["history"])
        self.instructions = f.get("instructions", str)
        self.history = history + _input_messages(data.get("input"))
        self.messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + \
            self.history
        if not any(m["role"] != "system" for m in self.messages):
            raise ApiError(400, "'input' needs a message", param="input")
        self.tools, self.echoed_tools = _tools(data.get("tools"))
        self.tool_choice = _tool_choice(data.get("tool_choice"), self.tools)
        self.parallel = f.get("parallel_tool_calls", bool, None)
        self.store = f.get("store", bool, True)
        self.stream = f.get("stream", bool, False)
        f.get("max_output_tokens", int, None, lo=1)
        self.echo = {"instructions": self.instructions, "max_output_tokens": data.get("max_output_tokens"),
                     "previous_response_id": previous, "metadata": data.get("metadata") or {},
                     "text": {"format": (data.get("text") or {}).get("format") or {"type": "text"}},
                     "tool_choice": data.get("tool_choice", "auto"), "parallel_tool_calls": self.parallel is not False,
                     "temperature": data.get("temperature", 1.0), "top_p": data.get("top_p", 1.0)}
        # the chat route's parameters for the same request
        self.chat = {k: data[k] for k in ("temperature", "top_p", "seed", "stop", "top_k", "min_p") if k in data}
        if data.get("max_output_tokens") is not None:
            self.chat["max_tokens"] = data["max_output_tokens"]
        fmt = _response_format(data.get("text"))
        if fmt is not None:
            self.chat["response_format"] = fmt

    def response(self, status: str, output: list[dict], usage: dict | None, error: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": self.echo["instructions"], "max_output_tokens": self.echo["max_output_tokens"],
                "model": self.model, "output": output, "parallel_tool_calls": self.echo["parallel_tool_calls"],
                "previous_response_id": self.echo["previous_response_id"],
                "reasoning": {"effort": None, "summary": None}, "store": self.store,
                "temperature": self.echo["temperature"], "text": self.echo["text"],
                "tool_choice": self.echo["tool_choice"], "tools": self.echoed_tools, "top_p": self.echo["top_p"],
                "truncation": "disabled", "usage": usage, "user": None, "metadata": self.echo["metadata"]}

    def keep(self, response: dict) -> None:
        if not self.store:
            return
        _STORE[self.id] = {"response": response, "history": self.history + [_assistant_message(response["output"])]}
        while len(_STORE) > STORE_SIZE:
            _STORE.popitem(last=False)


async def create(state: ServerState, request: Request):
    f = Fields(await read_json(request, state.max_body))
    turn = _Turn(state, f)
    cf = Fields(turn.chat)
    params, _ = openai_api._common(state, cf, None)
    await openai_api._response_format(state, cf, params)
    plan = None
    if tool_calls.uses_tools(turn.tools, turn.tool_choice, turn.messages):
        plan = await tool_calls.prepare(state, params, turn.tools, turn.tool_choice, turn.parallel)
        tokens = await off_loop(tool_calls.prompt, state, plan, turn.messages)
    else:
        tokens = await off_loop(lambda: prompt_tokens(
            state, render_system_anywhere(state.engine.render_chat, turn.messages), chat=True))
    calling = plan is not None and plan.choice != "none"
    handle = submit(state, tokens, params)

    if not turn.stream:
        events, final = await collect(request, handle)
        text = "".join(e.text for e in events)
        output = []
        calls = []
        if calling:
            parser = plan.parser()
            parser.feed(text)
            parser.finish()
            text, calls = parser.content, parser.calls
        if text or not calls:
            output.append(_message_item(_id("msg_"), text))
        output += [_call_item(_id("fc_"), c.id, c.name, c.arguments_json) for c in calls]
        status = "incomplete" if final.finish_reason == "length" else "completed"
        response = turn.response(status, output, _usage(final))
        turn.keep(response)
        return json_response(response)

    first = await first_item(request, handle)
    parser = plan.parser() if calling else None
    return StreamingResponse(_events(turn, handle, first, parser), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _events(turn: _Turn, handle, first, parser):
    seq = 0
    output: list[dict] = []
    text_item: dict | None = None  # the message item being written
    call_items: dict[int, dict] = {}  # a call's index -> its item

    def event(kind: str, **data) -> str:
        nonlocal seq
        body = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        return f"event: {kind}\ndata: {dumps_compact(body)}\n\n"

    def open_text() -> list[str]:
        nonlocal text_item
        text_item = _message_item(_id("msg_"), "", status="in_progress")
        text_item["text"] = ""
        output.append(text_item)
        at = len(output) - 1
        return [event("response.output_item.added", output_index=at, item=_message_item(text_item["id"], "",
                                                                                         "in_progress")),
                event("response.content_part.added", item_id=text_item["id"], output_index=at, content_index=0,
                      part={"type": "output_text", "text": "", "annotations": []})]

    def close_text() -> list[str]:
        nonlocal text_item
        if text_item is None:
            return []
        item, at = text_item, output.index(text_item)
        text_item = None
        done = _message_item(item["id"], item["text"])
        output[at] = done
        return [event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                      text=item["text"]),
                event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                      part=done["content"][0]),
                event("response.output_item.done", output_index=at, item=done)]

    def text(piece: str) -> list[str]:
        out = open_text() if text_item is None else []
        text_item["text"] += piece
        return out + [event("response.output_text.delta", item_id=text_item["id"], output_index=output.index(text_item),
                            content_index=0, delta=piece)]

    def call(d: CallDelta) -> list[str]:
        out = []
        if d.id is not None:
            out += close_text()
            item = _call_item(_id("fc_"), d.id, d.name, "", status="in_progress")
            output.append(item)
            call_items[d.index] = item
            out.append(event("response.output_item.added", output_index=len(output) - 1, item=dict(item)))
        item = call_items.get(d.index)
        if item is None:
            return out
        at = output.index(item)
        if d.arguments:
            item["arguments"] += d.arguments
            out.append(event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                             delta=d.arguments))
        if d.done is not None:
            item.update(status="completed", arguments=d.done.arguments_json)
            out += [event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                          arguments=item["arguments"]),
                    event("response.output_item.done", output_index=at, item=dict(item))]
        return out

    yield event("response.created", response=turn.response("in_progress", [], None))
    yield event("response.in_progress", response=turn.response("in_progress", [], None))
    try:
        async for item in stream_events(handle, first):
            if isinstance(item, Final):
                for chunk in close_text():
                    yield chunk
                # a call the token limit cut off: left out, as the chat route leaves it out
                output[:] = [it for it in output if it["type"] != "function_call" or it["status"] == "completed"]
                if not output:
                    for chunk in open_text() + close_text():
                        yield chunk
                status = "incomplete" if item.finish_reason == "length" else "completed"
                response = turn.response(status, output, _usage(item))
                turn.keep(response)
                yield event(f"response.{status}", response=response)
                return
            if parser is None:
                if item.text:
                    for chunk in text(item.text):
                        yield chunk
                continue
            deltas = parser.feed(item.text) + (parser.finish() if item.finish_reason is not None else [])
            for d in deltas:
                chunks = text(d.text) if isinstance(d, TextDelta) and d.text else (
                    call(d) if isinstance(d, CallDelta) else [])
                for chunk in chunks:
                    yield chunk
    except ApiError as e:
        error = {"code": "server_error" if e.status >= 500 else "invalid_request", "message": e.message}
        yield event("response.failed", response=turn.response("failed", output, None, error))


async def retrieve(state: ServerState, request: Request):
    rid = request.path_params["response_id"]
    stored = _STORE.get(rid)
    if stored is None:
        raise ApiError(404, f"no stored response '{rid[:80]}'", param="response_id")
    return json_response(stored["response"])


async def delete(state: ServerState, request: Request):
    rid = request.path_params["response_id"]
    if _STORE.pop(rid, None) is None:
        raise ApiError(404, f"no stored response '{rid[:80]}'", param="response_id")
    return json_response({"id": rid, "object": "response.deleted", "deleted": True})


ROUTES = [
    ("/v1/responses", ["POST"], create),
    ("/v1/responses/{response_id}", ["GET"], retrieve),
    ("/v1/responses/{response_id}", ["DELETE"], delete),
]
