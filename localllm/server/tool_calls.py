"""Tool calls on the server: a request's tools planned against the model's template (chat/tool_formats.py), the call's
grammar compiled into its GenerationParams, its prompt rendered. Shared by the chat endpoints of each API."""

from __future__ import annotations

import json
import logging
import re

from localllm.server.app import ApiError, ServerState, constrain, prompt_tokens, render_system_anywhere
from localllm.chat.tool_formats import ToolError, ToolPlan, plan_tools

log = logging.getLogger("localllm.server")
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")


def lenient(schema: dict) -> dict:
    """The schema with llguidance's lenient mode on: keywords it cannot enforce are left unenforced."""
    return {**schema, "x-guidance": {**(schema.get("x-guidance") or {}), "lenient": True}}


def relaxed_keywords(schema) -> list[str]:
    """The keywords of a JSON schema that the grammar engine cannot enforce, and so leaves unenforced in
    lenient mode (llguidance's warnings); [] for a schema it enforces whole or cannot read at all."""
    if not isinstance(schema, dict):
        return []
    try:
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_json_schema(lenient(schema))
        _, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    except Exception:  # noqa: BLE001 - not a schema it reads: the compile reports it
        return []
    found: set[str] = set()
    for warning in warnings:
        for listed in _UNIMPLEMENTED.findall(warning):
            try:
                found.update(k for k in json.loads(listed) if isinstance(k, str))
            except ValueError:
                pass
    return sorted(found)


_warned: set[tuple[str, tuple[str, ...]]] = set()


def log_relaxed(where: str, schema) -> list[str]:
    """The keywords relaxed in `schema` (relaxed_keywords), logged as a warning once per place and keywords
    (an agent sends the same tools on every turn)."""
    keys = relaxed_keywords(schema)
    if keys and (where, tuple(keys)) not in _warned:
        if len(_warned) < 4096:
            _warned.add((where, tuple(keys)))
        log.warning("%s: the grammar engine cannot enforce %s; left unenforced (the schema is relaxed, as "
                    "llama.cpp's converter ignores what it does not know)", where, ", ".join(keys))
    return keys


def uses_tools(tools, tool_choice, messages) -> bool:
    """Whether a chat request involves tools at all: tools or a tool_choice given, or a conversation holding
    calls or tool results (whose arguments the template wants as objects). Other requests keep the plain path."""
    if tools or tool_choice is not None:
        return True
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages)


async def prepare(state: ServerState, params, tools, tool_choice=None, parallel_tool_calls=None) -> ToolPlan:
    """The request's ToolPlan; its constraint (a lazy grammar for tool_choice "auto", a call from the start for
    "required" or a named function) goes into `params.grammar`. Bad tools are a 400 naming the field; tools
    with a response format as well are refused (one constraint per answer)."""
    try:
        plan = plan_tools(state.engine.template, tools, tool_choice, parallel_tool_calls)
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None
    if plan.choice == "none":
        return plan
    if params.grammar is not None:
        raise ApiError(400, "'tools' cannot be combined with a response format or grammar in one request",
                       param="tools")
    # Tool schemas compile leniently (toolcalls._schema): what cannot be enforced is relaxed, and logged here.
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict):
            log_relaxed(f"tools[{i}] ({str(fn.get('name'))[:60]})", fn.get("parameters"))
    await constrain(state, params, "tools", lark=plan.grammar, json_schema=plan.json_schema)
    return plan


def prompt(state: ServerState, plan: ToolPlan, messages) -> list[int]:
    """The prompt's tokens (call off the event loop: templates take up to their render budget)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array of messages", param="messages")
    try:
        text = render_system_anywhere(lambda msgs: plan.render(state.engine.template, msgs), messages)
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None
    return prompt_tokens(state, text, chat=True)
