"""A guard that ends an answer which repeats the same line or sentence over and over (a small model's loop), and
the loop count that chose the chat defaults (tools/measure_loops.py).

Units are lines, and within a line of prose its sentences; a unit counts when it has at least MIN_CHARS letters or
digits and, outside code, MIN_WORDS words, compared case-folded, with whitespace collapsed and a leading list marker
("1.", "-", "*", "#") dropped. Inside a ``` fence only whole lines count, and code repeats lines by nature, so
they need CODE_TIMES occurrences. `RepeatGuard` trips on a unit's `times`-th occurrence (default 4: a poem's or a
song's refrain may come back three times); `max_repeats` reports how often the most repeated unit occurs.
"""

from __future__ import annotations

import re

__all__ = ["RepeatGuard", "max_repeats", "looped", "NOTICE", "CHAT_LOOP_PROTECTION", "DRY_SEQUENCE_BREAKERS"]

# llama.cpp's default DRY sequence breakers (common/common.h)
DRY_SEQUENCE_BREAKERS = ("\n", ":", "\"", "*")
# The sampler settings a chat (the chat app, `chat`, `run --chat`) adds to llama.cpp's defaults, chosen by
# tools/measure_loops.py (README, "Answers that end")
CHAT_LOOP_PROTECTION = {"dry_multiplier": 0.8}

MIN_WORDS = 3
MIN_CHARS = 8
TIMES = 4
CODE_TIMES = 8
NOTICE = "Stopped: the answer kept repeating the same line (loop guard)."

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_MARKER = re.compile(r"^\s*(?:[-*+>#]+|\d+[.)]|[a-z][.)])\s+", re.I)
_SPACE = re.compile(r"\s+")


def _key(unit: str, code: bool = False) -> str | None:
    u = _MARKER.sub("", unit.strip())
    u = _SPACE.sub(" ", u).strip().casefold()
    if (not code and len(u.split(" ")) < MIN_WORDS) or sum(c.isalnum() for c in u) < MIN_CHARS:
        return None
    return u


class RepeatGuard:
    """Feed an answer's text as it streams; `feed` returns True once some unit has occurred `times` times."""

    def __init__(self, times: int = TIMES, code_times: int = CODE_TIMES):
        self.times, self.code_times = times, code_times
        self.counts: dict[tuple[bool, str], int] = {}
        self.line = ""  # the current line's text not yet counted
        self.in_code = False
        self.tripped = False
        self.unit: str | None = None  # the repeated unit, once tripped

    def _count(self, unit: str, code: bool) -> None:
        k = _key(unit, code)
        if k is None:
            return
        c = self.counts[(code, k)] = self.counts.get((code, k), 0) + 1
        if c >= (self.code_times if code else self.times):
            self.tripped, self.unit = True, unit.strip()

    def feed(self, text: str) -> bool:
        if self.tripped or not text:
            return self.tripped
        self.line += text
        while "\n" in self.line:
            line, self.line = self.line.split("\n", 1)
            if line.lstrip().startswith("```"):
                self.in_code = not self.in_code
                continue
            if self.in_code:
                self._count(line, True)
            else:
                for sentence in _SENTENCE_END.split(line):
                    self._count(sentence, False)
            if self.tripped:
                return True
        if not self.in_code:  # sentences the current line has finished
            parts = _SENTENCE_END.split(self.line)
            for sentence in parts[:-1]:
                self._count(sentence, False)
            self.line = parts[-1]
        return self.tripped


def max_repeats(text: str) -> int:
    """How many times the answer's most repeated unit occurs (0 when no unit counts)."""
    g = RepeatGuard(times=1 << 30, code_times=1 << 30)
    g.feed(text + "\n")
    return max(g.counts.values(), default=0)


def looped(text: str, finish_reason: str | None) -> bool:
    """The measurement's definition of a loop: a line or sentence repeated at least 3 times, or an answer that
    hit the token limit while repeating one (twice)."""
    n = max_repeats(text)
    return n >= 3 or (finish_reason == "length" and n >= 2)
