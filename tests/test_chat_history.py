"""Dropping the oldest turns of a conversation that outgrew the context (localllm/chat/history.py)."""

from __future__ import annotations

from functools import cache

import pytest
from conftest import model_file

from localllm.chat.history import fit_messages, fits
from localllm.runtime.engine import Engine
from localllm.errors import ContextOverflowError


@cache
def engine() -> Engine:
    return Engine(model_file("smollm2-135m-instruct"), ctx=256, quiet=True)


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"},
                     {"role": "assistant", "content": f"The answer to question {i} is {2 * i}, as you know."}]
    return messages + [{"role": "user", "content": "And the last question?"}]


def test_a_conversation_that_fits_is_unchanged():
    messages = conversation(2)
    assert fit_messages(engine(), messages, room=32) == (messages, 0)


def test_oldest_turns_go_first_keeping_the_system_prompt_and_the_last_message():
    e = engine()
    messages = conversation(12)
    assert not fits(e, messages, 32)
    kept, dropped = fit_messages(e, messages, room=32)
    assert dropped > 0 and kept[0] == messages[0] and kept[1:] == messages[1 + dropped :]
    assert kept[1]["role"] == "user" and kept[-1] == messages[-1]
    assert fits(e, kept, e.ctx // 4)  # headroom: the next turns can reuse the cache before dropping again


def test_a_last_message_that_cannot_fit_is_a_clear_error():
    with pytest.raises(ContextOverflowError, match="last message"):
        fit_messages(engine(), [{"role": "user", "content": "word " * 400}], room=32)
