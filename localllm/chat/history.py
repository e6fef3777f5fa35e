"""Keeping a conversation inside the context: drop the oldest turns, as Ollama does, instead of refusing.

A chat's rendered prompt grows every turn. When it no longer leaves room to answer, the oldest user/assistant
messages go (system messages always stay, and so does the newest user message). Dropping changes the prompt's
start, so the cached KV of the conversation cannot be reused for that turn; to pay that cost seldom, turns are
dropped until a quarter of the context is free, not just enough for one answer.
"""

from __future__ import annotations

from localllm.errors import ContextOverflowError


def fit_messages(engine, messages: list[dict], room: int, render=None) -> tuple[list[dict], int]:
    """(the messages to render, how many were dropped) so that the prompt plus `room` tokens fit the context.
    `render(messages)` makes the prompt text (by default the engine's chat template; a request with tools
    renders them too)."""
    if fits(engine, messages, room, render):
        return messages, 0
    system = [m for m in messages if m.get("role") == "system"]
    turns = [m for m in messages if m.get("role") != "system"]
    headroom = max(room, engine.ctx // 4)
    for dropped in range(1, len(turns)):
        kept = turns[dropped:]
        if kept[0].get("role") in ("assistant", "tool"):
            continue  # a conversation restarts at a user message
        if (fits(engine, system + kept, headroom, render)
                or (len(kept) == 1 and fits(engine, system + kept, room, render))):
            return system + kept, dropped
    raise ContextOverflowError(
        f"the last message alone does not leave {room} tokens to answer in a {engine.ctx}-token context "
        "(shorten it, or raise the context size)")


def fits(engine, messages: list[dict], room: int, render=None) -> bool:
    prompt = render(messages) if render is not None else engine.render_chat(messages)
    if engine.tokenizer.min_tokens(prompt) + room > engine.ctx:
        return False  # surely too long, known in milliseconds: tokenizing 4 MB takes 4-26 s
    n = len(engine.tokenize_prompt(prompt, chat=True))
    return n + room <= engine.ctx
