"""Stop strings for streamed text.

Generation produces text piece by piece; a stop string may arrive split over several pieces ("<|im" + "_end|>").
`StopMatcher` never emits any part of a stop string: it holds back the longest tail of the text that could
still grow into a stop string, releases it as soon as it cannot, and on a match emits only the text before the
stop string. When several stop strings match, the one that starts earliest wins (the longest one if several
start at the same place); everything from its start on is dropped.
"""

from __future__ import annotations

__all__ = ["StopMatcher"]


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...] | None):
        if isinstance(stops, str):
            stops = [stops]
        self.stops: list[str] = sorted({s for s in (stops or []) if s}, key=len, reverse=True)
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        """Add streamed text. Returns (text safe to emit now, stopped?). After a stop, further text is
        swallowed and (``""``, True) is returned."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        # earliest full match (stops are longest-first, so a tie in position goes to the longest)
        best = -1
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (best == -1 or i < best):
                best, self.matched = i, s
        if best != -1:
            self.stopped = True
            self._held = ""
            return buf[:best], True
        hold = self._partial_tail(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for n in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-n:]
            for s in self.stops:
                if len(s) > n and s.startswith(tail):
                    return n
        return 0

    def flush(self) -> str:
        """End of generation: release whatever was held back (nothing after a stop)."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def reset(self) -> None:
        self._held = ""
        self.stopped = False
        self.matched = None
