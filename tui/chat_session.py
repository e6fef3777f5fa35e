"""The engine side of the TUI, free of any UI: a loaded model, the conversation's Sequence (kept across turns so
each turn only evaluates its new tokens), one turn's stream of text, and its statistics.

Everything here runs on a worker thread; the app only reads the results it is sent.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from localllm import parameters
from localllm.runtime import session_file
from localllm.runtime import warmup
from localllm.runtime.cache_reuse import DEFAULT_CACHE_REUSE
from localllm.chat.history import fit_messages
from localllm.runtime.engine import Engine, GenerationParams, TokenEvent
from localllm.errors import LocalLLMError
from localllm.chat.loop_guard import DRY_SEQUENCE_BREAKERS, NOTICE, RepeatGuard
from localllm.chat.sampling import dry_breakers


def load_engine(name: str, ctx: int | None, on_compile: Callable[[int, int], None] | None = None,
                kv_type: str = parameters.KV_TYPE, device: str = parameters.DEVICE) -> Engine:
    """Load a model quietly (the console progress bars would corrupt the screen), reporting kernel compilation,
    which only happens on a first start, to `on_compile(done, total)`."""
    with warmup.reporting(on_compile):
        engine = Engine.load(name, ctx=ctx or None, quiet=True, kv_type=kv_type, device=device, warm="first-token")
    # A conversation whose oldest messages left the context, or whose earlier message was edited, keeps the
    # later turns' keys from its own cache, moved (cache_reuse.py), as `serve --cache-reuse` does.
    engine.cache_reuse = DEFAULT_CACHE_REUSE
    # DRY's sequence breakers, read from the whole vocabulary once (1.3 s on qwen2.5's 152k tokens): here, not in
    # the first answer's time to first token
    dry_breakers(engine.tokenizer, DRY_SEQUENCE_BREAKERS)
    return engine


@dataclass
class TurnStats:
    ttft_ms: float = 0.0  # from asking to the first token, as the user waits for it
    tokens_per_second: float = 0.0
    generated: int = 0
    prompt_n: int = 0  # prompt tokens evaluated
    cache_n: int = 0  # prompt tokens reused from the cache
    context_used: int = 0
    context_size: int = 0
    finish_reason: str | None = None  # "stop", "length", or None when the user stopped the answer
    stopped: bool = False
    n_shifts: int = 0
    max_tokens: int | None = None
    draft_n: int = 0  # speculative decoding: drafted tokens checked, and how many the model accepted
    draft_accepted: int = 0
    dropped: int = 0  # oldest messages left out of this turn's prompt to fit the context
    looped: bool = False  # the loop guard stopped the answer (localllm.chat.loop_guard)

    @property
    def context_full(self) -> bool:
        """The answer ran into the end of the context (not into the max-tokens limit)."""
        limited = self.max_tokens is not None and self.generated >= self.max_tokens
        return self.n_shifts > 0 or (self.finish_reason == "length" and not limited)

    def summary(self) -> str:
        cache = f"cache {self.cache_n}/{self.cache_n + self.prompt_n}"
        drafts = f" · drafts {self.draft_accepted / self.draft_n:.0%} accepted" if self.draft_n else ""
        return (f"TTFT {self.ttft_ms / 1000:.2f}s · {self.tokens_per_second:.1f} tok/s{drafts} · "
                f"ctx {self.context_used}/{self.context_size} · {cache}")

    def outcome(self) -> str | None:
        """What the user should know about how the answer ended, if anything unusual happened."""
        if self.looped:
            return f"{NOTICE} Regenerate (Ctrl+R), or raise the DRY multiplier in Settings (F2)."
        if self.stopped:
            return "Stopped."
        if self.dropped:
            return (f"The conversation outgrew the context: its oldest {self.dropped} messages were left out of "
                    "the prompt. Ctrl+N starts a new chat; F2 raises the context size.")
        if self.n_shifts:
            return ("Context full: the oldest part of the conversation was dropped to go on (context shift). "
                    "Ctrl+N starts a new chat; F2 raises the context size.")
        if self.context_full:
            return (f"Context full ({self.context_size} tokens): the answer was cut off. Start a new chat (Ctrl+N) "
                    "or raise the context size in Settings (F2).")
        if self.finish_reason == "length":
            return f"Reached max tokens ({self.max_tokens}): raise it in Settings (F2), or regenerate (Ctrl+R)."
        return None


class ChatSession:
    """A model and the Sequence holding the current conversation in its KV cache."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.seq = engine.new_sequence()
        self.cancel = threading.Event()
        self.first_in_context = 0  # messages before this index no longer fit the context
        self.dropped = 0

    @property
    def can_shift(self) -> bool:
        return self.engine.model.can_shift

    def reset(self) -> None:
        """A new conversation: the old one's blocks go back to the pool (still cached for a shared prefix)."""
        self.seq.close()
        self.seq = self.engine.new_sequence()
        self.first_in_context = 0

    def close(self) -> None:
        self.seq.close()

    def prompt_tokens(self, messages: list[dict], system_prompt: str, room: int = 1) -> list[int]:
        """The conversation's prompt, from its first message still in context: when it outgrows the context
        the oldest messages are left out (localllm.chat.history), and stay out for the following turns so the
        cached prefix holds."""
        system = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
        start = min(self.first_in_context, max(len(messages) - 1, 0))
        kept, self.dropped = fit_messages(self.engine, system + messages[start:], room)
        self.first_in_context = start + self.dropped
        return self.engine.tokenize_prompt(self.engine.render_chat(kept), chat=True)

    def stream(self, messages: list[dict], system_prompt: str, params: GenerationParams,
               stats: TurnStats, loop_guard: bool = True) -> Iterator[str]:
        """Text pieces of the next assistant message, filling `stats` as they come. Stops between two tokens
        once `self.cancel` is set; closing the generator then leaves the sequence holding what was generated."""
        self.cancel.clear()
        tokens = self.prompt_tokens(messages, system_prompt,
                                    room=min(params.max_tokens or self.engine.ctx, self.engine.ctx // 4))
        stats.dropped = self.dropped
        stats.context_size = self.engine.ctx
        stats.max_tokens = params.max_tokens
        guard = RepeatGuard() if loop_guard else None
        t0 = time.perf_counter()
        events: Iterator[TokenEvent] = self.engine.generate(tokens, params, seq=self.seq)
        try:
            for event in events:
                t = event.timings
                if stats.generated == 0:
                    stats.ttft_ms = 1000 * (time.perf_counter() - t0)
                stats.generated = t.predicted_n
                stats.prompt_n, stats.cache_n, stats.n_shifts = t.prompt_n, t.cache_n, t.n_shifts
                stats.tokens_per_second = t.predicted_per_second
                stats.draft_n, stats.draft_accepted = t.draft_n, t.draft_n_accepted
                stats.context_used = len(self.seq.tokens)
                stats.finish_reason = event.finish_reason
                if event.text:
                    yield event.text
                if guard is not None and event.finish_reason is None and guard.feed(event.text):
                    stats.looped = stats.stopped = True
                    return
                if self.cancel.is_set() and event.finish_reason is None:
                    stats.stopped = True
                    return
        finally:
            events.close()

    def save_kv(self, path) -> None:
        session_file.save(self.engine, self.seq, path)

    def restore_kv(self, path) -> int:
        """Adopt a conversation's saved KV cache; returns how many tokens it holds (0 when it is missing or was
        made by another model: the next turn then evaluates the conversation from scratch)."""
        if not path.exists():
            return 0
        try:
            seq = session_file.load(self.engine, path)
        except LocalLLMError:
            return 0
        self.seq.close()
        self.seq = seq
        return len(seq.tokens)
