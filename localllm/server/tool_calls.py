"""Tool calls on the server: a request's tools planned against the model's template (toolcalls.py), the call's
grammar compiled into its GenerationParams, its prompt rendered. Shared by the chat endpoints of each API."""

from __future__ import annotations

from localllm.server.app import ApiError, ServerState, constrain, prompt_tokens
from localllm.toolcalls import ToolError, ToolPlan, plan_tools


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
    await constrain(state, params, "tools", lark=plan.grammar, json_schema=plan.json_schema)
    return plan


def prompt(state: ServerState, plan: ToolPlan, messages) -> list[int]:
    """The prompt's tokens (call off the event loop: templates take up to their render budget)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array of messages", param="messages")
    try:
        text = plan.render(state.engine.template, messages)
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None
    return prompt_tokens(state, text, chat=True)
